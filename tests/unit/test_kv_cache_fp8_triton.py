"""The Triton paged-attention kernels over an FP8 (float8_e4m3fn) KV cache, under
Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 before triton imports): the
write stores the codes torch's saturating cast gives (nearest even, +-448 past the
range, subnormals), decode (single pass and split-K) and prefill read the codes
back widened, against a dense fp32 reference over the same cache; with a checkpoint's
per-layer k_scale / v_scale, the codes of x / scale and reads of codes x scale."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
ta = pytest.importorskip("tokenmill.ops.triton_attention")

FP8 = torch.float8_e4m3fn


def _values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 10, (n,), generator=g))
    specials = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 480.0, 1e6, -1e30,
                             float("inf"), float("-inf"), 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
                             1.0625, 1.1875, 240.0, 232.0, 2.0 ** -6, 15 * 2.0 ** -10])
    x[:len(specials)] = specials
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_stores_saturated_e4m3_codes_and_skips_pad_slots(dtype):
    bs, hkv, d, t = 4, 2, 24, 6  # 24: a 32 block, its tail masked
    k = _values(t * hkv * d, seed=1).view(t, hkv, d)
    v = _values(t * hkv * d, seed=2).view(t, hkv, d)
    if dtype == torch.float16:
        k, v = k.clamp(-6e4, 6e4), v.clamp(-6e4, 6e4)
    k, v = k.to(dtype), v.to(dtype)
    cache = torch.zeros(6, 2, bs, hkv, d, dtype=FP8)
    slots = torch.tensor([9, 10, -1, 21, 4, 5], dtype=torch.int64)
    ta.write_kv(k, v, cache, slots)
    expect = torch.zeros_like(cache)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[s // bs, 0, s % bs] = k[i].float().clamp(-448, 448).to(FP8)
            expect[s // bs, 1, s % bs] = v[i].float().clamp(-448, 448).to(FP8)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))


def _fp8_cache(nb, bs, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nb, 2, bs, hkv, d, generator=g) * 2
    x[..., 0] *= 100  # an outlier channel, some of it saturated
    return x.clamp(-448, 448).to(FP8)


def _table(lens, bs, nb, seed=1):
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(lens), max(-(-n // bs) for n in lens) + 1, dtype=torch.int32)
    for r, n in enumerate(lens):
        for j in range(-(-n // bs)):
            table[r, j] = perm.pop()
    return table


def _ref(q, cache, table_row, qpos, scale, window=0, softcap=0.0, k_scale=1.0, v_scale=1.0):
    """fp32 attention of q [M, Hq, D] at qpos over the widened cache (codes x scale)."""
    bs, hkv = cache.shape[2], cache.shape[3]
    n = int(qpos.max()) + 1
    pos = torch.arange(n)
    blocks = table_row[pos // bs].long()
    k = cache[blocks, 0, pos % bs].float().repeat_interleave(q.shape[1] // hkv, 1) * k_scale
    v = cache[blocks, 1, pos % bs].float().repeat_interleave(q.shape[1] // hkv, 1) * v_scale
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    visible = pos[None, :] <= qpos[:, None]
    if window:
        visible &= pos[None, :] > qpos[:, None] - window
    return torch.einsum("hmn,nhd->mhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("hq,hkv,d,window,softcap,splits", [
    (4, 2, 16, 0, 0.0, 1), (6, 2, 80, 5, 0.0, 1), (4, 1, 8, 0, 0.0, 1),
    (4, 2, 16, 0, 2.0, 1), (4, 2, 32, 0, 0.0, 2),
])
def test_paged_decode_over_fp8_cache(hq, hkv, d, window, softcap, splits):
    bs, nb = 4, 24
    cache = _fp8_cache(nb, bs, hkv, d)
    lens = [1, 7, 13, 0]
    table = _table(lens, bs, nb)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(5)) * 0.05
    scale = d ** -0.5
    out = ta.paged_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), scale,
                          window, num_splits=splits, softcap=softcap)
    for r, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        ref = _ref(q[r:r + 1], cache, table[r], torch.tensor([n - 1]), scale, window, softcap)
        torch.testing.assert_close(out[r], ref[0], atol=2e-5, rtol=1e-5)


def test_paged_decode_half_queries_over_fp8_cache():
    bs, hkv, d, hq = 8, 2, 32, 4
    cache = _fp8_cache(12, bs, hkv, d, seed=3)
    lens = [5, 19]
    table = _table(lens, bs, 12)
    q = (torch.randn(2, hq, d, generator=torch.Generator().manual_seed(1)) * 0.05).half()
    out = ta.paged_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    assert out.dtype == torch.float16
    for r, n in enumerate(lens):
        ref = _ref(q[r:r + 1], cache, table[r], torch.tensor([n - 1]), d ** -0.5)
        torch.testing.assert_close(out[r].float(), ref[0], atol=1e-2, rtol=5e-3)


@pytest.mark.parametrize("d,window", [(16, 0), (80, 7)])
def test_paged_prefill_over_fp8_cache(d, window):
    bs, nb, hq, hkv = 4, 40, 4, 2
    cache = _fp8_cache(nb, bs, hkv, d, seed=2)
    q_lens, ctx = [5, 3, 20], [0, 9, 3]
    lens = [a + b for a, b in zip(q_lens, ctx)]
    table = _table(lens, bs, nb)
    qsl = torch.tensor([0, 5, 8, 28], dtype=torch.int64)
    q = torch.randn(28, hq, d, generator=torch.Generator().manual_seed(4)) * 0.05
    out = ta.paged_prefill(q, cache, table, qsl, torch.tensor(lens, dtype=torch.int32),
                           max(q_lens), d ** -0.5, window)
    for r in range(3):
        s, e = int(qsl[r]), int(qsl[r + 1])
        ref = _ref(q[s:e], cache, table[r], torch.arange(ctx[r], lens[r]), d ** -0.5, window)
        torch.testing.assert_close(out[s:e], ref, atol=2e-5, rtol=1e-5)


# ---- per-layer KV scales (a checkpoint's k_scale / v_scale) ----------------------------
K_SCALE, V_SCALE = 4.0, 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k_scale,v_scale", [(K_SCALE, V_SCALE), (0.3712, 2.71875)])
def test_write_kv_with_scales_stores_the_reference_codes(dtype, k_scale, v_scale):
    from tokenmill.attention.backend import to_cache_dtype
    bs, hkv, d, t = 4, 2, 24, 6
    k = (_values(t * hkv * d, seed=3).view(t, hkv, d) * k_scale).clamp(-6e4, 6e4).to(dtype)
    v = (_values(t * hkv * d, seed=4).view(t, hkv, d) * v_scale).clamp(-6e4, 6e4).to(dtype)
    cache = torch.zeros(6, 2, bs, hkv, d, dtype=FP8)
    slots = torch.tensor([9, 10, -1, 21, 4, 5], dtype=torch.int64)
    ta.write_kv(k, v, cache, slots, k_scale, v_scale)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for kv, src, sc in ((0, k, k_scale), (1, v, v_scale)):
            want = (src[i].float() / torch.tensor(sc)).clamp(-448, 448).to(FP8)
            got = cache[s // bs, kv, s % bs]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(got.view(torch.uint8),
                               to_cache_dtype(src[i], cache, sc).view(torch.uint8))


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_decode_with_scales(splits):
    bs, nb, hq, hkv, d = 4, 24, 4, 2, 32
    cache = _fp8_cache(nb, bs, hkv, d, seed=7)
    lens = [1, 7, 13, 0]
    table = _table(lens, bs, nb)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(5)) * 0.01
    seq = torch.tensor(lens, dtype=torch.int32)
    out = ta.paged_decode(q, cache, table, seq, d ** -0.5, num_splits=splits,
                          k_scale=K_SCALE, v_scale=V_SCALE)
    unscaled = ta.paged_decode(q, cache, table, seq, d ** -0.5, num_splits=splits)
    for r, n in enumerate(lens[:3]):
        ref = _ref(q[r:r + 1], cache, table[r], torch.tensor([n - 1]), d ** -0.5,
                   k_scale=K_SCALE, v_scale=V_SCALE)
        torch.testing.assert_close(out[r], ref[0], atol=2e-6, rtol=1e-5)
        assert not torch.allclose(unscaled[r], ref[0], atol=1e-3)


def test_paged_prefill_with_scales():
    bs, nb, hq, hkv, d = 4, 40, 4, 2, 16
    cache = _fp8_cache(nb, bs, hkv, d, seed=2)
    q_lens, ctx = [5, 3, 20], [0, 9, 3]
    lens = [a + b for a, b in zip(q_lens, ctx)]
    table = _table(lens, bs, nb)
    qsl = torch.tensor([0, 5, 8, 28], dtype=torch.int64)
    q = torch.randn(28, hq, d, generator=torch.Generator().manual_seed(4)) * 0.01
    out = ta.paged_prefill(q, cache, table, qsl, torch.tensor(lens, dtype=torch.int32),
                           max(q_lens), d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    for r in range(3):
        s, e = int(qsl[r]), int(qsl[r + 1])
        ref = _ref(q[s:e], cache, table[r], torch.arange(ctx[r], lens[r]), d ** -0.5,
                   k_scale=K_SCALE, v_scale=V_SCALE)
        torch.testing.assert_close(out[s:e], ref, atol=2e-6, rtol=1e-5)


def test_scales_refused_on_other_caches_and_when_not_finite_positive():
    cache = torch.zeros(3, 2, 4, 1, 8)
    k = torch.ones(1, 1, 8)
    with pytest.raises(ValueError, match="float8_e4m3fn cache only"):
        ta.write_kv(k, k, cache, torch.tensor([1]), 2.0, 1.0)
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="v_scale must be a finite positive"):
            ta.paged_decode(k, cache.to(FP8), torch.ones(1, 1, dtype=torch.int32),
                            torch.tensor([1], dtype=torch.int32), 1.0, v_scale=bad)
