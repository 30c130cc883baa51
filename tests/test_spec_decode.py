"""Speculative decoding (n-gram drafts) end to end: greedy output equals the output
without speculation, token for token, whatever the drafts; the accounting holds.

Random tiny models fall into repetition loops under greedy decoding, so n-gram
drafts get accepted there (each test that depends on it checks acceptance > 0).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from conftest import make_llm, make_prompts, runner_of, scheduler_of
from tokenmill import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(autouse=True)
def no_row_budget(monkeypatch):
    """Drafts at every batch size: the tests below check speculation in batches larger
    than the CPU's row budget (which would leave them no drafts); the budget itself is
    tested in test_row_budget_shares_the_free_rows."""
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))


def loop_prompts(vocab: int, n: int = 6, seed: int = 5) -> list[list[int]]:
    """Prompts that end in a repeated motif (drafts right away), and plain ones."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        motif = rng.integers(0, vocab, size=int(rng.integers(2, 6))).tolist()
        head = rng.integers(0, vocab, size=int(rng.integers(3, 20))).tolist()
        prompts.append(head + motif * int(rng.integers(2, 5)) if i % 2 == 0 else head)
    return prompts


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def base(llama_tiny):
    prompts = loop_prompts(llama_tiny.vocab_size)
    llm = make_llm(llama_tiny.path)
    return llama_tiny, prompts, generate(llm, prompts, greedy())


def spec_stats(llm):
    return scheduler_of(llm).spec_stats


def assert_no_leaks(llm):
    sched = scheduler_of(llm)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert runner_of(llm).input_batch.num_reqs() == 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_equals_no_speculation(base, k):
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=dict(NGRAM, num_speculative_tokens=k))
    assert generate(llm, prompts, greedy()) == want
    stats = spec_stats(llm)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert_no_leaks(llm)


def test_equal_to_hf_greedy(llama_tiny):
    """Against HF itself, not only against our own run without drafts."""
    prompts = loop_prompts(llama_tiny.vocab_size, n=3, seed=9)
    llm = make_llm(llama_tiny.path, speculative_config=NGRAM)
    got = generate(llm, prompts, greedy(24))
    assert got == [llama_tiny.reference(p, 24) for p in prompts]


def test_chunked_prefill_and_preemption(base):
    """A small token budget (prompts in chunks, drafts cut to fit) and a KV cache too
    small for every request at once (preemption by recompute, drafts dropped)."""
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM, max_num_batched_tokens=16,
                   num_kv_blocks=14, block_size=8, max_model_len=96)
    assert generate(llm, prompts, greedy()) == want
    assert scheduler_of(llm).num_preemptions > 0
    assert spec_stats(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_non_adaptive_and_batch_size_switch(base):
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=dict(NGRAM, adaptive=False))
    assert generate(llm, prompts, greedy()) == want
    # A batch at or over disable_by_batch_size gets no drafts at all.
    llm = make_llm(tm.path, speculative_config=dict(NGRAM, disable_by_batch_size=2))
    assert generate(llm, prompts, greedy()) == want
    assert spec_stats(llm).num_drafts == 0


