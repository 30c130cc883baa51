"""The quad layout against the widening kernel, per capability level: one quantized
linear through `linear_quant` on the plain packing (codes widened in registers) and on
the quad packing (integer dot products on 15-bit activations) of the same random codes,
each level's kernels pinned with `kernels.cpu_ops(level)`, levels and layouts
interleaved. The platform's `QUAD_LEVELS` (platforms/cpu.py) are the levels where the
quad column wins.

    .venv/bin/python -m tokenmill.bench.quant_quad --levels avx2,avx512,avx512_vnni
    .venv/bin/python -m tokenmill.bench.quant_quad --threads 1 --rows 1,4,16

bf16 inputs; ms per call, median over --rounds of the best of 3 timed loops.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.quant_quad",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default=None,
                   help="comma list (default: every level this CPU runs with the layout)")
    p.add_argument("--shapes", default="3072x512,4096x4096")
    p.add_argument("--rows", default="1,4,16", type=lambda s: [int(r) for r in s.split(",")])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    args = p.parse_args(argv)

    import torch

    from tokenmill import kernels
    from tokenmill.bench.quant_rows import random_quantized_weight

    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.levels.split(",") if args.levels else kernels.runnable_levels()
    mods = {lv: kernels.cpu_ops(lv) for lv in names}
    mods = {lv: m for lv, m in mods.items() if m is not None and m.has_quant_quad}
    if not mods:
        print("no level with the quad layout here", file=sys.stderr)
        return 1
    print(f"torch threads {torch.get_num_threads()}; ms per call, widening / quad")
    gen = torch.Generator().manual_seed(0)
    no_bias = torch.empty(0)

    def timed(fn, n):
        fn()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - start) / n)
        return best * 1e3

    for fmt, bits, group in (("int8", 8, None), ("int4-g128", 4, 128)):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.lower().split("x"))
            g = group or k
            qw = random_quantized_weight(n, k, bits, g, gen)
            packs = {lv: [m.pack_quant_weight(qw.codes, qw.scales, qw.zeros, bits, g, quad)
                          for quad in (False, True)] for lv, m in mods.items()}
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen).bfloat16()
                loops = max(3, int(2.7e6 / (n * k) * 40 / max(1, rows ** 0.5)))
                times = {lv: ([], []) for lv in mods}
                for _ in range(args.rounds):
                    for lv, m in mods.items():
                        for i, packed in enumerate(packs[lv]):
                            times[lv][i].append(timed(
                                lambda: m.linear_quant(x, *packed, n, bits, g, no_bias), loops))
                cells = []
                for lv in mods:
                    w, q = (sorted(t)[len(t) // 2] for t in times[lv])
                    cells.append(f"{lv} {w:.3f} / {q:.3f} ({w / q:.2f}x)")
                print(f"{fmt} {n}x{k} rows {rows}: " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
