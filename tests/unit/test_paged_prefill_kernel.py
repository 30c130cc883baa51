"""The native flash-style prefill kernel (kernels/cpu_paged_prefill.cpp) at every
capability level this CPU runs, against a float64 PyTorch reference written out here
(gather through the block table, explicit causal / window mask, tanh cap, softmax):
head sizes (64, 128, 256 and odd ones), GQA ratios, sliding windows, soft-caps, block
sizes, ragged batches with cached prefixes (block multiples or not) and single-token
chunks; bf16 / fp16 activations and an fp8 cache. Slots the kernel must not read (past
a chunk's end, blocks before a window) hold NaN. Then the backend: builder fields, the
hand-made-metadata fallback, and a mixed decode + prefill step against the reference."""
import numpy as np
import pytest
import torch

from tokenmill.attention.builder import AttentionMetadataBuilder, PromptBatchBuilder
from tokenmill.attention.cpu_native import CpuNativeAttentionBackend, prompt_batch
from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk
from tokenmill.attention.torch_ref import TorchAttentionBackend
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.attention import PagedAttention

# (cached prefix, queries) per chunk: a fresh prompt longer than a query tile, a
# single-token chunk after a prefix that is no block multiple, prefixes on and off
# block boundaries.
CHUNKS = [(0, 130), (21, 1), (16, 50), (5, 37), (0, 1)]


def _make(chunks, hq, hkv, d, bs, dtype=torch.float32, cache_dtype=None, seed=0,
          window=None):
    """q [T, Hq, D], a cache with each chunk's blocks scattered, its block table; the
    slots past each chunk's end and (with a window) the blocks no query can see are NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in chunks]
    num_blocks = sum(need) + 2
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(chunks), max(need) + 1, dtype=torch.int32)  # one spare column
    used = 0
    for r, nb in enumerate(need):
        table[r, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    cache_dtype = cache_dtype or dtype
    if cache_dtype == torch.float8_e4m3fn:
        cache = cache.to(cache_dtype)
        nan = torch.tensor(0x7F, dtype=torch.uint8).view(cache_dtype)
    else:
        cache = cache.to(cache_dtype)
        nan = torch.tensor(float("nan"), dtype=cache_dtype)
    for r, (c, n) in enumerate(chunks):
        end = c + n
        last = table[r, (end - 1) // bs].item()
        cache[last, :, end - (end - 1) // bs * bs:] = nan
        if window:  # blocks wholly before the first query's window: never read
            for b in range(max(0, c - window + 1) // bs):
                cache[table[r, b].item()] = nan
    qsl = torch.tensor(np.cumsum([0] + [n for _, n in chunks]), dtype=torch.int64)
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32)
    q = (torch.randn(int(qsl[-1]), hq, d, generator=g) * 2).to(dtype)
    return q, cache, table, qsl, seq_lens


def _reference(q, cache, table, qsl, seq_lens, scale, window=None, softcap=None):
    """float64 attention of each chunk's queries over its cached K/V, written out."""
    hq, d = q.shape[1], q.shape[2]
    hkv, bs = cache.shape[3], cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(len(seq_lens)):
        n_kv = int(seq_lens[r])
        s, e = int(qsl[r]), int(qsl[r + 1])
        nb = -(-n_kv // bs)
        blocks = cache[table[r, :nb].long()].to(torch.float64)  # [nb, 2, bs, Hkv, D]
        k = blocks[:, 0].reshape(-1, hkv, d)[:n_kv]
        v = blocks[:, 1].reshape(-1, hkv, d)[:n_kv]
        qpos = torch.arange(n_kv - (e - s), n_kv)[:, None]
        kpos = torch.arange(n_kv)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        rep = hq // hkv
        kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, L, D]
        vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        qh = q[s:e].to(torch.float64).transpose(0, 1)  # [Hq, n, D]
        scores = qh @ kh.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        # Masked (NaN-poisoned) keys must not reach the sum: zero their values.
        probs = scores.softmax(-1)
        vh = torch.where(visible.any(0)[None, :, None], vh, torch.zeros_like(vh))
        out[s:e] = (probs @ vh).transpose(0, 1)
    return out


