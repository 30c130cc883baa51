"""The FP8 KV cache (--kv-cache-dtype fp8, float8_e4m3fn) in the attention kernels: the
e4m3 -> fp32 widening of kernels/vec_fp8.h at every ISA (the C++ check per level, the
plain-array fallback, NEON under qemu; the extension's `widen_e4m3` at every level this
CPU runs) against torch's float8_e4m3fn conversion for all 254 non-NaN codes; the
writes (native kv_cache_write, the PyTorch reference) storing torch's saturated codes;
the paged decode kernel over an fp8 cache against a dense fp32 reference on the same
cache; the Triton kernels (under the interpreter) reading and writing the same codes."""
import os

import pytest
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.attention.backend import FP8_MAX, to_cache_dtype
from tokenmill.attention.cpu_native import CpuNativeAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import TorchAttentionBackend
from tokenmill.kernels.testing import (IS_X86, aarch64_tools, build_and_run, host_compiler,
                                       kernel_level, ops)  # noqa: F401 (fixtures)
from tokenmill.models.layers.attention import PagedAttention

FP8 = torch.float8_e4m3fn
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK_SRC = os.path.join(ROOT, "tests", "kernels", "fp8_check.cpp")
# Every code but 0x7f / 0xff (NaN).
CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


# ---- the widening ----------------------------------------------------------------------
@pytest.mark.parametrize("level", kernels.all_levels())
def test_vec_fp8_header_at_each_level(tmp_path, level):
    if level not in kernels.runnable_levels():
        pytest.skip(f"this CPU cannot run the {level} build")
    out = build_and_run(CHECK_SRC, tmp_path / "fp8_check", host_compiler(),
                        kernels.LEVELS[level].flags)
    lanes = {"avx2": 8, "avx512": 16, "avx512_vnni": 16, "avx512_bf16": 16,
             "amx": 16}.get(level, 4)
    assert f"W={lanes}: 0 failures" in out


def test_vec_fp8_header_generic_fallback(tmp_path):
    assert "W=4: 0 failures" in build_and_run(CHECK_SRC, tmp_path / "fp8_check",
                                              host_compiler(), ["-DTM_VEC_FORCE_GENERIC"])


@pytest.mark.skipif(not IS_X86, reason="the cross-compile checks run on x86-64 hosts")
def test_vec_fp8_header_on_aarch64_neon_under_qemu(tmp_path):
    gxx, qemu = aarch64_tools()
    assert "W=4: 0 failures" in build_and_run(CHECK_SRC, tmp_path / "fp8_check", gxx,
                                              ["-static"], runner=(qemu,))


@pytest.mark.parametrize("shift", [0, 3])
def test_widen_e4m3_every_code_matches_torch(ops, shift):
    """All non-NaN codes, through the vector path and (the odd lengths) the scalar
    tail, bit for bit as torch widens them (subnormals and -0 included)."""
    codes = torch.cat([CODES.roll(shift), CODES[:shift + 5]])
    got = ops.widen_e4m3(codes)
    want = codes.view(FP8).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_widen_e4m3_refuses_wrong_input(ops):
    with pytest.raises(RuntimeError, match="widen_e4m3"):
        ops.widen_e4m3(torch.zeros(4))


