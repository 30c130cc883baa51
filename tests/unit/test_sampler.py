"""Sampling: seeded reproducibility, top-k / top-p limits, temperature statistics."""
from __future__ import annotations

import pytest
import torch

from conftest import make_llm, make_prompts
from tokenmill import SamplingParams
from tokenmill.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p

N_TOK = 12


def metadata(n, temperature=1.0, top_k=None, top_p=None, generators=None, greedy=None):
    greedy_mask = torch.zeros(n, dtype=torch.bool) if greedy is None else torch.tensor(greedy)
    temp = torch.full((n,), float(temperature))
    temp[greedy_mask] = 1.0
    return SamplingMetadata(
        temperature=temp, greedy_mask=greedy_mask, all_greedy=bool(greedy_mask.all()),
        all_random=not bool(greedy_mask.any()),
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.int32),
        top_p=None if top_p is None else torch.full((n,), float(top_p)),
        generators=generators or {})


# ---- seeded requests do not depend on what else is in the batch ------------------------

def _gen(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def seeded_setup(llama_tiny):
    prompts = make_prompts([20, 30, 7, 45, 12], llama_tiny.vocab_size, seed=11)
    target = prompts[0]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=N_TOK, ignore_eos=True)
    return llama_tiny, target, sp, prompts[1:]


class TargetTracker:
    """Runs LLM.generate and reports the target's tokens and its number of prompt chunks."""

    def __init__(self, llm):
        self.llm, self.seen = llm, []
        sched = llm.llm_engine.engine_core.scheduler
        orig = sched.schedule
        sched.schedule = lambda: self.seen.append(orig()) or self.seen[-1]

    def run(self, prompts, params, target_index):
        self.seen.clear()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        rid = outs[target_index].request_id
        chunks, done = 0, 0
        for so in self.seen:
            for nr in so.scheduled_new_reqs:  # a prefix-cache hit starts it past 0
                if nr.req_id == rid:
                    done = nr.num_computed_tokens
            n = so.num_scheduled_tokens.get(rid)
            if n and done < len(prompts[target_index]):
                chunks += 1
                done += n
        return outs[target_index].outputs[0].token_ids, chunks


@pytest.mark.parametrize("engine_kw", [
    {},  # the default budget: no prompt is chunked
    {"max_num_batched_tokens": 16, "block_size": 4},  # prompts chunked differently per mix
], ids=["unchunked", "chunked"])
def test_seeded_sampling_is_independent_of_the_batch(seeded_setup, engine_kw):
    tm, target, sp, others = seeded_setup
    tracker = TargetTracker(make_llm(tm.path, **engine_kw))
    alone, alone_chunks = tracker.run([target], [sp], 0)
    assert len(alone) == N_TOK
    # The same request mixed with greedy, unseeded-random and other seeded requests,
    # at different positions in the batch.
    other_params = [SamplingParams(temperature=0.0, max_tokens=N_TOK, ignore_eos=True),
                    SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True),
                    SamplingParams(temperature=1.0, seed=7, max_tokens=N_TOK, ignore_eos=True),
                    SamplingParams(temperature=0.5, top_k=5, max_tokens=3, ignore_eos=True)]
    mixes = {
        "last": (others + [target], other_params + [sp], len(others)),
        "first": ([target] + others, [sp] + other_params, 0),
        "middle": (others[:2] + [target] + others[2:], other_params[:2] + [sp] + other_params[2:],
                   2),
        "after_long_prompt": ([others[0], target], [other_params[0], sp], 1),
    }
    got, chunks = {}, {"alone": alone_chunks}
    for name, (prompts, params, idx) in mixes.items():
        got[name], chunks[name] = tracker.run(prompts, params, idx)
    if engine_kw:
        # Precondition: the mixes really split the target's prompt differently.
        assert len(set(chunks.values())) > 1, chunks
    else:
        assert set(chunks.values()) == {1}
    for name, toks in got.items():
        assert toks == alone, (f"seeded request differs when {name} (prompt chunks per mix: "
                               f"{chunks})")
    # A different seed gives a different stream (the seed is really used).
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=N_TOK, ignore_eos=True)
    assert tracker.run([target], [other_seed], 0)[0] != alone


def test_seeded_sampling_survives_preemption(llama_tiny):
    """Preempted and recomputed, seeded requests still produce their own streams."""
    prompts = make_prompts([20, 33, 41, 12, 27], llama_tiny.vocab_size, seed=12)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = _gen(make_llm(llama_tiny.path, max_model_len=64, block_size=4), prompts, params)
    tight = make_llm(llama_tiny.path, max_model_len=64, block_size=4, num_kv_blocks=34)
    got = _gen(tight, prompts, params)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert got == roomy


def test_unseeded_sampling_is_random(llama_tiny):
    """Guard for the test above: without a seed, two runs differ."""
    llm = make_llm(llama_tiny.path)
    p = make_prompts([10], llama_tiny.vocab_size, seed=3)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=N_TOK, ignore_eos=True)
    assert _gen(llm, [p], sp) != _gen(llm, [p], sp)


def test_engine_seed_makes_unseeded_sampling_reproducible(llama_tiny):
    prompts = make_prompts([5, 9, 14], llama_tiny.vocab_size, seed=8)
    sp = SamplingParams(temperature=1.0, max_tokens=N_TOK, ignore_eos=True)
    a = _gen(make_llm(llama_tiny.path, seed=0), prompts, sp)
    b = _gen(make_llm(llama_tiny.path, seed=0), prompts, sp)
    c = _gen(make_llm(llama_tiny.path, seed=1), prompts, sp)
    assert a == b
    assert a != c


# ---- top-k / top-p limits equal greedy -------------------------------------------------

