"""Automatic prefix caching on a tiny fp32 model: outputs identical with the cache on
and off (and equal to HF greedy), hits counted, blocks back to zero when idle,
cache_salt, eviction under memory pressure, preemption, prompt logprobs, n > 1,
hybrids with the external tier."""
from __future__ import annotations

import logging
import random

import pytest

from conftest import build_checkpoint, make_llm, scheduler_of
from tokenmill import SamplingParams

BS = 8
NEW = 12


def shared_prefix_prompts(vocab: int, prefix_len: int = 100, n: int = 6, seed: int = 0,
                          suffix=(1, 30)) -> list[list[int]]:
    # No token 0: the HF reference (generate with pad_token_id=0) would mask it out.
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(1, vocab) for _ in range(rng.randint(*suffix))]
               for _ in range(n)]
    prompts.append(list(prefix))  # the prefix alone
    prompts.append(prefix[:BS * 4])  # exactly 4 blocks: fully cached on a second run
    return prompts


def greedy(llm, prompts, n=NEW, **extra):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    items = [dict(prompt_token_ids=p, **extra) for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(items, sp, use_tqdm=False)]


def stats(llm) -> dict:
    return llm.llm_engine.engine_core.kv_cache_stats()


def assert_idle(llm):
    kvm = scheduler_of(llm).kv_cache_manager
    assert kvm.num_used_blocks == 0
    assert kvm.req_to_blocks == {} and kvm.num_cached_blocks == {}
    # What the cache keeps is counted apart, as evictable.
    assert kvm.pool.num_evictable_cached_blocks == kvm.pool.num_cached_blocks


@pytest.fixture(scope="module")
def prompts(llama_tiny):
    return shared_prefix_prompts(llama_tiny.vocab_size)


@pytest.fixture(scope="module")
def baseline(llama_tiny, prompts):
    llm = make_llm(llama_tiny.path, block_size=BS, max_model_len=160,
                   enable_prefix_caching=False)
    assert not scheduler_of(llm).kv_cache_manager.enable_caching
    out = greedy(llm, prompts)
    assert stats(llm)["prefix_cache_queries"] == 0
    return out


def test_on_by_default_and_identical_to_off(llama_tiny, prompts, baseline):
    llm = make_llm(llama_tiny.path, block_size=BS, max_model_len=160)
    assert scheduler_of(llm).kv_cache_manager.enable_caching  # the default
    # All in one batch: the later prompts hit blocks the first one computes in the
    # same step (their KV is written before any attention reads it).
    first = greedy(llm, prompts)
    assert first == baseline
    s1 = stats(llm)
    prefix_blocks = 100 // BS
    assert s1["prefix_cache_hits"] >= (len(prompts) - 3) * prefix_blocks * BS
    assert_idle(llm)
    # Again: every prompt finds its prefix among the freed, still cached blocks.
    second = greedy(llm, prompts)
    assert second == baseline
    s2 = stats(llm)
    hits = s2["prefix_cache_hits"] - s1["prefix_cache_hits"]
    assert hits >= (len(prompts) - 1) * prefix_blocks * BS
    assert s2["prefix_cache_hit_requests"] - s1["prefix_cache_hit_requests"] == len(prompts)
    assert_idle(llm)
    # And HF greedy agrees (a few prompts).
    for p, got in list(zip(prompts, second))[:3]:
        assert got == llama_tiny.reference(p, NEW)


def test_fully_cached_prompt_computes_its_last_token(llama_tiny, prompts, baseline):
    llm = make_llm(llama_tiny.path, block_size=BS, max_model_len=160)
    p = prompts[-1]  # exactly 4 blocks
    assert greedy(llm, [p]) == [baseline[-1]]
    before = stats(llm)["prefix_cache_hits"]
    seen = []
    core = llm.llm_engine.engine_core
    orig = core.scheduler.schedule

    def spy():
        so = core.scheduler.schedule.__wrapped__()
        seen.append(so)
        return so
    spy.__wrapped__ = orig
    core.scheduler.schedule = spy
    try:
        assert greedy(llm, [p]) == [baseline[-1]]
    finally:
        core.scheduler.schedule = orig
    # 3 of 4 blocks hit: the last block is recomputed for its last token's logits.
    assert stats(llm)["prefix_cache_hits"] - before == 3 * BS
    new = [nr for so in seen for nr in so.scheduled_new_reqs]
    assert len(new) == 1 and new[0].num_computed_tokens == 3 * BS
    first = next(so for so in seen if so.scheduled_new_reqs)
    assert first.num_scheduled_tokens[new[0].req_id] == BS
    assert_idle(llm)


def test_cache_salt_separates_caches(llama_tiny, prompts, baseline):
    llm = make_llm(llama_tiny.path, block_size=BS, max_model_len=160)
    p = prompts[:1]
    assert greedy(llm, p, cache_salt="alice") == baseline[:1]
    h0 = stats(llm)["prefix_cache_hits"]
    assert greedy(llm, p, cache_salt="bob") == baseline[:1]
    assert stats(llm)["prefix_cache_hits"] == h0  # another salt: no hit
    assert greedy(llm, p) == baseline[:1]
    assert stats(llm)["prefix_cache_hits"] == h0  # no salt: no hit either
    assert greedy(llm, p, cache_salt="alice") == baseline[:1]
    assert stats(llm)["prefix_cache_hits"] - h0 >= 100 // BS * BS
    with pytest.raises(ValueError, match="cache_salt"):
        greedy(llm, p, cache_salt="")
    assert_idle(llm)


