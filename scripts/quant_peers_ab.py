"""Single stream, llama.cpp against tokenmill at the same bits, alternating, in one sitting.

    python scripts/peers_bench.py --setup --engine llamacpp --llama-quant Q8_0,Q4_0  # once
    python scripts/quant_peers_ab.py --rounds 6
    python scripts/quant_peers_ab.py --rounds 6 --cpu-capability avx2 --pairs Q4_0

Each round runs, for every pair, `llama-bench -p 64 -n 128 -t THREADS -r 3` on the
GGUF and `tokenmill bench latency --skip-hf --skip-roofline --num-iters 3` on the
matching checkpoint, the order of the two swapped every round so that neither always
runs on the warmer machine. Two figures each, compared like for like:

- decode tok/s: llama-bench's `tg` rate (128 tokens generated, no prompt) against
  1000 / tokenmill's median TPOT (ms);
- end to end: tokenmill's output tok/s (128 tokens over prompt + decode, TTFT
  included) against llama.cpp's equivalent, 128 / (64 / pp rate + 128 / tg rate).

(llama-bench's headline `tg` figure leaves the prompt out; `bench latency`'s output
tok/s counts it: set against each other they understate tokenmill by its TTFT's share,
about 10% at these lengths.) The pairs (llama.cpp's type = tokenmill's model and
--quantization):

    bf16  = bench-qwen3-512, bf16 weights
    Q8_0  = bench-qwen3-512 --quantization int8 (per-channel int8 made at load)
    Q4_0  = bench-qwen3-512-gptq-int4 (GPTQ 4-bit, group 32, as Q4_0's blocks of 32)

It prints each round and, per pair, the mean of the rounds, their range and the ratio
of the means (tokenmill / llama.cpp) for both figures: these machines' speed moves
20-40% with the neighbours, so only the means of several rounds say anything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_bench  # noqa: E402  (the peers' paths and llama-bench's parser)

PAIRS = {
    "bf16": ("bfloat16", "bench-qwen3-512", None),
    "Q8_0": ("Q8_0", "bench-qwen3-512", "int8"),
    "Q4_0": ("Q4_0", "bench-qwen3-512-gptq-int4", None),
}


FIGURES = ("decode", "e2e")


def run_llama(args, host: dict, gguf_type: str) -> dict:
    ns = argparse.Namespace(peers_dir=args.peers_dir, threads=args.threads,
                            latency_input_len=args.input_len, latency_output_len=args.output_len,
                            latency_iters=3, timeout=1800,
                            llama_cpp_python_version=peers_bench.LLAMA_CPP_PYTHON_VERSION)
    got = peers_bench.run_llama_latency(ns, host, gguf_type)
    return {"decode": float(got["tg_tok_s"]), "e2e": float(got["e2e_equiv_tok_s"])}


def run_tokenmill(args, model: str, quantization: str | None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "latency", "--model", model,
           "--dtype", "bfloat16", "--skip-hf", "--skip-roofline", "--num-iters", "3",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--output-json", out]
    if quantization:
        cmd += ["--quantization", quantization]
    if args.cpu_capability:
        cmd += ["--cpu-capability", args.cpu_capability]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"tokenmill bench latency failed (exit {proc.returncode})")
    with open(out) as f:
        got = json.load(f)
    os.unlink(out)
    return {"decode": 1e3 / float(got["tokenmill"]["tpot_ms"]["median"]),
            "e2e": float(got["tokenmill_tok_s"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--pairs", default="bf16,Q8_0,Q4_0",
                   help=f"comma-separated from {', '.join(PAIRS)}")
    p.add_argument("--cpu-capability", default=None,
                   help="tokenmill's kernel level (default: the best this CPU runs); "
                        "llama.cpp runs its native build either way")
    p.add_argument("--threads", type=int, default=peers_bench.default_threads())
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--peers-dir", default=peers_bench.default_peers_dir())
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    pairs = [s.strip() for s in args.pairs.split(",") if s.strip()]
    unknown = [s for s in pairs if s not in PAIRS]
    if unknown:
        p.error(f"--pairs: unknown {unknown}; choose from {list(PAIRS)}")
    host = peers_bench.host_info()
    for name in pairs:
        path = peers_bench.gguf_path(args, PAIRS[name][0])
        if not os.path.isfile(path):
            p.error(f"{path} is missing: run scripts/peers_bench.py --setup --engine llamacpp "
                    f"--llama-quant Q8_0,Q4_0 first")
    runs = {name: {"llamacpp": [], "tokenmill": []} for name in pairs}
    print(f"CPU: {host['cpu_model']} ({', '.join(k for k, v in host['cpu_flags'].items() if v)}), "
          f"{args.threads} threads; tokenmill level: {args.cpu_capability or 'best'}")
    for r in range(args.rounds):
        for name in pairs:
            gguf_type, model, quant = PAIRS[name]
            order = ("llamacpp", "tokenmill") if r % 2 == 0 else ("tokenmill", "llamacpp")
            got = {}
            for side in order:
                got[side] = (run_llama(args, host, gguf_type) if side == "llamacpp"
                             else run_tokenmill(args, model, quant))
                runs[name][side].append(got[side])
            lc, tm = got["llamacpp"], got["tokenmill"]
            print(f"round {r + 1} {name}: decode llama.cpp {lc['decode']:.1f} tokenmill "
                  f"{tm['decode']:.1f} ({tm['decode'] / lc['decode']:.2f}x); end to end "
                  f"{lc['e2e']:.1f} / {tm['e2e']:.1f} ({tm['e2e'] / lc['e2e']:.2f}x)",
                  flush=True)
    summary = {}
    print("\n| format | tok/s | llama.cpp | tokenmill | ratio of means |\n|---|---|---|---|---|")
    for name in pairs:
        summary[name] = {}
        for fig in FIGURES:
            lc = [got[fig] for got in runs[name]["llamacpp"]]
            tm = [got[fig] for got in runs[name]["tokenmill"]]
            ratio = statistics.mean(tm) / statistics.mean(lc)
            summary[name][fig] = {"llamacpp": lc, "tokenmill": tm, "ratio_of_means": ratio}
            print(f"| {name} | {fig} | {statistics.mean(lc):.1f} ({min(lc):.1f}-{max(lc):.1f}) "
                  f"| {statistics.mean(tm):.1f} ({min(tm):.1f}-{max(tm):.1f}) | {ratio:.2f}x |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"host": host, "cpu_capability": args.cpu_capability, "pairs": summary}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
