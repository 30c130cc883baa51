"""`python -m tokenmill.bench.cpu_prefill`: the native prefill attention kernel
(kernels/cpu_paged_prefill.cpp) against the path it replaced, on one prompt.

One fresh prompt of --tokens tokens whose K/V sit in a paged cache (blocks scattered
as the pool hands them out): `paged_prefill` reads them through the block table; the
old path (the PyTorch reference's prompt chunk) runs causal SDPA over the prompt's
K/V, here gathered from the same blocks first (the gather timed as part of it, as a
chunk with a cached prefix pays it; a fresh chunk in the reference skips it, so
`sdpa_only` is printed too). The three take turns, best of --iters each. GFLOP/s count the causal half:
2 x 2 x heads x D x T^2 / 2. --baseline-level adds the kernel of another capability level
to the turns (e.g. avx512_vnni's widened fp32 products against avx512_bf16's vdpbf16ps).
"""
from __future__ import annotations

import argparse
import json
import time


def _time(fns: dict, iters: int) -> dict:
    """Best seconds per call of each fn, the fns taking turns (a busy machine's noise
    falls on all of them alike)."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run(tokens: int, hq: int, hkv: int, d: int, dtype_name: str, block_size: int,
        iters: int, level: str | None = None, baseline_level: str | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    from tokenmill import kernels
    ops = kernels.cpu_ops(level)
    if ops is None:
        raise SystemExit("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    nb = -(-tokens // block_size)
    cache = torch.randn(nb + 1, 2, block_size, hkv, d, generator=g).to(dtype)
    table = (torch.randperm(nb, generator=g) + 1).to(torch.int32)[None, :]
    q = torch.randn(tokens, hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0, tokens], dtype=torch.int64)
    lens = torch.tensor([tokens], dtype=torch.int32)
    scale = d ** -0.5

    def kernel():
        ops.paged_prefill(q, cache, table, qsl, lens, scale)

    def gather():
        blocks = cache[table[0].long()]  # [nb, 2, bs, Hkv, D]
        kv = blocks.transpose(0, 1).reshape(2, -1, hkv, d)[:, :tokens]
        return kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)

    qh = q.transpose(0, 1).unsqueeze(0)
    kh, vh = gather()

    def sdpa_only():
        F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                       enable_gqa=hq != hkv)

    def sdpa_gathered():
        k, v = gather()
        F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                       enable_gqa=hq != hkv)

    flops = 2 * 2 * hq * d * tokens * tokens / 2
    row = {"tokens": tokens, "num_heads": hq, "num_kv_heads": hkv, "head_size": d,
           "dtype": dtype_name, "block_size": block_size, "level": ops.capability,
           "threads": torch.get_num_threads()}
    fns = {"kernel": kernel, "sdpa_gathered": sdpa_gathered, "sdpa_only": sdpa_only}
    if baseline_level:
        base = kernels.cpu_ops(baseline_level)
        row["baseline_level"] = base.capability
        fns["kernel_baseline"] = lambda: base.paged_prefill(q, cache, table, qsl, lens, scale)
    for name, s in _time(fns, iters).items():
        row[name] = {"seconds": s, "gflops": flops / s / 1e9}
    row["speedup_vs_sdpa_gathered"] = row["sdpa_gathered"]["seconds"] / row["kernel"]["seconds"]
    if baseline_level:
        row["speedup_vs_baseline"] = (row["kernel_baseline"]["seconds"]
                                      / row["kernel"]["seconds"])
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.cpu_prefill")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16,float32",
                   help="comma-separated: bfloat16, float16, float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=10,
                   help="timed calls of each, taking turns (the best is kept)")
    p.add_argument("--cpu-capability", default=None, help="kernel level (default: the best)")
    p.add_argument("--baseline-level", default=None,
                   help="also time the kernel of this level (taking turns with the others)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.num_heads % args.num_kv_heads:
        raise ValueError(f"num_heads {args.num_heads} must be a multiple of num_kv_heads "
                         f"{args.num_kv_heads}")
    rows = []
    for dt in args.dtype.split(","):
        row = run(args.tokens, args.num_heads, args.num_kv_heads, args.head_size, dt,
                  args.block_size, args.iters, args.cpu_capability, args.baseline_level)
        rows.append(row)
        print(f"{dt:8s} T={args.tokens} heads {args.num_heads}/{args.num_kv_heads} "
              f"D={args.head_size} [{row['level']}, {row['threads']} threads]: "
              + ", ".join(f"{k} {1e3 * row[k]['seconds']:.1f} ms ({row[k]['gflops']:.0f} GFLOP/s)"
                          for k in ("kernel", "kernel_baseline", "sdpa_gathered", "sdpa_only")
                          if k in row)
              + f"; kernel {row['speedup_vs_sdpa_gathered']:.2f}x sdpa_gathered"
              + (f", {row['speedup_vs_baseline']:.2f}x the {row['baseline_level']} kernel"
                 if "speedup_vs_baseline" in row else ""), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