def test_max_tokens_and_max_model_len_inside_an_accepted_run(base):
    """No request passes max_tokens or max_model_len, however many drafts pass."""
    tm, prompts, _ = base
    llm = make_llm(tm.path, speculative_config=NGRAM, max_model_len=64)
    lengths = [13, 21, 29, 33, 37, 40]
    params = [greedy(m) for m in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = make_llm(tm.path, max_model_len=64)
    want = ref.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, w, p, m in zip(outs, want, prompts, lengths):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(o.outputs[0].token_ids) == min(m, 64 - len(p))
        assert o.outputs[0].finish_reason == "length"
    assert spec_stats(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_stop_token_inside_an_accepted_run(base):
    """A stop token among accepted drafts ends the request there; the tokens after it
    in the same run are dropped."""
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM)
    # Stop on a token each output repeats: it lands inside runs of accepted drafts.
    stops = [w[len(w) // 2] for w in want]
    params = [greedy(stop_token_ids=[s]) for s in stops]
    got = generate(llm, prompts, params)
    for g, w, s in zip(got, want, stops):
        assert g == w[:w.index(s) + 1]
    assert_no_leaks(llm)


def test_logprobs_of_emitted_tokens(base):
    tm, prompts, want = base
    params = greedy(logprobs=3)
    ref = make_llm(tm.path).generate([{"prompt_token_ids": p} for p in prompts], params,
                                     use_tqdm=False)
    llm = make_llm(tm.path, speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert spec_stats(llm).num_accepted_tokens > 0
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(o.outputs[0].logprobs) == len(r.outputs[0].logprobs)
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert list(a) == list(b)  # same tokens, in the same order
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
                assert a[t].rank == b[t].rank


def test_mixed_batch_sampled_processors_and_n(base):
    """Seeded random rows (rejection sampling), penalty rows (no drafts) and n = 2
    beside greedy rows: greedy rows keep their exact output, seeded rows are
    reproducible across runs."""
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM)
    params = [greedy(), SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
              greedy(), greedy(repetition_penalty=1.3),
              SamplingParams(temperature=0.7, seed=11, n=2, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=30, ignore_eos=True)]
    run1 = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    run2 = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i in (0, 2):
        assert run1[i].outputs[0].token_ids == want[i]
    for i in (1, 4, 5):  # seeded: the same tokens every run, whatever was accepted
        assert [c.token_ids for c in run1[i].outputs] == [c.token_ids for c in run2[i].outputs]
        assert all(len(c.token_ids) == 30 for c in run1[i].outputs)
    assert len(run1[4].outputs) == 2
    ref = make_llm(tm.path)
    pen = ref.generate([{"prompt_token_ids": prompts[3]}], params[3], use_tqdm=False)
    assert run1[3].outputs[0].token_ids == pen[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_prefix_caching_stays_exact(base):
    """Only accepted tokens' KV may be cached: rerunning the same prompts (prefix hits
    over blocks that once held rejected drafts' slots) gives the same output."""
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM, enable_prefix_caching=True,
                   block_size=4)
    assert generate(llm, prompts, greedy()) == want
    # The outputs are now part of cached blocks: prompt + output as the new prompt.
    longer = [p + w[:20] for p, w in zip(prompts, want)]
    assert generate(llm, longer, greedy(10)) == \
        generate(make_llm(tm.path), longer, greedy(10))
    assert scheduler_of(llm).kv_cache_manager.prefix_cache_stats.hits > 0


def test_structured_output_with_drafts(demo_path):
    """Grammar-constrained requests verify drafts too: every verified position is
    masked by the grammar's state after the drafts before it. A repetitive regex gives
    drafts that are accepted; outputs equal the run without speculation (greedy), and
    JSON-schema output beside greedy requests still validates."""
    pytest.importorskip("xgrammar")
    import json
    import re

    from tokenmill import LLM
    from tokenmill.sampling_params import StructuredOutputsParams
    small = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    prompts = ["The old mill", "JSON:", "x y x y x y", "Once"]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=
                             StructuredOutputsParams(regex="(the mill ){2,12}end")),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=
                             StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
              greedy(30),
              SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=
                             StructuredOutputsParams(choice=["yes", "no", "maybe"]))]
    want = LLM(demo_path, **small).generate(prompts, params, use_tqdm=False)
    llm = LLM(demo_path, speculative_config=NGRAM, **small)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert re.fullmatch("(the mill ){2,12}end", got[0].outputs[0].text)
    assert json.loads(got[1].outputs[0].text)["n"] in range(10)
    assert got[3].outputs[0].text in ("yes", "no", "maybe")
    assert spec_stats(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_bad_speculative_config_names_the_field(llama_tiny):
    for bad, field in (({"method": "medusa"}, "method"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 2**40}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"disable_by_batch_size": float("nan")}, "disable_by_batch_size"),
                       ({"typo": 1}, "typo"), ("{not json", "JSON")):
        with pytest.raises(ValueError, match=field):
            make_llm(llama_tiny.path, speculative_config=bad)


