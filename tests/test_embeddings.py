"""Embeddings in the engine (LLM.embed, AsyncLLM): equal to HF's pooling of the final
normed hidden states (fp32, within 1e-5) for a bare Qwen3Model with sentence-transformers
files (last-token, normalised) and for mean / CLS via pooler_config; any causal LM pools
beside its generation; batch-invariant; chunked prefill pools the same vector; a mixed
load of generate and embed requests on one engine leaves no KV block behind."""
from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import make_llm, make_prompts, scheduler_of
from embedding_checkpoint import build_qwen3_embedding, hf_pooled, write_st_files
from tokenmill import PoolingParams, SamplingParams
from tokenmill.errors import ParamError

LENGTHS = [5, 17, 33, 70, 3, 40]
TOL = 1e-5  # against HF, fp32
SAME = 1e-6  # tokenmill against itself (alone / batched / chunked)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A Qwen3-Embedding-shaped checkpoint: Qwen3Model, last-token pooling, normalised."""
    path = str(tmp_path_factory.mktemp("qwen3_embedding"))
    hf = build_qwen3_embedding(path)
    write_st_files(path, "LAST", normalize=True)
    return path, hf


def vectors(outs) -> list[torch.Tensor]:
    assert all(o.error is None and o.finished for o in outs), [o.error for o in outs]
    return [torch.tensor(o.outputs.embedding) for o in outs]


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def assert_no_blocks(llm):
    kvm = scheduler_of(llm).kv_cache_manager
    assert not scheduler_of(llm).has_unfinished_requests() and kvm.num_used_blocks == 0


def test_qwen3_embedding_checkpoint_equals_hf(embedder):
    path, hf = embedder
    llm = make_llm(path)
    engine = llm.llm_engine
    assert engine.runner_type == "pooling"  # a bare *Model: pooling by default
    assert (engine.pooler_config.pooling_type, engine.pooler_config.normalize) == ("LAST", True)
    prompts = make_prompts(LENGTHS, 384)
    outs = llm.embed(token_prompts(prompts), use_tqdm=False)
    for p, o, v in zip(prompts, outs, vectors(outs)):
        assert o.prompt_token_ids == p and o.outputs.hidden_size == 64
        assert max_diff(v, hf_pooled(hf, p, "LAST", True)) < TOL
        assert abs(float(v.norm()) - 1.0) < 1e-5
    # per request: the vector without its normalisation
    raw = vectors(llm.embed(token_prompts(prompts[:2]), PoolingParams(normalize=False),
                            use_tqdm=False))
    for p, v in zip(prompts, raw):
        assert max_diff(v, hf_pooled(hf, p, "LAST", False)) < TOL
    assert_no_blocks(llm)
    # a pooling engine generates nothing: refused by name
    with pytest.raises(ParamError) as ei:
        llm.generate(token_prompts(prompts[:1]), SamplingParams(max_tokens=2), use_tqdm=False)
    assert ei.value.param == "model" and "pooling runner" in str(ei.value)


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [False, True])
def test_mean_and_cls_pooling_via_pooler_config(embedder, kind, normalize):
    path, hf = embedder
    llm = make_llm(path, pooler_config={"pooling_type": kind, "normalize": normalize})
    prompts = make_prompts(LENGTHS, 384, seed=2)
    for p, v in zip(prompts, vectors(llm.embed(token_prompts(prompts), use_tqdm=False))):
        assert max_diff(v, hf_pooled(hf, p, kind, normalize)) < TOL


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_batch_invariant_and_chunked_prefill(embedder, kind):
    """A prompt alone, inside a batch of other lengths, and computed in chunks of 16
    tokens over several steps, beside other requests: the same vector."""
    path, hf = embedder
    cfg = {"pooling_type": kind}
    prompts = make_prompts(LENGTHS, 384, seed=3)
    whole = make_llm(path, pooler_config=cfg)
    alone = [vectors(whole.embed(token_prompts([p]), use_tqdm=False))[0] for p in prompts]
    batched = vectors(whole.embed(token_prompts(prompts), use_tqdm=False))
    chunked_llm = make_llm(path, pooler_config=cfg, max_num_batched_tokens=16)
    chunked = vectors(chunked_llm.embed(token_prompts(prompts), use_tqdm=False))
    assert scheduler_of(chunked_llm).config.max_num_batched_tokens == 16
    for p, a, b, c in zip(prompts, alone, batched, chunked):
        assert max_diff(a, b) <= SAME and max_diff(a, c) <= SAME
        assert max_diff(c, hf_pooled(hf, p, kind, True)) < TOL
    assert_no_blocks(chunked_llm)


