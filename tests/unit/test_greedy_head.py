"""The int8-screened greedy lm_head (kernels/cpu_greedy_head.cpp, layers/greedy_head.py).

Its token must be exactly argmax(linear_bf16(x)) as torch computes it: the
lowest index among equal (bf16-rounded) logits, the first NaN if there is one.
Every test runs at every capability level this CPU runs (the `ops` fixture): the
screen's inner loop is per ISA (AVX-512 VNNI / madd, AVX2, SSE2, NEON), the rest
is shared. The screen alone is also checked bit for bit against int64 sums at each
x86 level, on the plain-array fallback and on aarch64 NEON under qemu
(tests/kernels/greedy_screen_check.cpp).
"""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels.testing import (IS_X86, aarch64_tools, build_and_run, host_compiler,
                                       kernel_level, ops)  # noqa: F401 (fixtures)
from tokenmill.models.layers.greedy_head import GreedyHead, pack_int8_screen
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods import (PackedBf16LinearMethod, PackedF32LinearMethod,
                                                UnquantizedLinearMethod)

NO_BIAS = torch.empty(0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCREEN_CHECK = os.path.join(ROOT, "tests", "kernels", "greedy_screen_check.cpp")


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


# N not a multiple of 32 or 64, K odd (a padded k pair) and K over one and two int32
# chunks (1024 k): every layout remainder; M from 1 to 128, with remainders of every
# level's row blocks (4 at AVX-512 and NEON, 2 at AVX2 and SSE2) and linear_bf16's
# (12 at AVX-512, 3 at AVX2, 6 at NEON and SSE2; widened from 24 rows).
@pytest.mark.parametrize("m,n,k", [(1, 1000, 64), (2, 1001, 95), (3, 2048, 128), (5, 70, 33),
                                   (8, 333, 1100), (13, 4000, 48), (1, 5, 8), (1, 777, 2049),
                                   (4, 3000, 257), (31, 1500, 63), (128, 1100, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_argmax_of_linear_bf16(ops, m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = normalised(m, k, g).to(dtype)
    ids, blocks = screened(ops, x, w)
    assert ids.dtype == torch.int64 and ids.shape == (m,)
    assert ids.tolist() == reference(ops, x, ops.pack_bf16_weight(w), n).tolist()
    assert 1 <= blocks <= (n + 31) // 32


def test_screen_recomputes_few_blocks(ops):
    # The point of the screen: a bench-sized head (32000 x 512) recomputes a few of
    # its 1000 column blocks, not all of them.
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32000, 512, generator=g) * 0.02).bfloat16()
    x = normalised(1, 512, g).bfloat16()
    ids, blocks = screened(ops, x, w)
    assert ids.tolist() == reference(ops, x, ops.pack_bf16_weight(w), 32000).tolist()
    assert blocks <= 50


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


def test_greedy_head_for_a_linear_layer(ops):
    torch.manual_seed(5)
    lin = Linear(48, 700, bias=False).bfloat16()
    lin.set_method(PackedBf16LinearMethod(ops, 128, UnquantizedLinearMethod(torch.float32)))
    head = GreedyHead.build(lin, ops)
    assert head is not None
    x = torch.randn(3, 48).bfloat16()
    assert head(x).tolist() == lin(x).float().argmax(dim=-1).tolist()
    assert head.blocks_recomputed >= 1
    biased = Linear(48, 70, bias=True).bfloat16()
    biased.set_method(PackedBf16LinearMethod(ops, 128, UnquantizedLinearMethod(torch.float32)))
    assert GreedyHead.build(biased, ops) is None  # the screen has no bias term
    plain = Linear(48, 70, bias=False)  # fp32 weights, not packed
    assert GreedyHead.build(plain, ops) is None
    assert GreedyHead.build(lin, None) is None  # no kernels (the PyTorch path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_surely_finite_only_when_every_row_is(ops, dtype):
    """The runner skips its own NaN check of the hidden rows when the screen shows them
    finite: a row with an inf or a NaN must never pass as finite (the kernel recomputes
    every block then), and an all-blocks call is "unknown", never "finite"."""
    torch.manual_seed(6)
    lin = Linear(64, 700, bias=False).to(dtype)
    packed = (PackedBf16LinearMethod if dtype == torch.bfloat16 else PackedF32LinearMethod)
    lin.set_method(packed(ops, 128, UnquantizedLinearMethod(torch.float32)))
    head = GreedyHead.build(lin, ops)
    x = torch.randn(4, 64).to(dtype)
    head(x)
    assert head.rows_surely_finite()
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 17] = bad
        head(y)
        assert not head.rows_surely_finite()
        assert head.blocks_recomputed == head.num_blocks == 22
    head(torch.zeros(1, 64, dtype=dtype))  # every logit ties: all blocks, "unknown"
    assert not head.rows_surely_finite()


# ---- an fp32 lm_head: packed for linear_f32, screened in int8 -------------------------

def screened_f32(ops, x, w):
    q, scale, coef, l1 = pack_int8_screen(w)
    return ops.greedy_lm_head(x, ops.pack_f32_weight(w), q, scale, coef, l1, w.shape[0])


@pytest.mark.parametrize("m,n,k", [(1, 1000, 64), (2, 1001, 95), (4, 3000, 257),
                                   (1, 777, 2049), (8, 333, 1100), (13, 4000, 48),
                                   (128, 1100, 96)])
def test_fp32_head_matches_argmax_of_linear_f32(ops, m, n, k):
    """An fp32 model's lm_head: the screen reads int8 (a quarter of the fp32 bytes) and
    recomputes its candidate blocks as linear_f32 does, so the token is argmax of
    linear_f32's logits, bit for bit, ties and the partial last block included."""
    g = torch.Generator().manual_seed(m * 5 + n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    x = normalised(m, k, g)
    w[n - 1] = x[0] * 0.4  # row 0's largest logit, in the partial last block ...
    w[n // 3] = x[0] * 0.4  # ... tied with an earlier column: the lower index wins
    ids, blocks = screened_f32(ops, x, w)
    ref = ops.linear_f32(x, ops.pack_f32_weight(w), n, NO_BIAS).argmax(dim=-1)
    assert ids.tolist() == ref.tolist()
    assert ids[0] == n // 3
    assert 1 <= blocks <= (n + 31) // 32
    with pytest.raises(RuntimeError, match="fp32 x"):
        screened_f32(ops, x.bfloat16(), w)


def test_fp32_head_screens_few_blocks_and_handles_nan(ops):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32000, 512, generator=g) * 0.02
    x = normalised(2, 512, g)
    ids, blocks = screened_f32(ops, x, w)
    packed = ops.pack_f32_weight(w)
    assert ids.tolist() == ops.linear_f32(x, packed, 32000, NO_BIAS).argmax(-1).tolist()
    assert blocks <= 50
    x[1, 3] = float("nan")
    ids, _ = screened_f32(ops, x, w)
    assert ids.tolist() == ops.linear_f32(x, packed, 32000, NO_BIAS).argmax(-1).tolist()


def test_greedy_head_for_an_fp32_linear_layer(ops):
    """The CPU platform packs an fp32 lm_head for linear_f32 and builds the screen of
    it: the same token as the layer's own logits."""
    from tokenmill.platforms.cpu import CpuPlatform
    torch.manual_seed(8)
    lin = Linear(40, 300, bias=False)
    platform = CpuPlatform.create("cpu", torch.float32)
    assert platform.lm_head == "greedy_int8" and platform.greedy_head_max_rows == 4
    platform.prepare_model(lin)
    head = GreedyHead.build(lin, ops)
    assert head is not None and head.dtype == torch.float32
    x = torch.randn(4, 40)
    assert head(x).tolist() == lin(x).argmax(dim=-1).tolist()


def test_every_level_has_the_screen(ops):
    """Every level's build vectorises the screen (x86-64's default level is SSE2), and
    the CPU platform packs a bf16 lm_head there (packed weights only where bf16 is
    emulated) for it to screen."""
    assert ops.has_greedy_lm_head and ops.has_fast_linear_bf16
    from tokenmill.platforms import cpu as cpu_platform
    from tokenmill.platforms.cpu import CpuPlatform
    torch.manual_seed(6)
    lin = Linear(40, 300, bias=False).bfloat16()
    ref = lin.weight.detach().clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
        platform = CpuPlatform.create("cpu", torch.bfloat16)
    assert platform.lm_head == "greedy_int8"
    platform.prepare_model(lin)
    assert isinstance(lin.method, PackedBf16LinearMethod) and lin.method.fallback is None
    assert torch.equal(lin.dense_weight(), ref)  # the screen is built from the packed copy
    head = GreedyHead.build(lin, ops)
    x = torch.randn(5, 40)
    assert head(x).tolist() == lin(x).argmax(dim=-1).tolist()


@pytest.mark.parametrize("threads", [1, 2])
def test_many_rows_with_ties_nan_and_partial_blocks(ops, threads):
    """128 rows at once: exact ties inside a row (lowest index wins), a NaN row, an
    all-zero row, a tie whose columns straddle the partial last block, K odd."""
    g = torch.Generator().manual_seed(7)
    m, n, k = 128, 2017, 75  # 2017 = 31 * 64 + 33: the last 64-block has 33 columns
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = normalised(m, k, g)
    for r, cols in ((0, (1900, 2010, 1999)), (5, (64, 63, 2000)), (77, (2016, 2015)),
                    (127, (31, 32, 33))):
        top = (x[r] * 0.5).bfloat16()
        for c in cols:
            w[c] = top
    x[3, 10] = float("nan")
    x[9] = 0
    packed = ops.pack_bf16_weight(w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # pass 1's per-thread lower bounds, merged
    try:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            ids, blocks = screened(ops, xd, w)
            ref = reference(ops, xd, packed, n)
            assert ids.tolist() == ref.tolist()
            assert ids[0] == 1900 and ids[5] == 63 and ids[77] == 2015 and ids[127] == 31
            assert ids[9] == 0  # all logits 0: the first column
            assert blocks == (n + 31) // 32  # the NaN row: every block is recomputed
    finally:
        torch.set_num_threads(saved)


def test_nan_and_inf_weights(ops):
    # A NaN or inf weight makes that column's scale NaN or inf: its bounds are NaN,
    # so its block must be recomputed, and argmax takes the NaN logit (the first).
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(700, 40, generator=g) * 0.05).bfloat16()
    w[450, 3] = float("nan")
    w[600, 7] = float("inf")
    packed = ops.pack_bf16_weight(w)
    x = normalised(3, 40, g)
    for dtype in (torch.float32, torch.bfloat16):
        ids, _ = screened(ops, x.to(dtype), w)
        assert ids.tolist() == reference(ops, x.to(dtype), packed, 700).tolist()
        assert ids.tolist() == [450] * 3  # the first NaN logit


def test_same_screen_at_every_level(ops):
    """The approximation is exact int32 sums converted and added in one order, so
    every level recomputes the same blocks as the default level."""
    base = kernels.cpu_ops("default")
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(5000, 130, generator=g) * 0.03).bfloat16()
    x = normalised(6, 130, g).bfloat16()
    # A second block near the maximum makes the count depend on the bounds' values.
    w[4321] = (x[2].float() * 0.4).bfloat16()
    w[17] = (x[2].float() * 0.3999).bfloat16()
    assert screened(ops, x, w)[1] == screened(base, x, w)[1]
    assert screened(ops, x, w)[0].tolist() == screened(base, x, w)[0].tolist()


SCREEN_ISA = {"default": "sse2", "avx2": "avx2", "avx512": "avx512", "avx512_vnni": "avx512",
              "avx512_bf16": "avx512", "amx": "avx512"}


@pytest.mark.parametrize("level", kernels.all_levels())
def test_screen_bit_exact_at_each_level(tmp_path, level):
    if level not in kernels.runnable_levels():
        pytest.skip(f"this CPU cannot run the {level} build (it runs "
                    f"{', '.join(kernels.runnable_levels())})")
    out = build_and_run(SCREEN_CHECK, tmp_path / "screen_check", host_compiler(),
                        kernels.LEVELS[level].flags)
    isa = SCREEN_ISA[level] if IS_X86 else "neon"
    assert f"screen={isa} " in out and ": 0 failures" in out, out


def test_screen_bit_exact_on_the_generic_fallback(tmp_path):
    out = build_and_run(SCREEN_CHECK, tmp_path / "screen_check", host_compiler(),
                        ["-DTM_VEC_FORCE_GENERIC"])
    assert "screen=generic " in out and ": 0 failures" in out, out


@pytest.mark.skipif(not IS_X86, reason="the cross-compile checks run on x86-64 hosts")
def test_screen_bit_exact_on_aarch64_neon_under_qemu(tmp_path):
    gxx, qemu = aarch64_tools()
    out = build_and_run(SCREEN_CHECK, tmp_path / "screen_check", gxx, ["-static"],
                        runner=(qemu,))
    assert "screen=neon " in out and ": 0 failures" in out, out