@pytest.fixture(scope="module")
def greedy_setup(llama_tiny):
    llm = make_llm(llama_tiny.path)
    prompts = make_prompts([4, 19, 33], llama_tiny.vocab_size, seed=21)
    ref = _gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=N_TOK, ignore_eos=True))
    return llm, prompts, ref


def test_top_k_one_equals_greedy(greedy_setup):
    llm, prompts, ref = greedy_setup
    got = _gen(llm, prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=N_TOK,
                                            ignore_eos=True))
    assert got == ref
    # Guard: at this temperature, without top_k, the output is not greedy.
    hot = _gen(llm, prompts, SamplingParams(temperature=1.5, seed=0, max_tokens=N_TOK,
                                            ignore_eos=True))
    assert hot != ref


def test_tiny_top_p_equals_greedy(greedy_setup):
    llm, prompts, ref = greedy_setup
    got = _gen(llm, prompts, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=N_TOK,
                                            ignore_eos=True))
    assert got == ref


def test_sampler_top_k_one_and_tiny_top_p_equal_argmax():
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    def sampler(lg, md):
        return Sampler()(lg, md).sampled_token_ids
    argmax = logits.argmax(-1)
    assert torch.equal(sampler(logits, metadata(64, 2.0, top_k=1)), argmax)
    assert torch.equal(sampler(logits, metadata(64, 2.0, top_p=1e-6)), argmax)
    assert torch.equal(sampler(logits, metadata(64, greedy=[True] * 64)), argmax)
    assert not torch.equal(sampler(logits, metadata(64, 2.0)), argmax)


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    torch.manual_seed(1)
    logits = torch.randn(32, 40)
    greedy = [i % 2 == 0 for i in range(32)]
    out = Sampler()(logits, metadata(32, 1.0, greedy=greedy)).sampled_token_ids
    argmax = logits.argmax(-1)
    assert torch.equal(out[0::2], argmax[0::2])
    assert not torch.equal(out[1::2], argmax[1::2])


def test_apply_top_k_top_p_masks():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert torch.isfinite(out).tolist() == [[True, False, True, False, False]]
    # probs ~ [.64, .09, .24, .03, .01]: top_p 0.7 keeps the two most likely.
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.7]))
    assert torch.isfinite(out).tolist() == [[True, False, True, False, False]]
    out = apply_top_k_top_p(logits.clone(), torch.tensor([0]), torch.tensor([1.0]))
    assert torch.isfinite(out).all()
    out = apply_top_k_top_p(logits.clone(), torch.tensor([1000]), None)  # k > vocab
    assert torch.isfinite(out).all()
    # Rows are independent: each keeps its own top-k.
    two = torch.stack([logits[0], -logits[0]])
    out = apply_top_k_top_p(two, torch.tensor([1, 2]), None)
    assert torch.isfinite(out).tolist() == [[True, False, False, False, False],
                                            [False, False, False, True, True]]


# ---- temperature statistics ------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
N_DRAWS = 40000


def _frequencies(md, n=N_DRAWS):
    logits = LOGITS.expand(n, -1).clone()
    out = Sampler()(logits, md).sampled_token_ids
    return torch.bincount(out, minlength=LOGITS.numel()).float() / n


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_softmax(temperature):
    torch.manual_seed(1234)
    freq = _frequencies(metadata(N_DRAWS, temperature))
    expect = torch.softmax(LOGITS / temperature, -1)
    # Std of a frequency is <= 0.0025 at 40k draws; 0.015 is a loose, seeded bound.
    assert (freq - expect).abs().max() < 0.015, (freq, expect)
    # The temperature matters: the bound cannot be met by the T=1 distribution.
    if temperature != 1.0:
        assert (torch.softmax(LOGITS, -1) - expect).abs().max() > 0.05


def test_top_k_sampling_follows_the_renormalised_softmax():
    torch.manual_seed(99)
    freq = _frequencies(metadata(N_DRAWS, 1.0, top_k=3))
    expect = torch.zeros_like(LOGITS)
    expect[:3] = torch.softmax(LOGITS[:3], -1)
    assert freq[3:].sum() == 0
    assert (freq - expect).abs().max() < 0.015


def test_seeded_generators_give_per_row_streams():
    logits = LOGITS.expand(4, -1).clone()

    def draw(seed_rows):
        gens = {r: torch.Generator().manual_seed(s) for r, s in seed_rows.items()}
        md = metadata(4, 1.0, generators=gens)
        return torch.stack([Sampler()(logits, md).sampled_token_ids for _ in range(200)], 1)

    a = draw({0: 5, 2: 6})
    b = draw({0: 5, 3: 6})
    assert torch.equal(a[0], b[0])  # same seed on the same row
    assert torch.equal(a[2], b[3])  # same seed on another row: same stream
    assert not torch.equal(a[0], a[2])


def test_random_sample_never_draws_a_zero_probability_token(monkeypatch):
    """Inverse-CDF draws over unnormalised rows with zeros between and after the mass:
    only tokens with probability; a uniform at the very top of a row (its share would
    round up to the row's total) takes the row's last token with probability, not a
    trailing zero."""
    from tokenmill.sample.sampler import random_sample
    probs = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, 0.0],
                          [2.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 5.0]]).repeat(2000, 1)
    torch.manual_seed(3)
    ids = random_sample(probs.clone(), {})
    assert bool((probs.gather(1, ids.unsqueeze(1)) > 0).all())
    first = ids[0::3].float()
    assert abs((first == 1).float().mean().item() - 0.75) < 0.03  # 3 : 1
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: self.fill_(1.0))
    assert random_sample(probs[:3].clone(), {}).tolist() == [3, 0, 5]