def test_errors_name_the_field(embedder):
    path, _ = embedder
    llm = make_llm(path, max_model_len=64)
    cases = [([{"prompt_token_ids": [1, 2, 384]}], PoolingParams(), "prompt"),
             ([{"prompt_token_ids": [1] * 65}], PoolingParams(), "prompt"),
             ([{"prompt_token_ids": []}], PoolingParams(), "prompt"),
             ([{"prompt_token_ids": [1, 2]}], PoolingParams(dimensions=8), "dimensions"),
             ([{"prompt_token_ids": [1, 2]}], PoolingParams(pooling_type="MEAN"),
              "pooling_type")]
    for prompts, params, param in cases:
        with pytest.raises(ParamError) as ei:
            llm.embed(prompts, params, use_tqdm=False)
        assert ei.value.param == param, str(ei.value)
    # an embedding needs no room for output: max_model_len tokens fit; -1 keeps that many
    assert len(llm.embed([{"prompt_token_ids": [1] * 64}], use_tqdm=False)[0]
               .outputs.embedding) == 64
    long = list(range(1, 101))
    out = llm.embed([{"prompt_token_ids": long}], PoolingParams(truncate_prompt_tokens=-1),
                    use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-64:]
    assert_no_blocks(llm)
    # a checkpoint without an LM head cannot be a generate engine
    with pytest.raises(ValueError, match="no LM head"):
        make_llm(path, runner="generate")


def test_causal_lm_embeds_beside_generate(tiny_model_factory):
    """LLM.embed() on a Qwen3ForCausalLM (generate runner): the decoder's final normed
    hidden states, as HF's model.model(...).last_hidden_state; generate() on the same
    instance still gives HF's greedy tokens."""
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path)
    assert llm.llm_engine.runner_type == "generate"
    prompts = tm.prompts
    for p, v in zip(prompts, vectors(llm.embed(token_prompts(prompts), use_tqdm=False))):
        assert max_diff(v, hf_pooled(tm.hf.model, p, "LAST", True)) < TOL
    outs = llm.generate(token_prompts(prompts), SamplingParams(max_tokens=20, temperature=0,
                                                               ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tm.reference(p) for p in prompts]
    assert_no_blocks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batches_of_generate_and_embed(tiny_model_factory, async_scheduling):
    """Generate and embed requests stepped together (one batch, chunked prefill, prefix
    caching on), several steps: each gives what it gives alone, and no block is left."""
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path, max_num_batched_tokens=32, async_scheduling=async_scheduling,
                   enable_prefix_caching=True, pooler_config={"pooling_type": "MEAN"})
    engine = llm.llm_engine
    prompts = tm.prompts
    gen = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    kinds = {}
    for i, p in enumerate(prompts):
        kinds[engine.add_request(None, {"prompt_token_ids": p}, gen)] = ("gen", p)
        kinds[engine.add_request(None, {"prompt_token_ids": p}, PoolingParams())] = ("emb", p)
    finals, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        peak = max(peak, scheduler_of(llm).num_running)
    assert peak > 4 and set(finals) == set(kinds)
    for rid, (kind, p) in kinds.items():
        out = finals[rid]
        assert out.error is None
        if kind == "gen":
            assert out.outputs[0].token_ids == tm.reference(p)
        else:
            v = torch.tensor(out.outputs.embedding)
            assert max_diff(v, hf_pooled(tm.hf.model, p, "MEAN", True)) < TOL
    assert_no_blocks(llm)


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_preempted_embeddings_start_over_and_pool_the_same_vector(tiny_model_factory, kind):
    """A KV pool too small for the load: generations growing past it preempt embedding
    requests mid-prefill, which are recomputed from their first token (their pooling so
    far dropped) and pool the same vectors."""
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path, max_num_batched_tokens=32, num_kv_blocks=12,
                   pooler_config={"pooling_type": kind})
    engine, sched = llm.llm_engine, scheduler_of(llm)
    preempted = []
    preempt = sched._preempt
    sched._preempt = lambda req: (preempted.append(req.request_id), preempt(req))[1]
    gen = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    embeds = {}
    for i, p in enumerate(make_prompts([60, 60, 70, 66, 58, 75], 384, seed=6)):
        if i < 2:  # the oldest: they grow, and preemption takes the newest
            engine.add_request(None, {"prompt_token_ids": p}, gen)
        else:
            embeds[engine.add_request(None, {"prompt_token_ids": p}, PoolingParams())] = p
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(preempted) & set(embeds), preempted
    for rid, p in embeds.items():
        v = torch.tensor(finals[rid].outputs.embedding)
        assert max_diff(v, hf_pooled(tm.hf.model, p, kind, True)) < TOL
    assert_no_blocks(llm)


