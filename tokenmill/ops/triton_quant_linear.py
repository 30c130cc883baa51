"""Quantized-weight GEMMs in Triton for the CUDA path: W4A16 / W8A16 (the canonical
integer form of GPTQ, AWQ, compressed-tensors and int8 made at load) and FP8 with
block scales (DeepSeek-V3 / Qwen -FP8).

Both read the weights in their stored width and dequantize a [BLOCK_K, BLOCK_N] tile
in registers before the tile's dot product, so a layer's bytes read per step are its
quantized bytes: what sets a decode step's speed. The dequantized value of each weight
is the one the PyTorch reference computes ((code - zero) * scale, or e4m3 * scale_inv,
in fp32), rounded to the activations' dtype before the dot (as a model holding the
dequantized weights in that dtype would); fp32 models' dots use IEEE fp32 (no TF32).

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
def _int_weight_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K,
                            stride_xm, stride_ym,
                            GROUP: tl.constexpr, BITS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                            IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            k_per_split, SPLIT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & n_ok[None, :]
        if BITS == 4:
            byte = tl.load(w_ptr + (offs_k // 2)[:, None] * N + offs_n[None, :],
                           mask=tile_ok, other=0)
            code = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 15
        else:
            code = tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :],
                           mask=tile_ok, other=0).to(tl.int32)
        g = offs_k // GROUP
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=tile_ok, other=0.0)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=tile_ok, other=0)
        w = (code - z.to(tl.int32)).to(tl.float32) * s
        acc = _dot(acc, x, w, DOT_DTYPE, IEEE, EMULATE)
    _store(acc, b_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, M, stride_ym, HAS_BIAS,
           SPLIT)


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                           stride_xm, stride_ym, stride_sn,
                           BN: tl.constexpr, BK: tl.constexpr,
                           HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                           IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           k_per_split, SPLIT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & n_ok[None, :]
        # weight [N, K] row-major, read as the [BLOCK_K, BLOCK_N] tile of W^T
        b = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=tile_ok, other=0)
        s = tl.load(s_ptr + (offs_n // BN)[None, :] * stride_sn + (offs_k // BK)[:, None],
                    mask=tile_ok, other=0.0)
        w = _e4m3_to_f32(b) * s
        acc = _dot(acc, x, w, DOT_DTYPE, IEEE, EMULATE)
    _store(acc, b_ptr, y_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, M, stride_ym, HAS_BIAS,
           SPLIT)


def _tiles(m: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode-sized inputs take 16-row tiles (tl.dot's
    least); fp32 tiles are smaller (64 x 64 fp32 tiles spill registers on sm_80 / 90:
    `python -m tokenmill.ops.triton_compile --quantized`)."""
    if dtype == torch.float32:
        return (16, 32, 32) if m <= 16 else (32, 32, 32)
    return (16, 64, 64) if m <= 16 else (64, 64, 64)


_SM_COUNTS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no split unless asked
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def pick_split_k(tiles: int, k_blocks: int, sms: int) -> int:
    """How many K ranges a GEMM of `tiles` output tiles is cut into: decode-sized rows
    give few tiles (N / 64 for a layer), which leave most SMs idle while the weights
    stream; splits until about two programs per SM, each keeping at least 4 K blocks
    (a split's partials cost an fp32 [M, N] write and read)."""
    split = 1
    while tiles * split * 2 <= 2 * sms and k_blocks // (split * 2) >= 4:
        split *= 2
    return split


def _launch(kernel, x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, dtype,
            args: tuple, split_k: int | None, **consts) -> torch.Tensor:
    """Run `kernel` over x [..., k] -> [..., n] in `dtype`: tiles by row count, split
    over K by pick_split_k (or `split_k`), the splits' partials summed here."""
    x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    m = x2.shape[0]
    bm, bn, bk = _tiles(m, dtype)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_blocks = triton.cdiv(k, bk)
    split = split_k or pick_split_k(tiles, k_blocks, _num_sms(x.device))
    split = max(1, min(split, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(k, k_per_split)
    if split > 1:
        y = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=dtype, device=x.device)
    b = bias.to(torch.float32).contiguous() if bias is not None else y
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    kernel[grid](x2, *args, b, y, m, n, k, x2.stride(0), n, **consts,
                 HAS_BIAS=bias is not None, DOT_DTYPE=_DOT_DTYPES[dtype],
                 IEEE=dtype == torch.float32,
                 EMULATE=dtype != torch.float32 and _EMULATE_HALF_DOTS,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, k_per_split=k_per_split, SPLIT=split)
    if split > 1:
        y = y.sum(0)
        if bias is not None:
            y += b
        y = y.to(dtype)
    return y.view(*x.shape[:-1], n)


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
        y = _launch(_int_weight_gemm_kernel, x, self.n, self.k, bias, dtype,
                    (self.w, self.scales, self.zeros), split_k,
                    GROUP=self.group, BITS=self.bits)
        return y.to(x.dtype)


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
        y = _launch(_fp8_block_gemm_kernel, x, self.n, self.k, bias, dtype,
                    (self.w, self.scale_inv), split_k,
                    stride_sn=self.scale_inv.stride(0), BN=bn, BK=bk)
        return y.to(x.dtype)
