"""The Triton grouped GEMMs of integer-quantized MoE experts
(tokenmill/ops/triton_quant_moe.py) against `fused_experts` over the PyTorch
reference (`QuantizedExperts`), on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is imported), and the CUDA platform's
choice of them. Tiny shapes: the interpreter runs each program in Python."""
import pytest

from conftest import interpret_triton_or_skip, random_quantized_weight

triton = interpret_triton_or_skip(__name__)

import torch  # noqa: E402

tm = pytest.importorskip("tokenmill.ops.triton_quant_moe")

from tokenmill.models.layers.linear_methods.fused_moe import fused_experts  # noqa: E402
from tokenmill.models.layers.linear_methods.quantized_moe import QuantizedExperts  # noqa: E402
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight  # noqa: E402

HIDDEN, INTER = 45, 23  # odd K for both GEMMs (a half-filled last 4-bit byte)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # (the inputs drawn without a generator: the same every run)


def _qw(n, k, bits, group, perm=False, seed=0):
    top = 1 << bits  # (weights of like size whatever the bits: outputs of O(1))
    return random_quantized_weight(n, k, bits, group, perm, seed, 0.3 / top, 0.02 / top)


def _experts(num_experts, bits, group, perm=False, seed=0):
    """(w13, w2) per expert: gate | up [2I, H] and down [H, I]; act-order: each expert
    its own perm (different seeds)."""
    w13 = [_qw(2 * INTER, HIDDEN, bits, group, perm, seed + e) for e in range(num_experts)]
    w2 = [_qw(HIDDEN, INTER, bits, group, perm, seed + 100 + e) for e in range(num_experts)]
    return w13, w2


def _routing(tokens, num_experts, top_k, seed=0, only=None):
    """topk ids (distinct per token) over the first `only` experts (None: all)."""
    g = torch.Generator().manual_seed(seed)
    pool = only or num_experts
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return weights, ids


def _both(w13, w2, x, weights, ids, dtype=torch.float32):
    got = tm.fused_experts_triton(x, tm.IntExpertsTriton(w13, "cpu"),
                                  tm.IntExpertsTriton(w2, "cpu"), weights, ids)
    want = fused_experts(x, QuantizedExperts(w13, dtype), QuantizedExperts(w2, dtype),
                         weights, ids, dtype)
    return got, want


@pytest.mark.parametrize("bits,group,perm", [(4, 32, False), (4, -1, False), (4, 32, True),
                                             (8, 32, True), (8, -1, False)])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (3, 2), (17, 2), (40, 1)])
