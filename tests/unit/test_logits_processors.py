"""Logits processors of the sampler, against Hugging Face's and the OpenAI formulas.

Sampler level on random float32 logits: the repetition penalty against
transformers' RepetitionPenaltyLogitsProcessor, frequency / presence against
the OpenAI formula, min_p against transformers' warper (top-k / top-p: test_top_k_top_p.py), the
pipeline order (raw logprobs come before every processor), logit_bias,
allowed_token_ids, bad_words and min_tokens, the greedy fast path, an empirical
distribution check and gather_logprobs' ranks. The metadata is built through a
real InputBatch wherever the engine builds it that way. The last part runs the
same features end to end through tokenmill.LLM on a tiny checkpoint.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper)

from conftest import make_llm, make_prompts
from tokenmill import SamplingParams
from tokenmill.sample.sampler import (Penalties, Sampler, SamplingMetadata, apply_min_p,
                                      apply_penalties, apply_processors, gather_logprobs)
from tokenmill.worker.input_batch import CachedRequestState, InputBatch

VOCAB = 50
CPU = torch.device("cpu")


# ---- helpers ---------------------------------------------------------------------------

def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).float()


def params(stop_ids=(), bad_words_ids=None, **kw) -> SamplingParams:
    """SamplingParams with the fields the engine derives (LLMEngine._resolve_params)."""
    sp = SamplingParams(**kw)
    sp.all_stop_token_ids = frozenset(stop_ids) | sp.stop_token_ids_set
    if bad_words_ids is not None:
        sp.bad_words_token_ids = [list(w) for w in bad_words_ids]
    return sp


def make_batch(rows, vocab: int = VOCAB, max_model_len: int = 64, spare: int = 2) -> InputBatch:
    """An InputBatch holding `rows` = [(prompt ids, output ids, SamplingParams)] in order."""
    batch = InputBatch(len(rows) + spare, max_model_len, [16], CPU, vocab)
    for i, (prompt, output, sp) in enumerate(rows):
        state = CachedRequestState(f"r{i}", list(prompt), sp, None, [[]],
                                   len(prompt) + len(output), list(output))
        assert batch.add_request(state) == i
    return batch


def history(batch: InputBatch, row: int) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of a row, read back from the batch."""
    n_prompt = int(batch.num_prompt_tokens[row])
    n_total = int(batch.num_tokens_no_spec[row])
    toks = batch.token_ids_cpu[row, :n_total].tolist()
    return toks[:n_prompt], toks[n_prompt:]