def test_spec_metrics_count_positions(base):
    tm, prompts, _ = base
    llm = make_llm(tm.path, speculative_config=NGRAM)
    generate(llm, prompts, greedy())
    s = spec_stats(llm).as_dict()
    per_pos = s["accepted_per_position"]
    assert len(per_pos) == 4 and sum(per_pos) == s["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepted runs are prefixes
    assert s["mean_acceptance_length"] == pytest.approx(
        1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-3)


# ---- hybrid targets (Gated DeltaNet state): one state slot per verified token -----------

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))
    from test_hybrid_parity import HYBRID_SPECS, HybridModel, build_hybrid
    arch, overrides = HYBRID_SPECS["qwen3_5"]
    path = str(tmp_path_factory.mktemp("hybrid_spec"))
    return HybridModel("qwen3_5", path, arch, build_hybrid(path, arch, overrides))


def test_hybrid_greedy_equals_no_speculation(hybrid):
    prompts = loop_prompts(hybrid.vocab_size, n=6, seed=13)
    want = generate(make_llm(hybrid.path), prompts, greedy(32))
    for extra in ({}, {"max_num_batched_tokens": 16, "num_kv_blocks": 14, "block_size": 8,
                       "max_model_len": 96}):
        llm = make_llm(hybrid.path, speculative_config=NGRAM, **extra)
        assert generate(llm, prompts, greedy(32)) == want
        assert spec_stats(llm).num_accepted_tokens > 0
        # Every state slot group is back: none leaks through accept / release.
        slots = runner_of(llm).state_slots
        assert slots.width == 5 and not slots.slot_of and slots.num_free == slots.num_slots
        assert_no_leaks(llm)
    assert prompts and want[0] == hybrid.reference(prompts[0], 32)


def test_state_slots_follow_the_accepted_count():
    """The reference's state-slot rules with speculation on: a group of 1 + k slots per
    sequence, the first write in place, the accepted count picks the next current slot,
    release frees the whole group."""
    from tokenmill.worker.state_cache import StateSlots
    slots = StateSlots(12, width=4)
    a, new = slots.get_or_allocate("a")
    b, _ = slots.get_or_allocate("b")
    assert new and (a, b) == (0, 4) and slots.num_free == 4
    assert slots.write_slots("a", 4) == [0, 1, 2, 3]
    slots.accept("a", 2)
    assert slots.get_or_allocate("a") == (2, False)
    assert slots.write_slots("a", 3) == [2, 0, 1]  # in place first, then the others
    assert slots.write_slots("a", 1) == [2]
    slots.release("a")
    assert slots.num_free == 8 and "a" not in slots.slot_of
    c, _ = slots.get_or_allocate("c")
    assert c in (0, 8)
    with pytest.raises(ValueError):
        StateSlots(10, width=4)