def _check(got, ref, rtol):
    """Every element within rtol of the output's scale (outputs near zero included)."""
    assert not torch.isnan(got).any()
    err = (got.to(torch.float64) - ref).abs()
    bound = rtol * (ref.abs() + ref.abs().max() * 0.1)
    assert (err <= bound).all(), f"max error {err.max().item():.3g} vs bound {rtol}"


@pytest.mark.parametrize("d", [64, 128, 256, 80, 20])
@pytest.mark.parametrize("hq,hkv", [(8, 4), (8, 1), (4, 4), (12, 2)])
def test_prefill_fp32_matches_float64_reference(ops, d, hq, hkv):
    q, cache, table, qsl, seq_lens = _make(CHUNKS, hq, hkv, d, bs=16, seed=d + hq)
    scale = d ** -0.5
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    _check(got, _reference(q, cache, table, qsl, seq_lens, scale), 1e-5)


@pytest.mark.parametrize("bs", [16, 5, 1, 128])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 5.0),
                                            (40, 30.0), (200, None)])
def test_prefill_windows_caps_block_sizes(ops, bs, window, softcap):
    chunks = CHUNKS + [(90, 70)]  # a long prefix the window cuts into
    q, cache, table, qsl, seq_lens = _make(chunks, 6, 2, 64, bs=bs, seed=bs, window=window)
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, 0.125, window or 0, softcap or 0.0)
    ref = _reference(q, cache, table, qsl, seq_lens, 0.125, window, softcap)
    _check(got, ref, 1e-5)
    if softcap:  # the cap moved the output: the comparison sees it
        plain = _reference(q, cache, table, qsl, seq_lens, 0.125, window)
        assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_half_precision(ops, dtype, tol, d):
    """bf16 / fp16 q and cache: fp32 inside, one rounding on the way out."""
    q, cache, table, qsl, seq_lens = _make(CHUNKS, 8, 2, d, bs=16, dtype=dtype, seed=3)
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, d ** -0.5, 9, 0.0)
    assert got.dtype == dtype
    _check(got, _reference(q, cache, table, qsl, seq_lens, d ** -0.5, 9), tol)


def _check_bf16_bound(got, q, cache, table, qsl, seq_lens, scale, window=None, softcap=None):
    """bf16 q and cache: the output within the bf16 path's bound of the float64 reference.
    Q.K^T sums exact products in fp32; the weights P are rounded to bf16 for P.V (at
    most 2^-8 relative each), so |o - ref| <= 2^-8 * sum_j p_j |v_j| (the weights'
    rounding) + 2^-8 |ref| (the output's rounding) + fp32 sums (1e-4 of the first)."""
    ref = _reference(q, cache, table, qsl, seq_lens, scale, window, softcap)
    abs_cache = cache.abs()  # sum_j p_j |v_j|: the same attention over |V|
    abs_cache[:, 0] = cache[:, 0]
    weighted = _reference(q, abs_cache, table, qsl, seq_lens, scale, window, softcap)
    assert not torch.isnan(got).any()
    err = (got.to(torch.float64) - ref).abs()
    bound = 2.0 ** -8 * (weighted * 1.0001 + ref.abs()) + 1e-4 * weighted + 1e-6
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the bf16 path's bound"
    return ref


@pytest.mark.parametrize("d", [64, 128, 256, 80, 21])
@pytest.mark.parametrize("hq,hkv", [(8, 4), (8, 1), (4, 4), (12, 2)])
def test_prefill_bf16_within_the_bf16_bound(ops, kernel_level, d, hq, hkv):
    """bf16 q over a bf16 cache: at a level with AVX512-BF16 both products on vdpbf16ps
    (an odd head size pads its last pair), elsewhere widened to fp32; the bound holds
    for both."""
    assert ops.has_bf16_dot == (kernel_level in ("avx512_bf16", "amx"))
    chunks = CHUNKS + [(90, 70)]
    q, cache, table, qsl, seq_lens = _make(chunks, hq, hkv, d, bs=16, dtype=torch.bfloat16,
                                           seed=d + 7 * hq)
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, d ** -0.5)
    assert got.dtype == torch.bfloat16
    _check_bf16_bound(got, q, cache, table, qsl, seq_lens, d ** -0.5)


