"""`python -m tokenmill.bench.decode_step`: the time of a pure decode step against its
memory-bandwidth bound (bench/roofline.py: weights + KV read per step / the device's
measured copy bandwidth).

For each batch size B: B requests with prompts of --context tokens are prefilled,
then --steps engine steps are timed while all B decode (one token each, greedy,
ignore_eos). The device is synchronised by every step (the sampled ids come back to
the host), so wall time per step is the step's time, host work included.

With --quantization (or a quantized checkpoint) the bound's weight bytes are the
model's resident bytes (bench/throughput.weight_facts) less the input embedding's
table when the lm_head is not it (a step reads B of its rows).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import time

logger = logging.getLogger(__name__)


def time_decode_steps(engine, batch: int, context_len: int, steps: int, vocab: int,
                      seed: int = 0) -> float:
    """Seconds per pure-decode step of `batch` rows after `context_len` prompt tokens."""
    import numpy as np

    from tokenmill import SamplingParams
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, {"prompt_token_ids": rng.integers(
            0, vocab, size=context_len).tolist()}, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every request has its first token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    engine.step()  # one more: an async engine's pipeline is full of decode steps now
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def quantized_weight_bytes(llm, args) -> int | None:
    """The weight bytes a decode step reads when the weights are quantized (module
    docstring); None for weights as stored in a plain dtype (the checkpoint counts)."""
    from tokenmill.bench.throughput import weight_facts
    facts = weight_facts(llm, args)
    model = llm.llm_engine.engine_core.runner.model
    if not facts["quantization"] or facts["resident_weight_bytes"] is None:
        return None
    from tokenmill.bench.roofline import _checkpoint_shapes
    embed = getattr(model, "embed_tokens", None)
    # (tied: the checkpoint has no lm_head of its own; the model's modules cannot
    # tell, the platform may give the head its own copy)
    tied = not any(name.endswith("lm_head.weight")
                   for name in _checkpoint_shapes(llm.llm_engine.model_config.path))
    table = 0 if embed is None or tied else sum(t.nbytes for t in embed.parameters())
    return facts["resident_weight_bytes"] - table


def main(argv=None) -> int:
    from tokenmill import LLM
    from tokenmill.bench import roofline as rl
    from tokenmill.bench.throughput import BENCH_MODELS, ensure_bench_model, read_model_config
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.decode_step")
    p.add_argument("--model", default="bench-qwen3-0.6b")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(rl.DTYPE_BYTES))
    p.add_argument("--batch", default="1,8,32,128", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output-json", default=None)
    from tokenmill.engine.arg_utils import add_quantization_arg
    add_quantization_arg(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = ensure_bench_model(args.model) if args.model in BENCH_MODELS else args.model
    vocab = read_model_config(path)["vocab_size"]
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(path, dtype=args.dtype, device=args.device, max_num_seqs=max(batches),
              max_model_len=args.context + args.steps + 8, enforce_eager=args.enforce_eager,
              quantization=args.quantization)
    engine = llm.llm_engine
    device = engine.model_config.device
    bandwidth = rl.measure_bandwidth(device)
    counts = rl.count_decode_bytes(path)
    weights = quantized_weight_bytes(llm, args)
    rows = []
    for b in batches:
        time_decode_steps(engine, b, args.context, 4, vocab)  # warm-up at this size
        s = time_decode_steps(engine, b, args.context, args.steps, vocab)
        row = rl.decode_bound(counts, b, args.context + args.steps // 2, args.dtype,
                              bandwidth["gbps"], s, weight_bytes=weights)
        rows.append(row)
        print(f"batch {b:4d}: {1e3 * s:8.3f} ms/step, bound {1e3 * row['bound_s']:7.3f} ms "
              f"({100 * row['bound_fraction']:5.1f}% of the bandwidth bound; "
              f"{row['bytes']['total'] / 1e6:.0f} MB/step at {bandwidth['gbps']:.0f} GB/s)",
              flush=True)
    result = {"model": path, "device": str(device), "dtype": args.dtype,
              "quantization": args.quantization, "quantized_weight_bytes": weights,
              "platform": engine.platform.as_dict(), "bandwidth": bandwidth, "steps": rows}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    del llm, engine
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