def hf_repetition(logits_row: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    proc = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    return proc(torch.tensor([ids], dtype=torch.long), logits_row[None].clone())[0]


def openai_penalties(logits_row: torch.Tensor, output: list[int], frequency: float,
                     presence: float) -> torch.Tensor:
    """OpenAI: logit - frequency * count(output) - presence * (count(output) > 0)."""
    counts = torch.zeros(logits_row.shape[0])
    for t in output:
        counts[t] += 1
    return logits_row - frequency * counts - presence * (counts > 0).float()


def expected_penalised(logits_row, prompt, output, sp: SamplingParams) -> torch.Tensor:
    out = logits_row.clone()
    if sp.repetition_penalty != 1.0:
        out = hf_repetition(out, prompt + output, sp.repetition_penalty)
    return openai_penalties(out, output, sp.frequency_penalty, sp.presence_penalty)


def metadata(n: int, temperature=1.0, greedy=None, **kw) -> SamplingMetadata:
    greedy_mask = torch.zeros(n, dtype=torch.bool) if greedy is None else torch.tensor(greedy)
    temp = torch.full((n,), float(temperature))
    temp[greedy_mask] = 1.0
    return SamplingMetadata(temperature=temp, greedy_mask=greedy_mask,
                            all_greedy=bool(greedy_mask.all()),
                            all_random=not bool(greedy_mask.any()),
                            top_k=kw.pop("top_k", None), top_p=kw.pop("top_p", None), **kw)


# ---- repetition penalty vs transformers ------------------------------------------------

# Rows of different prompt / output lengths (one with no output yet); rows 1 and 4 have
# no penalty at all and must come out bit for bit unchanged.
PEN_ROWS = [
    ([3, 7, 7, 49], [0, 12, 3], dict(repetition_penalty=1.3)),
    ([5, 6], [8], dict()),
    (list(range(0, 40, 3)), [], dict(repetition_penalty=0.7)),
    ([1], [49, 49, 2, 1, 30, 31, 32, 33, 30], dict(repetition_penalty=2.0)),
    ([10, 11, 12, 13, 14, 15, 16, 17], [20, 21], dict(temperature=0.5)),
    ([44, 0], [0, 0, 44, 9, 9], dict(repetition_penalty=1.5)),
]


def pen_batch():
    return make_batch([(p, o, params(**kw)) for p, o, kw in PEN_ROWS])


def test_repetition_penalty_matches_transformers_through_the_input_batch():
    batch = pen_batch()
    md = batch.make_sampling_metadata()
    assert md.penalties is not None
    assert md.penalties.rows.tolist() == [0, 2, 3, 5]  # only rows with a penalty
    # Padded histories: the prompt block is as wide as the longest prompt, the output
    # block as the longest output, and pads point at the dump column vocab_size.
    assert md.penalties.prompt_token_ids.shape == (4, 14)
    assert md.penalties.output_token_ids.shape == (4, 9)
    assert (md.penalties.output_token_ids[1] == VOCAB).all()  # row 2 has no output

    logits = random_logits(len(PEN_ROWS), seed=1)
    # Make sure both signs of the rule are exercised on penalised tokens.
    logits[0, 3], logits[0, 12] = 1.7, -1.1
    before = logits.clone()
    got = apply_processors(logits, md)
    assert not torch.equal(got, logits)
    for row, (prompt, output, kw) in enumerate(PEN_ROWS):
        penalty = kw.get("repetition_penalty", 1.0)
        if penalty == 1.0:
            assert torch.equal(got[row], logits[row]), f"row {row} has no penalty"
            continue
        want = hf_repetition(logits[row], prompt + output, penalty)
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6)
        seen = set(prompt + output)
        others = [t for t in range(VOCAB) if t not in seen]
        assert torch.equal(got[row, others], logits[row, others])
    # The input logits are not modified.
    assert torch.equal(logits, before)


def test_penalty_histories_follow_rows_through_remove_and_condense():
    rows = [(p, o, params(**kw)) for p, o, kw in PEN_ROWS]
    rows.append(([2, 2, 2, 19], [19, 48], params(repetition_penalty=1.8, frequency_penalty=0.5)))
    batch = make_batch(rows)
    batch.remove_request("r2")
    batch.condense()  # the last request moves into row 2
    batch.swap_states(0, 3)
    md = batch.make_sampling_metadata()
    logits = random_logits(batch.num_reqs(), seed=2)
    got = apply_processors(logits, md)
    for row in range(batch.num_reqs()):
        rid = batch.req_ids[row]
        prompt, output, sp = rows[int(rid[1:])]
        assert history(batch, row) == (prompt, output)
        want = expected_penalised(logits[row], prompt, output, sp)
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6, msg=f"row {row} ({rid})")


