"""Multi-head latent attention: the latent KV cache spec and its allocation, the
weight-absorbed decode against the naive (expanded) form, DeepSeek's routing
against transformers' routers, and config errors that name the field."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tokenmill.core.kv_cache_spec import (FullAttentionSpec, KVCacheConfig, MLAAttentionSpec,
                                          group_layer_specs)
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.attention import AttentionMetadata, PrefillChunk
from tokenmill.models.layers.mla import PagedMLAAttention
from tokenmill.models.layers.moe import grouped_topk
from tokenmill.worker.kv_cache import allocate_kv_caches

# ---- the spec and the allocation -----------------------------------------------------


def test_spec_page_is_the_latent_row_only():
    """DeepSeek-V3's widths: 512 + 64 per token, no V, one head."""
    spec = MLAAttentionSpec(16, kv_lora_rank=512, rope_dim=64, dtype="bfloat16")
    assert spec.head_size == 576 and spec.num_kv_heads == 1
    assert spec.page_size_bytes == 16 * 576 * 2
    # Half a one-head K+V page of the same width.
    assert 2 * spec.page_size_bytes == FullAttentionSpec(16, 1, 576, "bfloat16").page_size_bytes
    assert spec.cache_shape(7) == (7, 16, 576)
    padded = MLAAttentionSpec(16, 512, 64, "bfloat16", page_size_padded=20000)
    assert padded.page_size_bytes == 20000 and padded.real_page_size_bytes == 16 * 576 * 2


@pytest.mark.parametrize("field,value", [("kv_lora_rank", 0), ("rope_dim", -1),
                                         ("kv_lora_rank", 1.5)])
def test_spec_refuses_bad_widths(field, value):
    kw = dict(kv_lora_rank=32, rope_dim=16)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        MLAAttentionSpec(4, dtype="float32", **kw)


def test_mla_layers_form_one_full_attention_group_and_allocate_latent_bytes():
    bs, r, rope, layers, blocks = 8, 32, 16, 3, 5
    spec = MLAAttentionSpec(bs, r, rope, "float32")
    groups = group_layer_specs({f"layers.{i}.attn": spec for i in range(layers)})
    assert len(groups) == 1 and groups[0].is_attention and groups[0].sliding_window is None
    config = KVCacheConfig(num_blocks=blocks, groups=groups)
    assert config.attention_group_id == 0 and config.block_size == bs
    per_layer = bs * (r + rope) * 4
    assert config.buffer_page_sizes() == [per_layer] * layers
    assert config.bytes_per_block() == layers * per_layer
    caches = allocate_kv_caches(config, torch.device("cpu"))
    for i in range(layers):
        cache = caches[f"layers.{i}.attn"]
        assert cache.shape == (blocks, bs, r + rope) and cache.dtype == torch.float32
        assert cache.untyped_storage().nbytes() == blocks * per_layer


# ---- absorbed decode == naive decode ---------------------------------------------------

H, NOPE, ROPE, V, R = 4, 16, 8, 12, 32
BS = 4


