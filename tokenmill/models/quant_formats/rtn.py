"""Round-to-nearest quantization of a weight matrix into the canonical QuantizedWeight
(layers/linear_methods/quantized_weight.py): what the checkpoint writers store.

Per group of `group_size` input columns of each row (in act-order, of the permuted
columns): symmetric: zero point 2**(bits-1), scale max|w| / (2**(bits-1) - 1);
asymmetric: the range [min(w, 0), max(w, 0)] over the 2**bits codes, the zero point
rounded into [min_zero, 2**bits - 1] (GPTQ v1 cannot store a zero point of 0, so its
writer asks for min_zero 1). Scales are rounded to the checkpoint's `scale_dtype`
before the codes are computed, so the stored scales are the ones the codes were
rounded against.
"""
from __future__ import annotations

import torch

from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                 perm: torch.Tensor | None = None, scale_dtype=torch.float16,
                 min_zero: int = 0) -> QuantizedWeight:
    """w [N, K] -> QuantizedWeight; group_size -1: one group of K; `perm`: act-order
    (column k of the result is w's column perm[k])."""
    wf = w.detach().float()
    if perm is not None:
        wf = wf.index_select(1, perm)
    n, k = wf.shape
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    pad = groups * g - k
    wg = torch.cat([wf, wf.new_zeros(n, pad)], 1).reshape(n, groups, g)
    top = (1 << bits) - 1
    if sym:
        amax = wg.abs().amax(-1)
        scales = amax / ((1 << (bits - 1)) - 1)
        zeros = torch.full((n, groups), 1 << (bits - 1), dtype=torch.int64)
    else:
        lo = wg.amin(-1).clamp(max=0.0)
        hi = wg.amax(-1).clamp(min=0.0)
        scales = (hi - lo) / top
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    scales = scales.to(scale_dtype).float()
    if not sym:
        zeros = torch.clamp(torch.round(-lo / scales), min_zero, top).to(torch.int64)
    q = torch.round(wg / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)
    codes = q.clamp(0, top).reshape(n, groups * g)[:, :k]
    return QuantizedWeight(codes.to(torch.uint8).contiguous(), scales.contiguous(),
                           zeros.to(torch.uint8), bits, g, perm).check("quantize_rtn")


def act_order_g_idx(qw: QuantizedWeight) -> torch.Tensor:
    """The checkpoint's g_idx [K] int32 of a QuantizedWeight: the group of each input
    column (k // group_size without act-order)."""
    k = qw.codes.shape[1]
    groups = torch.arange(k, dtype=torch.int32) // qw.group_size
    if qw.perm is None:
        return groups
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[qw.perm] = groups
    return g_idx


def checkpoint_order_codes(qw: QuantizedWeight) -> torch.Tensor:
    """The codes [N, K] in the checkpoint's column order (undoing act-order)."""
    if qw.perm is None:
        return qw.codes
    out = torch.empty_like(qw.codes)
    out[:, qw.perm] = qw.codes
    return out