def test_apply_penalties_on_hand_built_penalties():
    """Penalties built by hand, padded with vocab_size, one row of the batch left out."""
    logits = random_logits(3, seed=3)
    pad = VOCAB
    p = Penalties(rows=torch.tensor([0, 2]), presence=torch.tensor([0.0, 0.4]),
                  frequency=torch.tensor([0.0, 0.25]), repetition=torch.tensor([1.4, 1.1]),
                  prompt_token_ids=torch.tensor([[4, 5, pad], [6, 7, 8]]),
                  output_token_ids=torch.tensor([[9, pad], [7, 7]]))
    got = logits.clone()
    apply_penalties(got, p)
    assert torch.equal(got[1], logits[1])
    torch.testing.assert_close(got[0], hf_repetition(logits[0], [4, 5, 9], 1.4), rtol=0,
                               atol=1e-6)
    want = openai_penalties(hf_repetition(logits[2], [6, 7, 8, 7, 7], 1.1), [7, 7], 0.25, 0.4)
    torch.testing.assert_close(got[2], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("num_rows,vocab,prompt_len,output_len,rows", [
    (7, 100, 5, 9, None), (64, 32000, 256, 128, None), (16, 1000, 3, 1, [1, 4, 6, 9]),
    (3, 50, 1, 40, [2]), (5, 200, 60, 1, None)])
def test_the_cpu_penalties_equal_the_dense_form(num_rows, vocab, prompt_len, output_len, rows):
    """The CPU's penalties (only the tokens a row has seen, through their keys) against the
    dense form the other devices run, bit for bit: padded and empty outputs, a token
    many times, tokens in both prompt and output, -inf, zero and negative logits, rows
    of the batch left out, penalties of both signs."""
    from tokenmill.sample.sampler import _apply_penalties_dense, _apply_penalties_sparse
    g = torch.Generator().manual_seed(vocab + output_len)
    rows = torch.arange(num_rows) if rows is None else torch.tensor(rows)
    r = rows.numel()
    prompt = torch.randint(0, vocab, (r, prompt_len), generator=g)
    prompt[1::3, prompt_len // 2:] = vocab  # padding
    output = torch.randint(0, min(vocab, 50), (r, output_len), generator=g)  # repeats
    output[2::3, output_len // 3:] = vocab
    output[::4] = torch.where(torch.arange(output_len) < 1, prompt[::4, :1], output[::4])
    p = Penalties(rows=rows, presence=torch.rand(r, generator=g) * 4 - 2,
                  frequency=torch.rand(r, generator=g) * 4 - 2,
                  repetition=torch.rand(r, generator=g) * 1.5 + 0.5,
                  prompt_token_ids=prompt, output_token_ids=output)
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    logits[0, :5] = torch.tensor([float("-inf"), 0.0, -0.0, 1e-30, -1e-30])
    dense, sparse = logits.clone(), logits.clone()
    _apply_penalties_dense(dense, p)
    _apply_penalties_sparse(sparse, p)
    assert not torch.equal(dense, logits)  # (something was penalised)
    assert torch.equal(dense, sparse)


# ---- frequency / presence vs the OpenAI formula ------------------------------------------

FP_ROWS = [
    # prompt tokens 1, 2 never appear in the output: they must not be penalised
    ([1, 2, 2, 2, 3], [3, 3, 4], dict(frequency_penalty=0.5)),
    ([1, 2], [5, 6, 5, 5, 1], dict(presence_penalty=1.5)),
    ([7, 8, 9], [], dict(frequency_penalty=2.0, presence_penalty=2.0)),  # nothing to count
    ([9] * 10, [10, 10], dict()),
    ([11, 12], [12, 13, 13, 13, 13, 14], dict(frequency_penalty=-0.8, presence_penalty=0.3)),
    ([15, 16, 17], [17, 18], dict(frequency_penalty=0.4, presence_penalty=-1.0,
                                  repetition_penalty=1.25)),
]


def test_frequency_and_presence_follow_the_openai_formula():
    batch = make_batch([(p, o, params(**kw)) for p, o, kw in FP_ROWS])
    md = batch.make_sampling_metadata()
    logits = random_logits(len(FP_ROWS), seed=4)
    got = apply_processors(logits, md)
    for row, (prompt, output, kw) in enumerate(FP_ROWS):
        sp = params(**kw)
        want = expected_penalised(logits[row], prompt, output, sp)
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6, msg=f"row {row}")
        if sp.repetition_penalty == 1.0:
            # Prompt-only tokens are untouched by frequency and presence.
            prompt_only = sorted(set(prompt) - set(output))
            assert torch.equal(got[row, prompt_only], logits[row, prompt_only])
    assert torch.equal(got[3], logits[3])
    assert torch.equal(got[2], logits[2])  # penalties but no output yet
    # Spot values, written out: row 0 token 3 (twice in the output) and token 4 (once).
    assert got[0, 3].item() == pytest.approx(logits[0, 3].item() - 1.0, abs=1e-6)
    assert got[0, 4].item() == pytest.approx(logits[0, 4].item() - 0.5, abs=1e-6)
    assert got[1, 5].item() == pytest.approx(logits[1, 5].item() - 1.5, abs=1e-6)


# ---- min_p / top-k / top-p vs transformers' warpers --------------------------------------

def _probs(x):
    return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_min_p_after_temperature_matches_transformers(temperature):
    logits = random_logits(6, seed=5, scale=3.0)
    min_p = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.3, 0.9])
    got = apply_min_p(logits / temperature, min_p)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for row in range(6):
        scaled = TemperatureLogitsWarper(temperature)(ids, logits[row:row + 1].clone())
        want = scaled if min_p[row] == 0 else MinPLogitsWarper(float(min_p[row]))(ids, scaled)
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want[0])), f"row {row}"
        torch.testing.assert_close(_probs(got[row]), _probs(want[0]), rtol=0, atol=1e-6)
    kept = torch.isfinite(got).sum(1)
    assert kept[0] == VOCAB and kept[5] >= 1 and (kept[1:] < VOCAB).any()


