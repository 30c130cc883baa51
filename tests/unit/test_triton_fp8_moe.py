"""The Triton grouped GEMMs of block-scaled FP8 MoE experts (`Fp8ExpertsTriton`,
tokenmill/ops/triton_quant_moe.py) against `fused_experts` over fp8.py's PyTorch
reference (`DequantizedExperts`), on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is imported), and the CUDA platform's
choice of them for `Fp8BlockFusedMoEMethod`. Tiny shapes: the interpreter runs each
program in Python."""
import pytest

from conftest import interpret_triton_or_skip

triton = interpret_triton_or_skip(__name__)

import torch  # noqa: E402

tm = pytest.importorskip("tokenmill.ops.triton_quant_moe")

from tokenmill.models.layers.linear_methods.fp8 import (DequantizedExperts,  # noqa: E402
                                                        Fp8BlockFusedMoEMethod,
                                                        per_channel_block)
from tokenmill.models.layers.linear_methods.fused_moe import fused_experts  # noqa: E402

HIDDEN, INTER = 100, 48  # K = 100: not a multiple of bk 48 nor of the kernel's K tile
PER_CHANNEL = per_channel_block(HIDDEN, INTER)  # (1, 100): --quantization fp8's form


def _fp8(e, n, k, block, seed):
    """e4m3 experts [e, n, k] (values up to ~448) and scale_inv giving outputs up to ~0.5."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    w = (torch.randn(e, n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(e, -(-n // bn), -(-k // bk), generator=g) + 0.5) * 2e-3
    return w, s


def _experts(num_experts, block, seed=0):
    """((w13, s13), (w2, s2)): gate | up [2I, H] and down [H, I], stacked."""
    return (_fp8(num_experts, 2 * INTER, HIDDEN, block, seed),
            _fp8(num_experts, HIDDEN, INTER, block, seed + 1))


def _routing(tokens, num_experts, top_k, seed=0, only=None):
    """topk ids (distinct per token) over the first `only` experts (None: all)."""
    g = torch.Generator().manual_seed(seed)
    pool = only or num_experts
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g), ids


def _triton(w13, w2, block):
    return (tm.Fp8ExpertsTriton(*w13, block, "cpu"), tm.Fp8ExpertsTriton(*w2, block, "cpu"))


def _reference(w13, w2, block, x, weights, ids, dtype=torch.float32):
    return fused_experts(x, DequantizedExperts(*w13, block, dtype),
                         DequantizedExperts(*w2, block, dtype), weights, ids, dtype)


# 128: one partial block each way; 16 x 32: K tiles each in one block column (a scale
# per output column) over four; 16 x 48: a block column edge inside a K tile (a scale
# per weight); per-channel: one column spanning K
BLOCKS = [(128, 128), (16, 32), (16, 48), PER_CHANNEL]
BLOCK_IDS = ["block128", "block16x32", "block16x48", "per_channel"]


@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (3, 2), (17, 2), (40, 1)])
def test_fp8_experts_equal_the_reference(block, tokens, top_k):
    # 6 experts, routing over the first 5: one always without tokens, more at 1 / 3 tokens
    w13, w2 = _experts(6, block)
    weights, ids = _routing(tokens, 6, top_k, seed=tokens, only=5)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    got = tm.fused_experts_triton(x, *_triton(w13, w2, block), weights, ids)
    want = _reference(w13, w2, block, x, weights, ids)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert want.abs().amax() > 0.1  # (outputs not near 0: the tolerance means something)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_wrong_scale_in_one_expert_is_seen():
    block = (16, 48)
    w13, w2 = _experts(4, block)
    weights, ids = _routing(17, 4, 2)
    x = torch.randn(17, HIDDEN)
    want = _reference(w13, w2, block, x, weights, ids)
    s2 = w2[1].clone()
    s2[2, 3, 0] *= 1.5  # expert 2's down_proj, one block (rows 48..63, all 48 columns)
    got = tm.fused_experts_triton(x, *_triton(w13, (w2[0], s2), block), weights, ids)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    hit = (ids == 2).any(1)  # only the tokens routed to expert 2 change
    assert hit.any() and not hit.all()
    torch.testing.assert_close(got[~hit], want[~hit], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
def test_bf16_within_bf16_rounding(block):
    """bf16 activations: the weights rounded to bf16 before each dot (as the reference's
    dequantized bf16 experts), fp32 accumulation, each GEMM's output rounded to bf16.
    Tolerance: 8 bf16 ulps (2^-8 relative) of the largest output: two GEMMs and an
    activation between them each round, and Triton's interpreter truncates fp32 ->
    bf16 (each weight and output up to 1 ulp off where a GPU rounds to nearest)."""
    w13, w2 = _experts(4, block)
    weights, ids = _routing(17, 4, 2)
    x = torch.randn(17, HIDDEN).to(torch.bfloat16)
    wb = weights.to(torch.bfloat16)
    got = tm.fused_experts_triton(x, *_triton(w13, w2, block), wb, ids)
    want = _reference(w13, w2, block, x, wb, ids, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    scale = want.float().abs().amax()
    assert (got.float() - want.float()).abs().amax() <= 8 * 2 ** -8 * scale


def test_the_stacked_layout_holds_the_bytes_once():
    block = (16, 48)
    (w, s), _ = _experts(3, block)
    experts = tm.Fp8ExpertsTriton(w, s, block, "cpu")
    # the checkpoint's bytes viewed, not copied; the scales as fp32
    assert experts.w.data_ptr() == w.data_ptr() and experts.w.dtype == torch.uint8
    assert torch.equal(experts.scale_inv, s.float())
    assert experts.nbytes() == w.numel() + s.numel() * 4


def _cuda_platform(monkeypatch):
    from tokenmill.platforms import cuda
    monkeypatch.setattr(cuda, "module_available", lambda name: name == "triton")
    return cuda.CudaPlatform.create("cpu", torch.float32)  # (decisions only: no GPU here)


@pytest.mark.parametrize("block,per_channel", [((16, 48), False), (PER_CHANNEL, True)],
                         ids=["block", "per_channel"])
def test_the_cuda_platform_gives_fp8_experts_the_triton_gemms(monkeypatch, block,
                                                              per_channel):
    """The CUDA platform's choice for FP8 experts: the Triton layout holds the weights
    (the layer's stacks become meta, its scales go) and computes what the PyTorch
    method computes; the flag survives with_compute_dtype / for_platform; a second
    prepare_model keeps it; the CPU platform's method stays the PyTorch one."""
    from tokenmill.models.layers.moe import FusedMoE
    from tokenmill.platforms.cpu import CpuPlatform
    platform = _cuda_platform(monkeypatch)
    assert platform.quantized_gemm == "triton"
    layer = FusedMoE(4, HIDDEN, INTER)
    layer.use_method(Fp8BlockFusedMoEMethod(block, per_channel=per_channel), torch.float32)
    (w13, s13), (w2, s2) = _experts(4, block)
    with torch.no_grad():
        layer.gate_up_proj.copy_(w13)
        layer.gate_up_proj_scale_inv.copy_(s13)
        layer.down_proj.copy_(w2)
        layer.down_proj_scale_inv.copy_(s2)
    weights, ids = _routing(7, 4, 2)
    x = torch.randn(7, HIDDEN)
    want = layer(x, weights, ids)

    cpu_method = CpuPlatform.create().moe_method(layer)
    assert isinstance(cpu_method, Fp8BlockFusedMoEMethod) and not cpu_method.triton

    method = layer.method
    chosen = platform.moe_method(layer)
    assert isinstance(chosen, Fp8BlockFusedMoEMethod) and chosen is not method
    assert chosen.triton and chosen.gpu is None  # (weights moved when the layer sets it)
    assert chosen.with_compute_dtype(torch.float32).triton
    assert chosen.for_platform(None, None, 0).triton
    layer.set_method(chosen)
    assert chosen.gpu is not None
    assert layer.gate_up_proj.is_meta and layer.down_proj.is_meta
    assert not hasattr(layer, "gate_up_proj_scale_inv")
    assert not hasattr(layer, "down_proj_scale_inv")
    assert "Triton grouped GEMMs" in chosen.describe()
    assert chosen.nbytes() == w13.numel() + w2.numel() + 4 * (s13.numel() + s2.numel())
    torch.testing.assert_close(layer(x, weights, ids), want, rtol=1e-5, atol=1e-5)
    assert platform.moe_method(layer) is chosen  # a second prepare_model keeps it
    widened = chosen.with_compute_dtype(torch.float32)  # shares the device layout
    assert widened.gpu is chosen.gpu
