"""Per-layer FP8 KV cache scales (a checkpoint's k_scale / v_scale) in the attention
kernels: an fp8 cache stores K / k_scale and V / v_scale, reads multiply them back.

- Writes: the native kv_cache_write (every level) and the PyTorch reference store the
  codes torch's cast gives for x.float() / scale (saturated), bit for bit; scale 1.0
  stores what it stored before scales existed.
- Decode: the native paged_decode and the PyTorch reference against a dense fp32
  attention over codes x scale (an independent reference), with scales that make the
  unscaled reading visibly wrong (0.05, 4.0), k and v each on its own, a window.
- Prefill over a cached prefix (the reference's gather path) likewise.
- Refusals: scales on a cache that is not fp8, scales that are not finite positive.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.backend import FP8_MAX, as_cached, from_cache, to_cache_dtype
from tokenmill.attention.cpu_native import CpuNativeAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk
from tokenmill.attention.torch_ref import TorchAttentionBackend
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.attention import PagedAttention

FP8 = torch.float8_e4m3fn
SCALES = [(0.05, 4.0), (4.0, 0.05), (4.0, 1.0), (1.0, 0.05), (0.3712, 2.71875)]


def _codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The independent spelling of a scaled e4m3 write: fp32 division, saturation."""
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(
        -FP8_MAX, FP8_MAX).to(FP8)


def _layer(hq, hkv, d, scale, k_scale=1.0, v_scale=1.0, window=None):
    layer = PagedAttention(hq, hkv, d, scale, sliding_window=window)
    layer.k_scale, layer.v_scale = k_scale, v_scale
    return layer


