"""Integer codes packed into int32 words as GPTQ, AWQ and compressed-tensors checkpoints
store them: the one place both the readers (gptq.py, awq.py, compressed_tensors.py)
and the writer (models/quant_formats) pack and unpack.

A word holds 32 // bits codes, the first in its lowest bits. Which dim's consecutive
codes share a word is the format's:

- GPTQ: `qweight` [ceil(K*bits/32), N] along the input dim (0); `qzeros`
  [G, ceil(N*bits/32)] along the output dim (1);
- AWQ: `qweight` [K, N/8] and `qzeros` [G, N/8] along the output dim, in AWQ's
  order: nibble i of word w holds output column 8w + AWQ_ORDER[i];
- compressed-tensors: `weight_packed` [N, ceil(K*bits/32)] along the input dim (1),
  `weight_zero_point` [ceil(N*bits/32), G] along the output dim (0).

A partial last word is padded with zero codes. Words are int32 as stored (a code in
the top bits makes the word negative); they are read as unsigned.

Zero points: GPTQ's original format ("gptq", v1) stores each group's zero point minus
one (a symmetric 4-bit checkpoint stores 7 for 8), GPTQModel's "gptq_v2" the zero
point itself; AWQ stores the zero point; compressed-tensors stores signed codes
offset by 2**(bits-1) (`weight_packed` and `weight_zero_point` alike).

Act-order (GPTQ `desc_act`, compressed-tensors `actorder: group`): `g_idx[k]` is
the group of input column k; `act_order_perm` turns it into the canonical form's
`perm` (quantized_weight.py), whose groups are contiguous runs of columns.
"""
from __future__ import annotations

import torch

# Nibble i of an AWQ word holds output column AWQ_ORDER[i] of its 8; column j sits in
# nibble AWQ_SLOT[j] (the inverse permutation).
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_SLOT = [0, 4, 1, 5, 2, 6, 3, 7]


def per_word(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"{bits}-bit codes do not fill an int32 word evenly")
    return 32 // bits


def packed_len(length: int, bits: int) -> int:
    """Words holding `length` codes of `bits` bits."""
    return -(-length // per_word(bits))


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes (integers in [0, 2**bits)) -> int32 words along `dim`, first code in the
    lowest bits; a partial last word padded with zeros. (Shifted and summed in int32:
    the fields are disjoint, so the sum is their OR, a code in the top field wrapping
    into the sign bit as the stored word has it.)"""
    per = per_word(bits)
    dim = dim % codes.dim()
    if int(codes.min()) < 0 or int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes out of range for {bits} bits")
    length = codes.shape[dim]
    pad = packed_len(length, bits) * per - length
    c = codes.to(torch.int32)
    if pad:
        c = torch.cat([c, c.new_zeros(*c.shape[:dim], pad, *c.shape[dim + 1:])], dim)
    shape = list(c.shape)
    c = c.reshape(shape[:dim] + [shape[dim] // per, per] + shape[dim + 1:])
    shifts = torch.arange(per, dtype=torch.int32, device=c.device) * bits
    shifts = shifts.view([per] + [1] * (len(shape) - dim - 1))
    return (c << shifts).sum(dim + 1, dtype=torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, dim: int, length: int) -> torch.Tensor:
    """int32 words -> uint8 codes along `dim`, the first `length` of them. (Shifted and
    masked in int32, all fields at once: the arithmetic shift's sign bits are masked
    off, and no int64 copy of the words is made.)"""
    per = per_word(bits)
    dim = dim % words.dim()
    shape = list(words.shape)
    if shape[dim] * per < length:
        raise ValueError(f"{shape[dim]} words hold {shape[dim] * per} codes, not {length}")
    shifts = torch.arange(per, dtype=torch.int32, device=words.device) * bits
    shifts = shifts.view([per] + [1] * (words.dim() - dim - 1))
    codes = ((words.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    codes = codes.reshape(shape[:dim] + [shape[dim] * per] + shape[dim + 1:])
    return codes if codes.shape[dim] == length else codes.narrow(dim, 0, length).contiguous()


def awq_interleave(codes: torch.Tensor) -> torch.Tensor:
    """[..., N] codes (N a multiple of 8) in the column order AWQ packs them in: plain
    packing of the result puts column 8w + AWQ_ORDER[i] in nibble i of word w."""
    n = codes.shape[-1]
    return codes.reshape(*codes.shape[:-1], n // 8, 8)[..., AWQ_ORDER].reshape(codes.shape)


def awq_deinterleave(values: torch.Tensor) -> torch.Tensor:
    """The inverse of awq_interleave: codes unpacked from AWQ words -> column order."""
    n = values.shape[-1]
    return values.reshape(*values.shape[:-1], n // 8, 8)[..., AWQ_SLOT].reshape(values.shape)


def gptq_stored_zeros(zeros: torch.Tensor, bits: int, v1: bool) -> torch.Tensor:
    """Zero points -> the values a GPTQ checkpoint stores (v1: minus one; a zero point
    of 0 cannot be stored in v1)."""
    if not v1:
        return zeros
    if int(zeros.min()) < 1:
        raise ValueError("a gptq (v1) checkpoint cannot store a zero point of 0")
    return zeros.to(torch.int16) - 1


def gptq_zero_points(stored: torch.Tensor, bits: int, v1: bool, where: str) -> torch.Tensor:
    """The zero points a GPTQ checkpoint's unpacked `qzeros` stand for (uint8)."""
    if not v1:
        return stored
    top = (1 << bits) - 1
    if int(stored.max()) >= top:
        raise ValueError(f"{where}: qzeros holds {top}, which a gptq (v1) checkpoint stores "
                         f"for a zero point of {top + 1}: out of the {bits}-bit range (the "
                         f"v1 format cannot store a zero point of 0; its writer wraps it)")
    return (stored.to(torch.int16) + 1).to(torch.uint8)


def act_order_perm(g_idx: torch.Tensor, group_size: int, where: str) -> torch.Tensor | None:
    """g_idx [K] (the group of each input column) -> the canonical `perm` (column k of
    the kernel order is the checkpoint's perm[k]; groups contiguous), or None when
    g_idx is the identity assignment k // group_size. Raises ValueError unless every
    group g < ceil(K / group_size) has exactly min(group_size, K - g*group_size)
    columns."""
    k = g_idx.numel()
    groups = -(-k // group_size)
    g = g_idx.to(torch.int64).reshape(-1)
    cols = torch.arange(k, device=g.device)
    if torch.equal(g, cols // group_size):
        return None
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(f"{where}: g_idx holds group {int(g.min())}..{int(g.max())}, "
                         f"outside 0..{groups - 1} ({k} columns in groups of {group_size}): "
                         f"not a valid group assignment")
    counts = torch.bincount(g, minlength=groups)
    want = torch.clamp(k - torch.arange(groups, device=g.device) * group_size,
                       max=group_size)
    if not torch.equal(counts, want):
        bad = int(torch.nonzero(counts != want)[0])
        raise ValueError(f"{where}: g_idx gives group {bad} {int(counts[bad])} columns where "
                         f"groups of {group_size} over {k} columns need {int(want[bad])}: "
                         f"not a valid group assignment")
    return torch.argsort(g, stable=True)