def _layer(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    attn = PagedMLAAttention(H, NOPE, ROPE, V, R, scale=0.17)
    kv_b = nn.Linear(R, H * (NOPE + V), bias=False).to(dtype)
    with torch.no_grad():
        kv_b.weight.copy_(torch.randn(kv_b.weight.shape, generator=g) * 0.3)
    return attn, kv_b


def _filled_cache(seq_lens, dtype, seed=1):
    """A cache holding every row's latents in scattered blocks, and the rows' tables."""
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-n // BS) for n in seq_lens)
    num_blocks = 1 + nb * len(seq_lens)
    cache = torch.randn(num_blocks, BS, R + ROPE, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).view(len(seq_lens), nb)
    return cache, perm.to(torch.int32)


def _decode_meta(tables, seq_lens, native_ops=None):
    return AttentionMetadata(num_decodes=len(seq_lens), slot_block=torch.zeros(0, dtype=torch.long),
                             slot_offset=torch.zeros(0, dtype=torch.long),
                             decode_block_table=tables,
                             decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             native_ops=native_ops)


def _dense_reference(q, cache, tables, seq_lens, kv_b, scale):
    """Per row: K/V expanded per head from its latents, plain softmax attention (fp64)."""
    outs = []
    w = kv_b.weight.double().view(H, NOPE + V, R)
    for i, n in enumerate(seq_lens):
        lat = cache[tables[i].long()].reshape(-1, R + ROPE)[:n].double()
        c, k_pe = lat[:, :R], lat[:, R:]
        k_nope = torch.einsum("hdr,lr->hld", w[:, :NOPE], c)
        v = torch.einsum("hdr,lr->hld", w[:, NOPE:], c)
        k = torch.cat([k_nope, k_pe[None].expand(H, n, ROPE)], dim=-1)
        s = torch.einsum("hd,hld->hl", q[i].double(), k) * scale
        outs.append(torch.einsum("hl,hld->hd", s.softmax(-1), v))
    return torch.stack(outs)


SEQ_LENS = [1, 5, 13, 8, 20]


def _naive(attn, q, cache, tables, seq_lens, kv_b):
    """The engine's own naive form: each row as a one-query chunk over its context."""
    rows = []
    for i, n in enumerate(seq_lens):
        own = cache[tables[i].long()].reshape(-1, R + ROPE)[n - 1:n]  # its latent, written
        rows.append(attn._prefill(q[i:i + 1], own, cache,
                                  PrefillChunk(0, 1, n - 1, tables[i].long()), kv_b)[0])
    return torch.stack(rows)


def test_absorbed_decode_equals_naive_decode():
    attn, kv_b = _layer()
    cache, tables = _filled_cache(SEQ_LENS, torch.float32)
    q = torch.randn(len(SEQ_LENS), H, NOPE + ROPE, generator=torch.Generator().manual_seed(2))
    absorbed = attn._decode(q, cache, _decode_meta(tables, SEQ_LENS), kv_b)
    assert absorbed.shape == (len(SEQ_LENS), H, V)
    naive = _naive(attn, q, cache, tables, SEQ_LENS, kv_b)
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)
    ref = _dense_reference(q, cache, tables, SEQ_LENS, kv_b, attn.scale)
    torch.testing.assert_close(absorbed.double(), ref, atol=1e-5, rtol=1e-5)


