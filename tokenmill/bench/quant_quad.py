"""The quad layout against the widening kernel, per capability level: one quantized
linear through `linear_quant` on the plain packing (codes widened in registers) and on
the quad packing (integer dot products on 15-bit activations) of the same random codes,
each level's kernels pinned with `kernels.cpu_ops(level)`, levels and layouts
interleaved. The platform's `QUAD_LEVELS` (platforms/cpu.py) are the levels where the
quad column wins.

    .venv/bin/python -m tokenmill.bench.quant_quad --levels avx2,avx512,avx512_vnni
    .venv/bin/python -m tokenmill.bench.quant_quad --threads 1 --rows 1,4,16
    # the bench model's four linears, int4 groups 32 and 128, quad only, thread CPU time
    .venv/bin/python -m tokenmill.bench.quant_quad --shapes 1024x512,512x512,3072x512,512x1536 \\
        --bits 4 --groups 32,128 --rows 1 --layouts quad --clock thread --threads 1

bf16 inputs; us per call, median over --rounds of the best of 3 timed loops.
--clock thread times the calling thread's CPU (time.thread_time): on a shared machine
the time the thread was descheduled does not count (with several torch threads it is
the caller's share: its own blocks and its wait for the others).
"""
from __future__ import annotations

import argparse
import sys
import time

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _formats(bits_list, groups):
    """(label, bits, group or None for the whole K)."""
    if groups is None:  # the defaults: int8 per channel, int4 group 128
        return [(f"int{b}" if b == 8 else f"int{b}-g128", b, None if b == 8 else 128)
                for b in bits_list]
    return [(f"int{b}-g{g or 'K'}", b, g or None) for b in bits_list for g in groups]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.quant_quad",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default=None,
                   help="comma list (default: every level this CPU runs with the layout)")
    p.add_argument("--shapes", default="3072x512,4096x4096")
    p.add_argument("--rows", default="1,4,16", type=lambda s: [int(r) for r in s.split(",")])
    p.add_argument("--bits", default="8,4", type=lambda s: [int(b) for b in s.split(",")])
    p.add_argument("--groups", default=None,
                   type=lambda s: [0 if g.lower() == "k" else int(g) for g in s.split(",")],
                   help="comma list of group sizes for every --bits (k or 0: the whole K); "
                        "default int8 per channel, int4 group 128")
    p.add_argument("--layouts", default="plain,quad",
                   help="plain (widening kernel), quad, or both (the ratio is printed)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    args = p.parse_args(argv)
    layouts = [name == "quad" for name in args.layouts.split(",")]
    clock = CLOCKS[args.clock]

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
    heads = " / ".join("quad" if q else "widening" for q in layouts)
    print(f"torch threads {torch.get_num_threads()}, {args.clock} clock; us per call, {heads}")
    gen = torch.Generator().manual_seed(0)
    no_bias = torch.empty(0)

    def timed(fn, n):
        fn()
        best = float("inf")
        for _ in range(3):
            start = clock()
            for _ in range(n):
                fn()
            best = min(best, (clock() - start) / n)
        return best * 1e6

    totals = {}
    for fmt, bits, group in _formats(args.bits, args.groups):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.lower().split("x"))
            g = group or k
            qw = random_quantized_weight(n, k, bits, g, gen)
            packs = {lv: [m.pack_quant_weight(qw.codes, qw.scales, qw.zeros, bits, g, quad)
                          for quad in layouts] for lv, m in mods.items()}
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen).bfloat16()
                loops = max(3, int(2.7e6 / (n * k) * 40 / max(1, rows ** 0.5)))
                times = {lv: [[] for _ in layouts] for lv in mods}
                for _ in range(args.rounds):
                    for lv, m in mods.items():
                        for i, packed in enumerate(packs[lv]):
                            times[lv][i].append(timed(
                                lambda: m.linear_quant(x, *packed, n, bits, g, no_bias), loops))
                cells = []
                for lv in mods:
                    med = [sorted(t)[len(t) // 2] for t in times[lv]]
                    for i, t in enumerate(med):
                        key = (fmt, rows, lv, i)
                        totals[key] = totals.get(key, 0.0) + t
                    cell = f"{lv} " + " / ".join(f"{t:.1f}" for t in med)
                    if len(med) == 2:
                        cell += f" ({med[0] / med[1]:.2f}x)"
                    gw = n * k * rows / med[-1] / 1e3
                    cells.append(cell + f" [{gw:.1f} Gw/s]")
                print(f"{fmt} {n}x{k} rows {rows}: " + "; ".join(cells), flush=True)
    if len(args.shapes.split(",")) > 1:
        for (fmt, rows, lv, i), t in totals.items():
            print(f"sum over shapes {fmt} rows {rows} {lv} "
                  f"{'quad' if layouts[i] else 'widening'}: {t:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