# (top-k / top-p, alone and chained with min-p, against transformers' warpers on both
# paths: tests/unit/test_top_k_top_p.py::test_the_chain_matches_transformers_warpers)


# ---- the pipeline order: raw logprobs ------------------------------------------------------

def test_raw_logprobs_are_taken_before_every_processor():
    logits = random_logits(6, seed=7)
    top = logits.argmax(-1)
    low = logits.argmin(-1)
    rows = [
        # greedy, the least likely token biased to the top
        ([1, 2], [], params(temperature=0, logit_bias={int(low[0]): 60.0}, logprobs=3)),
        # random, only three unlikely tokens allowed
        ([3], [4], params(temperature=1.0, allowed_token_ids=logits[1].argsort()[:3].tolist(),
                          logprobs=0)),
        # greedy, the argmax already output three times: frequency + presence push it down
        ([5], [int(top[2])] * 3, params(temperature=0, frequency_penalty=2.0,
                                        presence_penalty=2.0, logprobs=2)),
        # greedy, the argmax is a stop token blocked by min_tokens
        ([6, 7], [8], params(temperature=0, min_tokens=4, stop_ids=[int(top[3])])),
        # random with min_p and top_k, no processor
        ([9], [], params(temperature=0.9, min_p=0.1, top_k=5, logprobs=1)),
        # greedy, a single-token bad word on the argmax
        ([10], [11], params(temperature=0, bad_words_ids=[[int(top[5])]], logprobs=3)),
    ]
    batch = make_batch(rows)
    md = batch.make_sampling_metadata()
    assert md.max_num_logprobs == 3 and not md.no_processors
    out = Sampler()(logits.clone(), md)
    sampled = out.sampled_token_ids
    raw = logits.log_softmax(-1)
    lp = out.logprobs
    assert lp is not None
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0],
                               rtol=0, atol=1e-6)
    top3_lp, top3_ids = raw.topk(3, dim=1)
    assert torch.equal(lp.token_ids[:, 1:], top3_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top3_lp, rtol=0, atol=1e-6)
    want_ranks = (raw > raw.gather(1, sampled[:, None])).sum(1) + 1
    assert torch.equal(lp.ranks, want_ranks)
    # The processors did change the token on the processed rows.
    assert sampled[0] == low[0] and lp.ranks[0] == VOCAB
    assert sampled[1] in rows[1][2].allowed_token_ids and lp.ranks[1] >= VOCAB - 2
    processed2 = openai_penalties(logits[2], rows[2][1], 2.0, 2.0)
    assert sampled[2] == processed2.argmax() != top[2]
    for r in (3, 5):
        second = logits[r].clone()
        second[top[r]] = float("-inf")
        assert sampled[r] == second.argmax() and lp.ranks[r] == 2


# ---- logit_bias, allowed_token_ids, bad_words, min_tokens ----------------------------------

def test_logit_bias_is_added_to_the_logits_of_its_row_only():
    logits = random_logits(4, seed=8)
    rows = [([1], [], params(temperature=0, logit_bias={3: 5.0, 7: -2.5, 49: 100.0})),
            ([1], [], params(temperature=0)),
            ([1], [], params(temperature=0, logit_bias={0: -100.0})),
            ([2], [], params(temperature=0.5))]
    md = make_batch(rows).make_sampling_metadata()
    got = apply_processors(logits, md)
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 7] -= 2.5
    want[0, 49] += 100.0
    want[2, 0] -= 100.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Greedy rows take the argmax of the biased logits.
    md_greedy = make_batch(rows[:3]).make_sampling_metadata()
    assert md_greedy.all_greedy
    sampled = Sampler()(logits[:3].clone(), md_greedy).sampled_token_ids
    assert torch.equal(sampled, want[:3].argmax(-1))
    assert sampled[0] == 49


