"""`python -m tokenmill.bench.quant_gemm`: the CUDA path's quantized-weight GEMMs
(ops/triton_quant_linear.py: W8A16 per channel, W4A16 in groups, FP8 with block
scales) against the same layer in bf16 through torch's GEMM (cuBLAS), at decode-sized
row counts: us per call, the weights' bytes read per second against the measured copy
bandwidth, and the speed over bf16.

    python -m tokenmill.bench.quant_gemm --shapes 4096x1024,1024x3072,4096x4096 --rows 1,16,64
    python -m tokenmill.bench.quant_gemm --sweep --shapes 4096x4096,1024x3072

--sweep tries the decode tile settings (ops/triton_quant_linear.DECODE_TILES: K tile,
programs per SM, pipeline stages) at one row, and the fused kernel against the
dequantized weights + torch's GEMM at 64 and 128 rows (DEQUANT_MIN_ROWS,
DEQUANT_MIN_ROWS_4BIT); a setting that cannot run (out of shared memory) is noted.

Shapes are NxK (out x in features; the defaults: Qwen3-0.6B's qkv / down and an 8B
model's square and gate_up layers). Weights are random codes (speed does not depend on
their values). On CUDA each call is replayed from a CUDA graph of --iters calls, so
launch overhead is not counted (as the engine's decode graphs replay them); elsewhere
(TRITON_INTERPRET, for the tests) calls are timed one by one.
"""
from __future__ import annotations

import argparse
import json
import time

