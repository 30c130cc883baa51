"""Quantized-weight GEMMs in Triton for the CUDA path: W4A16 / W8A16 (the canonical
integer form of GPTQ, AWQ, compressed-tensors and int8 made at load) and FP8 with
block scales (DeepSeek-V3 / Qwen -FP8).

Both read the weights in their stored width and dequantize a [BLOCK_K, BLOCK_N] tile
in registers before the tile's dot product, so a layer's bytes read per step are its
quantized bytes: what sets a decode step's speed. The dequantized value of each weight
is the one the PyTorch reference computes ((code - zero) * scale, or e4m3 * scale_inv,
in fp32), rounded to the activations' dtype before the dot (as a model holding the
dequantized weights in that dtype would); fp32 models' dots use IEEE fp32 (no TF32).

By row count: decode rows (up to 16) take 16-row tiles and, where the output's tiles
are too few for the SMs, a split over K (`pick_split_k`: fp32 partials summed by the
caller, deterministic); batches take 64-row tiles; from DEQUANT_MIN_ROWS rows (4-bit
codes: DEQUANT_MIN_ROWS_4BIT) W^T is dequantized once into a scratch buffer by a
Triton kernel and multiplied by torch's GEMM (the same rounded weights; cuBLAS's
tiles beat these kernels' at prefill sizes). Figures: docs/benchmarks.md, "On an
NVIDIA H200".

Device layouts, made once at load (`IntWeightTriton`, `Fp8WeightTriton`):
- integer codes K-major: 8-bit [K, N] uint8; 4-bit [ceil(K/2), N] uint8, the code of
  row k in byte k // 2's low nibble when k is even, its high nibble when odd;
  scales [G, N] fp32 and zeros [G, N] uint8 (group g = k // group_size);
- fp8: the checkpoint's e4m3 [N, K] read as bytes, and its scale_inv
  [ceil(N/bn), ceil(K/bk)]. e4m3 is decoded with integer ops (its bits moved into
  an fp16's, times 2^8, subnormals included), so the kernel needs no fp8 type:
  the same code runs on sm_80, which has none.

Act-order (`perm`) is applied to x by the caller. Imported only on the CUDA path or
under TRITON_INTERPRET (the tests): it imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill import envs

# Triton's interpreter (decided at import, as Triton decides): its dot of bf16 values
# converted inside a kernel is wrong, so the dots are emulated there (`_dot`).
_EMULATE_HALF_DOTS = envs.triton_interpret()
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
               torch.float32: tl.float32}


@triton.jit
def _e4m3_to_f32(b):
    """uint8 e4m3 bits -> fp32: sign and exponent|mantissa moved into fp16 bit places
    give the value times 2^-8 (the exponent biases differ by 8), subnormals too."""
    h = ((b.to(tl.uint16) & 0x80) << 8) | ((b.to(tl.uint16) & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _dot(acc, x, w, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    """acc + x w with both rounded to DOT_DTYPE, fp32 accumulation. EMULATE (Triton's
    interpreter, whose dot of in-kernel-converted bf16 is wrong): the rounded values
    widened back and multiplied in fp32, the same products (a bf16 or fp16 product is
    exact in fp32)."""
    if EMULATE:
        return acc + tl.dot(x.to(DOT_DTYPE).to(tl.float32), w.to(DOT_DTYPE).to(tl.float32),
                            input_precision="ieee")
    if IEEE:
        return acc + tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision="ieee")
    return acc + tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE))


@triton.jit
def _store(acc, b_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, M, stride_ym,
           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """The tile's result: y (+ bias) in y's dtype; split over K, this split's fp32
    partial into y [SPLIT, M, N] (the caller sums them: no atomics, deterministic)."""
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:
        tl.store(y_ptr + (pid_k * M + offs_m)[:, None] * stride_ym + offs_n[None, :], acc,
                 mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int_weights(s_ptr, z_ptr, rows, k0, offs_n, n_ok, N, K, row_ok, GROUP: tl.constexpr,
                 SCALES: tl.constexpr, TILE_ROWS: tl.constexpr, ROW_STEP: tl.constexpr):
    """(scale, zero) of a tile's TILE_ROWS codes, at K rows `rows` (k0 + ROW_STEP * i:
    every row for 8 bits, every other one for a 4-bit nibble), for each code. SCALES:
    1, the tile within one group (GROUP a multiple of BLOCK_K): one [1, BLOCK_N] row;
    2, whole groups (BLOCK_K a multiple of GROUP, a power of two): a row per group,
    widened over its rows; 0, any other group size: loaded code by code."""
    if SCALES == 1:
        # (a split's last tiles can lie past K: their codes and x are masked, so the
        # last group's row serves them, read instead of whatever lies past it)
        g = tl.minimum(k0, K - 1) // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)[None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.int32)[None, :]
    elif SCALES == 2:
        NUM_G: tl.constexpr = TILE_ROWS * ROW_STEP // GROUP
        g = k0 // GROUP + tl.arange(0, NUM_G)
        ok = (g * GROUP < K)[:, None] & n_ok[None, :]
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0).to(tl.int32)
        shape: tl.constexpr = (NUM_G, TILE_ROWS // NUM_G, s.shape[1])
        s = tl.reshape(tl.broadcast_to(s[:, None, :], shape), (TILE_ROWS, s.shape[1]))
        z = tl.reshape(tl.broadcast_to(z[:, None, :], shape), (TILE_ROWS, z.shape[1]))
    else:
        g = rows // GROUP
        ok = row_ok[:, None] & n_ok[None, :]
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0).to(tl.int32)
    return s, z


@triton.jit
def _int_weight_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K,
                            stride_xm, stride_ym,
                            GROUP: tl.constexpr, BITS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                            IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            k_per_split, SPLIT: tl.constexpr, SCALES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for kk in range(0, k_per_split, BLOCK_K):
        k0 = k_start + kk
        if BITS == 4:
            # Each byte once: its low nibbles are the tile's even K rows, its high ones
            # the odd rows, each dotted with x's matching columns (two half-K dots).
            half = tl.arange(0, BLOCK_K // 2)
            k_even = k0 + 2 * half
            even_ok = k_even < K
            odd_ok = k_even + 1 < K
            byte = tl.load(w_ptr + (k0 // 2 + half)[:, None] * N + offs_n[None, :],
                           mask=even_ok[:, None] & n_ok[None, :], other=0).to(tl.int32)
            s, z = _int_weights(s_ptr, z_ptr, k_even, k0, offs_n, n_ok, N, K, even_ok,
                                GROUP, SCALES, BLOCK_K // 2, 2)
            w_lo = ((byte & 15) - z).to(tl.float32) * s
            if SCALES == 0:  # the odd rows' groups, where a group edge can split a pair
                s, z = _int_weights(s_ptr, z_ptr, k_even + 1, k0, offs_n, n_ok, N, K, odd_ok,
                                    GROUP, SCALES, BLOCK_K // 2, 2)
            w_hi = ((byte >> 4) - z).to(tl.float32) * s
            x_lo = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_even[None, :],
                           mask=m_ok[:, None] & even_ok[None, :], other=0.0)
            x_hi = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k_even + 1)[None, :],
                           mask=m_ok[:, None] & odd_ok[None, :], other=0.0)
            acc = _dot(acc, x_lo, w_lo, DOT_DTYPE, IEEE, EMULATE)
            acc = _dot(acc, x_hi, w_hi, DOT_DTYPE, IEEE, EMULATE)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            code = tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :],
                           mask=k_ok[:, None] & n_ok[None, :], other=0).to(tl.int32)
            s, z = _int_weights(s_ptr, z_ptr, offs_k, k0, offs_n, n_ok, N, K, k_ok,
                                GROUP, SCALES, BLOCK_K, 1)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(acc, x, (code - z).to(tl.float32) * s, DOT_DTYPE, IEEE, EMULATE)
    _store(acc, b_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, M, stride_ym, HAS_BIAS,
           SPLIT)


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                           stride_xm, stride_ym, stride_sn,
                           BN: tl.constexpr, BK: tl.constexpr,
                           HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                           IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           k_per_split, SPLIT: tl.constexpr, SCALES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for kk in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + kk + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & n_ok[None, :]
        # weight [N, K] row-major, read as the [BLOCK_K, BLOCK_N] tile of W^T
        b = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=tile_ok, other=0)
        if SCALES == 1:  # the tile within one block column: a scale per output column
            kb = tl.minimum(k_start + kk, K - 1) // BK  # (past K: the last block's)
            s = tl.load(s_ptr + (offs_n // BN) * stride_sn + kb, mask=n_ok, other=0.0)[None, :]
        else:
            s = tl.load(s_ptr + (offs_n // BN)[None, :] * stride_sn + (offs_k // BK)[:, None],
                        mask=tile_ok, other=0.0)
        w = _e4m3_to_f32(b) * s
        acc = _dot(acc, x, w, DOT_DTYPE, IEEE, EMULATE)
    _store(acc, b_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, M, stride_ym, HAS_BIAS,
           SPLIT)


@triton.jit
def _int_tile(w_ptr, s_ptr, z_ptr, offs_k, offs_n, N, ok, GROUP: tl.constexpr,
              BITS: tl.constexpr):
    """The [len(offs_k), len(offs_n)] tile of W^T in fp32 from K-major codes (4-bit: row
    k in byte k // 2, the low nibble when k is even) and group scales / zeros [G, N]:
    (code - zero) * scale, each loaded code by code (`ok`: the tile's mask)."""
    if BITS == 4:
        byte = tl.load(w_ptr + (offs_k // 2)[:, None] * N + offs_n[None, :], mask=ok, other=0)
        code = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 15
    else:
        code = tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :], mask=ok,
                       other=0).to(tl.int32)
    g = offs_k // GROUP
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0)
    z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0).to(tl.int32)
    return (code - z).to(tl.float32) * s