def test_nan_in_a_verifying_request_fails_only_it(base, monkeypatch):
    """A request whose hidden state goes NaN while it verifies drafts emits nothing more
    and fails; the others (asking for logprobs) keep their exact tokens and logprobs."""
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM)
    model = runner_of(llm).model
    forward = model.forward
    victim = prompts[0] * 3  # longer than the rest: only it reaches position `poison_at`
    poison_at = len(victim) + 12
    others = prompts[1:]
    assert max(len(p) for p in others) + 40 < poison_at

    def nan_forward(input_ids, positions, meta):
        hidden = forward(input_ids, positions, meta)
        return hidden.masked_fill((positions >= poison_at).unsqueeze(1), float("nan"))

    monkeypatch.setattr(model, "forward", nan_forward)
    params = greedy(logprobs=2)
    ref = make_llm(tm.path).generate([{"prompt_token_ids": p} for p in others], params,
                                     use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in [victim] + others], params,
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert len(outs[0].outputs[0].token_ids) <= poison_at - len(victim) + 1
    for o, r in zip(outs[1:], ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert list(a) == list(b)
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert_no_leaks(llm)


def test_async_scheduling_runs_with_speculation(base):
    """Async scheduling stays on with speculation (draft slots the runner fills,
    tests/test_spec_async.py): the same tokens, drafts accepted."""
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM, async_scheduling=True)
    assert llm.llm_engine.engine_core.async_scheduling
    assert generate(llm, prompts, greedy()) == want
    assert spec_stats(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


# ---- draft models of the EAGLE kind (the target's hidden states in, drafts out) ---------

class OracleDrafter:
    """An EagleStyleDrafter that knows the right answer: its output at position p encodes
    p, and draft_token_ids returns the reference token at p + 2 (the one a row at p
    predicts). If the proposer feeds it the right positions, every draft is accepted."""

    aux_layer_ids = None

    def __init__(self, sequence: list[int]):
        import torch
        self.sequence = torch.tensor(sequence + [0] * 64)

    def combine_target_hidden(self, hidden):
        return hidden

    def __call__(self, input_ids, positions, hidden, meta):
        out = positions.float().unsqueeze(1).expand(-1, 2).clone()
        return out, out

    def draft_token_ids(self, out):
        return self.sequence[out[:, 0].long() + 2]

    def attention_layers(self):
        return []


class OracleWithWriteKV(OracleDrafter):
    """The same oracle, with write_kv: the proposer then writes K/V over the step and
    runs the full forward only at the rows drafts start from."""

    def write_kv(self, input_ids, positions, hidden, meta):
        self.kv_rows = getattr(self, "kv_rows", 0) + positions.shape[0]


@pytest.mark.parametrize("oracle_cls", [OracleDrafter, OracleWithWriteKV])
def test_eagle_proposer_feeds_the_right_positions(base, oracle_cls):
    """Prompt chunks, then verify steps: an oracle drafter's drafts are all accepted,
    so the first step's rows and the k - 1 follow-up positions are the right ones."""
    from tokenmill.spec_decode.drafter import Drafter
    from tokenmill.spec_decode.eagle import EagleProposer
    tm, prompts, want = base
    prompt = prompts[1]
    llm = make_llm(tm.path, speculative_config=NGRAM, max_num_batched_tokens=8)
    runner = runner_of(llm)
    oracle = oracle_cls(prompt + want[1])
    runner.draft_model = oracle
    runner.drafter = Drafter(runner.drafter.config,
                             EagleProposer(oracle, runner.device, runner.max_model_len))
    got = generate(llm, [prompt] * 3, greedy())
    assert got == [want[1]] * 3
    s = spec_stats(llm)
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    assert s.mean_acceptance_length > 4  # k = 4 accepted almost every step
    if oracle_cls is OracleWithWriteKV:  # every token of every step got its K/V
        assert oracle.kv_rows >= 3 * (len(prompt) + len(want[1]) - 1)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint with a random MTP head (mtp.* tensors)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))
    import json

    from test_hybrid_parity import HYBRID_SPECS, build_hybrid
    from tokenmill.spec_decode.random_drafters import mtp_tensors, write_folder
    arch, overrides = HYBRID_SPECS["qwen3_5"]
    base = str(tmp_path_factory.mktemp("mtp_base"))
    build_hybrid(base, arch, dict(overrides, mtp_num_hidden_layers=1))
    config = json.load(open(os.path.join(base, "config.json")))
    path = str(tmp_path_factory.mktemp("mtp") / "ckpt")
    write_folder(path, base, config, mtp_tensors(base, seed=7))
    return path


