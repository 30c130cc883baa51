"""Act-order (GPTQ `desc_act`, compressed-tensors `actorder: group`) on a row-parallel
rank's share of the input columns: the canonical form of a matrix whose columns hold
pieces of groups scattered over the whole K.

A published act-order checkpoint assigns each group columns from all over K, so a
rank holding K / tp consecutive columns holds a few columns of (nearly) every group.
The rank keeps its columns' codes, their global group ids (`g_idx`) and the scales /
zero points of every group (int_layout.int_tp_rules leaves those whole); this module
lays them out in the canonical form every kernel takes (quantized_weight.py: groups
are contiguous runs of one `group_size`):

- the rank's columns are sorted by group; each group's columns fill `slot` columns
  at a time (one slot, or several for a group with more columns than a slot), each
  slot a group of the canonical form with that group's scale and zero point;
- a slot's columns past its group's real ones are padding: their code is the group's
  zero point, so W' is exactly 0 there, and their `perm` entry is the slot's first
  real input column (x times an exact 0 adds exactly 0: the product is unchanged,
  except that an infinite input in that column gives NaN where the unpadded product
  gives +-inf);
- `slot` is chosen to minimise the bytes per row (codes plus each slot's scale and
  zero point), a multiple of 8 where the group size is one (the CPU quad layout
  needs it); with a random act order over two ranks a group's ~group/2 columns
  vary, so the padding costs up to ~1.5-2x the rank's codes (the log line at load
  and `QuantizedWeight.in_features` vs its codes' width say how much).

`perm` then has more entries than inputs (repeats point at real columns):
`QuantizedWeight.in_features` is the input width, the codes' is the kernels'.
"""
from __future__ import annotations

import logging

import torch

from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight

logger = logging.getLogger(__name__)
_logged = False
# Bytes of one slot's scale (fp32) and zero point per row of the canonical form.
SLOT_BYTES = 5


def slot_size(counts: torch.Tensor, bits: int, group_size: int) -> int:
    """The canonical group size for groups holding `counts` columns each: the fewest
    bytes per row (codes of every slot's columns plus each slot's scale and zero),
    the larger on a tie; multiples of 8 where `group_size` is one."""
    top = int(counts.max())
    step = 8 if group_size % 8 == 0 else 1
    best, best_cost = None, None
    for s in range(step, -(-top // step) * step + 1, step):
        slots = int((-(-counts // s)).sum())
        cost = slots * (s * bits / 8 + SLOT_BYTES)
        if best_cost is None or cost <= best_cost:
            best, best_cost = s, cost
    return best


def row_share_form(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   g_idx: torch.Tensor, bits: int, group_size: int,
                   where: str) -> QuantizedWeight:
    """The canonical form of a rank's share of an act-order matrix: `codes` uint8
    [N, k] (the rank's columns, checkpoint order), `scales` fp32 / `zeros` uint8 [N, G]
    (every group of the whole matrix), `g_idx` [k] (each column's global group)."""
    n, k = codes.shape
    groups = scales.shape[1]
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != k:
        raise ValueError(f"{where}: g_idx has {g.numel()} entries for {k} input columns")
    if k == 0:
        raise ValueError(f"{where}: no input columns")
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(f"{where}: g_idx holds group {int(g.min())}..{int(g.max())}, "
                         f"outside the checkpoint's 0..{groups - 1}: not a valid group "
                         f"assignment")
    counts = torch.bincount(g, minlength=groups)
    if int(counts.max()) > group_size:
        bad = int(torch.argmax(counts))
        raise ValueError(f"{where}: g_idx gives group {bad} {int(counts[bad])} of this "
                         f"rank's columns, more than the group size {group_size}: not a "
                         f"valid group assignment")
    if torch.equal(g, torch.arange(k) // group_size) and -(-k // group_size) == groups:
        return QuantizedWeight(codes.contiguous(), scales, zeros, bits, group_size)
    s = slot_size(counts[counts > 0], bits, group_size)
    order = torch.argsort(g, stable=True)        # the rank's columns by group
    sorted_g = g[order]
    per_group = -(-counts // s)                  # slots of each group (0: absent)
    first_slot = torch.cumsum(per_group, 0) - per_group
    start = torch.cumsum(counts, 0) - counts     # first sorted position of each group
    r = torch.arange(k) - start[sorted_g]        # rank of a column within its group
    slot = first_slot[sorted_g] + r // s
    num_slots = int(per_group.sum())
    width = num_slots * s
    perm = torch.full((width,), -1, dtype=torch.int64)
    perm[slot * s + r % s] = order
    real = perm >= 0
    slot_of = torch.arange(width) // s
    perm = torch.where(real, perm, perm[slot_of * s])  # padding: its slot's first column
    slot_group = torch.repeat_interleave(torch.arange(groups), per_group)
    kz = zeros.index_select(1, slot_group)
    kcodes = codes.index_select(1, perm)
    pad = torch.nonzero(~real).reshape(-1)
    kcodes[:, pad] = kz.index_select(1, slot_of[pad])  # W' exactly 0 there
    kscales = scales.index_select(1, slot_group).contiguous()
    if width == k and torch.equal(perm, torch.arange(k)):  # whole groups, in order
        return QuantizedWeight(kcodes.contiguous(), kscales, kz.contiguous(), bits, s)
    _log(where, k, width, s)
    return QuantizedWeight(kcodes.contiguous(), kscales, kz.contiguous(), bits, s, perm,
                           in_features=k)


def _log(where: str, k: int, width: int, s: int) -> None:
    global _logged
    line = ("%s: act-order groups scattered over the tensor-parallel ranks: this rank's "
            "%d input columns laid out as %d (groups of %d, padding codes at the zero "
            "point: %.2fx the codes)")
    if not _logged:
        logger.info(line + " (further layers at debug level)", where, k, width, s, width / k)
        _logged = True
    else:
        logger.debug(line, where, k, width, s, width / k)
