"""MoE experts in an integer format (GPTQ, AWQ, compressed-tensors, int8 made at load)
or block-scaled FP8 (DeepSeek-V3 / Qwen -FP8, fp8 made at load) as Triton grouped
GEMMs that read each expert's weights at their stored width: the CUDA path of
`QuantizedFusedMoEMethod`, `Int8AtLoadFusedMoEMethod` and `Fp8BlockFusedMoEMethod`,
with no host read of a device value and no shape that depends on the routing, so a
decode step's MoE layers can be captured in a CUDA graph (fused_experts' default path
reads the expert groups with `.tolist()`).

The (token, slot) pairs of a batch, p = token * top_k + slot, are sorted by expert on
the device and each expert's run padded to a multiple of BLOCK_M (`align_pairs`): a
program takes BLOCK_M slots of one expert, so its weight tiles are that expert's. The
padded buffer is sized by the worst case the shapes allow (every expert with work
wastes at most BLOCK_M - 1 slots), the blocks beyond the used ones hold no expert and
exit at once. Each GEMM writes its rows back in pair order: the first reads the
pair's token row of x (p // top_k), the second the pair's own row.

Device layout (`IntExpertsTriton`): the dense kernel's (ops/triton_quant_linear.py),
stacked over experts: codes [E, K', N] uint8 (4-bit: two K rows per byte, row k in
byte k // 2's low nibble when k is even), scales [E, G, N] fp32, zeros [E, G, N]
uint8. Act-order: perms [E, K] int32, each expert's own, applied in the kernel by
gathering x's columns; experts whose codes have fewer columns (a tensor-parallel
rank's padded act-order share, act_order_share.py) are padded with perm -1, whose
x is read as 0. The numbers are the dense kernel's: (code - zero) * scale in fp32,
rounded to the activations' dtype before the dot, fp32 accumulation, IEEE fp32 dots
for fp32 models.

FP8 (`Fp8ExpertsTriton`): the checkpoint's stacked e4m3 [E, N, K] read as bytes and
its scale_inv [E, ceil(N/bn), ceil(K/bk)] fp32, decoded as the dense FP8 kernel does
(`_e4m3_to_f32`: integer ops, so sm_80 runs it too): e4m3 * scale_inv in fp32,
rounded to the activations' dtype before the dot. Per-channel scales are blocks
(1, K' >= K). Each weights object launches its own kernel (`launch`); the routing,
the driver and the two GEMMs around the activation are shared.

Imported only on the CUDA path or under TRITON_INTERPRET: it imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.models.layers.linear_methods.fused_moe import act_and_mul
from tokenmill.ops.triton_quant_linear import (_DOT_DTYPES, _EMULATE_HALF_DOTS, _dot,
                                               _e4m3_to_f32, _int_tile)


@triton.jit
def _block_pairs(sorted_token_ids_ptr, pid_m, num_pairs, X_DIV: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """The pairs in block pid_m's BLOCK_M slots, which of them are real (padding slots
    hold num_pairs) and the x row each reads (pair // X_DIV)."""
    pair = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pair, pair < num_pairs, (pair // X_DIV).to(tl.int64)


@triton.jit
def _int_moe_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, y_ptr,
                         sorted_token_ids_ptr, expert_ids_ptr, num_pairs, N, K,
                         stride_xm, stride_ym, stride_we, stride_se, stride_pe,
                         X_DIV: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                         HAS_PERM: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[p] = x[p // X_DIV] @ W_e^T for the BLOCK_M sorted pairs of block pid_m, all of
    expert e = expert_ids[pid_m] (-1: a block past the used ones, nothing to do)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return
    e = expert.to(tl.int64)  # (E x a matrix's bytes can pass 2^31)
    pair, m_ok, row = _block_pairs(sorted_token_ids_ptr, pid_m, num_pairs, X_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_ptr += e * stride_we
    s_ptr += e * stride_se
    z_ptr += e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_PERM:  # act-order: code column k multiplies x's column perm[e, k]
            col = tl.load(perm_ptr + e * stride_pe + offs_k, mask=k_ok, other=-1)
            x_col_ok = col >= 0  # -1: padding or past K (x read as 0, whatever the weight)
        else:
            col = offs_k
            x_col_ok = k_ok
        x = tl.load(x_ptr + row[:, None] * stride_xm + col[None, :],
                    mask=m_ok[:, None] & x_col_ok[None, :], other=0.0)
        w = _int_tile(w_ptr, s_ptr, z_ptr, offs_k, offs_n, N, k_ok[:, None] & n_ok[None, :],
                      GROUP, BITS)
        acc = _dot(acc, x, w, DOT_DTYPE, IEEE, EMULATE)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_moe_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                         num_pairs, N, K, stride_xm, stride_ym, stride_we, stride_se,
                         stride_sn, X_DIV: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         SCALES: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """As `_int_moe_gemm_kernel`, over expert e's e4m3 [N, K] bytes and block scales.
    SCALES 1: every K tile within one block column (a scale per output column);
    0: a scale per weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    pair, m_ok, row = _block_pairs(sorted_token_ids_ptr, pid_m, num_pairs, X_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_ptr += e * stride_we
    s_ptr += e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + row[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & n_ok[None, :]
        # weight [N, K] row-major, read as the [BLOCK_K, BLOCK_N] tile of W^T
        b = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=tile_ok, other=0)
        if SCALES == 1:
            kb = tl.minimum(k0, K - 1) // BK  # (K's last tile: its block column)
            s = tl.load(s_ptr + (offs_n // BN) * stride_sn + kb, mask=n_ok, other=0.0)[None, :]
        else:
            s = tl.load(s_ptr + (offs_n // BN)[None, :] * stride_sn + (offs_k // BK)[:, None],
                        mask=tile_ok, other=0.0)
        acc = _dot(acc, x, _e4m3_to_f32(b) * s, DOT_DTYPE, IEEE, EMULATE)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class IntExpertsTriton:
    """An MoE projection's experts (one `QuantizedWeight` each, same bits, group size
    and shape) stacked in the kernel's device layout (module docstring)."""

    def __init__(self, weights, device):
        first = weights[0]
        self.bits, self.group = first.bits, first.group_size
        self.n, self.in_features = first.shape
        for qw in weights:
            if (qw.bits, qw.group_size, qw.shape) != (self.bits, self.group, first.shape):
                raise ValueError("the experts differ in bits, group size or shape")
        # Code columns: the widest expert's (only padded act-order shares differ).
        self.k = max(qw.codes.shape[1] for qw in weights)
        groups = -(-self.k // self.group)
        codes, scales, zeros = [], [], []
        for qw in weights:
            pad_k, pad_g = self.k - qw.codes.shape[1], groups - qw.scales.shape[1]
            # Padding columns: code 0, scale 0, and perm -1 (x read as 0) below.
            codes.append(_k_major(torch.nn.functional.pad(qw.codes, (0, pad_k)), qw.bits))
            scales.append(torch.nn.functional.pad(qw.scales, (0, pad_g)).t())
            zeros.append(torch.nn.functional.pad(qw.zeros, (0, pad_g)).t())
        self.w = torch.stack(codes).contiguous().to(device)
        self.scales = torch.stack(scales).contiguous().to(device)
        self.zeros = torch.stack(zeros).contiguous().to(device)
        self.perms = None
        if any(qw.perm is not None for qw in weights):
            perms = torch.full((len(weights), self.k), -1, dtype=torch.int32)
            for e, qw in enumerate(weights):
                k = qw.codes.shape[1]
                perms[e, :k] = (qw.perm if qw.perm is not None else torch.arange(k)).cpu()
            self.perms = perms.to(device)

    @property
    def num_experts(self) -> int:
        return self.w.shape[0]

    def launch(self, grid, x, y, sorted_token_ids, expert_ids, pairs, x_div, **consts):
        """The grouped kernel over these experts (grouped_gemm's `consts`: dtype, tiles)."""
        perms = self.perms if self.perms is not None else expert_ids  # (unread)
        _int_moe_gemm_kernel[grid](
            x, self.w, self.scales, self.zeros, perms, y, sorted_token_ids, expert_ids,
            pairs, self.n, self.k, x.stride(0), y.stride(0), self.w.stride(0),
            self.scales.stride(0), perms.stride(0) if self.perms is not None else 0,
            X_DIV=x_div, GROUP=self.group, BITS=self.bits, HAS_PERM=self.perms is not None,
            **consts)

    def nbytes(self) -> int:
        """Resident bytes on the device."""
        t = [self.w, self.scales, self.zeros] + ([self.perms] if self.perms is not None else [])
        return sum(x.numel() * x.element_size() for x in t)

    def dequantize(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's W [N, in_features] in the checkpoint's column order (debugging,
        tests)."""
        codes = self.w[e]
        if self.bits == 4:  # byte r holds rows 2r (low nibble) and 2r + 1
            codes = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1, self.n)[:self.k]
        g = torch.arange(self.k, device=codes.device) // self.group
        w = (codes.to(torch.int32) - self.zeros[e][g].to(torch.int32)).to(torch.float32)
        w = (w * self.scales[e][g]).t()
        if self.perms is None:
            return w.to(dtype)
        perm = self.perms[e].long()
        real = perm >= 0  # (padding columns: left out; a padded share's repeats add 0)
        return w.new_zeros(self.n, self.in_features).index_add_(
            1, perm[real], w[:, real]).to(dtype)


class Fp8ExpertsTriton:
    """An MoE projection's stacked e4m3 experts [E, N, K] and their block scale_inv
    [E, ceil(N/bn), ceil(K/bk)] on `device`: the weight's bytes viewed, not copied,
    where it is there already (the caller drops its own reference)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block_size: tuple[int, int], device):
        self.w = weight.contiguous().view(torch.uint8).to(device)
        self.scale_inv = scale_inv.to(device=device, dtype=torch.float32).contiguous()
        _, self.n, self.k = weight.shape
        self.block_size = (int(block_size[0]), int(block_size[1]))

    @property
    def num_experts(self) -> int:
        return self.w.shape[0]

    def nbytes(self) -> int:
        """Resident bytes on the device."""
        return sum(t.numel() * t.element_size() for t in (self.w, self.scale_inv))

    def launch(self, grid, x, y, sorted_token_ids, expert_ids, pairs, x_div, **consts):
        """The grouped kernel over these experts (grouped_gemm's `consts`: dtype, tiles).
        A scale per output column per K tile where each tile lies in one block column:
        bk a multiple of the tile, or one column spanning K (per-channel)."""
        bn, bk = self.block_size
        one_column = bk % consts["BLOCK_K"] == 0 or bk >= self.k
        _fp8_moe_gemm_kernel[grid](
            x, self.w, self.scale_inv, y, sorted_token_ids, expert_ids, pairs, self.n,
            self.k, x.stride(0), y.stride(0), self.w.stride(0), self.scale_inv.stride(0),
            self.scale_inv.stride(1), X_DIV=x_div, BN=bn, BK=bk, SCALES=int(one_column),
            **consts)


def _k_major(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] -> [K, N], 4-bit: two K rows per byte (an odd K padded by a zero row)."""
    codes = codes.t()
    if bits == 4:
        if codes.shape[0] % 2:
            codes = torch.cat([codes, codes.new_zeros(1, codes.shape[1])])
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes


def _tiles(pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from the mean rows per expert (static: the shapes'):
    decode-sized runs take 16-row tiles (tl.dot's least), fp32 smaller tiles (as the
    dense kernel's, whose 64 x 64 fp32 tiles spill registers)."""
    small = pairs <= 16 * num_experts
    if dtype == torch.float32:
        return (16, 32, 32) if small else (32, 32, 32)
    return (16, 64, 64) if small else (64, 64, 64)


def align_pairs(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's run padded to a multiple of `block_m`,
    on the device with shapes from topk_ids' shape alone: (sorted_token_ids [S] int32,
    the pair in each slot or P for padding; expert_ids [S / block_m] int32, each
    block's expert or -1 past the used blocks)."""
    flat_ids = topk_ids.reshape(-1).long()
    pairs, device = flat_ids.numel(), flat_ids.device
    # (bincount reads the largest id on the host: an index_add instead)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add_(
        0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    # a pair's rank within its expert's run, then its slot in the padded buffer
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    slots = (padded_ends - padded)[sorted_ids] + rank
    # At most min(E, P) experts have work, each wasting under block_m slots.
    num_blocks = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)
    sorted_token_ids = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32,
                                  device=device)
    sorted_token_ids[slots] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids


def grouped_gemm(x: torch.Tensor, experts, sorted_token_ids, expert_ids, pairs: int,
                 x_div: int, dtype: torch.dtype, tiles) -> torch.Tensor:
    """y [pairs, N] in `dtype`: y[p] = x[p // x_div] @ W_{expert of p}^T (`experts`: an
    IntExpertsTriton or Fp8ExpertsTriton, which launches its kernel)."""
    bm, bn, bk = tiles
    x = x.to(dtype).contiguous()
    y = torch.empty(pairs, experts.n, dtype=dtype, device=x.device)
    grid = (expert_ids.numel(), triton.cdiv(experts.n, bn))
    experts.launch(grid, x, y, sorted_token_ids, expert_ids, pairs, x_div,
                   DOT_DTYPE=_DOT_DTYPES[dtype], IEEE=dtype == torch.float32,
                   EMULATE=dtype != torch.float32 and _EMULATE_HALF_DOTS,
                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y


def fused_experts_triton(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, compute_dtype: torch.dtype | None = None,
                         activation: str = "silu") -> torch.Tensor:
    """`fused_experts` (fused_moe.py) over integer or FP8 experts (IntExpertsTriton /
    Fp8ExpertsTriton), without a host sync: w13 gate rows then up rows [2I, H], w2
    [H, I]; the GEMMs in `compute_dtype` (None: x's), each result rounded to x's
    dtype; topk weights applied, pairs summed into their tokens."""
    top_k = topk_ids.shape[1]
    pairs = topk_ids.numel()
    if pairs == 0:
        return torch.zeros_like(x)
    dtype = compute_dtype or x.dtype
    tiles = _tiles(pairs, w13.num_experts, dtype)
    sorted_token_ids, expert_ids = align_pairs(topk_ids, w13.num_experts, tiles[0])
    gate_up = grouped_gemm(x, w13, sorted_token_ids, expert_ids, pairs, top_k, dtype,
                           tiles).to(x.dtype)
    act = act_and_mul(gate_up, activation)
    down = grouped_gemm(act, w2, sorted_token_ids, expert_ids, pairs, 1, dtype,
                        tiles).to(x.dtype)
    down = down * topk_weights.reshape(-1).unsqueeze(-1)
    token_idx = torch.arange(pairs, device=x.device) // top_k
    return torch.zeros_like(x).index_add_(0, token_idx, down)
