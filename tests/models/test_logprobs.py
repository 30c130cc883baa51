"""Logprobs and prompt logprobs against Hugging Face transformers on fp32 tiny checkpoints.

Every reported value is compared with HF's log_softmax of the logits of a dense
forward over prompt + generated tokens: the top-N ids and values, the chosen
token's value and rank, the cumulative logprob. Prompt logprobs are checked
unchunked, chunked over several steps in a batch with requests that do not ask
for them, and across a forced preemption (delivered exactly once). Sampling
with a temperature or with logits processors still reports the model's raw
logprobs.
"""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from conftest import make_llm, make_prompts, preempt_pool, scheduler_of
from logprob_check import check_completion, check_prompt_logprobs
from tokenmill import SamplingParams
from tokenmill.sampling_params import RequestOutputKind

MODELS = ["llama_gqa_tied", "qwen3_headdim", "mistral_swa", "gemma3", "gemma4",
          "gemma4_moe_keqv", "gemma4_ple", "gemma4_kvshare", "gemma4_all"]


def generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


class Recorder:
    """Counts prompt-logprob deliveries per core request and records every preemption."""

    def __init__(self, llm):
        sched = scheduler_of(llm)
        self.prompt_logprobs = Counter()
        self.preempted = []  # (request id, computed tokens, prompt tokens) at preemption
        self.schedules = []
        update, preempt, schedule = sched.update_from_output, sched._preempt, sched.schedule

        def update_from_output(so, ro):
            outs = update(so, ro)
            for o in outs:
                if o.prompt_logprobs is not None:
                    self.prompt_logprobs[o.request_id] += 1
            return outs

        def _preempt(req):
            self.preempted.append((req.request_id, req.num_computed_tokens,
                                   req.num_prompt_tokens))
            return preempt(req)

        def record_schedule():
            so = schedule()
            self.schedules.append(so)
            return so

        sched.update_from_output = update_from_output
        sched._preempt = _preempt
        sched.schedule = record_schedule

    def was_chunked(self, rid: str, prompt_len: int) -> bool:
        chunks = [so.num_scheduled_tokens[rid] for so in self.schedules
                  if rid in so.num_scheduled_tokens]
        return bool(chunks) and chunks[0] < prompt_len


# ---- generated-token logprobs ----------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_greedy_logprobs_match_hf(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = tm.prompts[:4]  # lengths 5, 17, 33, 8
    n = 8
    params = [SamplingParams(temperature=0, logprobs=5, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=None, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=0, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=n, ignore_eos=True)]
    outs = generate(make_llm(tm.path), prompts, params)
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        comp = o.outputs[0]
        assert len(comp.token_ids) == n
        if sp.logprobs is None:
            assert comp.logprobs is None and comp.cumulative_logprob is None
            continue
        hf = check_completion(tm, p, comp, sp.logprobs, f"{name} prompt {i}")
        for t, d in zip(comp.token_ids, comp.logprobs):
            assert d[t].rank == 1  # greedy picks HF's argmax
        assert comp.token_ids == hf.argmax(-1).tolist()
        if sp.logprobs == 0:
            assert all(len(d) == 1 for d in comp.logprobs)


