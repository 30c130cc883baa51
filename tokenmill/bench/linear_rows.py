"""A bf16 linear at growing row counts: the packed bf16 layer (the native kernel; on a
CPU with AVX512-BF16 its many-row path on vdpbf16ps, kernels/cpu_linear_dot.cpp) against
oneDNN's bf16 GEMM on weights prepacked for it, the two copies the CPU platform chooses
between (platforms/cpu.py, `linear_bf16_max_rows`).

    .venv/bin/python -m tokenmill.bench.linear_rows
    .venv/bin/python -m tokenmill.bench.linear_rows --shapes 32000x512 --rows 16,128 --threads 1

Both layers are built by the platform from the same random bf16 weights; inputs are
bf16. One thread is timed in the calling thread's CPU time (time.thread_time: the
machine may be shared), more threads in wall time; per call, the median of --repeats
batches of at least --min-time seconds each. `ratio` is packed / oneDNN (below 1: the
packed layer is faster). --widen adds the packed kernel on fp32 inputs (its widening
fp32 path: what bf16 inputs took before the dot-product path). --quantized int8 (or
int4-gGROUP, int8-gGROUP) adds the same shape quantized: `dot` (linear_quant_dot, the
codes dequantized to bf16 pairs in the kernel's scratch, where the level has it) and
`tiles` (dequantized bf16 tiles and oneDNN's GEMM, what bf16 inputs took before).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from tokenmill.bench.quant_rows import parse_shapes, random_quantized_weight

SHAPES = "1024x512,512x512,3072x512,512x1536,32000x512,4096x4096"  # bench model + a 7B square


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def time_call(fn, threads: int, min_time: float, repeats: int) -> float:
    """Seconds per call of fn(): thread CPU time at one thread, wall time above."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    fn()  # warm: scratch buffers, pages, caches
    samples = []
    for _ in range(repeats):
        n, t0 = 0, clock()
        while True:
            fn()
            n += 1
            elapsed = clock() - t0
            if elapsed >= min_time:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.linear_rows",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, type=parse_shapes,
                   help="N x K of the linears (default: the bench model's qkv, o, gate_up, "
                        "down and lm_head, and 4096x4096)")
    p.add_argument("--rows", default="16,32,64,128,512,2048", type=_ints)
    p.add_argument("--threads", default="1,2", type=_ints)
    p.add_argument("--min-time", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--widen", action="store_true",
                   help="also time the packed kernel's fp32-input (widening) path")
    p.add_argument("--quantized", default=None,
                   help="also time the shape quantized (int8, int4-gGROUP, int8-gGROUP): "
                        "linear_quant_dot and the dequantized tiles")
    p.add_argument("--dot-tuning", default=None, type=_ints,
                   help="x_chunk_bytes,w_group_bytes,kc2,direct_rows: the bf16 dot-product "
                        "path's cache blocking for this run (kernels/cpu_linear_dot.cpp)")
    args = p.parse_args(argv)

    import torch

    from tokenmill.kernels import cpu_ops
    from tokenmill.models.layers.linear import Linear
    from tokenmill.models.layers.linear_methods.base import ALL_ROWS
    from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedWeight
    from tokenmill.platforms.cpu import CpuPlatform

    ops = cpu_ops()
    if ops is None:
        print("no native CPU kernels on this machine: nothing to compare", file=sys.stderr)
        return 1
    packed_only = CpuPlatform.create("cpu", torch.bfloat16, linear_bf16_max_rows=ALL_ROWS)
    onednn = CpuPlatform.create("cpu", torch.bfloat16, linear_bf16_max_rows=0)
    if onednn.gemm != "onednn_prepacked":
        print(f"oneDNN's prepacked bf16 GEMM is not in use here ({onednn.describe()}): "
              "nothing to compare", file=sys.stderr)
        return 1
    if args.dot_tuning is not None and getattr(ops, "has_bf16_dot_gemm", False):
        ops.linear_bf16_dot_tuning(args.dot_tuning)
    print(f"packed: {packed_only.describe()}")
    print(f"level {ops.capability}; bf16 dot-product path "
          + (f"from {ops.bf16_dot_gemm_min_rows} rows, cache blocking "
             f"{ops.linear_bf16_dot_tuning()}" if getattr(ops, "has_bf16_dot_gemm", False)
             else "not at this level"))
    print("ms per call (1 thread: thread CPU time; more: wall), ratio = packed / oneDNN")
    saved = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        for n, k in args.shapes:
            w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
            layers = {}
            for name, plat in (("packed", packed_only), ("onednn", onednn)):
                layer = Linear(k, n, bias=False, dtype=torch.bfloat16)
                layer.weight.data.copy_(w)
                layer.set_method(plat.linear_method(layer))
                layers[name] = layer
            quant = None
            if args.quantized:
                fmt = args.quantized
                group = int(fmt.split("-g")[1]) if "-g" in fmt else k
                quant = PackedQuantizedWeight(ops, random_quantized_weight(
                    n, k, 4 if fmt.startswith("int4") else 8, group, gen))
            for threads in args.threads:
                torch.set_num_threads(threads)
                cells = []
                with torch.inference_mode():
                    for m in args.rows:
                        x = torch.randn(m, k, generator=gen).bfloat16()
                        a = time_call(lambda: layers["packed"](x), threads, args.min_time,
                                      args.repeats) * 1e3
                        b = time_call(lambda: layers["onednn"](x), threads, args.min_time,
                                      args.repeats) * 1e3
                        cell = f"{m}: {a:.3f} / {b:.3f} = {a / b:.2f}"
                        if args.widen:
                            xf = x.float()
                            c = time_call(lambda: layers["packed"](xf), threads, args.min_time,
                                          args.repeats) * 1e3
                            cell += f" (widen {c:.3f})"
                        if quant is not None:
                            d = (time_call(lambda: quant._dot(x, None), threads, args.min_time,
                                           args.repeats) * 1e3 if quant.dot else float("nan"))
                            t = time_call(lambda: quant._tiled(x, None, torch.bfloat16),
                                          threads, args.min_time, args.repeats) * 1e3
                            cell += f" ({args.quantized} dot {d:.3f}, tiles {t:.3f})"
                        cells.append(cell)
                print(f"{n}x{k} t={threads}  " + "  ".join(cells), flush=True)
    finally:
        torch.set_num_threads(saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
