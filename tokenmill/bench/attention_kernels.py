"""`python -m tokenmill.bench.attention_kernels`: the Triton paged-decode kernel per
head size and with soft-capping, timed per call against the K/V bytes it reads (the
kernel is bound by them): GB/s and the fraction of the device's measured copy
bandwidth. A head size that is not a power of two runs in the next power of two with
its tail masked; this shows what that costs next to the powers of two around it.

Batch 1 takes split-K on a GPU (one program per KV head cannot fill it), larger
batches the single pass. The calls are replayed from a CUDA graph, as a decode step
runs them. Off CUDA it runs the kernels in Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported): only to check it runs.

`--kernel native` times the CPU's native decode kernels instead (tokenmill.kernels:
paged_decode, and mla_decode with `--mla-heads`) over a sweep of batch x context x
head size x GQA ratio x cache dtype (bf16, fp32, fp8), each call against the time its
K/V bytes take at the streaming read bandwidth measured in the same run
(decode_read.measure_read_bandwidth): `vs_bound` = seconds / (bytes / bandwidth), 1.0
being a call that does nothing but stream its K/V once. Each call reads K/V the cache
has not just read (the block tables rotate over a pool of at least --pool-mib), so
small cases are not served from the last-level cache. `--compare-prebuilt` also times
the level's prebuilt module (the kernels as installed, e.g. before a source edit that
the loader compiled) interleaved with the current one, on the same inputs.
"""
from __future__ import annotations

import argparse
import json
import time


def _cases(heads: str, softcap_heads: str, softcap: float) -> list[tuple[int, float]]:
    cases = [(int(d), 0.0) for d in heads.split(",") if d]
    cases += [(int(d), softcap) for d in softcap_heads.split(",") if d]
    return cases


def time_decode(ta, device, dtype, batch: int, context: int, hq: int, hkv: int, d: int,
                softcap: float, iters: int, block_size: int = 16) -> dict:
    """Seconds per paged_decode call over `batch` rows of `context` keys each (on CUDA
    `iters` calls captured in one graph, timed over a replay)."""
    import torch

    from tokenmill.bench.roofline import _sync
    per_row = -(-context // block_size)
    torch.manual_seed(0)  # made on the device: a GiB of cache is slow to fill on the host
    cache = torch.randn(batch * per_row + 1, 2, block_size, hkv, d, device=device, dtype=dtype)
    table = (torch.randperm(batch * per_row, device=device) + 1).view(batch, per_row)
    table = table.to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    out = torch.empty_like(q)
    scale = d ** -0.5

    def call():
        ta.paged_decode(q, cache, table, lens, scale, out=out, softcap=softcap)

    def loop():
        for _ in range(iters):
            call()

    call()  # compile (or interpret once)
    run = loop
    if device.type == "cuda":  # the calls replayed from a graph: no launch gaps between them
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop()
        run = graph.replay
        run()
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    kv_bytes = batch * context * hkv * d * 2 * cache.element_size()
    return {"batch": batch, "context": context, "head_size": d, "softcap": softcap,
            "num_splits": ta.decode_splits(batch, hkv, torch.device(device)),
            "seconds": seconds, "kv_bytes": kv_bytes, "gbps": kv_bytes / seconds / 1e9}


def main(argv=None) -> int:
    import sys
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--kernel", default="triton", choices=("triton", "native"))
    known, rest = pick.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.kernel == "native":  # the CPU's native kernels (cpu_decode_attention.py)
        from tokenmill.bench import cpu_decode_attention
        return cpu_decode_attention.main(rest)
    argv = rest
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.attention_kernels")
    p.add_argument("--kernel", default="triton", choices=("triton", "native"),
                   help="native: the CPU native kernels' sweep (see --kernel native --help)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--heads", default="64,96,128,256,512",
                   help="comma-separated head sizes timed without soft-capping")
    p.add_argument("--softcap-heads", default="128",
                   help="comma-separated head sizes also timed soft-capped")
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.num_heads % args.num_kv_heads:
        raise ValueError(f"num_heads {args.num_heads} must be a multiple of num_kv_heads "
                         f"{args.num_kv_heads}")
    import os

    import torch
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
    from tokenmill.bench import roofline as rl
    from tokenmill.ops import triton_attention as ta
    dtype = getattr(torch, args.dtype)
    bandwidth = rl.measure_bandwidth(device) if device.type == "cuda" else None
    rows = []
    for d, cap in _cases(args.heads, args.softcap_heads, args.softcap):
        for b in (int(x) for x in args.batch.split(",")):
            row = time_decode(ta, device, dtype, b, args.context, args.num_heads,
                              args.num_kv_heads, d, cap, args.iters)
            if bandwidth:
                row["bandwidth_fraction"] = row["gbps"] / bandwidth["gbps"]
            rows.append(row)
            frac = (f", {100 * row['bandwidth_fraction']:5.1f}% of "
                    f"{bandwidth['gbps']:.0f} GB/s" if bandwidth else "")
            print(f"head {d:3d} softcap {cap:4g} batch {b:4d} (splits {row['num_splits']:2d}): "
                  f"{1e6 * row['seconds']:9.1f} us/call, {row['gbps']:7.1f} GB/s of K/V{frac}",
                  flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": str(device), "dtype": args.dtype, "bandwidth": bandwidth,
                       "num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
