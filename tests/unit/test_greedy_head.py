"""The int8-screened greedy lm_head (kernels/cpu_greedy_head.cpp, layers/greedy_head.py).

Its token must be exactly argmax(linear_bf16(x)) as torch computes it: the
lowest index among equal (bf16-rounded) logits, the first NaN if there is one.
The kernel is AVX-512 code: it is tested at those levels, and the levels below
are tested for what they do instead (no screen: the CPU platform gives the runner
the full lm_head).
"""
from __future__ import annotations

import pytest
import torch

from tokenmill import cpu_platform
from tokenmill.cpu_platform import CpuPlatform
from tokenmill.kernels import all_levels
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.greedy_head import GreedyHead, pack_int8_screen
from tokenmill.models.layers.linear import Linear

NO_BIAS = torch.empty(0)
# The levels whose build has the screen (x86 names: skipped, named, where the CPU
# cannot run them), and those without it.
SCREEN_LEVELS = ["avx512", "avx512_vnni"]
screen_levels = pytest.mark.parametrize("kernel_level", SCREEN_LEVELS, indirect=True)
no_screen_levels = pytest.mark.parametrize(
    "kernel_level", [lv for lv in all_levels() if lv not in SCREEN_LEVELS], indirect=True)


def reference(ops, x, packed, n):
    return ops.linear_bf16(x, packed, n, NO_BIAS).float().argmax(dim=-1)


def screened(ops, x, w):
    """-> (token ids, exact blocks recomputed) for weights w [N, K] bf16."""
    q, scale, coef, l1 = pack_int8_screen(w)
    return ops.greedy_lm_head(x, ops.pack_bf16_weight(w), q, scale, coef, l1, w.shape[0])


def normalised(m, k, g):
    """Rows like a final RMSNorm's output: unit RMS."""
    x = torch.randn(m, k, generator=g)
    return x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()


# N not a multiple of 32 or 64, K odd (a padded k pair) and K over one int32 chunk
# (1024 k): every layout remainder; M from 1 to a row count with a 12-row remainder.
@pytest.mark.parametrize("m,n,k", [(1, 1000, 64), (2, 1001, 95), (3, 2048, 128), (5, 70, 33),
                                   (8, 333, 1100), (13, 4000, 48), (1, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@screen_levels
def test_matches_argmax_of_linear_bf16(ops, m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = normalised(m, k, g).to(dtype)
    ids, blocks = screened(ops, x, w)
    assert ids.dtype == torch.int64 and ids.shape == (m,)
    assert ids.tolist() == reference(ops, x, ops.pack_bf16_weight(w), n).tolist()
    assert 1 <= blocks <= (n + 31) // 32


@screen_levels
def test_screen_recomputes_few_blocks(ops):
    # The point of the screen: a bench-sized head (32000 x 512) recomputes a few of
    # its 1000 column blocks, not all of them.
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32000, 512, generator=g) * 0.02).bfloat16()
    x = normalised(1, 512, g).bfloat16()
    ids, blocks = screened(ops, x, w)
    assert ids.tolist() == reference(ops, x, ops.pack_bf16_weight(w), 32000).tolist()
    assert blocks <= 50


@screen_levels
def test_exact_ties_pick_the_lowest_index(ops):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3000, 64, generator=g) * 0.05).bfloat16()
    x = normalised(1, 64, g)
    top = (x[0] * 0.5).bfloat16()  # aligned with x: the largest logit by far
    for col in (2999, 2100, 1700, 65):  # in other blocks of both layouts; 65 is lowest
        w[col] = top
    for dtype in (torch.bfloat16, torch.float32):
        ids, _ = screened(ops, x.to(dtype), w)
        assert ids.tolist() == [65]


@screen_levels
def test_bf16_rounding_ties_follow_the_rounded_logits(ops):
    # Columns whose fp32 logits differ by less than a bf16 ulp round to the same
    # logit; torch's argmax then takes the lowest index, so must the screen.
    g = torch.Generator().manual_seed(2)
    k = 128
    w = (torch.randn(2000, k, generator=g) * 0.05).bfloat16()
    x = normalised(1, k, g).bfloat16()
    top = (x[0].float() * 0.3).bfloat16()
    w[40] = top
    w[1500] = top
    # One bf16 ulp further from zero, on the side that raises column 1500's logit.
    step = 1 if bool((x[0, 0] > 0) == (top[0] > 0)) else -1
    w[1500, 0] = (top[0].view(torch.int16) + step).view(torch.bfloat16)
    packed = ops.pack_bf16_weight(w)
    exact = ops.linear_bf16(x.float(), packed, 2000, NO_BIAS)[0]
    assert exact[1500] > exact[40]  # the later column is larger in fp32 ...
    assert exact[40].bfloat16() == exact[1500].bfloat16()  # ... but equal once rounded
    ids, _ = screened(ops, x, w)
    assert ids.tolist() == reference(ops, x, packed, 2000).tolist() == [40]


