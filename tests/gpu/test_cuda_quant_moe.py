"""The Triton grouped GEMMs of integer-quantized MoE experts (ops/triton_quant_moe.py)
compiled on a GPU: against `fused_experts` over the PyTorch reference in fp32 and bf16
(what the interpreter tests of tests/unit/test_triton_quant_moe.py cannot check), and
captured in a CUDA graph whose replays with new routing equal eager runs (the point
of the sync-free path). Skipped without CUDA (scripts/gpu_check.sh runs them)."""
from __future__ import annotations

import pytest
import torch

from conftest import random_quantized_weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

E, H, I, TOP_K = 16, 256, 192, 4


def _qw(n, k, bits, group, perm, seed):
    top = 1 << bits
    return random_quantized_weight(n, k, bits, group, perm, seed, 0.3 / top, 0.02 / top)


def _experts(bits, perm):
    w13 = [_qw(2 * I, H, bits, 64, perm, e) for e in range(E)]
    w2 = [_qw(H, I, bits, 64, perm, 100 + e) for e in range(E)]
    return w13, w2


def _routing(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    return torch.rand(tokens, TOP_K, generator=g).cuda(), ids.cuda()


@pytest.mark.parametrize("bits,perm", [(4, False), (4, True), (8, True)])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_int_experts_compiled_equal_the_reference(bits, perm, tokens):
    from tokenmill.models.layers.linear_methods.fused_moe import fused_experts
    from tokenmill.models.layers.linear_methods.quantized_moe import QuantizedExperts
    from tokenmill.ops.triton_quant_moe import IntExpertsTriton, fused_experts_triton
    torch.backends.cuda.matmul.allow_tf32 = False
    w13, w2 = _experts(bits, perm)
    g13, g2 = IntExpertsTriton(w13, "cuda"), IntExpertsTriton(w2, "cuda")
    weights, ids = _routing(tokens, tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1)).cuda()
    cpu = [t.cpu() for t in (x, weights, ids)]
    want = fused_experts(cpu[0], QuantizedExperts(w13, torch.float32),
                         QuantizedExperts(w2, torch.float32), cpu[1], cpu[2])
    got = fused_experts_triton(x, g13, g2, weights, ids)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    xb, wb = x.bfloat16(), weights.bfloat16()
    want_b = fused_experts(xb.cpu(), QuantizedExperts(w13, torch.bfloat16),
                           QuantizedExperts(w2, torch.bfloat16), wb.cpu(), cpu[2])
    got_b = fused_experts_triton(xb, g13, g2, wb, ids)
    assert got_b.dtype == torch.bfloat16
    err = (got_b.cpu().float() - want_b.float()).abs().amax()
    assert err <= 4 * 2 ** -8 * want_b.float().abs().amax()


def test_int_experts_replay_in_a_cuda_graph_with_new_routing():
    from tokenmill.ops.triton_quant_moe import IntExpertsTriton, fused_experts_triton
    w13, w2 = _experts(4, True)
    g13, g2 = IntExpertsTriton(w13, "cuda"), IntExpertsTriton(w2, "cuda")
    tokens = 8
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(tokens, 0)
    weights = weights.bfloat16()
    fused_experts_triton(x, g13, g2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(x, g13, g2, weights, ids)
    for seed in (1, 2, 3):  # new routing each replay (the first: one expert for all)
        new_w, new_ids = _routing(tokens, seed)
        if seed == 1:  # every token's first slot to expert 5
            new_ids[:, 0] = 5
            new_ids[:, 1:] = torch.arange(6, 5 + TOP_K, device="cuda")
        ids.copy_(new_ids)
        weights.copy_(new_w.bfloat16())
        x.normal_()
        graph.replay()
        # (index_add_'s atomics may sum a token's slots in another order, each add
        # rounded to bf16: seen 0.0078 on outputs of about 2 on an H200; a wrong routing
        # is off by the outputs' size)
        want = fused_experts_triton(x, g13, g2, weights, ids).float()
        torch.testing.assert_close(out.float(), want, rtol=0,
                                   atol=2 ** -6 * want.abs().max().item())