def test_mtp_greedy_equals_no_speculation(mtp_checkpoint):
    """A hybrid target with its own MTP head (random: few drafts pass): the output is
    the target's, with chunked prefill and preemption too; the head's K/V lives in
    the target's KV cache group, with lookahead slots for its draft steps. (How many
    drafts pass: test_spec_oracle.py, with drafts that are known to pass or fail.)"""
    vocab = 384
    prompts = loop_prompts(vocab, n=5, seed=21)
    want = generate(make_llm(mtp_checkpoint), prompts, greedy(24))
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    for extra in ({}, {"max_num_batched_tokens": 16, "num_kv_blocks": 16, "block_size": 8,
                       "max_model_len": 96}):
        llm = make_llm(mtp_checkpoint, speculative_config=spec, **extra)
        runner = runner_of(llm)
        assert "draft.0.attn" in runner.kv_caches
        assert scheduler_of(llm).config.num_lookahead_tokens == 3
        assert generate(llm, prompts, greedy(24)) == want
        assert spec_stats(llm).num_draft_tokens > 0
        assert_no_leaks(llm)


@pytest.mark.parametrize("aux_ids", [None, [0, 1, 0]])
def test_eagle3_greedy_equals_no_speculation(base, tmp_path, aux_ids):
    """An EAGLE-3 draft (random weights, its own smaller vocabulary mapped by d2t) on
    the Llama target: the output is the target's, with chunked prefill and preemption
    too. aux ids: the default for a 2-layer target repeats a layer; [0, 1, 0] taps
    the embedding output twice, out of layer order. (How many drafts pass:
    test_spec_oracle.py.)"""
    import json

    from tokenmill.spec_decode.random_drafters import build_eagle3_checkpoint
    tm, prompts, want = base
    draft = str(tmp_path / "eagle3")
    os.makedirs(draft)
    extra_cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}} if aux_ids \
        else {}
    build_eagle3_checkpoint(draft, json.load(open(os.path.join(tm.path, "config.json"))),
                            **extra_cfg)
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": draft}
    for extra in ({}, {"max_num_batched_tokens": 16, "num_kv_blocks": 14, "block_size": 8,
                       "max_model_len": 96}):
        llm = make_llm(tm.path, speculative_config=spec, **extra)
        runner = runner_of(llm)
        assert len(runner.model.aux_layer_ids) == 3 and "draft.0.attn" in runner.kv_caches
        assert generate(llm, prompts, greedy()) == want
        assert spec_stats(llm).num_draft_tokens > 0
        assert runner.model.aux_hidden.shape[1] == 3 * 64
        assert_no_leaks(llm)