def test_int_experts_equal_the_reference(bits, group, perm, tokens, top_k):
    # 6 experts, routing over the first 5: one always without tokens, more at 1 / 3 tokens
    w13, w2 = _experts(6, bits, group, perm)
    weights, ids = _routing(tokens, 6, top_k, seed=tokens, only=5)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    got, want = _both(w13, w2, x, weights, ids)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_wrong_zero_point_in_one_expert_is_seen():
    w13, w2 = _experts(4, 4, 32)
    weights, ids = _routing(17, 4, 2)
    x = torch.randn(17, HIDDEN)
    _, want = _both(w13, w2, x, weights, ids)
    bad = _experts(4, 4, 32)[1]
    bad[2].zeros[5, 0] ^= 1  # expert 2's down_proj, one row's first group
    got = tm.fused_experts_triton(x, tm.IntExpertsTriton(w13, "cpu"),
                                  tm.IntExpertsTriton(bad, "cpu"), weights, ids)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # only the tokens routed to expert 2 change
    hit = (ids == 2).any(1)
    torch.testing.assert_close(got[~hit], want[~hit], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_within_bf16_rounding(bits):
    """bf16 activations: the weights rounded to bf16 before each dot (as a bf16 model's
    dequantized experts), fp32 accumulation, each GEMM's output rounded to bf16, as
    the reference. Tolerance: 8 bf16 ulps (2^-8 relative) of the largest output. Two
    GEMMs and an activation between them each round, and Triton's interpreter
    truncates fp32 -> bf16 (each weight and output up to 1 ulp off where a GPU
    rounds to nearest)."""
    w13, w2 = _experts(4, bits, 32, perm=bits == 4)
    weights, ids = _routing(17, 4, 2)
    x = torch.randn(17, HIDDEN).to(torch.bfloat16)
    got, want = _both(w13, w2, x, weights.to(torch.bfloat16), ids, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    scale = want.float().abs().amax()
    assert (got.float() - want.float()).abs().amax() <= 8 * 2 ** -8 * scale


@pytest.mark.parametrize("tokens,top_k,only", [(40, 1, 1), (17, 2, 2), (3, 4, None)])
def test_padded_slots_all_tokens_to_one_expert_and_every_expert_hit(tokens, top_k, only):
    """One expert gets every token (runs of several blocks: 40 rows of 16); two get all
    (both padded); every expert for every token (4 of 4)."""
    w13, w2 = _experts(4, 8, 16)
    weights, ids = _routing(tokens, 4, top_k, only=only)
    x = torch.randn(tokens, HIDDEN)
    got, want = _both(w13, w2, x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_align_pairs_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0]])  # pairs 0..5: experts 3 0 3 1 3 0
    sorted_token_ids, expert_ids = tm.align_pairs(ids, 5, 4)
    # capacity from the shapes: 6 pairs + min(5 experts, 6 pairs) x 3 padding = 21 -> 6
    # blocks; used: expert 0 (2 pairs), 1 (1), 3 (3), one block each
    assert sorted_token_ids.shape == (24,)
    assert expert_ids.tolist() == [0, 1, 3, -1, -1, -1]
    assert sorted_token_ids.view(6, 4).tolist()[:3] == [[1, 5, 6, 6], [3, 6, 6, 6],
                                                        [0, 2, 4, 6]]
    assert (sorted_token_ids[12:] == 6).all()
    # more experts than pairs: the bound is the pairs', not E's
    s, e = tm.align_pairs(torch.tensor([[7]]), 64, 16)
    assert s.numel() == 16 and e.tolist() == [7]


