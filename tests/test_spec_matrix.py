"""Speculative decoding across methods x target kinds x engine features (issue 33).

What the other suites covered before this file (method x target x feature):

  ngram   dense Llama: greedy (k 1/3/5), HF equality, chunked prefill + preemption,
          logprobs=3, seeded / n=2 / penalty rows (reproducible only), prefix caching,
          stop tokens and strings, external KV tier (test_spec_decode.py); grammars on
          the demo model (regex / JSON / choice); Qwen3.5 hybrid greedy + chunked +
          preemption; Gemma 3, DeepSeek-V2 greedy (test_spec_targets.py); oracle
          full / partial / zero on Llama, also chunked + preempted (test_spec_oracle.py);
          the server (test_server_spec_decode.py).
  eagle3  dense Llama greedy + chunked + preemption; Mistral, Phi-3, Qwen2, Qwen3-MoE,
          Gemma 3, DeepSeek-V2, Qwen3.5, Qwen3-Next, Qwen2.5-VL greedy (+ chunked);
          oracle on Llama.
  mtp     Qwen3.5 greedy + chunked + preemption, oracle; Qwen3-Next greedy + partial
          acceptance (test_mtp_qwen3_next.py); DeepSeek-V3 greedy + chunked.
  dflash  Qwen3 greedy + chunked + preemption, oracle; Gemma 3, DeepSeek-V2, Qwen3.5,
          Qwen3-Next greedy + chunked; reduced draft vocabulary; sliding draft layers.

Gaps this file fills, each run compared with the plain engine (no speculation) under
the same engine arguments, fp32, tokens equal and logprobs within 1e-4:

  - every method on a dense (Qwen3), a MoE (Qwen3-MoE) and two hybrid targets
    (Qwen3.5, Qwen3-Next: Gated DeltaNet + sparse MoE), the hybrids with an MTP head;
    mtp where the target has a head, refused by name elsewhere;
  - in one batch: top-5 logprobs + prompt logprobs, a JSON-schema grammar (xgrammar),
    sampled n=3 / seeded n=2 with top_k=1 (the rejection sampler's random path where
    the result is still exact: every sample the greedy tokens; greedy n > 1 is
    refused by SamplingParams);
  - that batch with the drafter's own (random) drafts and with oracle drafts (the
    plain tokens, some corrupted: partial acceptance), plain engine arguments and
    chunked prefill + a KV pool small enough to preempt;
  - prefix caching with speculation on the hybrid target (recurrent-state snapshots
    restored under verify steps);
  - oracle full / partial / zero acceptance for n-gram, EAGLE-3 and DFlash on the
    hybrid target (test_spec_oracle.py had MTP only there).

  - DFlash drafts after a prefix-cache hit: the cached prefix's draft context comes
    with the hit blocks (the draft layers' K/V live in the paged cache), so the drafts
    equal a cold run's, proposal by proposal.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

from conftest import build_checkpoint, make_llm, record_model_drafts, runner_of, scheduler_of
from tokenmill import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))

pytest.importorskip("xgrammar")

VOCAB = 4096  # the demo tokenizer's: grammars need real token strings
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_TOKENS = 14
K = 3
CHUNKED = {"max_num_batched_tokens": 16, "num_kv_blocks": 14, "block_size": 8,
           "max_model_len": 96}
SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "k": {"enum": ["mill", "barn"]}},
          "required": ["n", "k"], "additionalProperties": False}


@pytest.fixture(autouse=True)
def no_row_budget(monkeypatch):
    """Drafts at every batch size (the CPU's row budget would give a batch of several
    requests none)."""
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))


# ---- targets and drafters -------------------------------------------------------------------

def _copy_tokenizer(src: str, dst: str) -> None:
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


@pytest.fixture(scope="module")
def targets(tmp_path_factory, demo_path):
    """kind -> checkpoint folder (with the demo tokenizer), built on first use:
    dense Qwen3, Qwen3-MoE (layer 0 dense, 1-2 sparse), and the Qwen3.5 hybrid and the
    Qwen3-Next hybrid MoE, each with a random MTP head."""
    from test_hybrid_parity import HYBRID_SPECS, build_hybrid
    from test_moe_parity import MOE_SPECS

    from tokenmill.spec_decode.random_drafters import mtp_tensors, write_folder
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind in cache:
            return cache[kind]
        path = str(tmp_path_factory.mktemp(kind))
        if kind == "dense":
            build_checkpoint(path, "qwen3", dict(head_dim=32, tie_word_embeddings=False,
                                                 vocab_size=VOCAB))
        elif kind == "moe":
            arch, overrides = MOE_SPECS["qwen3_moe_norm"]
            build_checkpoint(path, arch, dict(overrides, vocab_size=VOCAB))
        else:  # "hybrid": Qwen3.5; "hybrid_moe": Qwen3-Next (sparse MoE in every layer)
            arch, overrides = HYBRID_SPECS["qwen3_5" if kind == "hybrid" else "qwen3_next"]
            base = str(tmp_path_factory.mktemp(f"{kind}_base"))
            build_hybrid(base, arch, dict(overrides, vocab_size=VOCAB, mtp_num_hidden_layers=1))
            path = os.path.join(path, "ckpt")
            write_folder(path, base, json.load(open(os.path.join(base, "config.json"))),
                         mtp_tensors(base, seed=7))
        _copy_tokenizer(demo_path, path)
        cache[kind] = path
        return path
    return get


@pytest.fixture(scope="module")
def spec_configs(targets, tmp_path_factory):
    """(kind, method) -> speculative_config; draft checkpoints with random weights."""
    from tokenmill.spec_decode import random_drafters as rd
    cache: dict[tuple, dict] = {}

    def get(kind: str, method: str) -> dict:
        if (kind, method) in cache:
            return cache[kind, method]
        path = targets(kind)
        config = json.load(open(os.path.join(path, "config.json")))
        config = {**config, **config.get("text_config", {})}
        spec = {"method": method, "num_speculative_tokens": K}
        if method == "ngram":
            spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
        elif method == "eagle3":
            draft = str(tmp_path_factory.mktemp(f"eagle3_{kind}"))
            rd.build_eagle3_checkpoint(draft, config)
            spec["model"] = draft
        elif method == "dflash":
            draft = str(tmp_path_factory.mktemp(f"dflash_{kind}"))
            rd.build_dflash_checkpoint(draft, config, target_layer_ids=(0, 1), block_size=K + 1)
            spec["model"] = draft
        cache[kind, method] = spec
        return spec
    return get


# ---- the mixed batch --------------------------------------------------------------------------

def _token_prompts(seed: int) -> list[list[int]]:
    """Five prompts (8 to 29 tokens) with distinct first tokens (none a prefix of
    another: the oracle keys on them); the even ones end in a repeated motif (n-gram
    drafts right away)."""
    rng = np.random.default_rng(seed)
    firsts = rng.choice(VOCAB - 1, size=5, replace=False)
    out = []
    for i, (f, n) in enumerate(zip(firsts, (8, 21, 13, 29, 10))):
        body = rng.integers(0, VOCAB - 1, size=n - 1).tolist()
        if i % 2 == 0:
            motif = rng.integers(0, VOCAB - 1, size=3).tolist()
            body = body[:n - 7] + motif * 2
        out.append([int(f)] + body)
    return out


def batch(seed: int = 3):
    """(prompts, params): two greedy requests with top-5 logprobs and prompt logprobs,
    n=3 unseeded and n=2 seeded, both sampled with top_k=1 (the rejection sampler's
    random path, yet every sample the greedy tokens; greedy n > 1 is refused by
    SamplingParams), a plain greedy request and a JSON-schema grammar."""
    from tokenmill import StructuredOutputsParams
    p = _token_prompts(seed)
    prompts = [{"prompt_token_ids": t} for t in p] + [{"prompt": "JSON please:"}]
    g = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=5, **g),
              SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=5, **g),
              SamplingParams(temperature=1.0, top_k=1, n=3, **g),  # unseeded
              SamplingParams(temperature=0.8, top_k=1, seed=11, n=2, **g),
              SamplingParams(temperature=0.0, **g),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=
                             StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))]
    return prompts, params


def _close(a: dict, b: dict, where: str) -> None:
    assert list(a) == list(b), where  # the same tokens, in the same order
    for t in a:
        assert abs(a[t].logprob - b[t].logprob) <= 1e-4, (where, t, a[t].logprob, b[t].logprob)
        assert a[t].rank == b[t].rank, where


def assert_same(got, want) -> None:
    """Tokens (every sample), finish reasons, logprobs and prompt logprobs as the plain
    engine's."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], i
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        for c, d in zip(g.outputs, w.outputs):
            if d.logprobs is not None:
                assert len(c.logprobs) == len(d.logprobs)
                for j, (a, b) in enumerate(zip(c.logprobs, d.logprobs)):
                    _close(a, b, f"request {i} token {j}")
        if w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
            for j, (a, b) in enumerate(zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:])):
                _close(a, b, f"request {i} prompt position {j + 1}")