def test_eviction_under_memory_pressure(llama_tiny):
    """A pool far smaller than the prefixes in play: cached blocks are evicted
    (LRU) as blocks are needed, and outputs stay right."""
    vocab = llama_tiny.vocab_size
    groups = [shared_prefix_prompts(vocab, prefix_len=48, n=3, seed=s, suffix=(1, 12))[:3]
              for s in range(4)]
    order = [p for rnd in range(2) for g in groups for p in g[rnd:] + g[:rnd]]
    kw = dict(block_size=BS, max_model_len=96, num_kv_blocks=26, max_num_seqs=3)
    off = make_llm(llama_tiny.path, enable_prefix_caching=False, **kw)
    on = make_llm(llama_tiny.path, **kw)
    want, got = [], []
    for i in range(0, len(order), 3):  # a few requests at a time, prefixes interleaved
        want += greedy(off, order[i:i + 3])
        got += greedy(on, order[i:i + 3])
    assert got == want
    s = stats(on)
    assert s["num_cache_evictions"] > 0 and s["prefix_cache_hits"] > 0
    assert_idle(on)


def test_preemption_with_prefix_caching_matches_hf(llama_tiny):
    prompts = shared_prefix_prompts(llama_tiny.vocab_size, prefix_len=40, n=6, seed=3,
                                    suffix=(1, 20))
    llm = make_llm(llama_tiny.path, max_model_len=96, block_size=BS, num_kv_blocks=25)
    got = greedy(llm, prompts, n=20)
    sched = scheduler_of(llm)
    assert sched.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats(llm)["prefix_cache_hits"] > 0
    for p, g in zip(prompts, got):
        assert g == llama_tiny.reference(p, 20)
    assert_idle(llm)


def test_chunked_prefill_with_prefix_caching(llama_tiny, prompts, baseline):
    llm = make_llm(llama_tiny.path, block_size=BS, max_model_len=160,
                   max_num_batched_tokens=24)
    assert greedy(llm, prompts) == baseline
    assert greedy(llm, prompts[::-1]) == baseline[::-1]
    assert stats(llm)["prefix_cache_hits"] > 0
    assert_idle(llm)


def test_prompt_logprobs_are_computed_not_cached(llama_tiny, prompts):
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    item = {"prompt_token_ids": prompts[0]}
    off = make_llm(llama_tiny.path, block_size=BS, max_model_len=160,
                   enable_prefix_caching=False)
    want = off.generate(item, sp, use_tqdm=False)[0].prompt_logprobs
    on = make_llm(llama_tiny.path, block_size=BS, max_model_len=160)
    greedy(on, prompts[:1])  # the prompt is cached now
    hits = stats(on)["prefix_cache_hits"]
    got = on.generate(item, sp, use_tqdm=False)[0].prompt_logprobs
    assert stats(on)["prefix_cache_hits"] == hits  # no lookup for this request
    assert len(got) == len(want) == len(prompts[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)


def test_n_siblings_and_abort_leave_accounting_right(llama_tiny, prompts):
    llm = make_llm(llama_tiny.path, block_size=BS, max_model_len=160)
    engine = llm.llm_engine
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=30)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, sp)
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, sp)
    for _ in range(3):
        engine.step()
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks > 0
    engine.abort_request(["a", "b"])
    for _ in range(5):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert_idle(llm)
    # The siblings' prompt came from the cache; a later lone request equals its sibling.
    out = llm.generate({"prompt_token_ids": prompts[0]}, sp, use_tqdm=False)[0]
    lone = llm.generate({"prompt_token_ids": prompts[0]},
                        sp.clone(n=1, seed=8), use_tqdm=False)[0]
    assert lone.outputs[0].token_ids == out.outputs[1].token_ids
    assert_idle(llm)


HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, tie_word_embeddings=False)


def test_hybrid_models_cache_prefixes_with_the_external_tier(tmp_path, caplog):
    """Hybrids: prefix caching on by default (their recurrent state is snapshotted:
    tests/models/test_hybrid_prefix_caching.py); the external tier carries the
    snapshots (tests/models/test_hybrid_kv_tier.py), so it stays off only without
    prefix caching, with a warning saying why."""
    path = str(tmp_path / "hybrid")
    build_checkpoint(path, "qwen3_5", HYBRID)
    with caplog.at_level(logging.INFO, logger="tokenmill.kv_connector.setup"):
        no_cache = make_llm(path, enable_prefix_caching=False, kv_connector=["cpu"])
    assert no_cache.llm_engine.engine_core.kv_connector is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "tokenmill.kv_connector.setup"]
    assert len(warnings) == 1 and "recurrent" in warnings[0].getMessage()
    llm = make_llm(path, kv_connector=["cpu"])
    assert scheduler_of(llm).kv_cache_manager.enable_caching
    assert llm.llm_engine.engine_core.kv_connector.state_geometry is not None
    p = [[5, 6, 7] * 10]
    assert greedy(llm, p) == greedy(llm, p)
    assert stats(llm)["prefix_cache_hits"] > 0
    off = make_llm(path, enable_prefix_caching=False)
    assert not scheduler_of(off).kv_cache_manager.enable_caching
    assert greedy(off, p) == greedy(llm, p)
    # The local cache forgotten: the CPU store's block and snapshot serve the prompt.
    scheduler_of(llm).kv_cache_manager.reset_prefix_cache()
    assert greedy(llm, p) == greedy(off, p)
    assert llm.llm_engine.engine_core.kv_cache_stats()["external"]["snapshots_loaded"] > 0
