"""Before / after: the same `tokenmill bench` command on two checkouts, alternating, in one
sitting, with the medians and the after / before ratio.

    git worktree add /tmp/before <commit>          # the baseline checkout
    cp tokenmill/kernels/_C_* /tmp/before/tokenmill/kernels/   # if its kernel sources match
    python scripts/bench_ab.py --before /tmp/before --after . --rounds 3 \\
        -- throughput --skip-hf --skip-hf-cb --skip-roofline --dtype bfloat16

Each round runs before then after (then after then before on the next round, so
neither side always runs on a warmer machine), each as its own process with
PYTHONPATH set to its checkout and this interpreter. The figure compared is the
bench JSON's `tokenmill_tok_s`. Alternating rounds put both sides under the same
machine noise; the spread of each side's runs is printed next to its median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(checkout: str, bench_args: list[str]) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", *bench_args,
           "--output-json", out]
    proc = subprocess.run(cmd, env=env, cwd=os.path.abspath(checkout),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"bench failed in {checkout} (exit {proc.returncode})")
    with open(out) as f:
        value = json.load(f)["tokenmill_tok_s"]
    os.unlink(out)
    return float(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the baseline checkout")
    p.add_argument("--after", default=".", help="the checkout under test (default: .)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="after --: the `tokenmill bench` subcommand and its flags")
    args = p.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    if not bench_args:
        p.error("give the bench command after --, e.g. -- latency --skip-hf")
    runs: dict[str, list[float]] = {"before": [], "after": []}
    sides = {"before": args.before, "after": args.after}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            runs[side].append(run_once(sides[side], bench_args))
            print(f"round {r + 1} {side:6s} {runs[side][-1]:8.1f} tok/s", flush=True)
    med = {s: statistics.median(v) for s, v in runs.items()}
    print(f"bench {' '.join(bench_args)}")
    for side in ("before", "after"):
        v = runs[side]
        print(f"  {side:6s} median {med[side]:8.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in v)})")
    print(f"  after / before: {med['after'] / med['before']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