def assert_idle(llm) -> None:
    sched = scheduler_of(llm)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_used_blocks == 0
    runner = runner_of(llm)
    assert runner.input_batch.num_reqs() == 0
    if runner.state_slots is not None:  # every state slot group back
        assert not runner.state_slots.slot_of
        assert runner.state_slots.num_free == runner.state_slots.num_slots
    proposer = getattr(runner.drafter, "model_proposer", None)
    if proposer is not None:
        assert not proposer.deferred._slot


_PLAIN: dict[tuple, list] = {}


def plain_run(path: str, config: str, **extra):
    key = (path, config, tuple(sorted(extra.items())))
    if key not in _PLAIN:
        prompts, params = batch()
        llm = make_llm(path, **(CHUNKED if config == "chunked" else {}), **extra)
        _PLAIN[key] = llm.generate(prompts, params, use_tqdm=False)
    return _PLAIN[key]


def install_partial_oracle(llm, method: str, plain, vocab: int):
    """Drafts that are the plain run's tokens except where test_spec_oracle's "partial"
    pattern corrupts one (the first 1-3 drafts pass): -> the oracle (its .errors)."""
    from test_spec_oracle import Oracle, install_oracle
    seqs = {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in plain}
    oracle = Oracle(seqs, "partial", vocab)
    install_oracle(llm, method, oracle, K)
    return oracle


