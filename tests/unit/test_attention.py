"""The paged attention backends' decode: the CPU native kernel (at every capability level
this CPU runs) vs the PyTorch reference vs a dense reference."""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.cpu_native import CpuNativeAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import TorchAttentionBackend
from tokenmill.kernels import cpu_ops
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.attention import PagedAttention


def _setup(dtype, seq_lens, block_size=4, hkv=2, hq=6, d=16, num_blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, 2, block_size, hkv, d, generator=g).to(dtype)
    need = [-(-n // block_size) for n in seq_lens]
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(need):
        table[r, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    return cache, table, q


def _dense(cache, table, q, seq_lens, scale):
    out = []
    for r, n in enumerate(seq_lens):
        blocks = cache[table[r].long()]  # [nb, 2, bs, Hkv, D]
        k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:n].float().transpose(0, 1)
        v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:n].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[r].float()[:, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


def _decode(layer, cache, table, q, seq_lens, native):
    """The decode rows through the CPU native backend's implementation of `layer`
    (`native`: the kernels module) or the PyTorch reference's (None)."""
    meta = AttentionMetadata(num_decodes=len(seq_lens), slot_block=None, slot_offset=None,
                             decode_block_table=table,
                             decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    backend = TorchAttentionBackend() if native is None else CpuNativeAttentionBackend(native)
    return backend.make_impl(layer).decode(q, cache, meta)


def test_native_kernels_build_where_a_compiler_exists(kernel_level):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        pytest.skip("native kernels turned off (TOKENMILL_NO_NATIVE=1)")
    ops = cpu_ops(kernel_level)
    assert ops is not None and ops.capability == kernel_level
    assert cpu_ops() is ops  # the engine's cpu_ops() runs the forced level


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_matches_dense_reference(dtype, tol):
    """The PyTorch path."""
    seq_lens = [1, 4, 5, 17, 30, 2]
    cache, table, q = _setup(dtype, seq_lens)
    layer = PagedAttention(6, 2, 16, 16 ** -0.5)
    got = _decode(layer, cache, table, q, seq_lens, None)
    ref = _dense(cache, table, q, seq_lens, 16 ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_decode_matches_dense_reference(ops, dtype, tol):
    seq_lens = [1, 4, 5, 17, 30, 2]
    cache, table, q = _setup(dtype, seq_lens)
    layer = PagedAttention(6, 2, 16, 16 ** -0.5)
    got = _decode(layer, cache, table, q, seq_lens, ops)
    ref = _dense(cache, table, q, seq_lens, 16 ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_decode_ignores_garbage_past_each_rows_length(ops):
    """Slots past seq_len (stale or NaN) must not leak into the result."""
    seq_lens = [3, 6]
    cache, table, q = _setup(torch.float32, seq_lens)
    layer = PagedAttention(6, 2, 16, 16 ** -0.5)
    ref = _dense(cache, table, q, seq_lens, 16 ** -0.5)
    poisoned = cache.clone()
    # Row 0 uses positions 0..2 of its first block; poison position 3 of that block.
    poisoned[table[0, 0].long(), :, 3] = 1e4
    for native in (None, ops):
        got = _decode(layer, poisoned, table, q, seq_lens, native)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_widened_gemm_matches_a_bf16_gemm(kernel_level):
    """fp32 GEMM over upcast bf16 weights == bf16 GEMM with fp32 accumulation, up to rounding."""
    from tokenmill.models.layers.linear import Linear, widen_gemms
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ref = (x.float() @ layer.weight.float().T + layer.bias.float())
    native = layer(x)
    assert widen_gemms(layer, torch.float32) == 1
    assert layer.weight.dtype == torch.float32
    wide = layer(x)
    assert wide.dtype == torch.bfloat16
    # Both round the same fp32-accumulated sum to bf16.
    torch.testing.assert_close(wide.float(), ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(wide.float(), native.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (8, 2), (6, 2), (14, 2), (8, 1)])
@pytest.mark.parametrize("num_rows", [2, 11])
@pytest.mark.parametrize("d", [64, 128])
def test_native_decode_fixed_head_dim_paths(ops, dtype, tol, hq, hkv, num_rows, d):
    """head_dim 64 and 128 have kernels with the head dimension in registers (query
    heads in groups of 4, 2 and 1: here 1, 2, 3, 4, 7 and 8 per kv head; one job per
    (row, head) for few rows, one per row for many; the next block prefetched). All
    must equal the dense reference, and slots past each row's length must not leak in."""
    seq_lens = [1, 15, 16, 17, 40, 33, 2, 64, 5, 31, 48][:num_rows]
    cache, table, q = _setup(dtype, seq_lens, block_size=16, hkv=hkv, hq=hq, d=d,
                             num_blocks=48, seed=num_rows)
    ref = _dense(cache, table, q, seq_lens, d ** -0.5)
    poisoned = cache.clone()
    poisoned[table[0, 0].long(), :, 1:] = 1e4  # row 0 has 1 token: the rest is garbage
    layer = PagedAttention(hq, hkv, d, d ** -0.5)
    got = _decode(layer, poisoned, table, q, seq_lens, ops)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [4, 20, 72, 96])
@pytest.mark.parametrize("num_rows", [2, 11])
def test_native_decode_any_head_dim(ops, dtype, tol, d, num_rows):
    """Other head dims take vector chunks and a scalar tail (20, 72: both at 8 and
    16 lanes; 4: a tail only from 8 lanes up), for both job kinds."""
    seq_lens = [3, 15, 16, 17, 40, 33, 2, 64, 5, 31, 48][:num_rows]
    cache, table, q = _setup(dtype, seq_lens, block_size=8, hkv=2, hq=6, d=d,
                             num_blocks=48, seed=d)
    ref = _dense(cache, table, q, seq_lens, d ** -0.5)
    poisoned = cache.clone()
    poisoned[table[0, 0].long(), :, 3:] = float("nan")  # row 0 has 3 tokens
    layer = PagedAttention(6, 2, d, d ** -0.5)
    got = _decode(layer, poisoned, table, q, seq_lens, ops)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [16, 64])
def test_native_decode_soft_capping_matches_pytorch_path(ops, dtype, tol, window, d):
    """Gemma's attention soft-capping in the native kernel (cap small enough that it
    moves every score), with and without a sliding window, vs the PyTorch path."""
    seq_lens = [1, 4, 5, 17, 30, 2]
    cache, table, q = _setup(dtype, seq_lens, d=d)
    q = q * 4  # large scores: the cap matters
    layer = PagedAttention(6, 2, d, d ** -0.5, sliding_window=window, logit_softcap=1.5)
    got = _decode(layer, cache, table, q, seq_lens, ops)
    ref = _decode(layer, cache, table, q, seq_lens, None)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    uncapped = PagedAttention(6, 2, d, d ** -0.5, sliding_window=window)
    plain = _decode(uncapped, cache, table, q, seq_lens, ops)
    assert (plain.float() - got.float()).abs().max() > 10 * tol  # the cap did something
