"""Act order on a row-parallel rank's share of the input columns (linear_methods/
act_order_share.py): a GPTQ / compressed-tensors act-order matrix whose groups are
scattered over all of K, cut for each rank by the tensor-parallel rules
(int_layout.int_tp_rules: codes and g_idx with the columns, scales and zero points
whole) and converted into the padded canonical form.

Checked against the checkpoint's own dequantized matrix: every rank's dequantize()
equals its columns exactly, the padding columns of W' are exactly 0 with the group's
zero point as their code, each slot holds one group's columns, the ranks' partial
products add up to the whole product, and the native CPU kernels (plain and quad
layouts) take the padded form. Bad g_idx is refused naming it.
"""
import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.linear_methods.act_order_share import row_share_form
from tokenmill.models.layers.linear_methods.compressed_tensors import CompressedTensorsLayout
from tokenmill.models.layers.linear_methods.gptq import GptqLayout
from tokenmill.models.layers.linear_methods.int_layout import int_tp_rules
from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedWeight
from tokenmill.models.layers.linear_methods.quantized_weight import reference_linear
from tokenmill.models.quant_formats.encode import encode_compressed_tensors, encode_gptq
from tokenmill.models.quant_formats.rtn import quantize_rtn
from tokenmill.models.tensor_parallel import RankSlices

N, K = 40, 192


def _checkpoint(bits, group, sym, seed=0, perm=None, scale_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    perm = torch.randperm(K, generator=g) if perm is None else perm
    return quantize_rtn(w, bits, group, sym, perm, scale_dtype)


def _rank_forms(layout, tensors, tp):
    """Each rank's QuantizedWeight, its tensors cut by the tensor-parallel rules."""
    k = K // tp
    forms = []
    for rank in range(tp):
        rules = int_tp_rules(layout, RankSlices(rank, tp, 1).row(k),
                             {"weight": tuple(tensors)})
        t = {kind: rules[(kind, None)].take(v) if (kind, None) in rules else v
             for kind, v in tensors.items()}
        t = {kind: v.float() if v.is_floating_point() else v.to(torch.int64)
             if kind.endswith(("g_idx", "shape")) else v for kind, v in t.items()}
        forms.append(layout.convert(t, k, (N,), f"rank {rank}", groups_k=K).check())
    return forms


def _real_columns(perm):
    """Kernel columns that are real (a perm value's first occurrence; padding repeats
    its slot's first column, which comes before it)."""
    seen, real = set(), []
    for j, c in enumerate(perm.tolist()):
        real.append(c not in seen)
        seen.add(c)
    return torch.tensor(real)


def _check_rank(form, qw, g_idx, lo, hi):
    whole = qw.dequantize()
    assert form.shape == (N, hi - lo)
    assert torch.equal(form.dequantize(), whole[:, lo:hi])
    if form.perm is None:
        return
    real = _real_columns(form.perm)
    assert int(real.sum()) == hi - lo
    w = form.dequantize_rows(0, N)
    assert torch.equal(w[:, ~real], torch.zeros_like(w[:, ~real]))  # exactly 0
    slot = torch.arange(form.codes.shape[1]) // form.group_size
    pad = torch.nonzero(~real).reshape(-1)
    assert torch.equal(form.codes[:, pad], form.zeros[:, slot[pad]])
    # each slot one group's columns (the slot's scale that group's)
    col_group = g_idx[lo:hi][form.perm]
    for s in range(form.scales.shape[1]):
        groups = col_group[slot == s].unique()
        assert groups.numel() == 1
        assert torch.equal(form.scales[:, s], qw.scales[:, int(groups[0])])


@pytest.mark.parametrize("tp", [2, 4])
# 40: divides neither share (and K ends in a short group); 20: not a multiple of 8
@pytest.mark.parametrize("group", [32, 64, 40, 20])
@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, True), (8, False)])
def test_gptq_share_is_the_checkpoints_columns(bits, sym, group, tp):
    qw = _checkpoint(bits, group, sym)
    layout = GptqLayout(bits, group, v1_zeros=False)
    assert layout.keeps_groups_on_row_split()
    tensors = encode_gptq(qw, False)
    forms = _rank_forms(layout, tensors, tp)
    k = K // tp
    x = torch.randn(5, K)
    total = torch.zeros(5, N, dtype=torch.float64)
    for rank, form in enumerate(forms):
        _check_rank(form, qw, tensors["g_idx"].long(), rank * k, (rank + 1) * k)
        assert form.perm is not None and form.codes.shape[1] <= 2 * k
        total += reference_linear(form, x[:, rank * k:(rank + 1) * k], None).double()
    want = x.double() @ qw.dequantize().double().t()
    assert torch.allclose(total, want, atol=1e-4, rtol=0)


def test_compressed_tensors_share_is_the_checkpoints_columns():
    qw = _checkpoint(4, 32, False, seed=1, scale_dtype=torch.bfloat16)  # (as it stores)
    layout = CompressedTensorsLayout(4, 32, False, g_idx=True)
    tensors = encode_compressed_tensors(qw, False)
    for rank, form in enumerate(_rank_forms(layout, tensors, 2)):
        _check_rank(form, qw, tensors["weight_g_idx"].long(), rank * 96, (rank + 1) * 96)
        assert form.perm is not None


def test_whole_groups_in_order_need_no_padding():
    """Static groups (no act order): each rank's columns are whole groups, in order."""
    qw = _checkpoint(4, 32, True, perm=torch.arange(K))
    qw.perm = None
    for rank, form in enumerate(_rank_forms(GptqLayout(4, 32, False), encode_gptq(qw, False),
                                            2)):
        assert form.perm is None and form.codes.shape == (N, 96) and form.group_size == 32
        assert torch.equal(form.dequantize(), qw.dequantize()[:, rank * 96:(rank + 1) * 96])


def test_share_on_the_native_kernels(ops):
    qw = _checkpoint(4, 32, False, seed=2)
    form = _rank_forms(GptqLayout(4, 32, False), encode_gptq(qw, False), 2)[1]
    x = torch.randn(33, 96)
    want = (x.double() @ form.dequantize().double().t()).float()  # the exact product
    for quad in (False, True):
        packed = PackedQuantizedWeight(ops, form, quad=quad)
        assert torch.equal(packed.dequantize(), form.dequantize())
        if not quad:
            for rows in (1, 4, 33):
                got = packed.linear(x[:rows], None, 64, None)
                assert torch.allclose(got, want[:rows], atol=1e-4, rtol=1e-5)


def test_bad_g_idx_is_refused():
    codes = torch.zeros(2, 4, dtype=torch.uint8)
    scales, zeros = torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"g_idx holds group 0\.\.3, outside the "
                                         r"checkpoint's 0\.\.2"):
        row_share_form(codes, scales, zeros, torch.tensor([0, 3, 1, 1]), 4, 2, "w")
    with pytest.raises(ValueError, match=r"g_idx gives group 1 3 of this rank's columns, "
                                         r"more than the group size 2"):
        row_share_form(codes, scales, zeros, torch.tensor([0, 1, 1, 1]), 4, 2, "w")