def test_prefix_cache_hits_for_last_token_pooling_only(embedder):
    """Last-token pooling may start from cached prefix blocks (the last position is always
    computed); mean pooling needs every position, so it never looks the cache up."""
    path, hf = embedder
    p = make_prompts([70], 384, seed=5)[0]
    for kind, hits in (("LAST", True), ("MEAN", False)):
        llm = make_llm(path, enable_prefix_caching=True, pooler_config={"pooling_type": kind})
        stats = scheduler_of(llm).kv_cache_manager.prefix_cache_stats
        first = vectors(llm.embed(token_prompts([p]), use_tqdm=False))[0]
        again = vectors(llm.embed(token_prompts([p]), use_tqdm=False))[0]
        assert (stats.hits > 0) == hits, (kind, stats.hits)
        assert max_diff(first, again) <= SAME
        assert max_diff(again, hf_pooled(hf, p, kind, True)) < TOL
        assert_no_blocks(llm)


def test_a_non_finite_vector_fails_its_request_alone(embedder):
    """An overflow in one request's activations: that request finishes with an error
    (never NaN in a response), the others of its batch get their vectors."""
    path, hf = embedder
    llm = make_llm(path)
    model = llm.llm_engine.engine_core.runner.model
    forward = model.forward

    def poisoned(input_ids, positions, meta, **kw):  # NaN on the rows of token 383
        hidden = forward(input_ids, positions, meta, **kw)
        return hidden.masked_fill((input_ids == 383).unsqueeze(-1), float("nan"))

    model.forward = poisoned
    good = make_prompts([20], 383, seed=7)[0]
    bad, ok = llm.embed(token_prompts([[5, 6, 383], good]), use_tqdm=False)
    assert bad.finished and bad.outputs.embedding == [] and "NaN" in bad.error
    assert ok.error is None and max_diff(torch.tensor(ok.outputs.embedding),
                                         hf_pooled(hf, good)) < TOL
    stats = llm.llm_engine.engine_core.stats()
    assert stats.num_errors == {"nan_embedding": 1}
    assert_no_blocks(llm)


def test_tensor_parallel_embeddings(embedder):
    """Two ranks (gloo): the bare model shards without an lm_head; rank 0 pools."""
    path, hf = embedder
    llm = make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=16,
                   pooler_config={"pooling_type": "MEAN"})
    try:
        prompts = make_prompts(LENGTHS, 384, seed=8)
        for p, v in zip(prompts, vectors(llm.embed(token_prompts(prompts), use_tqdm=False))):
            assert max_diff(v, hf_pooled(hf, p, "MEAN", True)) < TOL
        assert_no_blocks(llm)
    finally:
        llm.shutdown()


def test_abort_frees_an_embedding_mid_prefill(embedder):
    path, _ = embedder
    llm = make_llm(path, max_num_batched_tokens=16)
    engine = llm.llm_engine
    rid = engine.add_request(None, {"prompt_token_ids": make_prompts([70], 384)[0]},
                             PoolingParams())
    assert engine.step() == [] and scheduler_of(llm).kv_cache_manager.num_used_blocks > 0
    engine.abort_request(rid)
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert_no_blocks(llm)
    assert rid not in engine.output_processor.pooling


def test_async_llm_serves_a_concurrent_mixed_load(tiny_model_factory):
    """The server's engine (AsyncLLM) under concurrent generate and embed callers."""
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.engine_args import EngineArgs
    tm = tiny_model_factory("qwen3_headdim")
    async_llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(
        tm.path, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=16,
        max_num_batched_tokens=48), log_stats_interval=0)
    gen = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    async def last(prompt, params):
        out = None
        async for out in async_llm.generate({"prompt_token_ids": prompt}, params):
            pass
        return out

    async def run():
        calls = [last(p, gen) for p in tm.prompts] + [last(p, PoolingParams())
                                                        for p in tm.prompts]
        return await asyncio.gather(*calls)

    try:
        outs = asyncio.run(run())
        n = len(tm.prompts)
        for p, out in zip(tm.prompts, outs[:n]):
            assert out.outputs[0].token_ids == tm.reference(p)
        for p, out in zip(tm.prompts, outs[n:]):
            assert max_diff(torch.tensor(out.outputs.embedding),
                            hf_pooled(tm.hf.model, p, "LAST", True)) < TOL
        core = async_llm.engine.engine_core
        assert core.stats().num_used_blocks == 0 and not core.has_unfinished_requests()
    finally:
        async_llm.shutdown()
