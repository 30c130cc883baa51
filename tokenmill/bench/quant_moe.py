"""`python -m tokenmill.bench.quant_moe`: one quantized MoE layer at decode, the experts
packed for the native kernel (quantized_cpu.PackedQuantizedExperts, the engine's path on
the CPU) against each routed expert dequantized for a library GEMM per call (the path
without kernels, and every CPU step before the packed experts).

Random integer experts shaped like Qwen3-30B-A3B's by default (64 experts, hidden 1024,
intermediate 768, top-8, group 128), bf16 activations; per weight width, with and without
the quad layout where the level has it, 1 and 4 tokens: medians of interleaved timings.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _experts(n: int, k: int, bits: int, group: int, count: int, gen: torch.Generator):
    from tokenmill.bench.quant_rows import random_quantized_weight
    return [random_quantized_weight(n, k, bits, group, gen) for _ in range(count)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-capability", default=None, help="kernel level (default: the best)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill import kernels
    from tokenmill.models.layers.linear_methods.fused_moe import fused_experts
    from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedExperts
    from tokenmill.models.layers.linear_methods.quantized_moe import QuantizedExperts
    ops = kernels.cpu_ops(args.cpu_capability) if args.cpu_capability else kernels.cpu_ops()
    if ops is None:
        raise SystemExit("no native kernels on this machine")
    e, h, i, top = args.experts, args.hidden, args.intermediate, args.top_k
    print(f"level {ops.capability}; {e} experts, hidden {h}, intermediate {i}, top-{top}, "
          f"group {args.group}, bf16 activations, {torch.get_num_threads()} threads")
    gen = torch.Generator().manual_seed(0)
    meta13 = torch.empty(e, 2 * i, h, device="meta")
    meta2 = torch.empty(e, h, i, device="meta")
    for bits in (4, 8):
        w13, w2 = _experts(2 * i, h, bits, args.group, e, gen), _experts(h, i, bits, args.group, e, gen)
        quads = (0, 64) if ops.has_quant_quad else (0,)
        for quad in quads:
            packed = PackedQuantizedExperts.from_quantized(ops, w13, w2, 32, quad, None)
            for tokens in (1, 4):
                x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
                ids = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(tokens)])
                wts = torch.rand(tokens, top, generator=gen).to(torch.bfloat16)

                def old():
                    return fused_experts(x, QuantizedExperts(w13, torch.bfloat16),
                                         QuantizedExperts(w2, torch.bfloat16), wts, ids,
                                         torch.bfloat16)

                def new():
                    return fused_experts(x, meta13, meta2, wts, ids, torch.bfloat16, packed)
                a, b = old().float(), new().float()
                rel = float((a - b).abs().max() / a.abs().max())
                t_old, t_new = [], []
                for _ in range(args.iters):  # interleaved
                    for fn, out in ((old, t_old), (new, t_new)):
                        start = time.perf_counter()
                        fn()
                        out.append(time.perf_counter() - start)
                mo, mn = statistics.median(t_old) * 1e3, statistics.median(t_new) * 1e3
                print(f"{bits}-bit{' quad' if packed.quad else '     '} {tokens} token(s): "
                      f"dequantized per call {mo:8.2f} ms, packed {mn:7.3f} ms, "
                      f"{mo / mn:5.1f}x (max rel diff {rel:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