def test_allowed_token_ids_over_many_draws():
    logits = random_logits(5, seed=9)
    allowed = {0: [2, 40, 41], 2: [int(logits[2].argmin())], 3: list(range(0, VOCAB, 7))}
    rows = [([1, 2], [], params(temperature=1.3, allowed_token_ids=allowed.get(r)))
            for r in range(5)]
    rows[4] = ([1], [], params(temperature=0, allowed_token_ids=[5, 6]))
    md = make_batch(rows).make_sampling_metadata()
    processed = apply_processors(logits, md)
    for r, toks in allowed.items():
        assert set(torch.isfinite(processed[r]).nonzero()[:, 0].tolist()) == set(toks)
        assert torch.equal(processed[r, toks], logits[r, toks])
    assert torch.isfinite(processed[1]).all()
    torch.manual_seed(0)
    draws = torch.stack([Sampler()(logits, md).sampled_token_ids for _ in range(400)], 1)
    for r, toks in allowed.items():
        assert set(draws[r].tolist()) <= set(toks), f"row {r}"
        # Every allowed token with a fair chance shows up.
        p = torch.softmax(logits[r, toks] / 1.3, -1)
        likely = {t for t, q in zip(toks, p.tolist()) if q > 0.02}
        assert likely <= set(draws[r].tolist()), f"row {r}"
    assert len(set(draws[1].tolist())) > 5  # the row without a list is unconstrained
    assert set(draws[4].tolist()) == {5 if logits[4, 5] > logits[4, 6] else 6}


def test_bad_words_single_and_two_token():
    logits = torch.zeros(5, VOCAB)
    logits[:, 7] = 5.0  # a single-token bad word on top
    logits[:, 9] = 4.0  # the last token of the bad word [3, 9], second
    bad = [[7], [3, 9], [20, 21, 22]]
    rows = [
        ([1], [4, 3], params(temperature=0, bad_words_ids=bad)),  # ends with 3: ban 9 too
        ([1], [3, 4], params(temperature=0, bad_words_ids=bad)),  # 3 not last: 9 allowed
        ([1], [], params(temperature=0, bad_words_ids=bad)),  # no output yet
        ([1], [3], params(temperature=0)),  # no bad words at all
        ([1], [8, 20, 21], params(temperature=0, bad_words_ids=bad)),  # three-token word
    ]
    md = make_batch(rows).make_sampling_metadata()
    processed = apply_processors(logits, md)
    blocked = {r: set((~torch.isfinite(processed[r])).nonzero()[:, 0].tolist()) for r in range(5)}
    assert blocked == {0: {7, 9}, 1: {7}, 2: {7}, 3: set(), 4: {7, 22}}
    sampled = Sampler()(logits, md).sampled_token_ids.tolist()
    assert sampled == [0, 9, 9, 7, 9]  # ties at 0.0 go to the lowest id


def test_min_tokens_blocks_eos_and_stop_ids_until_enough_outputs():
    eos, stop = 11, 30
    logits = torch.zeros(6, VOCAB)
    logits[:, eos] = 6.0
    logits[:, stop] = 5.0
    rows = [
        ([1, 2], [], params(temperature=0, min_tokens=3, stop_ids=[eos], stop_token_ids=[stop])),
        ([1, 2], [4, 5], params(temperature=0, min_tokens=3, stop_ids=[eos],
                                stop_token_ids=[stop])),
        # three outputs exist: nothing is blocked any more
        ([1, 2], [4, 5, 6], params(temperature=0, min_tokens=3, stop_ids=[eos],
                                   stop_token_ids=[stop])),
        ([1, 2], [], params(temperature=0, stop_ids=[eos], stop_token_ids=[stop])),
        # ignore_eos: the engine leaves EOS out of all_stop_token_ids, only the stop id blocks
        ([1, 2], [4], params(temperature=0, min_tokens=2, stop_token_ids=[stop],
                             ignore_eos=True)),
        ([3], [], params(temperature=1.0, min_tokens=1, stop_ids=[eos])),
    ]
    md = make_batch(rows).make_sampling_metadata()
    processed = apply_processors(logits, md)
    blocked = {r: set((~torch.isfinite(processed[r])).nonzero()[:, 0].tolist()) for r in range(6)}
    assert blocked == {0: {eos, stop}, 1: {eos, stop}, 2: set(), 3: set(), 4: {stop}, 5: {eos}}
    sampled = Sampler()(logits, md).sampled_token_ids.tolist()
    assert sampled[:5] == [0, 0, eos, eos, eos]
    assert sampled[5] != eos
    # The InputBatch re-derives the block every step: after a write-back of 1 token,
    # row 1 has 3 outputs and may stop.
    batch = make_batch(rows[1:2])
    batch.token_ids_cpu[0, 4] = 7
    batch.num_tokens_no_spec[0] += 1
    assert batch.make_sampling_metadata().blocked is None