FORMATS = ("bf16", "int8", "int4-g128", "fp8-b128")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def make_layer(fmt: str, n: int, k: int, device, gen):
    """(callable x -> y, bytes of weight data it reads) for one format."""
    import torch
    import torch.nn.functional as F
    if fmt == "bf16":
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.bfloat16)
        return (lambda x: F.linear(x, w)), w.nbytes
    from tokenmill.ops.triton_quant_linear import Fp8WeightTriton, IntWeightTriton
    if fmt.startswith("fp8"):
        b = int(fmt.split("-b")[1])
        w = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
        s = torch.rand(-(-n // b), -(-k // b), generator=gen) * 0.01
        layer = Fp8WeightTriton(w.to(device), s.to(device), (b, b))
        return (lambda x: layer.linear(x, None)), layer.w.nbytes + layer.scale_inv.nbytes
    from tokenmill.bench.quant_rows import random_quantized_weight
    bits, group = (8, k) if fmt == "int8" else (4, int(fmt.split("-g")[1]))
    layer = IntWeightTriton(random_quantized_weight(n, k, bits, group, gen), device)
    return ((lambda x: layer.linear(x, None)),
            layer.w.nbytes + layer.scales.nbytes + layer.zeros.nbytes)


def time_call(fn, x, iters: int) -> float:
    """Seconds per call of fn(x): the best of 3 replays of a CUDA graph holding `iters`
    calls on CUDA, the best of `iters` single calls elsewhere."""
    import torch
    fn(x)  # compile / warm
    if x.device.type != "cuda":
        best = float("inf")
        for _ in range(iters):
            t = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t)
        return best
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best


def run(shapes, rows, formats, device, iters: int, bandwidth_gbps: float | None) -> list[dict]:
    import torch
    gen = torch.Generator().manual_seed(0)
    results = []
    for n, k in shapes:
        layers = {f: make_layer(f, n, k, device, gen) for f in formats}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            base = None
            for f, (fn, nbytes) in layers.items():
                s = time_call(fn, x, iters)
                base = s if f == "bf16" else base
                row = {"shape": [n, k], "rows": m, "format": f, "us": s * 1e6,
                       "weight_bytes": nbytes, "gbps": nbytes / s / 1e9}
                if bandwidth_gbps:
                    row["bandwidth_fraction"] = row["gbps"] / bandwidth_gbps
                if base is not None and f != "bf16":
                    row["speed_over_bf16"] = base / s
                results.append(row)
                print(f"{n:6d}x{k:<6d} rows {m:4d} {f:10s} {row['us']:9.2f} us/call "
                      f"{row['gbps']:7.0f} GB/s of weights"
                      + (f" ({100 * row['bandwidth_fraction']:4.1f}% of copy bandwidth)"
                         if bandwidth_gbps else "")
                      + (f", {row['speed_over_bf16']:.2f}x bf16"
                         if "speed_over_bf16" in row else ""), flush=True)
        del layers
    return results


# --sweep: the decode tile settings tried at one row (ops/triton_quant_linear.DECODE_TILES)
# and the row counts where the fused kernel and the dequantized path are compared.
SWEEP_TILES = [dict(block_n=64, block_k=bk, programs_per_sm=pps, num_warps=4, num_stages=st)
               for bk in (128, 256) for pps in (2, 8) for st in (3, 4)]
SWEEP_ROWS = (64, 128)


def sweep(shapes, formats, device, iters: int, bandwidth_gbps: float | None) -> dict:
    """The decode tiles of SWEEP_TILES at one row, and the fused kernel against the
    dequantized weights + torch's GEMM at SWEEP_ROWS: rows of results, and the best
    tile setting by the geometric mean of its speed over the formats and shapes."""
    import math

    from tokenmill.ops import triton_quant_linear as tq
    saved = dict(tq.DECODE_TILES), tq.DEQUANT_MIN_ROWS, tq.DEQUANT_MIN_ROWS_4BIT
    quantized = [f for f in formats if f != "bf16"]
    tiles, paths, failed = [], [], []
    try:
        for i, cfg in enumerate(SWEEP_TILES):
            tq.DECODE_TILES.update(cfg)
            print(f"decode tiles {i}: {cfg}", flush=True)
            for f in quantized:  # one format at a time: a setting one cannot run is noted
                try:
                    for row in run(shapes, [1], [f], device, iters, bandwidth_gbps):
                        tiles.append({**row, "tiles": dict(cfg)})
                except Exception as e:  # noqa: BLE001 (e.g. Triton's OutOfResources)
                    print(f"  {f}: {type(e).__name__}: {e}", flush=True)
                    failed.append({"tiles": dict(cfg), "format": f, "error": str(e)})
        tq.DECODE_TILES.update(saved[0])
        for path, min_rows in (("fused", 1 << 30), ("dequantized", 1)):
            tq.DEQUANT_MIN_ROWS = tq.DEQUANT_MIN_ROWS_4BIT = min_rows
            print(f"path {path}", flush=True)
            for row in run(shapes[:1], list(SWEEP_ROWS), quantized, device, iters,
                           bandwidth_gbps):
                paths.append({**row, "path": path})
    finally:
        tq.DECODE_TILES.update(saved[0])
        tq.DEQUANT_MIN_ROWS, tq.DEQUANT_MIN_ROWS_4BIT = saved[1:]

    def score(cfg):
        if any(f["tiles"] == cfg for f in failed):
            return float("inf")
        us = [r["us"] for r in tiles if r["tiles"] == cfg]
        return math.exp(sum(math.log(u) for u in us) / len(us))

    best = min(SWEEP_TILES, key=score)
    print(f"best decode tiles (geometric mean us over formats and shapes): {best}", flush=True)
    return {"tiles": tiles, "paths": paths, "failed": failed, "best_tiles": best}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.quant_gemm")
    p.add_argument("--shapes", type=parse_shapes,
                   default=parse_shapes("4096x1024,1024x3072,4096x4096,28672x4096"))
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true",
                   help="try the decode tile settings (SWEEP_TILES) at one row and the fused "
                        "kernel against the dequantized path at SWEEP_ROWS rows")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    formats = args.formats.split(",")
    if "bf16" in formats:  # the baseline first: the others' ratios refer to it
        formats.remove("bf16")
        formats.insert(0, "bf16")
    bandwidth = None
    if torch.device(args.device).type == "cuda":
        from tokenmill.bench.roofline import measure_bandwidth
        # copies count bytes read + written; a GEMM's weights are only read
        bandwidth = measure_bandwidth(args.device)["gbps"]
        print(f"copy bandwidth {bandwidth:.0f} GB/s (read + write)", flush=True)
    if args.sweep:
        results = sweep(args.shapes, formats, args.device, args.iters, bandwidth)
    else:
        results = run(args.shapes, [int(r) for r in args.rows.split(",")], formats,
                      args.device, args.iters, bandwidth)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if bandwidth else args.device,
                       "copy_bandwidth_gbps": bandwidth, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
