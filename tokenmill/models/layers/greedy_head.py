"""Greedy tokens from the lm_head without reading all of its weights.

A batch-1 decode step on CPU is bound by streaming weights, and the lm_head
is about 40% of them. Rows that only take the argmax read an int8 copy of the
lm_head instead (half the bytes of bf16 weights, a quarter of fp32 ones), then
recompute exactly the few 32-column blocks whose error bound lets them hold the
maximum (kernels/cpu_greedy_head.cpp has the bound), with the packed linear
kernel's own code (linear_bf16, or linear_f32 for an fp32 model). The token
equals argmax over the full logits, ties included.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

QB = 64  # int8 columns per block in the kernel's layout


def pack_int8_screen(weight: torch.Tensor):
    """bf16 or fp32 [N, K] -> (q, scale, coef, l1) in the kernel's layout.

    q [ceil(N/64), ceil(K/2), 64, 2] int8: row n quantised symmetrically with
    scale [Npad] = max|w|/127, pairs of k side by side for the int16 dot
    products. coef [Npad] bounds |approx - exact| / ||x||_1 for that column:
    the quantisation error max|s q - w| (exact in float64) plus the fp32
    rounding of the approximate and of the exact dot product (each within
    (K + 8) 2^-24 max|w| ||x||_1; both terms taken twice for slack), rounded up
    to an fp32. l1 [Npad] = sum|w| (rounded up), for the error of the int16
    activations.
    """
    n, k = weight.shape
    nq, kp = -(-n // QB), k + k % 2
    q = torch.zeros(nq * QB, kp, dtype=torch.int8)
    scale = torch.zeros(nq * QB, dtype=torch.float32)
    coef = torch.zeros(nq * QB, dtype=torch.float32)
    l1 = torch.zeros(nq * QB, dtype=torch.float32)
    gamma = 2 * (k + 8) * 2.0 ** -24
    for r0 in range(0, n, 4096):  # in float64, a slice of rows at a time
        w = weight[r0:r0 + 4096].detach().to(torch.float64)
        maxabs = w.abs().amax(dim=1)
        s32 = (maxabs / 127).to(torch.float32)
        s = s32.to(torch.float64)
        qr = torch.where(s[:, None] > 0, w / s.clamp(min=1e-300)[:, None], 0.0).round()
        qr = qr.clamp(-127, 127)
        quant_err = (qr * s[:, None] - w).abs().amax(dim=1)
        rows = slice(r0, r0 + w.shape[0])
        q[rows, :k] = qr.to(torch.int8)
        scale[rows] = s32
        coef[rows] = _round_up(quant_err * (1 + 2.0 ** -20) + 2 * gamma * (127 * s + maxabs))
        l1[rows] = _round_up(w.abs().sum(dim=1) * (1 + 2.0 ** -40))
    q = q.view(nq, QB, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    return q, scale, coef, l1


def _round_up(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the fp32 at or above each value."""
    v32 = v.to(torch.float32)
    return torch.where(v32.to(torch.float64) < v,
                       torch.nextafter(v32, torch.tensor(float("inf"))), v32)


class GreedyHead:
    """The int8 screen of one packed `Linear` lm_head (no bias): packed bf16, or packed
    fp32 for an fp32 model."""

    def __init__(self, lm_head, ops):
        self.lm_head = lm_head
        self.ops = ops
        self.packed = lm_head.method.packed_weight  # the packed kernel's own copy
        self.dtype = lm_head.method.packed_dtype
        weight = lm_head.dense_weight().to(self.dtype)
        self.q, self.scale, self.coef, self.l1 = pack_int8_screen(weight)
        self.blocks_recomputed = 0  # last call's exact 32-column blocks (tests, profiling)
        self.num_blocks = -(-lm_head.out_features // 32)

    @classmethod
    def build(cls, lm_head, ops) -> GreedyHead | None:
        """The screen of `lm_head` with the kernels module `ops`, or None where it cannot
        give the packed kernel's answer (no packed weights, a bias, or a kernel that
        refuses): the runner then takes the full lm_head. Whether to build one at all
        is the CPU platform's decision (tokenmill/platforms/cpu.py)."""
        packed = lm_head.method.packed_dtype in (torch.bfloat16, torch.float32)
        if ops is None or not packed or lm_head.bias is not None:
            return None
        head = cls(lm_head, ops)
        try:
            head(torch.zeros(1, lm_head.in_features, dtype=head.dtype))
        except RuntimeError as e:
            logger.info("greedy lm_head screen unavailable: %s", e)
            return None
        return head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> argmax(lm_head(x), dim=-1) as [M] int64."""
        ids, self.blocks_recomputed = self.ops.greedy_lm_head(
            x, self.packed, self.q, self.scale, self.coef, self.l1,
            self.lm_head.out_features)
        return ids

    def rows_surely_finite(self) -> bool:
        """After a call: True when every row of its x was finite. The kernel recomputes
        every 32-column block when a row holds an inf or a NaN, so fewer blocks prove
        that none did (all blocks recomputed: unknown, the caller checks the rows)."""
        return self.blocks_recomputed < self.num_blocks