# ---- the greedy fast path ----------------------------------------------------------------

class RecordCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_all_greedy_batch_without_processors_is_a_plain_argmax():
    logits = random_logits(6, seed=10)
    md = make_batch([([1 + i], [], params(temperature=0)) for i in range(6)]
                    ).make_sampling_metadata()
    assert md.all_greedy and md.no_processors and md.max_num_logprobs is None
    with RecordCalls() as calls:
        out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None
    assert not {"softmax", "log_softmax", "exponential_", "clone"} & set(calls.names), calls.names
    # Guard: the recorder does see a log_softmax when one row asks for logprobs.
    md = make_batch([([1 + i], [], params(temperature=0, logprobs=1 if i == 2 else None))
                     for i in range(6)]).make_sampling_metadata()
    with RecordCalls() as calls:
        out = Sampler()(logits, md)
    assert "log_softmax" in calls.names and out.logprobs is not None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_row_with_logit_bias_takes_the_biased_argmax():
    logits = random_logits(6, seed=11)
    second = logits.topk(2, dim=-1).indices[:, 1]
    rows = [([1], [], params(temperature=0)) for _ in range(6)]
    gap = float(logits[4].max() - logits[4, second[4]])
    rows[4] = ([1], [], params(temperature=0, logit_bias={int(second[4]): gap + 0.5}))
    md = make_batch(rows).make_sampling_metadata()
    assert md.all_greedy and not md.no_processors
    out = Sampler()(logits.clone(), md).sampled_token_ids
    want = logits.argmax(-1)
    want[4] = second[4]
    assert torch.equal(out, want)


# ---- empirical distribution --------------------------------------------------------------

DIST_LOGITS = torch.tensor([2.0, 1.6, 1.2, 0.8, 0.3, 0.0, -0.4, -1.0, -2.0, -3.5])
DIST_PROMPT, DIST_OUTPUT = [0, 4, 4], [0, 1, 1, 1, 6]
N_DRAWS = 40000


def test_sampling_with_penalties_min_p_and_temperature_follows_the_processed_softmax():
    v = DIST_LOGITS.numel()
    rep, freq, pres, temp, min_p = 1.4, 0.3, 0.5, 0.7, 0.08
    sp = params(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    processed = expected_penalised(DIST_LOGITS, DIST_PROMPT, DIST_OUTPUT, sp)
    ids = torch.zeros(1, 1, dtype=torch.long)
    warped = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(temp)(ids, processed[None]))
    expect = torch.softmax(warped[0], -1)
    # Guards: min_p really drops tokens, and the penalties really move the distribution.
    assert (expect == 0).sum() >= 2
    assert (expect - torch.softmax(DIST_LOGITS / temp, -1)).abs().max() > 0.1

    n = N_DRAWS
    pad = v
    md = metadata(n, temp, min_p=torch.full((n,), min_p), penalties=Penalties(
        rows=torch.arange(n), presence=torch.full((n,), pres), frequency=torch.full((n,), freq),
        repetition=torch.full((n,), rep),
        prompt_token_ids=torch.tensor(DIST_PROMPT + [pad]).expand(n, -1).clone(),
        output_token_ids=torch.tensor(DIST_OUTPUT).expand(n, -1).clone()))
    torch.manual_seed(2024)
    out = Sampler()(DIST_LOGITS.expand(n, -1).clone(), md).sampled_token_ids
    freq_obs = torch.bincount(out, minlength=v).float() / n
    assert (freq_obs[expect == 0] == 0).all()
    # A frequency's std is <= 0.0025 at 40k draws; 0.012 is a loose, seeded bound.
    assert (freq_obs - expect).abs().max() < 0.012, (freq_obs, expect)