TARGET_METHODS = [("dense", m) for m in ("ngram", "eagle3", "dflash")] + \
    [("moe", m) for m in ("ngram", "eagle3", "dflash")] + \
    [("hybrid", m) for m in ("ngram", "eagle3", "dflash", "mtp")] + \
    [("hybrid_moe", m) for m in ("ngram", "eagle3", "dflash", "mtp")]


@pytest.mark.parametrize("config", ["plain", "chunked"])
@pytest.mark.parametrize("drafts", ["random", "oracle"])
@pytest.mark.parametrize("kind,method", TARGET_METHODS)
def test_mixed_batch_equals_the_plain_engine(targets, spec_configs, kind, method, drafts,
                                             config):
    """Logprobs, prompt logprobs, top_k=1 sampled n > 1 and a JSON grammar in
    one batch: every token, finish reason and logprob the plain engine's, with the
    drafter's random drafts (mostly rejected) and with oracle drafts (accepted part-way),
    under chunked prefill with preemption too; nothing held afterwards."""
    path = targets(kind)
    want = plain_run(path, config)
    extra = CHUNKED if config == "chunked" else {}
    llm = make_llm(path, speculative_config=spec_configs(kind, method), **extra)
    oracle = install_partial_oracle(llm, method, want, VOCAB) if drafts == "oracle" else None
    from test_spec_oracle import record_verifications
    seen = record_verifications(llm)
    prompts, params = batch()
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, want)
    if oracle is not None:  # every request verified drafts: grammar and sampled rows too
        assert {p for p, _, d in seen if d} == {tuple(o.prompt_token_ids) for o in want}
    json.loads(want[-1].outputs[0].text)  # the grammar finished its object
    stats = scheduler_of(llm).spec_stats
    assert stats.num_draft_tokens > 0
    if oracle is not None:
        assert not oracle.errors, oracle.errors[:5]
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if config == "chunked":
        assert scheduler_of(llm).num_preemptions > 0
    assert_idle(llm)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_without_a_head_is_refused_by_name(targets, kind):
    """Dense and MoE Qwen3 targets have no MTP head: refused at start-up, naming the
    field."""
    with pytest.raises(ValueError, match=r"^speculative_config\.method 'mtp' needs a "
                                         r"Qwen3-Next / Qwen3\.5 or DeepSeek-V3 target"):
        make_llm(targets(kind), speculative_config={"method": "mtp"})


