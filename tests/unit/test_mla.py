"""Multi-head latent attention: the latent KV cache spec and its allocation, the
weight-absorbed decode against the naive (expanded) form, DeepSeek's routing
against transformers' routers, and config errors that name the field."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk
from tokenmill.attention.mla import CpuNativeMLABackend, TorchMLABackend
from tokenmill.core.kv_cache_spec import (FullAttentionSpec, KVCacheConfig, MLAAttentionSpec,
                                          group_layer_specs)
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
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


def _layer(dtype=torch.float32, seed=0, ops=None):
    """The layer bound to the PyTorch MLA backend, or with `ops` to the native one."""
    g = torch.Generator().manual_seed(seed)
    attn = PagedMLAAttention(H, NOPE, ROPE, V, R, scale=0.17)
    backend = TorchMLABackend() if ops is None else CpuNativeMLABackend(ops)
    attn.impl = backend.make_impl(attn)
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


def _decode_meta(tables, seq_lens):
    return AttentionMetadata(num_decodes=len(seq_lens), slot_block=torch.zeros(0, dtype=torch.long),
                             slot_offset=torch.zeros(0, dtype=torch.long),
                             decode_block_table=tables,
                             decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


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


# ---- the native latent-space decode kernel (kernels/cpu_mla_decode.cpp) -----------------

def _latent_reference(qa, cache, tables, seq_lens, scale, r):
    """The absorbed form's attention in fp64: softmax(scale * qa . latent) @ latent[:, :r]
    per row over its first seq_len latents (a null row, seq_len 0: zeros)."""
    out = torch.zeros(qa.shape[0], qa.shape[1], r, dtype=torch.float64)
    for i, n in enumerate(seq_lens):
        if n == 0:
            continue
        lat = cache[tables[i].long()].reshape(-1, cache.shape[-1])[:n].double()
        p = (qa[i].double() @ lat.T * scale).softmax(-1)
        out[i] = p @ lat[:, :r]
    return out


def _kernel_case(seq_lens, heads, r, rope, bs, dtype, seed=0):
    """(qa, cache, tables): rows' latents in scattered blocks, the null block 0 left
    in every table past a row's blocks (as the engine's tables are)."""
    g = torch.Generator().manual_seed(seed)
    nb = max(1, max(-(-n // bs) for n in seq_lens))
    num_blocks = 1 + nb * len(seq_lens)
    cache = torch.randn(num_blocks, bs, r + rope, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).view(len(seq_lens), nb)
    for i, n in enumerate(seq_lens):
        perm[i, -(-n // bs):] = 0
    qa = torch.randn(len(seq_lens), heads, r + rope, generator=g).to(dtype)
    return qa, cache, perm.to(torch.int32)


# (atol, rtol) against the fp64 reference: bf16 rounds the inputs' products the same
# way (they are exact in fp32), so only the fp32 sums and the output rounding differ.
KERNEL_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,r,rope", [(4, 32, 8), (5, 36, 12), (16, 128, 32), (1, 512, 64)])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("span", [0, 7])
def test_mla_decode_kernel_matches_the_absorbed_form(ops, dtype, heads, r, rope, bs, span):
    """Rows of 1 token, lengths off the block size and off the kernel's 32-token tile,
    a null row (length 0) and heads off the 4-head micro-tile; span 7: every row longer
    than 7 tokens split-K over spans of 7 and merged."""
    lens = [1, 5, 0, 13, 40, 77, 33]
    qa, cache, tables = _kernel_case(lens, heads, r, rope, bs, dtype)
    scale = 0.11
    out = ops.mla_decode(qa, cache, tables, torch.tensor(lens, dtype=torch.int32), scale, r,
                         span_tokens=span)
    assert out.shape == (len(lens), heads, r) and out.dtype == dtype
    ref = _latent_reference(qa, cache, tables, lens, scale, r)
    atol, rtol = KERNEL_TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    assert torch.count_nonzero(out[2]) == 0  # the null row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_kernel_splits_long_rows_across_threads(ops, dtype):
    """The automatic split at 2 threads (a 700-token row becomes several spans) and
    at 1 thread (no split) agree with each other and with the reference."""
    lens = [700, 3, 260]
    qa, cache, tables = _kernel_case(lens, 4, 64, 16, 16, dtype, seed=3)
    seq = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = ops.mla_decode(qa, cache, tables, seq, 0.2, 64)
        torch.set_num_threads(1)
        one = ops.mla_decode(qa, cache, tables, seq, 0.2, 64)
    finally:
        torch.set_num_threads(threads)
    ref = _latent_reference(qa, cache, tables, lens, 0.2, 64)
    atol, rtol = KERNEL_TOL[dtype]
    torch.testing.assert_close(two.double(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(one.double(), ref, atol=atol, rtol=rtol)


def test_mla_decode_kernel_refuses_mismatched_inputs(ops):
    qa, cache, tables = _kernel_case([3], 2, 16, 8, 4, torch.float32)
    seq = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.mla_decode(qa, cache.bfloat16(), tables, seq, 1.0, 16)
    with pytest.raises(RuntimeError, match="kv_lora_rank"):
        ops.mla_decode(qa, cache, tables, seq, 1.0, 25)
    with pytest.raises(RuntimeError, match="D as q's"):
        ops.mla_decode(qa[..., :20].contiguous(), cache, tables, seq, 1.0, 16)


class _CountingOps:
    """A kernels module with only the MLA kernel, counting its calls."""

    def __init__(self, ops):
        self.ops, self.calls = ops, 0

    def mla_decode(self, *args, **kw):
        self.calls += 1
        return self.ops.mla_decode(*args, **kw)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_layer_decodes_through_the_kernel_like_the_torch_form(ops, dtype, tol):
    """PagedMLAAttention bound to the native MLA backend takes the kernel: same output as
    the PyTorch backend's batched matmuls, and (fp32) as the dense reference."""
    attn, kv_b = _layer(dtype)
    cache, tables = _filled_cache(SEQ_LENS, dtype)
    q = torch.randn(len(SEQ_LENS), H, NOPE + ROPE).to(dtype)
    torch_out = attn._decode(q, cache, _decode_meta(tables, SEQ_LENS), kv_b)
    counting = _CountingOps(ops)
    attn.impl = CpuNativeMLABackend(counting).make_impl(attn)
    native = attn._decode(q, cache, _decode_meta(tables, SEQ_LENS), kv_b)
    assert counting.calls == 1
    torch.testing.assert_close(native.float(), torch_out.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:
        ref = _dense_reference(q, cache, tables, SEQ_LENS, kv_b, attn.scale)
        torch.testing.assert_close(native.double(), ref, atol=1e-5, rtol=1e-5)
    attn.impl = TorchMLABackend().make_impl(attn)  # bound back to the batched matmuls
    attn._decode(q, cache, _decode_meta(tables, SEQ_LENS), kv_b)
    assert counting.calls == 1


def test_kernel_ignores_latents_past_each_rows_length(ops):
    attn, kv_b = _layer(ops=ops)
    cache, tables = _filled_cache(SEQ_LENS, torch.float32)
    q = torch.randn(len(SEQ_LENS), H, NOPE + ROPE)
    before = attn._decode(q, cache, _decode_meta(tables, SEQ_LENS), kv_b)
    poisoned = cache.clone()
    for i, n in enumerate(SEQ_LENS):
        flat = poisoned[tables[i].long()].reshape(-1, R + ROPE)
        flat[n:] = 1e4
        poisoned[tables[i].long()] = flat.view(-1, BS, R + ROPE)
    after = attn._decode(q, poisoned, _decode_meta(tables, SEQ_LENS), kv_b)
    assert torch.equal(after, before)


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