# ---- gather_logprobs ---------------------------------------------------------------------

def test_gather_logprobs_ranks_and_ties():
    lp = torch.tensor([[-1.0, -2.0, -1.0, -3.0, -2.0],
                       [-0.5, -4.0, -2.0, -1.0, -9.0],
                       [-1.0, -2.0, -1.0, -3.0, -2.0],
                       [-2.0, -2.0, -2.0, -2.0, -2.0]])
    chosen = torch.tensor([1, 0, 3, 4])
    got = gather_logprobs(lp, 2, chosen)
    # rank = 1 + number of tokens strictly more likely; ties share the better rank
    assert got.ranks.tolist() == [3, 1, 5, 1]
    assert got.token_ids[:, 0].tolist() == chosen.tolist()
    assert got.logprobs[:, 0].tolist() == [-2.0, -0.5, -3.0, -2.0]
    assert got.token_ids[1, 1:].tolist() == [0, 3]
    assert got.logprobs[1, 1:].tolist() == [-0.5, -1.0]
    assert got.token_ids.shape == (4, 3) and got.logprobs.dtype == torch.float32
    only = gather_logprobs(lp, 0, chosen)
    assert only.token_ids.shape == (4, 1) and only.ranks.tolist() == [3, 1, 5, 1]


def test_gather_logprobs_ranks_on_random_rows():
    lp = random_logits(6, seed=12).log_softmax(-1)
    chosen = torch.tensor([0, 5, 17, 49, 23, 8])
    got = gather_logprobs(lp, 4, chosen)
    order = lp.argsort(dim=1, descending=True)
    for r in range(6):
        assert got.ranks[r] == order[r].tolist().index(int(chosen[r])) + 1
    assert torch.equal(got.token_ids[:, 1:], order[:, :4])
    argmax = gather_logprobs(lp, 1, lp.argmax(-1))
    assert (argmax.ranks == 1).all()


# ---- end to end through tokenmill.LLM ----------------------------------------------------