@triton.jit
def _int_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP: tl.constexpr,
                        BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W^T [K, N] in out's dtype from the K-major codes: (code - zero) * scale in fp32,
    rounded once (the weights a model of that dtype holds)."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    w = _int_tile(w_ptr, s_ptr, z_ptr, offs_k, offs_n, N, ok, GROUP, BITS)
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_sn, BN: tl.constexpr,
                        BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W^T [K, N] in out's dtype from e4m3 [N, K] and its block scale_inv."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    b = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=ok, other=0)
    s = tl.load(s_ptr + (offs_n // BN)[None, :] * stride_sn + (offs_k // BK)[:, None],
                mask=ok, other=0.0)
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :],
             (_e4m3_to_f32(b) * s).to(out_ptr.dtype.element_ty), mask=ok)


# Decode-sized inputs (up to 16 rows, tl.dot's least M): the weights stream once, so
# what counts is bytes in flight per SM: wide K tiles, enough programs per SM (split
# over K when the output's tiles are too few). The best of
# `python -m tokenmill.bench.quant_gemm --sweep` on an H200 (docs/benchmarks.md: K 256
# tiles ran out of shared memory for fp8 at 4 stages and ran 6x slower at 3; 8
# programs per SM and 4 stages each cost 5-25%).
DECODE_TILES = dict(block_n=64, block_k=128, programs_per_sm=2, num_warps=4, num_stages=3)
# From this many rows the weights are dequantized to the activations' dtype (W^T in a
# scratch buffer: one write and read of N*K elements) for torch's GEMM (cuBLAS): the
# fused kernels' 64-row tiles are far from a tuned GEMM's at prefill sizes. 4-bit
# codes leave the fused kernel above the decode tile: its two half-K dots over
# 64-row tiles ran 4-12x slower than dequantizing on an H200 (a 4096 x 4096 layer at
# 64 rows: 97 us fused, about 23 us dequantized + cuBLAS).
DEQUANT_MIN_ROWS = 128
DEQUANT_MIN_ROWS_4BIT = 17


