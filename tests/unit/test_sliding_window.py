"""Sliding-window attention and per-layer KV cache groups.

* windowed decode (native kernel at every level, PyTorch path) and prompt chunks vs a
  dense reference with HF's mask: a query at p sees keys in (p - window, p];
* groups from per-layer specs (equal specs share one; cut to equal sizes; buffers
  shared by position, each at its largest page);
* the KV cache manager gives a sliding group's blocks back once they leave the window
  (at most ceil(window / block_size) + 1 held while decoding) and serves prefix-cache
  hits that need only the window's blocks;
* end to end: a request far longer than its window, HF's tokens, the block bound.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import build_checkpoint, hf_greedy, make_llm, make_prompts, scheduler_of
from tokenmill import SamplingParams
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_spec import (FullAttentionSpec, KVCacheConfig, KVCacheGroup,
                                          MambaSpec, SlidingWindowSpec, group_layer_specs)
from tokenmill.attention.cpu_native import CpuNativeAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk
from tokenmill.attention.torch_ref import TorchAttentionBackend
from tokenmill.core.request import Request
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.attention import PagedAttention

# ---- attention ---------------------------------------------------------------------


def _paged(num_blocks, bs, hkv, d, seq_len, g, dtype=torch.float32):
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=g).to(dtype)
    nb = -(-seq_len // bs)
    table = (torch.randperm(num_blocks - 1, generator=g)[:nb] + 1).to(torch.int32)
    return cache, table


def _dense_window(cache, table, q, seq_len, scale, window, num_q=1):
    """The last `num_q` positions of a sequence of seq_len, HF's sliding-window mask."""
    blocks = cache[table.long()]
    k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:seq_len].float().transpose(0, 1)
    v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:seq_len].float().transpose(0, 1)
    kpos = torch.arange(seq_len)[None, :]
    qpos = torch.arange(seq_len - num_q, seq_len)[:, None]
    mask = (kpos <= qpos) & (kpos > qpos - window)
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("window", [1, 5, 8, 13, 100])
def test_windowed_decode_matches_dense(ops, d, window):
    """Rows shorter and longer than the window, windows inside a block and across
    blocks; the blocks wholly before a row's window hold NaN (given back: never read)."""
    g = torch.Generator().manual_seed(window)
    bs, hkv, hq = 4, 2, 6
    seq_lens = [1, 4, 5, 9, 17, 30]
    cache = torch.randn(64, 2, bs, hkv, d, generator=g)
    perm = (torch.randperm(63, generator=g) + 1).tolist()
    width = -(-max(seq_lens) // bs)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(seq_lens):
        nb = -(-n // bs)
        table[r, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    ref = torch.stack([_dense_window(cache, table[r], q[r:r + 1], n, d ** -0.5, window)[0]
                       for r, n in enumerate(seq_lens)])
    poisoned = cache.clone()
    for r, n in enumerate(seq_lens):
        first = max(0, n - window) // bs
        for b in range(first):
            poisoned[table[r, b].long()] = float("nan")
    layer = PagedAttention(hq, hkv, d, d ** -0.5, sliding_window=window)
    for native in (None, ops):
        meta = AttentionMetadata(num_decodes=len(seq_lens), slot_block=None, slot_offset=None,
                                 decode_block_table=table,
                                 decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
        backend = (TorchAttentionBackend() if native is None
                   else CpuNativeAttentionBackend(native))
        src = poisoned if native is not None else cache  # (the runner nulls them for torch)
        got = backend.make_impl(layer).decode(q, src, meta)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context_len,n", [(0, 9), (3, 6), (10, 7), (21, 1)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_windowed_prefill_matches_dense(context_len, n, softcap):
    """A prompt chunk after `context_len` cached tokens: blocks before the first query's
    window are NaN (given back) and must not be read."""
    g = torch.Generator().manual_seed(context_len + n)
    bs, hkv, hq, d, window = 4, 2, 4, 16, 6
    seq_len = context_len + n
    cache, table = _paged(32, bs, hkv, d, seq_len, g)
    q = torch.randn(n, hq, d, generator=g)
    kv = cache[table.long()]
    k_new = kv[:, 0].reshape(-1, hkv, d)[context_len:seq_len]
    v_new = kv[:, 1].reshape(-1, hkv, d)[context_len:seq_len]
    blocks = cache[table.long()]
    k_all = blocks[:, 0].reshape(-1, hkv, d)[:seq_len].transpose(0, 1)
    v_all = blocks[:, 1].reshape(-1, hkv, d)[:seq_len].transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k_all.repeat_interleave(2, 0).transpose(1, 2))
    scores = scores * d ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kpos = torch.arange(seq_len)[None, :]
    qpos = torch.arange(context_len, seq_len)[:, None]
    scores = scores.masked_fill(~((kpos <= qpos) & (kpos > qpos - window)), float("-inf"))
    ref = torch.matmul(scores.softmax(-1), v_all.repeat_interleave(2, 0)).transpose(0, 1)
    poisoned = cache.clone()
    for b in range(max(0, context_len - window + 1) // bs):
        poisoned[table[b].long()] = float("nan")
    layer = PagedAttention(hq, hkv, d, d ** -0.5, sliding_window=window, logit_softcap=softcap)
    got = TorchAttentionBackend().make_impl(layer).prefill(
        q, k_new, v_new, poisoned, PrefillChunk(0, n, context_len, table.long()))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ---- groups --------------------------------------------------------------------------

def test_equal_specs_share_a_group_cut_to_equal_sizes():
    full = FullAttentionSpec(4, 2, 16, "float32")
    swa = SlidingWindowSpec(4, 2, 16, "float32", 8)
    state = MambaSpec(((3, 4),), ("float32",))
    kinds = [swa, swa, full, swa, swa, full, "state"]
    specs = {f"layers.{i}": (state if s == "state" else s) for i, s in enumerate(kinds)}
    groups = group_layer_specs(specs)
    # Full first (the target's attention group), sliding cut into groups of two.
    assert [(g.layer_names, g.spec) for g in groups] == [
        (["layers.2", "layers.5"], full), (["layers.0", "layers.1"], swa),
        (["layers.3", "layers.4"], swa), (["layers.6"], state)]
    config = KVCacheConfig(10, groups)
    assert config.attention_group_id == 0 and config.state_group_id == 3
    assert config.attention_group_ids == [0, 1, 2]
    assert groups[1].sliding_window == 8 and groups[0].sliding_window is None
    # Two buffers (layer 0 and 1 of every group), one page each per block id.
    assert config.buffer_page_sizes() == [full.page_size_bytes] * 2
    assert config.bytes_per_block() == 2 * full.page_size_bytes


def test_a_draft_models_own_group_is_never_the_targets():
    """An EAGLE drafter's full-attention layers beside an all-sliding target."""
    full = FullAttentionSpec(4, 2, 16, "float32")
    swa = SlidingWindowSpec(4, 2, 16, "float32", 8)
    groups = group_layer_specs({"layers.0.attn": swa, "layers.1.attn": swa,
                                "draft.0.attn": full})
    config = KVCacheConfig(10, groups)
    assert groups[0].is_draft and groups[0].layer_names == ["draft.0.attn"]
    assert config.attention_group_id == 1
    # With the target's spec, the drafter's layers join its group (as before).
    groups = group_layer_specs({"layers.0.attn": full, "draft.0.attn": full})
    assert len(groups) == 1 and not groups[0].is_draft


def test_groups_of_different_head_dims_share_buffers_at_the_largest_page():
    """Per-layer head_dim (Gemma 4: sliding layers one head_dim, global another)."""
    from tokenmill.worker.kv_cache import allocate_kv_caches
    full = FullAttentionSpec(4, 1, 32, "float32")
    swa = SlidingWindowSpec(4, 2, 8, "float32", 6)
    groups = group_layer_specs({"a": swa, "b": full, "c": swa, "d": full})
    config = KVCacheConfig(5, groups)
    assert config.buffer_page_sizes() == [full.page_size_bytes] * 2  # 1 x 32 > 2 x 8
    caches = allocate_kv_caches(config, torch.device("cpu"))
    assert caches["b"].shape == (5, 2, 4, 1, 32) and caches["a"].shape == (5, 2, 4, 2, 8)
    # Layer j of each group views the same buffer: block ids never overlap between groups.
    assert caches["a"].untyped_storage().data_ptr() == caches["b"].untyped_storage().data_ptr()
    assert caches["c"].untyped_storage().data_ptr() == caches["d"].untyped_storage().data_ptr()


# ---- the KV cache manager --------------------------------------------------------------

def _manager(window=6, bs=4, num_blocks=64, caching=True):
    full = FullAttentionSpec(bs, 1, 8, "float32")
    swa = SlidingWindowSpec(bs, 1, 8, "float32", window)
    config = KVCacheConfig(num_blocks, [KVCacheGroup(["full"], full),
                                        KVCacheGroup(["swa"], swa)])
    return KVCacheManager(config, enable_caching=caching)


def _request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=100),
                   frozenset())


@pytest.mark.parametrize("window,bs", [(6, 4), (4, 4), (1, 4), (13, 4), (3, 1)])
def test_sliding_group_holds_at_most_the_window_while_decoding(window, bs):
    mgr = _manager(window, bs, num_blocks=256, caching=False)
    req = _request("r", range(1, 41))
    bound = math.ceil(window / bs) + 1
    step = 7
    while req.num_computed_tokens < 120:
        decoding = req.num_computed_tokens >= req.num_prompt_tokens
        n = 1 if decoding else min(step, req.num_prompt_tokens - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n) is not None
        held = mgr.num_blocks_held("r", 1)
        if decoding:
            assert held <= bound
        else:  # a prompt chunk: the window before it plus the chunk
            assert held <= math.ceil((window - 1 + n) / bs) + 1
        assert mgr.num_blocks_held("r", 0) == -(-(req.num_computed_tokens + n) // bs)
        req.num_computed_tokens += n
        if req.num_computed_tokens >= req.num_tokens:
            req.output_token_ids.append(5)
    blocks = mgr.req_to_blocks["r"][1]
    assert blocks[0] == BlockPool.NULL_BLOCK  # given back
    used = mgr.num_used_blocks
    assert used == mgr.num_blocks_held("r", 0) + mgr.num_blocks_held("r", 1)
    mgr.free(req)
    assert mgr.num_used_blocks == 0


def test_prefix_hit_needs_only_the_window_blocks():
    bs, window = 4, 6
    mgr = _manager(window, bs)
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks
    a = _request("a", prompt)
    assert mgr.allocate_slots(a, 30) is not None
    a.num_computed_tokens = 30
    a.output_token_ids.append(7)
    assert mgr.allocate_slots(a, 1) is not None  # gives back the blocks before its window
    swa_a = mgr.req_to_blocks["a"][1]
    gone = (30 - window + 1) // bs  # token 30 reads positions 25.. (block 6 on)
    assert swa_a[:gone] == [0] * gone and all(b != 0 for b in swa_a[gone:])
    mgr.free(a)
    assert mgr.num_used_blocks == 0
    # The given-back blocks were cached while held: a new request hits them all...
    b = _request("b", prompt + [99])
    hit, num = mgr.get_computed_blocks(b)
    assert num == 28  # 7 blocks, the last token left to compute
    first = max(0, num - window + 1) // bs  # the first block the window of token 28 reads
    assert hit[1][:first] == [0] * first and all(x != 0 for x in hit[1][first:])
    assert len(hit[0]) == 7 and all(x != 0 for x in hit[0])
    # ... and after the early sliding blocks were evicted, still (only the window counts).
    hashes = _hashes(b, bs)
    for i in range(first):
        mgr.pool._evict(mgr.pool.cached[(1, hashes[i])])
    hit2, num2 = mgr.get_computed_blocks(b)
    assert num2 == 28 and hit2 == hit
    # A block missing inside the window: no shorter hit has its window whole either
    # (the blocks before are gone), so nothing is hit.
    mgr.pool._evict(hit[1][6])
    _, num3 = mgr.get_computed_blocks(b)
    assert num3 == 0
    assert mgr.allocate_slots(b, 31 - num3, *mgr.get_computed_blocks(b)) is not None
    mgr.free(b)
    assert mgr.num_used_blocks == 0


def _hashes(req, bs):
    from tokenmill.core.kv_cache_utils import request_block_hashes
    return request_block_hashes(req, bs)


# ---- end to end ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_mistral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mistral_long_window"))
    hf = build_checkpoint(path, "mistral", dict(head_dim=32, sliding_window=10,
                                                tie_word_embeddings=False,
                                                max_position_embeddings=256))
    return path, hf


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_request_far_longer_than_its_window(long_mistral, cpu_kernels):
    """A 150-token prompt and 60 new tokens through a 10-token window: HF's tokens, and
    at most ceil(10 / 4) + 1 blocks held per decode step (the max_model_len cap of old
    is gone: 256 positions)."""
    path, hf = long_mistral
    prompt = make_prompts([150], 384, seed=5)[0]
    llm = make_llm(path, block_size=4, max_model_len=256, max_num_batched_tokens=32,
                   cpu_kernels=cpu_kernels)
    engine = llm.llm_engine
    assert engine.model_config.max_model_len == 256
    kvm = scheduler_of(llm).kv_cache_manager
    (gid,) = kvm.sliding  # Mistral: every layer sliding, one group
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    out, held = None, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        req = scheduler_of(llm).requests.get("r")
        if req is not None and req.num_computed_tokens > len(prompt):
            held.append(kvm.num_blocks_held("r", gid))
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 60)
    assert len(held) >= 50 and max(held) <= math.ceil(10 / 4) + 1
    assert kvm.num_used_blocks == 0


@pytest.mark.parametrize("name", ["mistral_swa", "gemma3", "gemma4_all"])
def test_prefix_caching_with_sliding_groups_matches_hf(tiny_model_factory, name):
    """Prompts sharing a 60-token prefix (five windows), run twice: the second run hits
    the cache in every group (the sliding groups only for their windows' blocks) and
    gives HF's tokens, as the first did."""
    import random
    tm = tiny_model_factory(name)
    rng = random.Random(3)
    prefix = [rng.randrange(1, tm.vocab_size) for _ in range(60)]
    prompts = [prefix + [rng.randrange(1, tm.vocab_size) for _ in range(k)] for k in (3, 9, 17)]
    prompts.append(list(prefix))
    llm = make_llm(tm.path, block_size=4, max_model_len=128, max_num_batched_tokens=32)
    kvm = scheduler_of(llm).kv_cache_manager
    assert kvm.enable_caching and kvm.sliding
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    refs = [hf_greedy(tm.hf, p, 12) for p in prompts]
    for run in range(2):
        hits = kvm.prefix_cache_stats.hits
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs, f"run {run}"
        assert kvm.num_used_blocks == 0
    assert kvm.prefix_cache_stats.hits - hits >= 4 * 56  # every prompt hit on run 2


def test_gemma4_groups_allocate_each_layer_at_its_own_head_dim(tiny_model_factory):
    """Gemma 4's local layers (head_dim 16, a window) and global ones (head_dim 32): two
    groups of different page layouts, each layer's cache viewed at its own head_dim over
    buffers of the larger page; HF's tokens (the parity suite runs the rest)."""
    from conftest import runner_of
    tm = tiny_model_factory("gemma4")
    llm = make_llm(tm.path, block_size=4)
    config = llm.llm_engine.engine_core.kv_cache_config
    specs = {g.spec.head_size: g for g in config.groups}
    assert set(specs) == {16, 32}
    assert specs[16].sliding_window == 12 and specs[32].sliding_window is None
    assert specs[32].layer_names == ["layers.1.attn", "layers.3.attn"]
    assert config.attention_group_id == config.groups.index(specs[32])
    assert config.bytes_per_block() == 2 * specs[32].spec.page_size_bytes
    caches = runner_of(llm).kv_caches
    assert caches["layers.0.attn"].shape[-1] == 16 and caches["layers.1.attn"].shape[-1] == 32
    prompt = tm.prompts[4]  # 70 tokens: past the window
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tm.reference(prompt)


def test_eagle3_draft_beside_a_sliding_target(tiny_model_factory, tmp_path):
    """An EAGLE-3 drafter's full-attention layer has a spec no layer of an all-sliding
    target has: its own KV group (is_draft), whose block table its K/V steps use. The
    output is the target's alone."""
    import json
    import os

    from conftest import runner_of
    from tokenmill.spec_decode.random_drafters import build_eagle3_checkpoint
    tm = tiny_model_factory("mistral_swa")
    draft = str(tmp_path / "eagle3")
    os.makedirs(draft)
    build_eagle3_checkpoint(draft, json.load(open(os.path.join(tm.path, "config.json"))))
    prompts = [tm.prompts[4], tm.prompts[2], tm.prompts[0]]
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": draft}
    llm = make_llm(tm.path, speculative_config=spec, block_size=4,
                   max_num_batched_tokens=32)
    config = llm.llm_engine.engine_core.kv_cache_config
    runner = runner_of(llm)
    assert runner.draft_group_id != runner.attn_group_id
    assert config.groups[runner.draft_group_id].is_draft
    assert config.groups[runner.attn_group_id].sliding_window == 12
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tm.reference(p) for p in prompts]
    assert scheduler_of(llm).spec_stats.num_draft_tokens > 0
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0