def test_draft_model_configs_are_checked(llama_tiny, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model"):
        make_llm(llama_tiny.path, speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="mtp"):  # a Llama checkpoint has no MTP head
        make_llm(llama_tiny.path, speculative_config={"method": "mtp"})


def test_dflash_greedy_equals_no_speculation(tiny_model_factory, tmp_path):
    """A DFlash draft (random weights: few drafts pass) on a Qwen3 target: the output is
    the target's, also with chunked prefill and preemption (the context is cut back
    when a request resumes); the context follows accepted tokens only. (How many
    drafts pass: test_spec_oracle.py.)"""
    import json

    from tokenmill.spec_decode.random_drafters import build_dflash_checkpoint
    tm = tiny_model_factory("qwen3_headdim")
    draft = str(tmp_path / "dflash")
    os.makedirs(draft)
    build_dflash_checkpoint(draft, json.load(open(os.path.join(tm.path, "config.json"))),
                            target_layer_ids=(0, 1), block_size=5)
    prompts = loop_prompts(tm.vocab_size, n=5, seed=23)
    want = generate(make_llm(tm.path), prompts, greedy(24))
    spec = {"method": "dflash", "num_speculative_tokens": 4, "model": draft}
    for extra in ({}, {"max_num_batched_tokens": 16, "num_kv_blocks": 16, "block_size": 8,
                       "max_model_len": 96}):
        llm = make_llm(tm.path, speculative_config=spec, **extra)
        assert runner_of(llm).model.aux_layer_ids == (1, 2)
        assert generate(llm, prompts, greedy(24)) == want
        assert spec_stats(llm).num_draft_tokens > 0
        assert_no_leaks(llm)
        assert not runner_of(llm).drafter.model_proposer.context_end  # every request forgotten
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(tm.path, speculative_config=dict(spec, num_speculative_tokens=5))


def test_stop_strings_inside_an_accepted_run(demo_path):
    """A stop string matched in the text of a multi-token step ends the request there,
    the same text and tokens as without speculation."""
    from tokenmill import LLM
    small = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)
    prompts = ["the mill the mill the mill", "x y x y x y x y", "Once upon a time"]
    plain = LLM(demo_path, **small)
    first = plain.generate(prompts, greedy(40), use_tqdm=False)
    # Stop on a piece of each output's second half: it lands inside the run of tokens
    # one step emits whenever drafts pass.
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:4] for o in first]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[s]) for s in stops]
    want = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(demo_path, speculative_config=NGRAM, **small)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w, s in zip(got, want, stops):
        assert g.outputs[0].text == w.outputs[0].text and s not in g.outputs[0].text
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == "stop"
    assert_no_leaks(llm)


def test_external_kv_tier_with_speculation(base):
    """The CPU KV store beside n-gram drafts: a second engine run over the same prompts
    loads their prompt blocks and still gives the same output."""
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM, kv_connector="cpu", block_size=4)
    assert generate(llm, prompts, greedy()) == want
    assert generate(llm, prompts, greedy()) == want
    assert llm.llm_engine.engine_core.kv_cache_stats()["prefix_cache_hits"] > 0
    assert_no_leaks(llm)


# ---- rows that wait: a request that proposes nothing defers its drafter pass -------------

def _record_drafts(llm):
    """Every step's drafts, as the drafter returned them."""
    drafter = runner_of(llm).drafter
    seen, inner = [], drafter.propose_with_model

    def propose_with_model(*args, **kw):
        out = inner(*args, **kw)
        seen.append([list(d) for d in out])
        return out
    drafter.propose_with_model = propose_with_model
    return seen


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 16, "num_kv_blocks": 16,
                                        "block_size": 8, "max_model_len": 96}])
def test_waiting_rows_leave_the_drafts_unchanged(tiny_model_factory, tmp_path, method, extra):
    """Requests whose random drafts keep failing back off, and their decode rows wait
    (spec_decode/deferred.py) until they next propose: every draft of every step is
    the one a drafter run over every row at once proposes, with chunked prefill and
    preemption (rows cut back on resume) too."""
    tm = tiny_model_factory("qwen3_headdim")
    draft = _random_draft(tm, tmp_path, method)
    spec = {"method": method, "num_speculative_tokens": 3, "model": draft}
    prompts = loop_prompts(tm.vocab_size, n=5, seed=31)
    runs = []
    for max_rows in (0, None):  # 0: no row ever waits
        llm = make_llm(tm.path, speculative_config=spec, **extra)
        deferred = runner_of(llm).drafter.model_proposer.deferred
        if max_rows is not None:
            deferred.max_rows = max_rows
        waited = []
        inner = deferred.wait_all

        def wait_all(*args, _inner=inner, _waited=waited):
            ok = _inner(*args)
            _waited.append(ok)
            return ok
        deferred.wait_all = wait_all
        verified_waits = []  # a verification that accepted nothing: its kept row waits
        inner_step = deferred.step

        def step(req_ids, first_pos, counts, *args, _inner=inner_step, _seen=verified_waits):
            out = _inner(req_ids, first_pos, counts, *args)
            _seen.append(bool((out[0] & (counts > 1)).any()))
            return out
        deferred.step = step
        drafts = _record_drafts(llm)
        out = generate(llm, prompts, greedy(40))
        runs.append((out, drafts, any(waited), any(verified_waits)))
        assert_no_leaks(llm)
        assert not deferred._slot  # every request's rows released
    (out0, drafts0, waited0, vwaited0), (out1, drafts1, waited1, vwaited1) = runs
    assert out0 == out1
    assert not waited0 and waited1
    assert not vwaited0 and vwaited1
    assert sum(map(len, (d for step in drafts1 for d in step))) > 0
    assert drafts1 == drafts0