def _kv(t, hkv, d, dtype, k_scale, v_scale, seed=0):
    """K / V whose magnitudes fit e4m3 only after their scale: K of a few hundred times
    k_scale's share, V as small as v_scale makes room for."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, hkv, d, generator=g) * 60 * k_scale
    v = torch.randn(t, hkv, d, generator=g) * 3 * v_scale
    return k.to(dtype), v.to(dtype)


# ---- writes ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_native_and_reference_writes_store_scaled_codes(ops, dtype, k_scale, v_scale):
    bs, hkv, d, t = 4, 2, 24, 9
    k, v = _kv(t, hkv, d, dtype, k_scale, v_scale)
    k[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0]).to(dtype)  # saturating after the scale
    blocks = torch.tensor([1, 1, 2, 4, 3, 2, 1, 4, 3])
    offsets = torch.tensor([0, 3, 1, 2, 0, 3, 1, 0, 3])
    native = torch.zeros(5, 2, bs, hkv, d, dtype=FP8)
    ops.kv_cache_write(native, k, v, blocks, offsets, k_scale, v_scale)
    ref = torch.zeros_like(native)
    meta = AttentionMetadata(num_decodes=0, slot_block=blocks, slot_offset=offsets)
    TorchAttentionBackend().make_impl(_layer(hkv, hkv, d, 1.0, k_scale, v_scale)).write_kv(
        k, v, ref, meta)
    for kv, src, s in ((0, k, k_scale), (1, v, v_scale)):
        want = _codes(src, s).view(torch.uint8)
        assert torch.equal(native[blocks, kv, offsets].view(torch.uint8), want)
        assert torch.equal(ref[blocks, kv, offsets].view(torch.uint8), want)


def test_unit_scale_writes_what_the_unscaled_write_stores(ops):
    k, v = _kv(7, 2, 16, torch.bfloat16, 1.0, 1.0)
    cache = torch.zeros(3, 2, 4, 2, 16, dtype=FP8)
    blocks, offsets = torch.tensor([1, 1, 1, 1, 2, 2, 2]), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    ops.kv_cache_write(cache, k, v, blocks, offsets)
    again = torch.zeros_like(cache)
    ops.kv_cache_write(again, k, v, blocks, offsets, 1.0, 1.0)
    assert torch.equal(cache.view(torch.uint8), again.view(torch.uint8))
    assert torch.equal(to_cache_dtype(k, cache, 1.0).view(torch.uint8),
                       k.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8))


def test_from_cache_and_as_cached_apply_the_scale():
    x = torch.tensor([0.001, 0.02, 3.0, 900.0, -2000.0])
    cache = torch.zeros(1, dtype=FP8)
    stored = to_cache_dtype(x, cache, 4.0)
    assert torch.equal(stored.view(torch.uint8), _codes(x, 4.0).view(torch.uint8))
    assert torch.equal(from_cache(stored, torch.float32, 4.0), stored.float() * 4.0)
    assert torch.equal(as_cached(x, cache, 4.0), stored.float() * 4.0)
    # 900 fits only with the scale; 2000 / 4 = 500 saturates at 448 * 4
    assert as_cached(x, cache, 4.0)[3] == 896.0 and as_cached(x, cache, 4.0)[4] == -1792.0
    assert as_cached(x, cache)[3] == 448.0


# ---- decode ----------------------------------------------------------------------------
def _scaled_setup(dtype, seq_lens, k_scale, v_scale, block_size=16, hkv=2, hq=6, d=64,
                  num_blocks=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g) * 40 * k_scale
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g) * 2 * v_scale
    cache = torch.stack([_codes(k, k_scale), _codes(v, v_scale)], dim=1)
    need = [-(-n // block_size) for n in seq_lens]
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(need):
        table[r, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    # queries small enough that scores of K ~ 40 k_scale stay a few units
    q = (torch.randn(len(seq_lens), hq, d, generator=g) * 0.02 / k_scale).to(dtype)
    return cache, table, q


def _dense(cache, table, q, seq_lens, scale, k_scale, v_scale, window=None):
    """fp32 attention over codes x scale, row by row."""
    out = []
    for r, n in enumerate(seq_lens):
        blocks = cache[table[r].long()].float()
        k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:n].transpose(0, 1) * k_scale
        v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:n].transpose(0, 1) * v_scale
        if window:
            k, v = k[:, max(0, n - window):], v[:, max(0, n - window):]
        o = F.scaled_dot_product_attention(q[r].float()[:, None], k, v, scale=scale,
                                           enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


def _decode(layer, cache, table, q, seq_lens, native):
    meta = AttentionMetadata(num_decodes=len(seq_lens), slot_block=None, slot_offset=None,
                             decode_block_table=table,
                             decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    backend = TorchAttentionBackend() if native is None else CpuNativeAttentionBackend(native)
    return backend.make_impl(layer).decode(q, cache, meta)


def _rel(got, want):
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("d,hq,hkv,window", [(64, 8, 2, None), (80, 6, 2, 9)])
@pytest.mark.parametrize("k_scale,v_scale", SCALES[:4])
def test_decode_over_scaled_fp8_cache_matches_dense(ops, dtype, tol, d, hq, hkv, k_scale,
                                                    v_scale, window):
    """Both backends against the dense reference (relative to the output's size, as V
    spans a factor 80 across the scales), and the same call without the scales far off:
    the test fails if either scale is dropped."""
    seq_lens = [1, 15, 17, 40, 33, 2, 64]
    cache, table, q = _scaled_setup(dtype, seq_lens, k_scale, v_scale, hkv=hkv, hq=hq, d=d,
                                    seed=d + int(k_scale * 10))
    scale = d ** -0.5
    want = _dense(cache, table, q, seq_lens, scale, k_scale, v_scale, window)
    layer = _layer(hq, hkv, d, scale, k_scale, v_scale, window)
    for native in (ops, None):
        got = _decode(layer, cache, table, q, seq_lens, native)
        assert got.dtype == dtype
        assert _rel(got, want) <= tol, ("native" if native else "reference", _rel(got, want))
    unscaled = _decode(_layer(hq, hkv, d, scale, window=window), cache, table, q, seq_lens, ops)
    assert _rel(unscaled, want) > 0.1


def test_reference_prefill_over_scaled_cached_prefix(ops):
    """A chunk of 5 queries over 23 cached tokens (the gather path) and a chunk with no
    context (its own K/V rounded through the scaled cache), against the dense attention
    over the same stored values."""
    hq, hkv, d, k_scale, v_scale = 4, 2, 32, 4.0, 0.05
    cache, table, _ = _scaled_setup(torch.float32, [28], k_scale, v_scale, block_size=8,
                                    hkv=hkv, hq=hq, d=d)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, hq, d, generator=g) * 0.005
    layer = _layer(hq, hkv, d, d ** -0.5, k_scale, v_scale)
    impl = TorchAttentionBackend().make_impl(layer)
    chunk = PrefillChunk(query_start=0, query_end=5, context_len=23,
                         block_table=table[0].long())
    unused = torch.zeros(5, hkv, d)  # (in the cache already: the gather reads them there)
    got = impl.prefill(q, unused, unused, cache, chunk)
    for i in range(5):
        want = _dense(cache, table, q[i:i + 1], [24 + i], d ** -0.5, k_scale, v_scale)
        torch.testing.assert_close(got[i:i + 1], want, atol=2e-5, rtol=2e-5)
    # no context: its own K / V as the scaled cache would give them back
    k = torch.randn(6, hkv, d, generator=g) * 100
    v = torch.randn(6, hkv, d, generator=g) * 0.01
    own = impl.prefill(q[:1].expand(6, hq, d).contiguous(), k, v, cache,
                       PrefillChunk(query_start=0, query_end=6, context_len=0,
                                    block_table=table[0].long()))
    kc, vc = _codes(k, k_scale).float() * k_scale, _codes(v, v_scale).float() * v_scale
    want = F.scaled_dot_product_attention(
        q[:1].expand(6, hq, d).transpose(0, 1)[None], kc.transpose(0, 1)[None],
        vc.transpose(0, 1)[None], is_causal=True, scale=d ** -0.5, enable_gqa=True)
    torch.testing.assert_close(own, want[0].transpose(0, 1), atol=2e-5, rtol=2e-5)


# ---- refusals --------------------------------------------------------------------------
def test_kernels_refuse_scales_on_other_caches_and_bad_scales(ops):
    cache = torch.zeros(3, 2, 4, 1, 8)
    k = torch.ones(1, 1, 8)
    b, o = torch.tensor([1]), torch.tensor([2])
    with pytest.raises(RuntimeError, match="float8_e4m3fn cache only"):
        ops.kv_cache_write(cache, k, k, b, o, 2.0, 1.0)
    table, lens = torch.ones(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="float8_e4m3fn cache only"):
        ops.paged_decode(k, cache, table, lens, 1.0, 0, 0.0, 1.0, 0.5)
    fp8 = cache.to(FP8)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(RuntimeError, match="finite and positive"):
            ops.kv_cache_write(fp8, k, k, b, o, bad, 1.0)
        with pytest.raises(RuntimeError, match="finite and positive"):
            ops.paged_decode(k, fp8, table, lens, 1.0, 0, 0.0, 1.0, bad)