def test_the_stacked_layout_dequantizes_each_expert():
    """Experts of different code widths (a padded act-order share: perm repeats input
    columns, padding columns exactly 0) and one without perm, stacked together."""
    k = 40
    plain = _qw(24, k, 4, 16, perm=True, seed=1)
    g = torch.Generator().manual_seed(2)
    # padded share: 48 code columns over 40 inputs, the 8 padding columns code == zero
    codes = torch.randint(0, 16, (24, 48), generator=g).to(torch.uint8)
    zeros = torch.randint(0, 16, (24, 3), generator=g).to(torch.uint8)
    codes[:, 40:] = zeros[:, 2:3]
    perm = torch.cat([torch.randperm(k, generator=g), torch.arange(8)])
    padded = QuantizedWeight(codes, torch.rand(24, 3, generator=g) * 0.02, zeros, 4, 16,
                             perm, in_features=k).check()
    in_order = _qw(24, k, 4, 16, seed=3)
    experts = tm.IntExpertsTriton([plain, padded, in_order], "cpu")
    assert experts.perms.shape == (3, 48) and (experts.perms[0, 40:] == -1).all()
    for e, qw in enumerate([plain, padded, in_order]):
        torch.testing.assert_close(experts.dequantize(e), qw.dequantize(), rtol=0, atol=1e-6)
    x = torch.randn(5, k)
    ids = torch.tensor([0, 1, 2, 1, 0]).view(5, 1)
    y = tm.grouped_gemm(x, experts, *tm.align_pairs(ids, 3, 16), 5, 1, torch.float32,
                        (16, 32, 32))
    want = torch.stack([x[p] @ [plain, padded, in_order][ids[p, 0]].dequantize().t()
                        for p in range(5)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert experts.nbytes() == 3 * 24 * 24 + 3 * 3 * 24 * 5 + 3 * 48 * 4


def _cuda_platform(monkeypatch):
    from tokenmill.platforms import cuda
    monkeypatch.setattr(cuda, "module_available", lambda name: name == "triton")
    return cuda.CudaPlatform.create("cpu", torch.float32)  # (decisions only: no GPU here)


def test_the_cuda_platform_gives_quantized_experts_the_triton_gemms(monkeypatch):
    """GPTQ experts and int8-at-load experts through the CUDA platform's choice: the
    Triton layout holds the weights (no other copy) and computes what the PyTorch
    method computes; fp8 experts get theirs too; the CPU platform's stays."""
    from tokenmill.models.layers.linear_methods.fp8 import Fp8BlockFusedMoEMethod
    from tokenmill.models.layers.linear_methods.gptq import GptqLayout
    from tokenmill.models.layers.linear_methods.int8_at_load import Int8AtLoadFusedMoEMethod
    from tokenmill.models.layers.linear_methods.quantized_moe import QuantizedFusedMoEMethod
    from tokenmill.models.layers.moe import FusedMoE
    platform = _cuda_platform(monkeypatch)
    assert platform.quantized_gemm == "triton"
    weights, ids = _routing(7, 4, 2)
    x = torch.randn(7, HIDDEN)

    layer = FusedMoE(4, HIDDEN, INTER)
    method = QuantizedFusedMoEMethod(GptqLayout(4, 32, False))
    method.w13, method.w2 = _experts(4, 4, 32, perm=True)  # (as converted at load)
    layer.method = method
    want = layer(x, weights, ids)
    layer.set_method(platform.moe_method(layer))
    chosen = layer.method
    assert isinstance(chosen, QuantizedFusedMoEMethod) and chosen is not method
    assert chosen.gpu is not None and chosen.w13 is None and chosen.w2 is None
    assert "Triton" in chosen.describe()
    assert chosen.nbytes() == sum(w.nbytes() for w in chosen.gpu)
    torch.testing.assert_close(layer(x, weights, ids), want, rtol=1e-5, atol=1e-5)
    assert platform.moe_method(layer) is chosen  # a second prepare_model keeps it

    int8 = FusedMoE(4, HIDDEN, INTER)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # (weights of 0.2: outputs of O(1), as in test_moe.py)
        int8.gate_up_proj.copy_(torch.randn(int8.gate_up_proj.shape, generator=g) * 0.2)
        int8.down_proj.copy_(torch.randn(int8.down_proj.shape, generator=g) * 0.2)
    Int8AtLoadFusedMoEMethod.quantize_fused_moe(int8)
    want = int8(x, weights, ids)
    int8.set_method(platform.moe_method(int8))
    assert int8.method.gpu is not None and "Triton" in int8.method.describe()
    assert int8.gate_up_proj.is_meta and not hasattr(int8, "gate_up_proj_scale")
    torch.testing.assert_close(int8(x, weights, ids), want, rtol=1e-5, atol=1e-5)

    # fp8 experts too (tests/unit/test_triton_fp8_moe.py checks their numbers)
    fp8 = FusedMoE(4, 64, 32, method=Fp8BlockFusedMoEMethod((16, 32)))
    fp8_method = platform.moe_method(fp8)
    assert isinstance(fp8_method, Fp8BlockFusedMoEMethod) and fp8_method.triton

    from tokenmill.platforms.cpu import CpuPlatform
    cpu_layer = FusedMoE(4, HIDDEN, INTER)
    cpu_layer.method = QuantizedFusedMoEMethod(GptqLayout(4, 32, False))
    cpu_method = CpuPlatform.create().moe_method(cpu_layer)
    assert not cpu_method.triton and cpu_method.gpu is None