def _random_draft(tm, tmp_path, method: str) -> str:
    """A random-weight EAGLE-3 or DFlash drafter for `tm` (its drafts nearly all fail)."""
    import json

    from tokenmill.spec_decode import random_drafters as rd
    draft = str(tmp_path / method)
    os.makedirs(draft)
    config = json.load(open(os.path.join(tm.path, "config.json")))
    if method == "eagle3":
        rd.build_eagle3_checkpoint(draft, config)
    else:
        rd.build_dflash_checkpoint(draft, config, target_layer_ids=(0, 1), block_size=5)
    return draft


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_step_nobody_proposes_from_skips_the_proposer(tiny_model_factory, tmp_path, method):
    """A decode step from which no request proposes (each backs off after failed
    drafts) has its rows wait without the proposer's full path: `propose` (its numpy
    bookkeeping over the batch, the drafter's passes) runs only on steps that propose
    or run waiting rows, never on one where every row just waits."""
    tm = tiny_model_factory("qwen3_headdim")
    draft = _random_draft(tm, tmp_path, method)
    llm = make_llm(tm.path, speculative_config={"method": method, "model": draft,
                                                "num_speculative_tokens": 3})
    proposer = runner_of(llm).drafter.model_proposer
    inside, waits_in_propose, fast = [False], [], []
    inner_propose, inner_wait_all = proposer.propose, proposer.deferred.wait_all

    def propose(*args, **kw):
        inside[0] = True
        try:
            return inner_propose(*args, **kw)
        finally:
            inside[0] = False

    def wait_all(*args):
        ok = inner_wait_all(*args)
        (waits_in_propose if inside[0] else fast).append(ok)
        return ok
    proposer.propose, proposer.deferred.wait_all = propose, wait_all
    out = generate(llm, loop_prompts(tm.vocab_size, n=2, seed=31), greedy(60))
    assert all(len(o) == 60 for o in out)
    assert sum(fast) > 20  # most steps after the first misses
    assert not any(waits_in_propose)


def test_row_budget_shares_the_free_rows(base, monkeypatch):
    """With the CPU's row budget (the rows a decode step takes at about the cost of
    one), each verifying step stays within it: drafts fill the rows the batch leaves
    free, none once the batch fills it; the output is unchanged."""
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: 4))
    tm, prompts, want = base
    llm = make_llm(tm.path, speculative_config=NGRAM)
    runner = runner_of(llm)
    assert runner.drafter.row_budget == 4
    rows = []
    inner = runner.drafter.propose

    def propose(req_ids, *args):
        out = inner(req_ids, *args)
        rows.append(len(req_ids) + sum(map(len, out)))
        assert all(not d for d in out) or len(req_ids) + sum(map(len, out)) <= 4
        return out
    runner.drafter.propose = propose
    # Lengths that finish one after another: the batch shrinks under the budget.
    lengths = [15 + 5 * i for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(m) for m in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w[:m] for w, m in zip(want, lengths)]
    assert spec_stats(llm).num_draft_tokens > 0  # the last requests draft
    assert max(rows) > 4  # batches past the budget ran, without drafts
    plain = make_llm(tm.path, speculative_config=dict(NGRAM, adaptive=False))
    assert plain.llm_engine.engine_core.runner.drafter.row_budget is None
