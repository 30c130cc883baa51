"""The CPU native decode attention kernels against the bytes they read
(`python -m tokenmill.bench.attention_kernels --kernel native ...`).

Decode attention reads each cached K/V element once and does a few multiply-adds per
query head with it, so its floor is the time those bytes take at the machine's
streaming read bandwidth. Every case prints `vs_bound` = seconds per call / (K/V bytes
/ bandwidth): the goal is <= 1.3 for every head size, GQA ratio, window and soft-cap.
The bandwidth is measured in the same run (decode_read.measure_read_bandwidth: the
best of torch's fp32 max over 256 MiB, all threads).

A call's K/V must come from memory, as in a model's step (each layer reads its own
cache): the block tables of successive calls walk a shuffled pool of blocks of at
least --pool-mib (far past the last-level cache), each call taking blocks no recent
call read. `--compare-prebuilt` loads the level's prebuilt module (the kernels as
installed: what the sources were before an edit the loader compiled at run time) and
times it on the same inputs, interleaved call batch by call batch, so the before /
after ratio of one run shares its noise.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmill.worker.huge_pages import zeros_huge_paged

CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                "float16": torch.float16, "fp8": torch.float8_e4m3fn}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Pool:
    """A shuffled pool of cache blocks, handed out so that consecutive calls read
    blocks no recent call touched."""

    def __init__(self, num_blocks: int, block_shape: tuple, dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # fp8: random codes from a bf16 draw, scaled into e4m3's range
        draw = torch.float32 if dtype == torch.float32 else torch.bfloat16
        # on huge pages where the engine's KV cache has them (worker/huge_pages.py): with
        # 4 KiB pages nearly every scattered block read is a TLB miss the engine does not pay
        self.cache = zeros_huge_paged((num_blocks, *block_shape), dtype, "cpu")
        self.cache.copy_(torch.randn(num_blocks, *block_shape, generator=g, dtype=draw))
        self.order = torch.randperm(num_blocks, generator=g).to(torch.int32)
        self.next = 0

    def table(self, rows: int, per_row: int) -> torch.Tensor:
        need = rows * per_row
        if self.next + need > self.order.numel():
            self.next = 0
        t = self.order[self.next:self.next + need].view(rows, per_row).clone()
        self.next += need
        return t


def _pool_blocks(block_bytes: int, call_bytes: int, pool_mib: int) -> int:
    return max(2 * call_bytes, pool_mib << 20) // block_bytes + 1


def _time_calls(fns, iters: int, rounds: int, clock=time.perf_counter) -> list[float]:
    """Best mean seconds per call of each fn over `rounds` rounds of `iters` calls, the
    fns taking turns inside each round (interleaved: they share the machine's noise)."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = clock()
            for _ in range(iters):
                fn()
            best[i] = min(best[i], (clock() - start) / iters)
    return best


def _prebuilt(level: str):
    """The prebuilt module file of `level`, imported whatever its build record says."""
    from tokenmill import kernels
    from tokenmill.kernels import levels
    path = kernels._prebuilt_file(level)
    if path is None:
        raise SystemExit(f"--compare-prebuilt: no prebuilt module of the {level} level")
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"tokenmill_prebuilt.{levels.module_name(level)}",
                                                  path)  # PyInit_ names the last part
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _iters_for(call_bytes: int, bandwidth_gbps: float, target_s: float) -> int:
    return max(2, min(200, int(target_s / max(call_bytes / (bandwidth_gbps * 1e9), 1e-7))))


def decode_cases(args) -> list[dict]:
    cases = []
    for dtype in args.cache_dtypes.split(","):
        for d in _ints(args.heads):
            for g in _ints(args.gqa):
                for b in _ints(args.batch):
                    for ctx in _ints(args.contexts):
                        cases.append(dict(kind="paged_decode", cache_dtype=dtype, head_size=d,
                                          gqa=g, batch=b, context=ctx, window=args.window,
                                          softcap=args.softcap))
    for h in _ints(args.mla_heads):
        for dtype in args.cache_dtypes.split(","):
            if dtype == "fp8":
                continue  # the latent kernel reads a cache of the queries' dtype
            for b in _ints(args.batch):
                for ctx in _ints(args.contexts):
                    cases.append(dict(kind="mla_decode", cache_dtype=dtype, heads=h, batch=b,
                                      context=ctx, head_size=args.mla_rank + args.mla_rope))
    return cases


