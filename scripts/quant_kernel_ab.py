"""Two builds of the native kernels side by side in one process: `linear_quant` on the
same packed weights (quad layout), the builds taking turns, for kernel changes too
small to see across processes.

    # the change in a worktree, built there at run time:
    git worktree add -f --detach /tmp/wt HEAD   # ... edit /tmp/wt/tokenmill/kernels ...
    PY=$PWD/.venv/bin/python
    GET="from tokenmill import kernels; print(kernels.cpu_ops('avx2').__file__)"
    A=$($PY -c "$GET"); B=$(cd /tmp/wt && PYTHONPATH=/tmp/wt $PY -c "$GET")
    $PY scripts/quant_kernel_ab.py $A $B --shapes 512x512,4096x4096

Both builds must give the same bits (checked first). Prints per shape the median call
time of each over --rounds rounds and B's speedup. One thread unless --threads.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import time

import torch

from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight


def load(path: str):
    """The extension module at `path` (a prebuilt or a run-time build)."""
    name = path.rsplit("/", 1)[1].split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--shapes", default="512x512,3072x512,4096x4096", help="N x K, comma list")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--weights-per-round", type=float, default=8e7,
                   help="calls a round: this many weights' worth")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    a, b = load(args.a), load(args.b)
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        groups = -(-k // args.group)
        top = 1 << args.bits
        qw = QuantizedWeight(torch.randint(0, top, (n, k), generator=g).to(torch.uint8),
                             (torch.rand(n, groups, generator=g) * 0.01 + 1e-3).half().float(),
                             torch.randint(0, top, (n, groups), generator=g).to(torch.uint8),
                             args.bits, args.group).check()
        packed = {m: m.pack_quant_weight(qw.codes, qw.scales, qw.zeros, args.bits, args.group,
                                         True) for m in (a, b)}
        x, none = torch.randn(args.rows, k).bfloat16(), torch.empty(0)
        ya, yb = (m.linear_quant(x, *packed[m], n, args.bits, args.group, none) for m in (a, b))
        if not torch.equal(ya.view(torch.int16), yb.view(torch.int16)):
            raise SystemExit(f"{shape}: the two builds' outputs differ")
        reps = max(1, int(args.weights_per_round / (n * k)))

        def run(m):
            t0 = time.perf_counter()
            for _ in range(reps):
                m.linear_quant(x, *packed[m], n, args.bits, args.group, none)
            return (time.perf_counter() - t0) / reps * 1e6

        times = {a: [], b: []}
        for _ in range(args.rounds):
            for m in (a, b):
                times[m].append(run(m))
        ma, mb = statistics.median(times[a]), statistics.median(times[b])
        print(f"{shape} int{args.bits} g{args.group}, {args.rows} row(s): A {ma:.2f} us, "
              f"B {mb:.2f} us, B {ma / mb:.3f}x ({n * k / ma / 1e3:.1f} / "
              f"{n * k / mb / 1e3:.1f} G weights/s)")


if __name__ == "__main__":
    main()