# ---- prefix caching with speculation on the hybrid target -------------------------------------

def _shared_prefix_prompts() -> list[list[int]]:
    rng = np.random.default_rng(17)
    prefix = rng.integers(1, VOCAB - 1, size=27).tolist()
    motif = rng.integers(1, VOCAB - 1, size=3).tolist()
    return [prefix + motif * 2 + rng.integers(1, VOCAB - 1, size=n).tolist()
            for n in (2, 5, 11)] + [prefix[:17]]


_UNCACHED: dict[str, list] = {}


@pytest.mark.parametrize("config", ["plain", "chunked"])
@pytest.mark.parametrize("kind,drafts", [("hybrid", "random"), ("hybrid", "oracle"),
                                         ("hybrid_moe", "oracle")])
@pytest.mark.parametrize("method", ["ngram", "eagle3", "dflash", "mtp"])
def test_hybrid_prefix_caching_with_speculation(targets, spec_configs, method, kind, drafts,
                                                config):
    """A batch sharing a prefix, twice on one engine with prefix caching (recurrent
    state restored from snapshots at block boundaries, then verify steps over 1 + k
    state slots), also in 16-token chunks with a pool that preempts: the uncached plain
    engine's tokens both times, hits > 0, nothing held."""
    extra = dict(CHUNKED, block_size=8) if config == "chunked" else {"block_size": 8}
    path = targets(kind)
    prompts = [{"prompt_token_ids": p} for p in _shared_prefix_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if path not in _UNCACHED:
        _UNCACHED[path] = make_llm(path, enable_prefix_caching=False).generate(
            prompts, params, use_tqdm=False)
    want = _UNCACHED[path]
    llm = make_llm(path, speculative_config=spec_configs(kind, method),
                   enable_prefix_caching=True, state_snapshot_interval=8, **extra)
    oracle = install_partial_oracle(llm, method, want, VOCAB) if drafts == "oracle" else None
    for _ in range(2):
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.llm_engine.engine_core.kv_cache_stats()["prefix_cache_hits"] > 0
    if config == "chunked":
        assert scheduler_of(llm).num_preemptions > 0
    stats = scheduler_of(llm).spec_stats
    assert stats.num_draft_tokens > 0
    if oracle is not None:
        assert not oracle.errors, oracle.errors[:5]
        assert stats.num_accepted_tokens > 0
    assert_idle(llm)


# ---- oracle acceptance patterns on the hybrid target ------------------------------------------

@pytest.fixture(scope="module")
def hybrid_setups(targets, spec_configs):
    from test_spec_oracle import Setup, _prompts
    cache = {}

    def get(method):
        if method not in cache:
            cache[method] = Setup(targets("hybrid"), spec_configs("hybrid", method), VOCAB,
                                  _prompts(VOCAB, seed=5))
        return cache[method]
    return get


@pytest.mark.parametrize("pattern", ["all", "partial", "none"])
@pytest.mark.parametrize("method", ["ngram", "eagle3", "dflash"])
def test_oracle_acceptance_on_the_hybrid_target(hybrid_setups, method, pattern):
    """test_spec_oracle.py's exact check (the verifications and metrics the corruption
    pattern implies, adaptive k included) for the methods it ran on dense targets only:
    the Gated DeltaNet state must go on from each accepted position."""
    from test_spec_oracle import check_run, expected_stats, run_oracle, simulate
    setup = hybrid_setups(method)
    llm, oracle, seen, got = run_oracle(setup, pattern, True)
    want = simulate(setup.prompts, oracle, setup.k, True)
    assert sorted((p, n, len(d)) for p, n, d in seen) == sorted(want)
    s = check_run(llm, setup, oracle, seen, got)
    assert s == dict(s, **expected_stats(want, oracle, setup.k))
    assert_idle(llm)


# ---- DFlash drafts after a prefix-cache hit ----------------------------------------------------

def _record_drafts(llm) -> dict[tuple, list[int]]:
    """Every model proposal of the run (conftest.record_model_drafts, strict)."""
    return record_model_drafts(runner_of(llm), strict=True)


@pytest.mark.parametrize("config", ["plain", "chunked"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_dflash_drafts_after_a_prefix_hit_equal_the_uncached_drafts(targets, spec_configs,
                                                                    kind, config):
    """The same prompt twice: the second run's drafts with prefix caching (its cached
    blocks' rows never reach the drafter: their draft context comes from the paged
    cache's hit blocks) equal to those of a run without, request by request and
    position by position (and, unchunked, the drafts verified and accepted); with the hit blocks' draft K/V wiped they differ (the
    check sees a missing context). Chunked: 16-token chunks and a pool small enough
    that a second, longer request preempts (the drafts of both compared)."""
    path = targets(kind)
    spec = dict(spec_configs(kind, "dflash"), adaptive=False)
    long = _token_prompts(9)[3] * 2  # 58 tokens: 7 full blocks of 8
    prompts = [{"prompt_token_ids": long}]
    extra = {"block_size": 8}
    if config == "chunked":
        prompts.append({"prompt_token_ids": _token_prompts(4)[1] * 3})  # 63 tokens
        extra = dict(CHUNKED, block_size=8, num_kv_blocks=18)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for cache, wipe in ((False, False), (True, False), (True, True)):
        llm = make_llm(path, speculative_config=spec, enable_prefix_caching=cache,
                       state_snapshot_interval=8, **extra)
        first = llm.generate(prompts, params, use_tqdm=False)
        if wipe:  # the hit blocks' draft context lost: the check must see it
            for name, kv in runner_of(llm).kv_caches.items():
                if name.startswith("draft."):
                    kv.zero_()
        seen = _record_drafts(llm)
        sched = scheduler_of(llm)
        before = (sched.spec_stats.num_draft_tokens, sched.spec_stats.num_accepted_tokens,
                  llm.llm_engine.engine_core.kv_cache_stats()["prefix_cache_hits"])
        out = llm.generate(prompts, params, use_tqdm=False)
        stats = (sched.spec_stats.num_draft_tokens - before[0],
                 sched.spec_stats.num_accepted_tokens - before[1])
        hits = llm.llm_engine.engine_core.kv_cache_stats()["prefix_cache_hits"] - before[2]
        runs.append(([o.outputs[0].token_ids for o in out], seen, stats, hits,
                     sched.num_preemptions))
        assert [o.outputs[0].token_ids for o in first] == runs[-1][0]
        assert_idle(llm)
    (cold_out, cold, cold_stats, _, _), (hit_out, warm, warm_stats, hits, preempted), \
        (wiped_out, wiped, _, wiped_hits, _) = runs
    assert hit_out == cold_out == wiped_out  # the output is exact either way
    assert hits > 0 and wiped_hits > 0
    assert len(cold) >= len(prompts) * 5
    assert warm == cold
    assert wiped != cold  # (drafts that read no context differ)
    if config == "chunked":  # (the budget cuts a step's drafts where the runs' chunks differ)
        assert preempted > 0
    else:
        assert warm_stats == cold_stats  # the same verifications, the same acceptance


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_dflash_drafts_after_an_external_tier_load(targets, spec_configs, tmp_path, kind):
    """A fresh engine whose prompt's blocks come from the external tier (disk; no local
    prefix cache): the draft layers' K/V travel in the same pages as the target's, so
    its drafts equal a cold run's, position by position."""
    path = targets(kind)
    spec = dict(spec_configs(kind, "dflash"), adaptive=False)
    prompts = [{"prompt_token_ids": _token_prompts(9)[3] * 2}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(speculative_config=spec, block_size=8, state_snapshot_interval=8)
    cold_llm = make_llm(path, enable_prefix_caching=False, **kw)
    cold = _record_drafts(cold_llm)
    want = cold_llm.generate(prompts, params, use_tqdm=False)
    store = [f"disk:{tmp_path / 'kv'}"]
    make_llm(path, kv_connector=store, **kw).generate(prompts, params, use_tqdm=False)
    reader = make_llm(path, kv_connector=store, **kw)
    got = _record_drafts(reader)
    out = reader.generate(prompts, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    external = reader.llm_engine.engine_core.kv_cache_stats()["external"]
    assert external["hit_blocks"] > 0 and external["load_failures"] == 0
    assert len(cold) >= 5 and got == cold