def test_absorbed_decode_ignores_latents_past_each_rows_length():
    attn, kv_b = _layer()
    cache, tables = _filled_cache(SEQ_LENS, torch.float32)
    q = torch.randn(len(SEQ_LENS), H, NOPE + ROPE)
    meta = _decode_meta(tables, SEQ_LENS)
    before = attn._decode(q, cache, meta, kv_b)
    poisoned = cache.clone()
    for i, n in enumerate(SEQ_LENS):
        flat = poisoned[tables[i].long()].reshape(-1, R + ROPE)
        flat[n:] = 1e4  # the tail of each row's last block
        poisoned[tables[i].long()] = flat.view(-1, BS, R + ROPE)
    after = attn._decode(q, poisoned, _decode_meta(tables, SEQ_LENS), kv_b)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_native_kernel_as_mqa_equals_torch_path(ops, dtype, tol):
    """The native paged decode over the latent cache (one KV head of width R + ROPE,
    V the same rows) gives the PyTorch path's output."""
    attn, kv_b = _layer(dtype)
    cache, tables = _filled_cache(SEQ_LENS, dtype)
    q = torch.randn(len(SEQ_LENS), H, NOPE + ROPE).to(dtype)
    torch_out = attn._decode(q, cache, _decode_meta(tables, SEQ_LENS, ops), kv_b)
    calls = []
    orig = attn._as_mqa
    attn._as_mqa = lambda c: calls.append(1) or orig(c)
    attn.native_decode = True
    native = attn._decode(q, cache, _decode_meta(tables, SEQ_LENS, ops), kv_b)
    assert calls  # the kernel really ran
    torch.testing.assert_close(native.float(), torch_out.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:
        ref = _dense_reference(q, cache, tables, SEQ_LENS, kv_b, attn.scale)
        torch.testing.assert_close(native.double(), ref, atol=1e-5, rtol=1e-5)


def test_forward_writes_latents_and_mixes_decodes_with_a_chunk():
    """A step of 2 decode rows and a 3-token chunk with context: every new latent lands
    in its slot, and each row's output equals the naive form over the updated cache."""
    attn, kv_b = _layer()
    cache, tables = _filled_cache([6, 9, 7], torch.float32)
    attn.kv_cache = cache
    # Rows 0, 1 decode their 6th / 9th token; row 2 computes tokens 4..6 (context 4).
    lens = [6, 9]
    positions = [5, 8, 4, 5, 6]
    rows = [0, 1, 2, 2, 2]
    slot_block = torch.stack([tables[r, p // BS] for r, p in zip(rows, positions)]).long()
    slot_offset = torch.tensor([p % BS for p in positions])
    meta = AttentionMetadata(num_decodes=2, slot_block=slot_block, slot_offset=slot_offset,
                             decode_block_table=tables[:2], decode_seq_lens=torch.tensor(
                                 lens, dtype=torch.int32),
                             prefills=[PrefillChunk(2, 5, 4, tables[2].long())])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, H, NOPE + ROPE, generator=g)
    latent = torch.randn(5, R + ROPE, generator=g)
    out = attn(q, latent, kv_b, meta).view(5, H, V)
    for i in range(5):
        assert torch.equal(cache[slot_block[i], slot_offset[i]], latent[i])
    naive = _naive(attn, q[:2], cache, tables[:2], lens, kv_b)
    torch.testing.assert_close(out[:2], naive, atol=1e-5, rtol=1e-5)
    ref = torch.stack([_dense_reference(q[2 + j:3 + j], cache, tables[2:3], [5 + j], kv_b,
                                        attn.scale)[0] for j in range(3)])
    torch.testing.assert_close(out[2:].double(), ref, atol=1e-5, rtol=1e-5)


# ---- routing against transformers' routers ---------------------------------------------

def _hf_router(version: str, **kw):
    import transformers as tf
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, n_routed_experts=16, num_experts_per_tok=3,
                kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if version == "v2":
            from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
            router = DeepseekV2TopkRouter(tf.DeepseekV2Config(**base))
        else:
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
            router = DeepseekV3TopkRouter(tf.DeepseekV3Config(**base))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        if version == "v3":
            router.e_score_correction_bias.normal_(0, 0.2)
    return router


def _same_routing(hf_out, ours):
    _, hf_w, hf_ids = hf_out
    w, ids = ours
    hf_order, order = hf_ids.sort(-1), ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), hf_w.gather(1, hf_order.indices))


@pytest.mark.parametrize("method,kw", [("greedy", {}),
                                       ("group_limited_greedy", dict(n_group=4, topk_group=2))])
def test_v2_routing_matches_hf(method, kw):
    router = _hf_router("v2", topk_method=method, routed_scaling_factor=1.7, **kw)
    x = torch.randn(40, 16)
    logits = x @ router.weight.t()
    ours = grouped_topk(logits, 3, scoring="softmax", num_groups=kw.get("n_group", 1),
                        topk_groups=kw.get("topk_group", 1), scaling=1.7)
    _same_routing(router(x), ours)


@pytest.mark.parametrize("norm", [True, False])
def test_v3_routing_matches_hf(norm):
    router = _hf_router("v3", n_group=4, topk_group=2, norm_topk_prob=norm,
                        routed_scaling_factor=2.5)
    x = torch.randn(40, 16)
    logits = x @ router.weight.t()
    ours = grouped_topk(logits, 3, scoring="sigmoid", num_groups=4, topk_groups=2,
                        correction_bias=router.e_score_correction_bias, renormalize=norm,
                        scaling=2.5)
    _same_routing(router(x), ours)
    # The bias chose differently from the raw scores somewhere (it is really used).
    plain = grouped_topk(logits, 3, scoring="sigmoid", num_groups=4, topk_groups=2,
                         correction_bias=torch.zeros(16), renormalize=norm, scaling=2.5)
    assert not torch.equal(plain[1].sort(-1).values, ours[1].sort(-1).values)


# ---- config errors ----------------------------------------------------------------------

BASE_CFG = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, kv_lora_rank=8, qk_rope_head_dim=4,
                qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, first_k_dense_replace=1)


@pytest.mark.parametrize("v3,change,field", [
    (False, dict(topk_method="noaux_tc"), "topk_method"),
    (False, dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (True, dict(n_group=3), "n_group"),
    (True, dict(n_group=2, topk_group=3), "topk_group"),
    (True, dict(n_group=4), "n_group"),  # one expert per group: V3 scores the best two
    (False, dict(kv_lora_rank=0), "kv_lora_rank"),
    (False, dict(qk_rope_head_dim=5), "qk_rope_head_dim"),
])
def test_bad_config_names_the_field(v3, change, field):
    from tokenmill.models.deepseek_v2 import DeepseekConfig
    with pytest.raises(ValueError, match=field):
        DeepseekConfig({**BASE_CFG, **change}, v3=v3)


def test_tensor_parallel_splits_heads_and_refuses_what_does_not_divide():
    """MLA shards by heads (tests/test_tensor_parallel.py runs it); a head count the
    ranks do not divide is refused naming the field."""
    from tokenmill.models.tensor_parallel import check_divisible, rank_config
    cfg = {**BASE_CFG, "architectures": ["DeepseekV3ForCausalLM"]}
    check_divisible(cfg, 2)
    shard = rank_config(cfg, 2)
    assert shard["num_attention_heads"] == 1 and shard["kv_lora_rank"] == 8  # latent whole
    with pytest.raises(ValueError, match="tensor_parallel_size=4 .*num_attention_heads"):
        check_divisible(cfg, 4)