@pytest.mark.parametrize("bs", [16, 5, 1, 128])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 5.0),
                                            (40, 30.0), (200, None)])
def test_prefill_bf16_windows_caps_block_sizes(ops, bs, window, softcap):
    chunks = CHUNKS + [(90, 70), (3, 64), (0, 65)]  # odd key counts in a tile
    q, cache, table, qsl, seq_lens = _make(chunks, 6, 2, 128, bs=bs, dtype=torch.bfloat16,
                                           seed=bs + 1, window=window)
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, 128 ** -0.5, window or 0,
                            softcap or 0.0)
    _check_bf16_bound(got, q, cache, table, qsl, seq_lens, 128 ** -0.5, window, softcap)


@pytest.mark.parametrize("window", [None, 300])
def test_prefill_bf16_long_prompts_take_the_largest_jobs(ops, window):
    """Prompts long enough for the AMX tiles' largest jobs (up to 960 query rows, more
    than one job's window start), key tiles packed 16 keys at a time: within the bound."""
    q, cache, table, qsl, seq_lens = _make([(0, 1100), (200, 600), (7, 45)], 8, 4, 128,
                                           bs=16, dtype=torch.bfloat16, seed=11,
                                           window=window)
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, 128 ** -0.5, window or 0, 0.0)
    _check_bf16_bound(got, q, cache, table, qsl, seq_lens, 128 ** -0.5, window)


def test_prefill_bf16_pairs_differ_from_the_widened_path(ops):
    """The avx512_bf16 level takes its own products (rounded weights): its output is not
    the widened level's bit for bit, yet both sit within the bound (above)."""
    if not ops.has_bf16_dot:
        pytest.skip(f"no vdpbf16ps path at the {ops.capability} level")
    from tokenmill import kernels
    if "avx512_vnni" not in kernels.runnable_levels():
        pytest.skip("this CPU has no avx512_vnni level to compare with")
    widened = kernels.cpu_ops("avx512_vnni")
    q, cache, table, qsl, seq_lens = _make(CHUNKS, 8, 2, 128, bs=16, dtype=torch.bfloat16)
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, 128 ** -0.5)
    base = widened.paged_prefill(q, cache, table, qsl, seq_lens, 128 ** -0.5)
    assert not torch.equal(got, base)
    # fp32 queries over an fp32 cache keep the exact fp32 path at every level.
    q32, cache32 = q.float(), cache.float()
    assert torch.equal(ops.paged_prefill(q32, cache32, table, qsl, seq_lens, 0.1),
                       widened.paged_prefill(q32, cache32, table, qsl, seq_lens, 0.1))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_prefill_over_fp8_cache(ops, dtype, tol):
    q, cache, table, qsl, seq_lens = _make(CHUNKS, 8, 4, 64, bs=16, dtype=dtype,
                                           cache_dtype=torch.float8_e4m3fn, seed=4, window=30)
    got = ops.paged_prefill(q, cache, table, qsl, seq_lens, 0.125, 30)
    _check(got, _reference(q, cache, table, qsl, seq_lens, 0.125, 30), tol)


def test_prefill_no_chunks_and_strided_q(ops):
    q, cache, table, qsl, seq_lens = _make([(3, 9)], 4, 2, 32, bs=4)
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])
    wide[..., :32] = q
    got = ops.paged_prefill(wide[..., :32], cache, table, qsl, seq_lens, 0.2)
    _check(got, _reference(q, cache, table, qsl, seq_lens, 0.2), 1e-5)
    empty = ops.paged_prefill(q[:0], cache, table[:0], qsl[:1], seq_lens[:0], 0.2)
    assert empty.shape == (0, 4, 32)