def _tiles(m: int, dtype: torch.dtype, grouped: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode-sized inputs take 16-row tiles (DECODE_TILES);
    fp32 tiles are smaller (64 x 64 fp32 tiles spill registers on sm_80 / 90; the
    integer kernel's decode tile takes K 64, the fp8 one's 32, the sizes neither
    spills at: `python -m tokenmill.ops.triton_compile --quantized`)."""
    if dtype == torch.float32:
        return (16, 32, 64 if grouped else 32) if m <= 16 else (32, 32, 32)
    if m <= 16:
        return 16, DECODE_TILES["block_n"], DECODE_TILES["block_k"]
    return 64, 64, 64


_SM_COUNTS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no split unless asked
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def pick_split_k(tiles: int, k_blocks: int, sms: int, programs_per_sm: int = 2) -> int:
    """How many K ranges a GEMM of `tiles` output tiles is cut into: decode-sized rows
    give few tiles (N / 64 for a layer), which leave most SMs idle while the weights
    stream; splits (powers of two) until about `programs_per_sm` programs per SM, each
    keeping at least 2 K blocks (a split's partials cost an fp32 [M, N] write and
    read)."""
    split = 1
    while tiles * split * 2 <= programs_per_sm * sms and k_blocks // (split * 2) >= 2:
        split *= 2
    return split


def _scales_mode(span: int, block_k: int, grouped: bool) -> int:
    """The kernels' SCALES (_int_weights): 1 where a K tile lies within the `span` of
    K one scale row covers, 2 (`grouped`: the integer kernel) where the tile holds
    whole spans of a power-of-two size, 0 otherwise."""
    if span % block_k == 0:
        return 1
    if grouped and block_k % span == 0 and span & (span - 1) == 0 and span >= 2:
        return 2
    return 0


def _launch(kernel, x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, dtype,
            args: tuple, split_k: int | None, scale_span: int, grouped: bool,
            **consts) -> torch.Tensor:
    """Run `kernel` over x [..., k] -> [..., n] in `dtype`: tiles by row count, split
    over K by pick_split_k (or `split_k`), the splits' partials summed here.
    `scale_span`: the K span one scale row covers (a group, an fp8 block column)."""
    x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    m = x2.shape[0]
    bm, bn, bk = _tiles(m, dtype, grouped)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_blocks = triton.cdiv(k, bk)
    decode = bm == 16 and dtype != torch.float32
    split = split_k or pick_split_k(tiles, k_blocks, _num_sms(x.device),
                                    DECODE_TILES["programs_per_sm"] if decode else 2)
    split = max(1, min(split, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(k, k_per_split)
    if split > 1:
        y = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=dtype, device=x.device)
    b = bias.to(torch.float32).contiguous() if bias is not None else y
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    launch = ({"num_warps": DECODE_TILES["num_warps"], "num_stages": DECODE_TILES["num_stages"]}
              if decode else {})
    kernel[grid](x2, *args, b, y, m, n, k, x2.stride(0), n, **consts,
                 HAS_BIAS=bias is not None, DOT_DTYPE=_DOT_DTYPES[dtype],
                 IEEE=dtype == torch.float32,
                 EMULATE=dtype != torch.float32 and _EMULATE_HALF_DOTS,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, k_per_split=k_per_split, SPLIT=split,
                 SCALES=_scales_mode(scale_span, bk, grouped), **launch)
    if split > 1:
        y = y.sum(0)
        if bias is not None:
            y += b
        y = y.to(dtype)
    return y.view(*x.shape[:-1], n)


def _dequant_linear(dequantize, x: torch.Tensor, n: int, bias: torch.Tensor | None,
                    dtype) -> torch.Tensor:
    """x W^T + b through W^T dequantized to `dtype` (`dequantize(out)` fills it)."""
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    wt = torch.empty(x2.shape[1], n, dtype=dtype, device=x.device)
    dequantize(wt)
    y = x2 @ wt if bias is None else torch.addmm(bias.to(dtype), x2, wt)  # as F.linear
    return y.view(*x.shape[:-1], n)


def _dequant_grid(k: int, n: int) -> tuple[int, int]:
    return triton.cdiv(k, 64), triton.cdiv(n, 64)


class IntWeightTriton:
    """A `QuantizedWeight` in the integer kernel's device layout (module docstring)."""

    def __init__(self, qw, device):
        n, k = qw.codes.shape
        codes = qw.codes.t().contiguous()  # [K, N]
        if qw.bits == 4:
            if k % 2:
                codes = torch.cat([codes, codes.new_zeros(1, n)])
            codes = codes[0::2] | (codes[1::2] << 4)
        self.w = codes.contiguous().to(device)
        self.scales = qw.scales.t().contiguous().to(device)
        self.zeros = qw.zeros.t().contiguous().to(device)
        self.perm = qw.perm.to(device) if qw.perm is not None else None
        self.n, self.k, self.bits, self.group = n, k, qw.bits, qw.group_size
        self.in_features = qw.shape[1]  # the input's width (k: the codes', padded or not)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype | None = None, split_k: int | None = None) -> torch.Tensor:
        """y = x W^T + b, in `dtype` (None: x's), shaped as x with N last."""
        dtype = dtype or x.dtype
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        rows = x.numel() // x.shape[-1]
        if rows >= (DEQUANT_MIN_ROWS_4BIT if self.bits == 4 else DEQUANT_MIN_ROWS):
            return _dequant_linear(self._dequantize_into, x, self.n, bias, dtype).to(x.dtype)
        y = _launch(_int_weight_gemm_kernel, x, self.n, self.k, bias, dtype,
                    (self.w, self.scales, self.zeros), split_k, self.group, True,
                    GROUP=self.group, BITS=self.bits)
        return y.to(x.dtype)

    def _dequantize_into(self, wt: torch.Tensor) -> None:
        """W^T [K, N] (the codes' order: act-order applies to x) in wt's dtype."""
        _int_dequant_kernel[_dequant_grid(self.k, self.n)](
            self.w, self.scales, self.zeros, wt, self.n, self.k, GROUP=self.group,
            BITS=self.bits, BLOCK_N=64, BLOCK_K=64)

    @property
    def group_size(self) -> int:
        return self.group

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in the checkpoint's column order (for code that needs the matrix)."""
        codes = self.w
        if self.bits == 4:  # byte r holds rows 2r (low nibble) and 2r + 1
            codes = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1, self.n)[:self.k]
        g = torch.arange(self.k, device=codes.device) // self.group
        w = (codes.to(torch.int32) - self.zeros[g].to(torch.int32)).to(torch.float32)
        w = (w * self.scales[g]).t()
        if self.perm is not None and self.in_features != self.k:
            # padded act-order (act_order_share.py): padding columns are exactly 0
            w = w.new_zeros(self.n, self.in_features).index_add_(1, self.perm, w)
        elif self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w.to(dtype)


