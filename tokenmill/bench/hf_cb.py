"""The HF continuous-batching baseline: transformers' paged-attention CB manager.

`model.generate_batch(inputs, generation_config)` is a thin wrapper over
`model.continuous_batching_context_manager(...)` + `manager.add_requests(...)`
that gives every request the same `max_new_tokens`. The manager's `add_request`
takes a per-request `max_new_tokens`, so this baseline uses the same manager
directly and each request stops at its own length, as in tokenmill (no padding
waste to discount). EOS is disabled (`eos_token_id=-1`), greedy.

Sizing: left alone, the manager sizes its KV cache from free memory (on CPU it
took ~14 GB, with an attention mask to match); here it gets room for the whole
workload at once and tokenmill's token budget per step (`max_batch_tokens` =
--max-num-batched-tokens, default 2048) and request cap (--max-num-seqs).
"""
from __future__ import annotations

import math
import time

RESULT_TIMEOUT_S = 1.0


def _cb_config(prompt_lens, output_lens, max_batch_tokens: int, max_requests: int):
    from transformers.generation import ContinuousBatchingConfig
    page = ContinuousBatchingConfig.page_size  # the class default (256 tokens)
    blocks = sum(math.ceil((a + b) / page) for a, b in zip(prompt_lens, output_lens)) + 2
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max_batch_tokens,
                                    max_requests_per_batch=max_requests)


def _workload_hints(prompt_lens, output_lens):
    try:
        from transformers.generation.continuous_batching.continuous_api import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(max_prompt_length=max(prompt_lens),
                         max_generated_length=max(output_lens), num_requests=len(prompt_lens))


def _run_requests(manager, prompts: list[list[int]], output_lens: list[int],
                  tag: str) -> list[list[int]]:
    """Add every request, wait for all of them; -> generated ids in request order."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt, n in zip(ids, prompts, output_lens):
        if manager.add_request(list(prompt), request_id=rid, max_new_tokens=n,
                               eos_token_id=-1) is None:
            raise RuntimeError(f"HF continuous batching dropped request {rid}")
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=RESULT_TIMEOUT_S)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the HF continuous batching thread stopped "
                                   f"({len(done)} of {len(ids)} requests done)")
            continue
        if getattr(result, "error", None):
            raise RuntimeError(f"HF continuous batching request {result.request_id} failed: "
                               f"{result.error}")
        if result.is_finished():
            done[result.request_id] = list(result.generated_tokens)
    return [done[rid] for rid in ids]


def run_hf_cb(model_path: str, prompts: list[list[int]], output_lens: list[int],
              warmup_prompts: list[list[int]], warmup_lens: list[int], dtype: str, device,
              max_batch_tokens: int, max_requests: int):
    """-> (output tok/s, seconds, generated token ids per request). One manager serves
    an untimed warmup, then the timed requests (all added at once)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    if not hasattr(model, "continuous_batching_context_manager"):
        raise RuntimeError("this transformers has no continuous batching "
                           "(generate_batch); use --skip-hf-cb")
    lens_in = [len(p) for p in prompts] + [len(p) for p in warmup_prompts]
    lens_out = list(output_lens) + list(warmup_lens)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(lens_out), eos_token_id=-1,
                           pad_token_id=0)
    cb = _cb_config(lens_in, lens_out, max_batch_tokens, max_requests)
    cm = model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30,
        warmup=False, workload_hints=_workload_hints(lens_in, lens_out))
    with cm as manager:
        _run_requests(manager, warmup_prompts, warmup_lens, "warmup-")
        start = time.perf_counter()
        token_ids = _run_requests(manager, prompts, output_lens, "req-")
        seconds = time.perf_counter() - start
    wrong = [i for i, (t, n) in enumerate(zip(token_ids, output_lens)) if len(t) != n]
    if wrong:
        raise RuntimeError(f"HF continuous batching: wrong output lengths in requests {wrong[:8]}")
    del model
    return sum(output_lens) / seconds, seconds, token_ids