def test_prefill_refuses_bad_input_by_name(ops):
    q, cache, table, qsl, seq_lens = _make([(3, 9)], 4, 2, 32, bs=4)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.paged_prefill(q, cache.to(torch.bfloat16), table, qsl, seq_lens, 0.2)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        ops.paged_prefill(q, cache, table, qsl.int(), seq_lens, 0.2)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.paged_prefill(q, cache, table, qsl, seq_lens - 5, 0.2)
    with pytest.raises(RuntimeError, match="block_table"):
        ops.paged_prefill(q, cache, table[:, :2], qsl, seq_lens, 0.2)
    with pytest.raises(RuntimeError, match="head size"):
        ops.paged_prefill(q[..., :16].contiguous(), cache, table, qsl, seq_lens, 0.2)


# ---- the backend -----------------------------------------------------------------------
class _Table:
    """The block table the builders read (worker/block_table.py's fields)."""

    def __init__(self, block_table, block_size):
        self.block_table, self.block_size = block_table, block_size
        self.max_num_blocks_per_req = block_table.shape[1]


def _step(bs=4):
    """Two decode rows, a chunk after a 7-token prefix, a fresh 6-token prompt."""
    rows = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [6, 7, 8, 9, 0], [10, 11, 0, 0, 0]],
                    dtype=np.int32)
    computed = np.array([9, 5, 7, 0])
    num_sched = np.array([1, 1, 5, 6])
    seq_lens = computed + num_sched
    qsl = np.concatenate([[0], np.cumsum(num_sched)])
    req = np.repeat(np.arange(4), num_sched)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, num_sched)])
    args = (_Table(rows, bs), None, req, positions, seq_lens, computed, num_sched, qsl, 2, 4)
    return args


def test_prompt_batch_from_the_builder_or_from_the_chunks():
    args = _step()
    built = PromptBatchBuilder(torch.device("cpu")).step(*args)
    plain = AttentionMetadataBuilder(torch.device("cpu")).step(*args)
    assert plain.prefill_query_start_loc is None
    got, want = prompt_batch(plain), prompt_batch(built)
    assert got[0].tolist() == want[0].tolist() == [0, 5, 11]
    assert got[1].tolist() == want[1].tolist() == [12, 6]
    assert got[2].dtype == want[2].dtype == torch.int32
    for r, n in enumerate([3, 2]):  # the blocks each chunk needs
        assert got[2][r, :n].tolist() == want[2][r, :n].tolist()


@pytest.mark.parametrize("window,softcap", [(None, None), (3, 4.0)])
def test_mixed_step_matches_the_reference(ops, window, softcap):
    """Decode rows and prompt chunks in one step through the native backend (decode
    kernel + prefill kernel) and the PyTorch reference (gather + SDPA)."""
    args = _step()
    hq, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(12, 2, 4, hkv, d, generator=g)
    q = torch.randn(13, hq, d, generator=g) * 3
    k, v = torch.randn(13, hkv, d, generator=g), torch.randn(13, hkv, d, generator=g)
    layer = PagedAttention(hq, hkv, d, d ** -0.5, sliding_window=window, logit_softcap=softcap)
    outs = []
    for backend in (TorchAttentionBackend(), CpuNativeAttentionBackend(ops)):
        meta = backend.make_builder(torch.device("cpu")).step(*(args[:1] + (window,) + args[2:]))
        c = cache.clone()
        impl = backend.make_impl(layer)
        impl.write_kv(k, v, c, meta)
        outs.append(impl.forward(q, k, v, c, meta))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_hand_made_metadata_takes_the_kernel(ops):
    """Metadata without the builder's flat fields (a PrefillChunk list only) still runs
    the kernel, and agrees with it."""
    hq, hkv, d, bs = 4, 2, 16, 4
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(8, 2, bs, hkv, d, generator=g)
    q = torch.randn(7, hq, d, generator=g)
    meta = AttentionMetadata(num_decodes=0, slot_block=None, slot_offset=None, prefills=[
        PrefillChunk(0, 3, 5, torch.tensor([3, 1])), PrefillChunk(3, 7, 0, torch.tensor([6]))])
    impl = CpuNativeAttentionBackend(ops).make_impl(PagedAttention(hq, hkv, d, 0.25))
    got = impl.forward(q, None, None, cache, meta)
    qsl, lens, table = prompt_batch(meta)
    ref = _reference(q, cache, table, qsl, lens, 0.25)
    _check(got, ref, 1e-5)