def _gen(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def llm(llama_tiny):
    return make_llm(llama_tiny.path)


@pytest.fixture(scope="module")
def worded(llama_tiny, tmp_path_factory):
    """llama_tiny with a word-level tokenizer: the text "w<i>" is token i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    path = tmp_path_factory.mktemp("llama_words")
    shutil.copytree(llama_tiny.path, path, dirs_exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(llama_tiny.vocab_size)},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    llm = make_llm(str(path))
    assert llm.get_tokenizer().encode("w5 w17", add_special_tokens=False) == [5, 17]
    return llm


@torch.no_grad()
def _hf_logits(tm, tokens):
    return tm.hf(torch.tensor([tokens])).logits[0].float().clone()


def test_e2e_logit_bias_bans_the_greedy_token(llm, llama_tiny):
    prompt = make_prompts([11], llama_tiny.vocab_size, seed=31)[0]
    ref = llama_tiny.reference(prompt, 6)
    last = _hf_logits(llama_tiny, prompt)[-1]
    last[ref[0]] = float("-inf")
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                             logit_bias={ref[0]: -100}, logprobs=1))[0]
    assert out.token_ids[0] == int(last.argmax()) != ref[0]
    assert ref[0] not in out.token_ids
    # The reported logprob is the model's own: the second-best token has rank 2.
    assert out.logprobs[0][out.token_ids[0]].rank == 2
    assert out.logprobs[0][ref[0]].rank == 1


def test_e2e_allowed_token_ids_with_sampling(llm, llama_tiny):
    prompts = make_prompts([5, 23, 9], llama_tiny.vocab_size, seed=32)
    allowed = [3, 77, 150, 151, 383]
    outs = _gen(llm, prompts, [SamplingParams(temperature=1.0, seed=s, max_tokens=24,
                                              ignore_eos=True, allowed_token_ids=allowed)
                               for s in range(3)])
    seen = set()
    for o in outs:
        assert len(o.token_ids) == 24 and set(o.token_ids) <= set(allowed)
        seen |= set(o.token_ids)
    assert len(seen) >= 3
    # Greedy with an allow-list: the argmax among the allowed tokens at every step.
    prompt = prompts[0]
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                             allowed_token_ids=allowed))[0].token_ids
    toks = list(prompt)
    for t in out:
        assert t == allowed[int(_hf_logits(llama_tiny, toks)[-1, allowed].argmax())]
        toks.append(t)


def test_e2e_bad_words(worded, llama_tiny):
    prompt = make_prompts([13], llama_tiny.vocab_size, seed=33)[0]
    ref = llama_tiny.reference(prompt, 12)
    # A token whose first occurrence is at k >= 2, with a different token before it.
    k = next(i for i in range(2, 12) if ref[i] not in ref[:i] and ref[i - 1] != ref[i])
    sp = dict(temperature=0, max_tokens=12, ignore_eos=True)
    single = _gen(worded, [prompt], SamplingParams(bad_words=[f"w{ref[k]}"], **sp))[0].token_ids
    assert single[:k] == ref[:k] and ref[k] not in single
    pair = _gen(worded, [prompt], SamplingParams(bad_words=[f"w{ref[k - 1]} w{ref[k]}"],
                                                 **sp))[0].token_ids
    assert pair[:k] == ref[:k] and pair[k] != ref[k]
    for i in range(1, len(pair)):  # the pair never appears
        assert (pair[i - 1], pair[i]) != (ref[k - 1], ref[k])
    # Only the last token of the pair is banned, and only right after the first.
    second = _hf_logits(llama_tiny, prompt + ref[:k])[-1]
    second[ref[k]] = float("-inf")
    assert pair[k] == single[k] == int(second.argmax())


def test_e2e_min_tokens_holds_back_eos_and_stop_ids(eos_model):
    tm = eos_model
    llm = make_llm(tm.path)
    k = tm.eos_index
    free = _gen(llm, [tm.eos_prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert free.token_ids == tm.eos_ref[:k + 1] and free.finish_reason == "stop"
    held = _gen(llm, [tm.eos_prompt], SamplingParams(temperature=0, max_tokens=20,
                                                     min_tokens=k + 3))[0]
    assert held.token_ids[:k] == tm.eos_ref[:k]
    assert tm.eos_id not in held.token_ids[:k + 3]
    assert len(held.token_ids) > k + 3 or held.finish_reason == "length"
    # A stop token id is held back the same way.
    stop_id = tm.eos_ref[tm.stop_index]
    sp = dict(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    stopped = _gen(llm, [tm.eos_prompt], SamplingParams(**sp))[0]
    assert stopped.token_ids == tm.eos_ref[:tm.stop_index + 1]
    assert stopped.stop_reason == stop_id
    late = _gen(llm, [tm.eos_prompt], SamplingParams(min_tokens=tm.stop_index + 2, **sp))[0]
    assert late.token_ids[:tm.stop_index] == tm.eos_ref[:tm.stop_index]
    assert stop_id not in late.token_ids[:tm.stop_index + 2]


def test_e2e_penalties_mixed_with_plain_rows(llm, llama_tiny):
    """A penalised greedy request follows its own recurrence (HF logits + the penalty rules),
    while plain greedy requests in the same batch still match HF greedy."""
    prompts = make_prompts([7, 19, 12], llama_tiny.vocab_size, seed=34)
    pen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=2.0,
                         frequency_penalty=-1.0, presence_penalty=-2.0)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = _gen(llm, prompts, [plain, pen, plain])
    assert outs[0].token_ids == llama_tiny.reference(prompts[0], 8)
    assert outs[2].token_ids == llama_tiny.reference(prompts[2], 8)
    toks, out = list(prompts[1]), []
    for _ in range(8):
        logits = _hf_logits(llama_tiny, toks)[-1]
        t = int(expected_penalised(logits, prompts[1], out, pen).argmax())
        out.append(t)
        toks.append(t)
    assert outs[1].token_ids == out
    assert out != llama_tiny.reference(prompts[1], 8)  # the penalties changed something
