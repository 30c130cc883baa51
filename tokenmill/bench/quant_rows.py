"""Where the native quantized kernel stops paying: one quantized linear at growing row
counts, through the kernel (`linear_quant`, codes widened in registers) and through
dequantized tiles + the library GEMM, beside the same weights in bf16 / fp32 through the
platform's dense path. The platform's `quantized_max_rows` (platforms/cpu.py) is the
row count where the two quantized columns cross on the machines measured.

    .venv/bin/python -m tokenmill.bench.quant_rows
    .venv/bin/python -m tokenmill.bench.quant_rows --shapes 4096x4096 --rows 8,16,32,64
    .venv/bin/python -m tokenmill.bench.quant_rows --layers 8 --formats int4-g32 \
        --shapes 1024x512,512x512,3072x512,512x1536

--layers L: instead, one row through L distinct copies of the shapes in order (as a
decode step streams its layers' weights, most of them from memory), timed as a whole:
ms per pass and the packed bytes read over that time.

Weights are random codes (the speed does not depend on their values); inputs are in
--dtype (bf16 on a CPU with native bf16, where the tiles are dequantized straight to
bf16). Medians of torch.utils.benchmark, ms per call, at the torch thread count.
"""
from __future__ import annotations

import argparse
import re
import sys



def random_quantized_weight(n: int, k: int, bits: int, group: int, gen):
    """Random `bits`-bit codes [n, k] in groups of `group` columns, small scales, the
    midpoint as zero (`gen`: a torch.Generator): a weight for the kernels' timings
    (the values do not matter)."""
    import torch

    from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight
    groups = -(-k // group)
    return QuantizedWeight(torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=gen),
                           torch.rand(n, groups, generator=gen) * 0.01,
                           torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8),
                           bits, group)


def parse_format(fmt: str) -> tuple[int, int | None]:
    """'int8' (per channel), 'int4-g128', 'int8-g32' -> (bits, group or None); any other
    name is refused (it would otherwise be timed as something it is not)."""
    m = re.fullmatch(r"int([48])(?:-g([1-9][0-9]*))?", fmt)
    if m is None:
        raise ValueError(f"--formats: {fmt!r} is not int8, int4, int8-gGROUP or int4-gGROUP")
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


def stream_layers(ops, fmt: str, shapes, layers: int, dtype, gen, timed):
    """One row through `layers` distinct copies of `shapes`, in the layout a model of
    `dtype` keeps (bf16: the quad one where this CPU's kernels have it; fp32 models keep
    the exact widening kernels) -> (ms per pass, packed MB)."""
    import torch

    from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedWeight
    bits, group = parse_format(fmt)
    linears = []
    for _ in range(layers):
        for n, k in shapes:
            qw = random_quantized_weight(n, k, bits, group or k, gen)
            packed = PackedQuantizedWeight(ops, qw, quad=dtype == torch.bfloat16)
            linears.append((packed, k))
    nbytes = sum(t.numel() * t.element_size() for packed, _ in linears
                 for t in (packed.codes, packed.scales, packed.zeros))
    xs = {k: torch.randn(1, k, generator=gen).to(dtype) for _, k in shapes}

    def one_pass():
        for packed, k in linears:
            packed.linear(xs[k], None, 1 << 30, None)
    with torch.inference_mode():
        return timed(one_pass), nbytes / 1e6


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        n, k = part.lower().split("x")
        out.append((int(n), int(k)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.quant_rows",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="3072x512,512x1536,4096x4096", type=parse_shapes,
                   help="N x K of the linears (default: the bench model's gate_up and "
                        "down, and a 7B-class square)")
    p.add_argument("--rows", default="1,8,16,24,32,48,64",
                   type=lambda s: [int(r) for r in s.split(",")])
    p.add_argument("--formats", default="int8,int4-g128",
                   help="comma list of int8 (per channel), int4-gGROUP, int8-gGROUP")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--min-run-time", type=float, default=0.4)
    p.add_argument("--layers", type=int, default=0,
                   help="time one row through this many copies of the shapes instead")
    args = p.parse_args(argv)
    if args.layers < 0:
        p.error(f"--layers must be >= 0, got {args.layers}")
    try:
        for fmt in args.formats.split(","):
            parse_format(fmt)
    except ValueError as e:
        p.error(str(e))

    import torch
    from torch.utils import benchmark

    from tokenmill.kernels import cpu_ops
    from tokenmill.models.layers.linear import Linear
    from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedWeight
    from tokenmill.platforms.cpu import CpuPlatform

    ops = cpu_ops()
    if ops is None:
        print("no native CPU kernels on this machine: nothing to compare", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    platform = CpuPlatform.create("cpu", dtype)
    print(f"platform: {platform.describe()}")
    print(f"torch threads {torch.get_num_threads()}; ms per call (median); "
          f"kernel / tiles / dense {args.dtype}"
          + (" / quad-layout kernel" if getattr(ops, "has_quant_quad", False) else ""))

    def timed(fn) -> float:
        # (num_threads: the Timer runs on one thread unless told, whatever torch's count)
        return benchmark.Timer("fn()", globals={"fn": fn},
                               num_threads=torch.get_num_threads()).blocked_autorange(
            min_run_time=args.min_run_time).median * 1e3

    gen = torch.Generator().manual_seed(0)
    if args.layers:
        for fmt in args.formats.split(","):
            ms, mb = stream_layers(ops, fmt, args.shapes, args.layers, dtype, gen, timed)
            print(f"{fmt} one row through {args.layers} x {len(args.shapes)} linears: "
                  f"{ms:.3f} ms, {mb:.2f} MB packed, {mb / ms:.1f} GB/s", flush=True)
        return 0
    for fmt in args.formats.split(","):
        bits, group = parse_format(fmt)
        for n, k in args.shapes:
            qw = random_quantized_weight(n, k, bits, group or k, gen)
            packed = PackedQuantizedWeight(ops, qw)
            # The quad layout (integer dot products on 15-bit activations) where this
            # CPU's kernels have it: the bf16 models' kernel there.
            quad = PackedQuantizedWeight(ops, qw, quad=True)
            quad = quad if quad.quad else None
            layer = Linear(k, n, bias=False, dtype=dtype)  # the same weights, dense
            layer.weight.data.copy_(packed.dequantize(dtype))
            layer.set_method(platform.linear_method(layer))
            cells = []
            with torch.inference_mode():
                for m in args.rows:
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    a = timed(lambda: packed.linear(x, None, 1 << 30, None))
                    b = timed(lambda: packed.linear(x, None, 0, None))
                    c = timed(lambda: layer(x))
                    d = ("" if quad is None else
                         f" / quad {timed(lambda: quad.linear(x, None, 1 << 30, None)):.3f}")
                    cells.append(f"{m}: {a:.3f} / {b:.3f} / {c:.3f}{d}")
            print(f"{fmt} {n}x{k}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