@pytest.mark.parametrize("name", MODELS)
def test_sampled_logprobs_are_raw_not_temperature_scaled(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = tm.prompts[:3]
    temp = 0.8
    params = [SamplingParams(temperature=temp, seed=10 + i, logprobs=5, max_tokens=10,
                             ignore_eos=True) for i in range(3)]
    outs = generate(make_llm(tm.path), prompts, params)
    ranks, scaled_gap = [], 0.0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        comp = o.outputs[0]
        hf = check_completion(tm, p, comp, 5, f"{name} prompt {i}")
        for j, (t, d) in enumerate(zip(comp.token_ids, comp.logprobs)):
            ranks.append(d[t].rank)
            # What a temperature-scaled report would be (log_softmax is shift-invariant).
            scaled = torch.log_softmax(hf[j] / temp, -1)
            scaled_gap = max(scaled_gap, abs(d[t].logprob - scaled[t].item()))
    # Guards: the draws are really random (not all argmax), and temperature-scaled
    # logprobs would have been told apart.
    assert max(ranks) > 1
    assert scaled_gap > 1e-2


@pytest.mark.parametrize("name", MODELS)
def test_logprobs_ignore_logits_processors(tiny_model_factory, name):
    """Bias and penalties change the tokens, not the reported (model) logprobs."""
    tm = tiny_model_factory(name)
    prompt = tm.prompts[1]
    plain = generate(make_llm(tm.path), [prompt],
                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    first = plain[0].outputs[0].token_ids[0]
    sp = SamplingParams(temperature=0, logprobs=3, max_tokens=6, ignore_eos=True,
                        logit_bias={first: -100.0}, repetition_penalty=1.5,
                        frequency_penalty=0.5, presence_penalty=0.5)
    comp = generate(make_llm(tm.path), [prompt], sp)[0].outputs[0]
    check_completion(tm, prompt, comp, 3, name)
    assert comp.token_ids[0] != first
    assert comp.logprobs[0][comp.token_ids[0]].rank >= 2
    assert comp.logprobs[0][first].rank == 1


# ---- prompt logprobs ---------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_prompt_logprobs_match_hf(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = tm.prompts[:4] + make_prompts([1, 2], tm.vocab_size, seed=5)
    llm = make_llm(tm.path)
    rec = Recorder(llm)
    outs = generate(llm, prompts, SamplingParams(temperature=0, prompt_logprobs=3, max_tokens=2,
                                                 ignore_eos=True))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        check_prompt_logprobs(tm, p, o.prompt_logprobs, 3, f"{name} prompt {i}")
        assert rec.prompt_logprobs[o.request_id] == 1
    assert outs[4].prompt_logprobs == [None]
    # Requests that do not ask get none; n > 1 reports them once, for the request.
    outs = generate(llm, prompts[1:3], [
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=1.0, n=2, seed=3, prompt_logprobs=0, max_tokens=2,
                       ignore_eos=True)])
    assert outs[0].prompt_logprobs is None
    check_prompt_logprobs(tm, prompts[2], outs[1].prompt_logprobs, 0, f"{name} n=2")
    assert len(outs[1].outputs) == 2


@pytest.mark.parametrize("name", MODELS)
def test_prompt_logprobs_chunked_in_a_mixed_batch(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = tm.prompts  # lengths 5, 17, 33, 8, 70, 3, 40, 12
    ks = [None, 3, None, 5, 3, None, 0, None]
    params = [SamplingParams(temperature=0, prompt_logprobs=k, max_tokens=4, ignore_eos=True,
                             logprobs=1 if i % 3 == 0 else None)
              for i, k in enumerate(ks)]
    llm = make_llm(tm.path, max_num_batched_tokens=16, block_size=4)
    rec = Recorder(llm)
    outs = generate(llm, prompts, params)
    for i, (p, k, o) in enumerate(zip(prompts, ks, outs)):
        if k is None:
            assert o.prompt_logprobs is None
            assert rec.prompt_logprobs[o.request_id] == 0
        else:
            check_prompt_logprobs(tm, p, o.prompt_logprobs, k, f"{name} prompt {i}")
            assert rec.prompt_logprobs[o.request_id] == 1
        if params[i].logprobs is not None:
            check_completion(tm, p, o.outputs[0], 1, f"{name} prompt {i}")
        assert o.outputs[0].token_ids == tm.reference(p, 4)
    # The long prompts that asked were really spread over several steps.
    assert rec.was_chunked(outs[4].request_id, 70) and rec.was_chunked(outs[6].request_id, 40)


@pytest.mark.parametrize("name", MODELS)
def test_prompt_logprobs_in_delta_outputs_come_once(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    engine = make_llm(tm.path, max_num_batched_tokens=16, block_size=4).llm_engine
    prompt = tm.prompts[2]  # 33 tokens: three chunks
    engine.add_request("d", {"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, prompt_logprobs=2, logprobs=2, max_tokens=5, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA))
    got, tokens, logprobs = [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got.append(out.prompt_logprobs)
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs or []
    assert len(got) == 1
    check_prompt_logprobs(tm, prompt, got[0], 2, name)
    assert len(tokens) == 5
    # The DELTA pieces put together are the whole completion's logprobs.
    check_completion(tm, prompt, SimpleNamespace(
        token_ids=tokens, logprobs=logprobs,
        cumulative_logprob=sum(d[t].logprob for t, d in zip(tokens, logprobs))), 2, name)


PREEMPT_CONFIGS = {
    # 24 usable blocks of 8 tokens: two full-length (96-token) sequences.
    "pool": dict(max_model_len=96, block_size=8, num_kv_blocks=25),
    # The same pressure in 4-token blocks, prompts chunked by a 16-token budget.
    "pool_chunked": dict(max_model_len=96, block_size=4, num_kv_blocks=49,
                         max_num_batched_tokens=16),
}


@pytest.mark.parametrize("config", list(PREEMPT_CONFIGS))
@pytest.mark.parametrize("name", MODELS)
def test_prompt_logprobs_survive_preemption(tiny_model_factory, name, config):
    tm = tiny_model_factory(name)
    prompts = tm.prompts
    n_new = 20
    params = [SamplingParams(temperature=0, prompt_logprobs=3 if i != 3 else None,
                             logprobs=1 if i % 2 else None, max_tokens=n_new, ignore_eos=True)
              for i in range(len(prompts))]
    llm = make_llm(tm.path, **preempt_pool(name, PREEMPT_CONFIGS[config]))
    rec = Recorder(llm)
    outs = generate(llm, prompts, params)
    assert scheduler_of(llm).num_preemptions > 0, "the config was meant to force preemption"
    by_id = {o.request_id: i for i, o in enumerate(outs)}
    preempted = {by_id[rid] for rid, _, _ in rec.preempted}
    asked = {i for i, sp in enumerate(params) if sp.prompt_logprobs is not None}
    # Some request that asked was preempted after its prompt logprobs went out (they must
    # not come again when its prompt is recomputed) ...
    assert any(by_id[rid] in asked and done >= n_prompt for rid, done, n_prompt in rec.preempted)
    if config == "pool_chunked":
        # ... and one in the middle of its prompt (they must come once, complete).
        assert any(by_id[rid] in asked and done < n_prompt
                   for rid, done, n_prompt in rec.preempted)
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        where = f"{name}/{config} prompt {i}{' (preempted)' if i in preempted else ''}"
        assert o.outputs[0].token_ids == tm.reference(p), where
        if sp.prompt_logprobs is None:
            assert o.prompt_logprobs is None and rec.prompt_logprobs[o.request_id] == 0
        else:
            assert rec.prompt_logprobs[o.request_id] == 1, where
            check_prompt_logprobs(tm, p, o.prompt_logprobs, 3, where)
        if sp.logprobs is not None:
            check_completion(tm, p, o.outputs[0], 1, where)