class Fp8WeightTriton:
    """Block-scaled e4m3 weights [N, K] (bytes) and their scale_inv on the device."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block_size: tuple[int, int]):
        self.w = weight.contiguous().view(torch.uint8)
        self.scale_inv = scale_inv.to(torch.float32).contiguous()
        self.n, self.k = weight.shape
        self.block_size = block_size

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype | None = None, split_k: int | None = None) -> torch.Tensor:
        dtype = dtype or x.dtype
        bn, bk = self.block_size
        if x.numel() // x.shape[-1] >= DEQUANT_MIN_ROWS:
            return _dequant_linear(self._dequantize_into, x, self.n, bias, dtype).to(x.dtype)
        y = _launch(_fp8_block_gemm_kernel, x, self.n, self.k, bias, dtype,
                    (self.w, self.scale_inv), split_k, bk, False,
                    stride_sn=self.scale_inv.stride(0), BN=bn, BK=bk)
        return y.to(x.dtype)

    def _dequantize_into(self, wt: torch.Tensor) -> None:
        bn, bk = self.block_size
        _fp8_dequant_kernel[_dequant_grid(self.k, self.n)](
            self.w, self.scale_inv, wt, self.n, self.k, self.scale_inv.stride(0), BN=bn,
            BK=bk, BLOCK_N=64, BLOCK_K=64)