# ---- the writes ------------------------------------------------------------------------
def _values(n, seed=0):
    """Values over e4m3's whole range and past it: subnormals, ties, beyond +-448, inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 10, (n,), generator=g))
    specials = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 480.0, 1e6, -1e30,
                             float("inf"), float("-inf"), 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
                             1.0625, 1.1875, 240.0, 232.0])
    x[:len(specials)] = specials
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_kv_cache_write_stores_torchs_saturated_codes(ops, dtype):
    bs, hkv, d, t = 4, 2, 24, 9
    k = _values(t * hkv * d, seed=1).view(t, hkv, d)
    v = _values(t * hkv * d, seed=2).view(t, hkv, d)
    if dtype == torch.float16:  # fp16 has no room for 1e30: inf saturates as well
        k, v = k.clamp(-6e4, 6e4), v.clamp(-6e4, 6e4)
    k, v = k.to(dtype), v.to(dtype)
    cache = torch.zeros(5, 2, bs, hkv, d, dtype=FP8)
    blocks = torch.tensor([1, 1, 2, 4, 3, 2, 1, 4, 3])
    offsets = torch.tensor([0, 3, 1, 2, 0, 3, 1, 0, 3])
    ops.kv_cache_write(cache, k, v, blocks, offsets)
    for kv, src in ((0, k), (1, v)):
        got = cache[blocks, kv, offsets].view(torch.uint8)
        want = src.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        assert torch.equal(got, want)
        assert not torch.isnan(cache[blocks, kv, offsets].float()).any()


def test_reference_write_saturates_and_native_write_refuses_fp8_input(ops):
    cache = torch.zeros(3, 2, 4, 1, 8, dtype=FP8)
    k = torch.full((1, 1, 8), 1e4)
    meta = AttentionMetadata(num_decodes=0, slot_block=torch.tensor([1]),
                             slot_offset=torch.tensor([2]))
    TorchAttentionBackend().make_impl(PagedAttention(1, 1, 8, 1.0)).write_kv(k, -k, cache, meta)
    assert cache[1, 0, 2].float().eq(448).all() and cache[1, 1, 2].float().eq(-448).all()
    assert torch.equal(to_cache_dtype(k, cache).float(), torch.full((1, 1, 8), 448.0))
    with pytest.raises(RuntimeError, match="kv_cache_write"):
        ops.kv_cache_write(cache, k.to(FP8), k.to(FP8), torch.tensor([1]), torch.tensor([2]))


# ---- the paged decode ------------------------------------------------------------------
def _setup(dtype, seq_lens, block_size=16, hkv=2, hq=6, d=64, num_blocks=48, seed=0,
           outlier=200.0):
    g = torch.Generator().manual_seed(seed)
    # K/V as the fp8 cache holds them; one channel of outliers (some saturated at 448),
    # as real models' keys have.
    cache = (torch.randn(num_blocks, 2, block_size, hkv, d, generator=g) * 3)
    cache[..., 0] *= outlier
    cache = cache.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    need = [-(-n // block_size) for n in seq_lens]
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(need):
        table[r, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    q = (torch.randn(len(seq_lens), hq, d, generator=g) * 0.05).to(dtype)
    return cache, table, q


def _dense(cache, table, q, seq_lens, scale, window=None):
    """fp32 attention over the fp8 cache's values (widened by torch)."""
    out = []
    for r, n in enumerate(seq_lens):
        blocks = cache[table[r].long()].float()  # [nb, 2, bs, Hkv, D]
        k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:n].transpose(0, 1)
        v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:n].transpose(0, 1)
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


# fp32 queries: the kernel's fp32 sums over exactly widened values, in another order
# than the reference's (a score's rounding is eps x sum |q_i k_i|, ~2e-5 with the keys'
# outlier channel at 448: outputs move by that, relative); bf16 / fp16: the output's
# own rounding.
TOLS = [(torch.float32, 4e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]


@pytest.mark.parametrize("dtype,tol", TOLS)
@pytest.mark.parametrize("d,hq,hkv", [(64, 8, 2), (128, 4, 4), (80, 6, 2), (20, 8, 1),
                                       (256, 4, 2), (256, 16, 2), (128, 16, 2)])
@pytest.mark.parametrize("num_rows", [2, 11])
def test_native_decode_over_fp8_cache_matches_dense_reference(ops, dtype, tol, d, hq, hkv,
                                                              num_rows):
    """The fixed head dims (64, 128, 256: K/V rows widened into registers) and the
    any-dim loops (80, 20: vector chunks and the scalar tail); a block widened once into
    fp32 first where more than 4 query heads share a kv head or the head dim is not a
    fixed one (GQA 8 at 128 and 256; 80, 20); both job kinds; slots past a row's length
    never read (poisoned with the NaN code)."""
    seq_lens = [1, 15, 16, 17, 40, 33, 2, 64, 5, 31, 48][:num_rows]
    cache, table, q = _setup(dtype, seq_lens, hkv=hkv, hq=hq, d=d, seed=d + num_rows)
    ref = _dense(cache, table, q, seq_lens, d ** -0.5)
    poisoned = cache.clone()
    poisoned.view(torch.uint8)[table[0, 0].long(), :, 1:] = 0x7F  # row 0 has 1 token
    layer = PagedAttention(hq, hkv, d, d ** -0.5)
    got = _decode(layer, poisoned, table, q, seq_lens, ops)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype,tol", TOLS[:2])
def test_native_and_reference_decode_agree_on_fp8_cache(ops, dtype, tol, window):
    """The PyTorch reference (gathered blocks widened to the queries' dtype, its
    matmuls in that dtype) and the kernel over the same fp8 cache, with a sliding
    window (no outlier channel: bf16 scores of hundreds would round past the tolerance)."""
    seq_lens = [1, 4, 5, 17, 30, 2]
    cache, table, q = _setup(dtype, seq_lens, block_size=4, d=16, outlier=1.0)
    layer = PagedAttention(6, 2, 16, 0.25, sliding_window=window)
    got = _decode(layer, cache, table, q, seq_lens, ops)
    ref = _decode(layer, cache, table, q, seq_lens, None)
    dense = _dense(cache, table, q, seq_lens, 0.25, window)
    torch.testing.assert_close(got.float(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(ref.float(), dense, atol=tol, rtol=tol)


def test_native_decode_refuses_mixed_non_fp8_cache(ops):
    cache, table, q = _setup(torch.float32, [3], block_size=4, d=16)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.paged_decode(q, cache.float().to(torch.bfloat16), table,
                         torch.tensor([3], dtype=torch.int32), 0.25)
