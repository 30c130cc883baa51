"""The native decode kernel (kernels/cpu_paged_attention.cpp) over bf16 queries and a
bf16 cache, at every capability level this CPU runs, against the float64 reference of
test_paged_prefill_kernel.py (a decode row is a one-query chunk after its context):
at avx512_bf16 both products on vdpbf16ps (head sizes that are a multiple of 32), the
widening path elsewhere, both within the bf16 path's stated bound. Head sizes, GQA
ratios (query heads in groups of 4, 2, 1), windows, soft-caps, block sizes, ragged
rows with odd token counts (the last pair's partner is a zero row), few rows (a job
per kv head) and many (a job per row); slots the kernel must not read hold NaN."""
import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from test_paged_prefill_kernel import _check_bf16_bound, _make

# Context lengths before each decode row's query: one token alone, odd and even counts,
# block multiples and not, a row longer than several 32-token chunks.
FEW = [(0, 1), (33, 1)]
MANY = [(c, 1) for c in (0, 1, 31, 32, 47, 100, 257, 5, 64, 15, 130)]


def _decode(module, q, cache, table, seq_lens, scale, window=None, softcap=None):
    return module.paged_decode(q, cache, table, seq_lens, scale, window or 0, softcap or 0.0)


@pytest.mark.parametrize("d", [64, 128, 256, 96, 80])
@pytest.mark.parametrize("hq,hkv", [(8, 4), (8, 1), (4, 4), (12, 2), (14, 2)])
@pytest.mark.parametrize("chunks", [FEW, MANY], ids=["few-rows", "many-rows"])
def test_decode_bf16_within_the_bf16_bound(ops, kernel_level, d, hq, hkv, chunks):
    assert ops.has_bf16_dot == (kernel_level in ("avx512_bf16", "amx"))
    q, cache, table, qsl, seq_lens = _make(chunks, hq, hkv, d, bs=16, dtype=torch.bfloat16,
                                           seed=d + 7 * hq + len(chunks))
    got = _decode(ops, q, cache, table, seq_lens, d ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    _check_bf16_bound(got, q, cache, table, qsl, seq_lens, d ** -0.5)


@pytest.mark.parametrize("bs", [16, 5, 1, 128])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 5.0),
                                            (40, 30.0), (200, None)])
def test_decode_bf16_windows_caps_block_sizes(ops, bs, window, softcap):
    q, cache, table, qsl, seq_lens = _make(MANY, 6, 2, 128, bs=bs, dtype=torch.bfloat16,
                                           seed=bs + 3, window=window)
    q = q * 2  # larger scores: the cap moves them
    got = _decode(ops, q, cache, table, seq_lens, 128 ** -0.5, window, softcap)
    ref = _check_bf16_bound(got, q, cache, table, qsl, seq_lens, 128 ** -0.5, window, softcap)
    if softcap:  # the cap moved the output: the comparison sees it
        from test_paged_prefill_kernel import _reference
        plain = _reference(q, cache, table, qsl, seq_lens, 128 ** -0.5, window)
        assert (plain - ref).abs().max() > 1e-2


def test_decode_bf16_pairs_differ_from_the_widened_path(ops):
    """The avx512_bf16 level takes its own products (rounded weights): its bf16 output is
    not the widened level's bit for bit; fp32 queries over an fp32 cache keep the exact
    fp32 path there (the same bits as the widened level)."""
    if not ops.has_bf16_dot:
        pytest.skip(f"no vdpbf16ps path at the {ops.capability} level")
    from tokenmill import kernels
    if "avx512_vnni" not in kernels.runnable_levels():
        pytest.skip("this CPU has no avx512_vnni level to compare with")
    widened = kernels.cpu_ops("avx512_vnni")
    q, cache, table, _, seq_lens = _make(MANY, 8, 2, 128, bs=16, dtype=torch.bfloat16)
    got = _decode(ops, q, cache, table, seq_lens, 128 ** -0.5)
    base = _decode(widened, q, cache, table, seq_lens, 128 ** -0.5)
    assert not torch.equal(got, base)
    q32, cache32 = q.float(), cache.float()
    assert torch.equal(_decode(ops, q32, cache32, table, seq_lens, 0.1),
                       _decode(widened, q32, cache32, table, seq_lens, 0.1))