@screen_levels
def test_degenerate_inputs_match_torch(ops):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(500, 32, generator=g) * 0.05).bfloat16()
    w[100:200] = 0  # zero rows: a zero scale
    packed = ops.pack_bf16_weight(w)
    rows = [torch.zeros(32), torch.full((32,), 1e30), normalised(1, 32, g)[0] * 1e-30]
    nan_row = normalised(1, 32, g)[0]
    nan_row[5] = float("nan")
    rows.append(nan_row)
    inf_row = normalised(1, 32, g)[0]
    inf_row[3] = float("inf")
    rows.append(inf_row)
    outlier = normalised(1, 32, g)[0]
    outlier[7] = 300.0
    rows.append(outlier)
    x = torch.stack(rows)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ids, _ = screened(ops, xd, w)
        assert ids.tolist() == reference(ops, xd, packed, 500).tolist()


def test_rejects_bad_layouts(ops):
    # Every level checks its arguments, with or without the screen.
    w = torch.randn(100, 16).bfloat16()
    q, scale, coef, l1 = pack_int8_screen(w)
    packed = ops.pack_bf16_weight(w)
    with pytest.raises(RuntimeError, match="1 to 128 rows"):
        ops.greedy_lm_head(torch.randn(129, 16), packed, q, scale, coef, l1, 100)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.greedy_lm_head(torch.randn(1, 16), packed, q[:1], scale, coef, l1, 100)
    with pytest.raises(RuntimeError, match="pack_bf16_weight"):
        ops.greedy_lm_head(torch.randn(1, 16), w, q, scale, coef, l1, 100)


def test_pack_bounds_the_quantisation_error():
    # coef >= max |s q - w| per column, so the kernel's bound holds for any x.
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(130, 40, generator=g) * 0.1).bfloat16()
    w[3, 5] = 7.0  # one outlier: a coarse scale for that row
    q, scale, coef, l1 = pack_int8_screen(w)
    assert q.shape == (3, 20, 64, 2) and q.dtype == torch.int8
    cols = q.permute(0, 2, 1, 3).reshape(192, 40)[:130].double()
    err = (cols * scale[:130, None].double() - w.double()).abs().amax(dim=1)
    assert (coef[:130].double() >= err).all()
    assert (l1[:130].double() >= w.double().abs().sum(dim=1)).all()
    assert (scale[130:] == 0).all() and (coef[130:] == 0).all()


@screen_levels
def test_greedy_head_for_a_linear_layer(ops):
    torch.manual_seed(5)
    lin = Linear(48, 700, bias=False).bfloat16()
    lin.pack_bf16(ops, 128)
    lin.set_compute_dtype(torch.float32)
    head = GreedyHead.build(lin, ops)
    assert head is not None
    x = torch.randn(3, 48).bfloat16()
    assert head(x).tolist() == lin(x).float().argmax(dim=-1).tolist()
    assert head.blocks_recomputed >= 1
    biased = Linear(48, 70, bias=True).bfloat16()
    biased.pack_bf16(ops, 128)
    biased.set_compute_dtype(torch.float32)
    assert GreedyHead.build(biased, ops) is None  # the screen has no bias term
    plain = Linear(48, 70, bias=False)  # fp32 weights: no packed bf16 copy
    assert GreedyHead.build(plain, ops) is None
    assert GreedyHead.build(lin, None) is None  # no kernels (the PyTorch path)


@no_screen_levels
def test_no_screen_below_avx512(ops, monkeypatch):
    """Below AVX-512 the build has no screen: the kernel says so, the CPU platform keeps
    a widened Linear on its fp32 GEMM (nothing packed to screen) and gives the runner
    the full lm_head (tests/test_greedy_head_engine.py: same tokens), and
    GreedyHead.build gives None even for a lm_head packed by hand."""
    assert not ops.has_greedy_lm_head
    w = (torch.randn(100, 16) * 0.05).bfloat16()
    q, scale, coef, l1 = pack_int8_screen(w)
    with pytest.raises(RuntimeError, match=f"needs AVX-512: this is the {ops.capability} build"):
        ops.greedy_lm_head(torch.randn(1, 16), ops.pack_bf16_weight(w), q, scale, coef, l1, 100)
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
    platform = CpuPlatform.create("cpu", torch.bfloat16)
    assert platform.lm_head == "full" and platform.greedy_head_max_rows == 0
    lin = Linear(48, 700, bias=False).bfloat16()
    platform.prepare_model(lin)
    assert lin.weight.dtype == torch.float32
    assert (lin.packed_bf16 is not None) == ops.has_fast_linear_bf16
    # Even a lm_head packed by hand: the kernel refuses, build gives None.
    by_hand = Linear(48, 700, bias=False).bfloat16()
    by_hand.pack_bf16(ops, 128)
    by_hand.set_compute_dtype(torch.float32)
    assert GreedyHead.build(by_hand, ops) is None