def _setup(case: dict, args, pools: dict):
    """(fn(ops) -> one call, K/V bytes of one call)."""
    dtype = CACHE_DTYPES[case["cache_dtype"]]
    bs, b, ctx = args.block_size, case["batch"], case["context"]
    per_row = -(-ctx // bs)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    if case["kind"] == "mla_decode":
        d, h = case["head_size"], case["heads"]
        block_shape, seen = (bs, d), ctx
        call_bytes = b * seen * d * dtype.itemsize
        qdtype = dtype
        q = torch.randn(b, h, d).to(qdtype)
    else:
        d, hkv = case["head_size"], args.num_kv_heads
        block_shape = (2, bs, hkv, d)
        seen = min(ctx, case["window"]) if case["window"] else ctx
        call_bytes = b * seen * hkv * d * 2 * dtype.itemsize
        qdtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
        q = torch.randn(b, hkv * case["gqa"], d).to(qdtype)
    block_bytes = dtype.itemsize * int(torch.tensor(block_shape).prod())
    key = (case["kind"], block_shape, case["cache_dtype"])
    want = _pool_blocks(block_bytes, call_bytes, args.pool_mib)
    if key not in pools or pools[key].cache.shape[0] < want:
        pools.pop(key, None)  # free the smaller one first
        pools[key] = Pool(want, block_shape, dtype)
    pool = pools[key]
    tables = [pool.table(b, per_row) for _ in range(max(1, min(8, pool.cache.shape[0]
                                                               // (b * per_row))))]
    state = {"i": 0}
    scale = d ** -0.5
    k_scale, v_scale = (0.5, 0.25) if dtype == torch.float8_e4m3fn else (1.0, 1.0)

    def make(ops):
        def call():
            t = tables[state["i"] % len(tables)]
            state["i"] += 1
            if case["kind"] == "mla_decode":
                return ops.mla_decode(q, pool.cache, t, lens, scale, args.mla_rank)
            return ops.paged_decode(q, pool.cache, t, lens, scale, case["window"],
                                    case["softcap"], k_scale, v_scale)
        return call
    return make, call_bytes


def run(args) -> dict:
    from tokenmill import kernels
    from tokenmill.bench.decode_read import READ_PROBE_BYTES, measure_read_bandwidth
    level = args.level or kernels.cpu_capability()
    ops = kernels.cpu_ops(level)
    if ops is None:
        raise SystemExit("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    base = _prebuilt(level) if args.compare_prebuilt else None
    torch.set_num_threads(args.threads or torch.get_num_threads())
    clock = time.perf_counter
    if args.clock == "thread":  # CPU time of this thread: one thread runs the kernel here
        if torch.get_num_threads() != 1:
            raise SystemExit("--clock thread needs --threads 1 (the kernel on this thread)")
        clock = time.thread_time
    bandwidth = measure_read_bandwidth()
    if args.clock == "thread":  # the same probe (fp32 max over 256 MiB) on the same clock
        x = torch.ones(READ_PROBE_BYTES // 4)
        x.amax()
        best = min(_time_calls([x.amax], 1, 7, clock))
        bandwidth["probes"]["torch amax fp32, thread time"] = READ_PROBE_BYTES / best / 1e9
        bandwidth["gbps"] = max(bandwidth["probes"].values())
    gbps = bandwidth["gbps"]
    print(f"level {level}, {torch.get_num_threads()} threads, streaming reads {gbps:.1f} GB/s "
          f"(best of: {', '.join(f'{k} {v:.1f}' for k, v in bandwidth['probes'].items())})",
          flush=True)
    rows, pools = [], {}
    for case in decode_cases(args):
        make, call_bytes = _setup(case, args, pools)
        if call_bytes > args.max_kv_mib << 20:
            print(f"skip {case}: {call_bytes >> 20} MiB of K/V > --max-kv-mib", flush=True)
            continue
        fns = [make(ops)] + ([make(base)] if base is not None else [])
        for fn in fns:
            fn()  # first touch
        iters = _iters_for(call_bytes, gbps, args.target_ms / 1e3)
        times = _time_calls(fns, iters, args.rounds, clock)
        bound = call_bytes / (gbps * 1e9)
        row = dict(case, kv_bytes=call_bytes, seconds=times[0], vs_bound=times[0] / bound,
                   gbps=call_bytes / times[0] / 1e9)
        text = ""
        if base is not None:
            row.update(prebuilt_seconds=times[1], prebuilt_vs_bound=times[1] / bound)
            text = f"  prebuilt {times[1] / bound:5.2f}x ({times[1] / times[0]:4.2f}x slower)"
        rows.append(row)
        shape = (f"mla h{case['heads']:3d} d{case['head_size']}" if case["kind"] == "mla_decode"
                 else f"d{case['head_size']:3d} g{case['gqa']}")
        print(f"{case['cache_dtype']:8s} {shape:12s} batch {case['batch']:4d} ctx "
              f"{case['context']:5d}: {1e6 * times[0]:9.1f} us {row['gbps']:6.1f} GB/s "
              f"{row['vs_bound']:5.2f}x bound{text}", flush=True)
    return {"level": level, "threads": torch.get_num_threads(), "bandwidth": bandwidth,
            "num_kv_heads": args.num_kv_heads, "block_size": args.block_size, "rows": rows}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dtypes", default="bfloat16,float32,fp8",
                   help="comma-separated cache dtypes (bfloat16, float32, float16, fp8)")
    p.add_argument("--heads", default="64,128,256", help="comma-separated head sizes")
    p.add_argument("--gqa", default="1,4,8", help="comma-separated query heads per kv head")
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--batch", default="1,8,32,128", help="comma-separated batch sizes")
    p.add_argument("--contexts", default="512,1024,2048,4096",
                   help="comma-separated context lengths (every row the same)")
    p.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    p.add_argument("--softcap", type=float, default=0.0, help="score soft-cap (0: none)")
    p.add_argument("--mla-heads", default="",
                   help="comma-separated MLA head counts also timed (mla_decode)")
    p.add_argument("--mla-rank", type=int, default=512, help="MLA kv_lora_rank")
    p.add_argument("--mla-rope", type=int, default=64, help="MLA rope head dim")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--level", default=None, help="kernel level (default: the chosen one)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="thread: the CPU time of the (one) kernel thread, for a machine "
                        "shared with other work (time descheduled does not count)")
    p.add_argument("--compare-prebuilt", action="store_true")
    p.add_argument("--pool-mib", type=int, default=256)
    p.add_argument("--max-kv-mib", type=int, default=1024)
    p.add_argument("--target-ms", type=float, default=60.0, help="time per round per case")
    p.add_argument("--rounds", type=int, default=3)


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.attention_kernels --kernel native")
    add_args(p)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    out = run(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
