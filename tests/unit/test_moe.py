"""The MoE layer (tokenmill/models/layers/moe.py) against a naive per-token reference,
and the SparseMoeBlock against transformers' Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE blocks."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.linear import ALL_ROWS, widen_gemms
from tokenmill.models.layers.linear_methods import (PackedBf16FusedMoEMethod,
                                                    SyncFreeFusedMoEMethod)
from tokenmill.models.layers.linear_methods import fused_moe as moe_mod
from tokenmill.models.layers.moe import FusedMoE, SparseMoeBlock, route


def naive_moe(x, w13, w2, weights, ids, activation="silu"):
    """One token and one slot at a time: y[t] = sum_k w[t,k] * down(act(gate x) * up x),
    act SiLU or (Gemma 4) tanh-approximated GELU."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    act = F.silu if activation == "silu" else lambda v: F.gelu(v, approximate="tanh")
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = w13[e, :inter], w13[e, inter:]
            h = act(gate @ x[t]) * (up @ x[t])
            out[t] += weights[t, k] * (w2[e] @ h)
    return out


def _experts(num_experts, hidden, inter, seed=0, dtype=torch.float32, activation="silu"):
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(num_experts, hidden, inter, activation=activation)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(moe.gate_up_proj.shape, generator=g) * 0.2)
        moe.down_proj.copy_(torch.randn(moe.down_proj.shape, generator=g) * 0.2)
    return moe.to(dtype).requires_grad_(False)


CASES = [  # (tokens, experts, top_k, renormalize)
    (1, 8, 2, True),
    (17, 8, 2, False),
    (40, 16, 1, False),   # top-1 of 16: several experts get no tokens
    (6, 32, 3, True),     # more experts than (token, slot) pairs
    (5, 4, 4, True),      # every expert for every token
]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,num_experts,top_k,renorm", CASES)
def test_fused_experts_match_per_token_reference(tokens, num_experts, top_k, renorm,
                                                 activation):
    torch.manual_seed(tokens)
    hidden, inter = 24, 12
    moe = _experts(num_experts, hidden, inter, seed=num_experts, activation=activation)
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, num_experts)
    weights, ids = route(logits, top_k, renorm)
    # route: softmax over all experts, top-k, renormalised only when asked.
    probs = torch.softmax(logits, dim=-1)
    ref_w, ref_ids = probs.topk(top_k, dim=-1)
    if renorm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    got = moe(x, weights, ids)
    ref = naive_moe(x, moe.gate_up_proj, moe.down_proj, weights, ids, activation)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if activation != "silu":  # the activation is really applied, not SiLU's
        silu = naive_moe(x, moe.gate_up_proj, moe.down_proj, weights, ids)
        assert not torch.allclose(got, silu, atol=1e-3)


def test_one_gemm_pair_per_expert_that_received_tokens(monkeypatch):
    """The experts run as grouped GEMMs: 2 GEMMs per expert hit, none for idle experts."""
    torch.manual_seed(0)
    moe = _experts(16, 24, 12)
    x = torch.randn(64, 24)
    ids = torch.randint(0, 10, (64, 2))  # experts 10..15 get no tokens
    ids[:, 1] = (ids[:, 0] + 1) % 10
    weights = torch.rand(64, 2)
    calls = []
    mm = torch.mm

    def counting_mm(*args, **kw):
        calls.append(args[0].shape[0])
        return mm(*args, **kw)

    monkeypatch.setattr(torch, "mm", counting_mm)
    got = moe(x, weights, ids)
    monkeypatch.undo()
    hit = ids.unique()
    assert len(hit) == 10
    assert len(calls) == 2 * len(hit)
    assert sum(calls) == 2 * ids.numel()  # every (token, slot) pair once per GEMM
    torch.testing.assert_close(got, naive_moe(x, moe.gate_up_proj, moe.down_proj, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_widened_experts_match_bf16_experts():
    """bf16 experts widened to fp32 GEMMs: weights exact in fp32, output bf16, same math."""
    torch.manual_seed(0)
    block = SparseMoeBlock(32, 8, 2, 16, norm_topk_prob=True, shared_expert_intermediate_size=24,
                           shared_expert_gate=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    block = block.to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(9, 32).to(torch.bfloat16)
    native = block(x)
    w13 = block.experts.gate_up_proj.float()
    # gate, experts, shared gate_up / down, shared_expert_gate
    assert widen_gemms(block, torch.float32) == 5
    assert block.experts.gate_up_proj.dtype == block.experts.down_proj.dtype == torch.float32
    assert block.experts.method.compute_dtype == torch.float32
    assert torch.equal(block.experts.gate_up_proj, w13)
    assert widen_gemms(block, torch.float32) == 0
    wide = block(x)
    assert wide.dtype == torch.bfloat16
    torch.testing.assert_close(wide.float(), native.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("max_rows", [ALL_ROWS, 3])
def test_packed_experts_match_widened_experts(ops, max_rows, activation):
    """bf16 experts packed for linear_bf16 (the CPU platform's packed_bf16 path), at every
    capability level: the widened fp32 GEMMs' math. ALL_ROWS: every expert slice takes
    the kernel and the bf16 weights are dropped (no fp32 copy either); 3: slices of up
    to 3 rows take it, the larger ones the GEMM."""
    torch.manual_seed(0)
    x = torch.randn(23, 40).bfloat16()
    logits = torch.randn(23, 8)
    logits[:, :2] += 3.0  # experts 0 and 1 get most tokens, the others a few
    weights, ids = route(logits, 2, True)
    counts = torch.bincount(ids.flatten(), minlength=8)
    assert (counts > 3).any() and ((counts > 0) & (counts <= 3)).any()
    ref_moe = _experts(8, 40, 24, dtype=torch.bfloat16, activation=activation)
    moe = _experts(8, 40, 24, dtype=torch.bfloat16, activation=activation)
    assert widen_gemms(ref_moe, torch.float32) == 1
    ref = ref_moe(x, weights.bfloat16(), ids)
    moe.set_method(PackedBf16FusedMoEMethod(ops, max_rows, torch.float32))
    assert widen_gemms(moe, torch.float32) == 0  # a chosen method is kept
    if max_rows == ALL_ROWS:
        assert moe.gate_up_proj.is_meta and moe.down_proj.is_meta
    else:
        assert moe.gate_up_proj.dtype == torch.float32
    packed = moe.method.packed
    assert all(p.dtype == torch.bfloat16 for p in packed.w13 + packed.w2)
    got = moe(x, weights.bfloat16(), ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_unknown_expert_activation_is_rejected():
    with pytest.raises(ValueError, match="activation"):
        FusedMoE(4, 8, 8, activation="relu")


def test_bad_top_k_is_rejected():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(16, 4, 5, 8, norm_topk_prob=False)


# ---- SparseMoeBlock vs transformers' blocks ------------------------------------------

def _hf_block(kind: str, norm_topk_prob: bool):
    import transformers as tf
    common = dict(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, vocab_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "qwen3_moe":
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
            block = Qwen3MoeSparseMoeBlock(tf.Qwen3MoeConfig(norm_topk_prob=norm_topk_prob,
                                                             **common))
        elif kind == "qwen3_next":
            from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
            block = Qwen3NextSparseMoeBlock(tf.Qwen3NextConfig(
                norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=24, **common))
        else:
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
                Qwen3_5MoeSparseMoeBlock)
            common.pop("intermediate_size")
            block = Qwen3_5MoeSparseMoeBlock(tf.Qwen3_5MoeTextConfig(
                shared_expert_intermediate_size=24, **common))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.float().eval()


@pytest.mark.parametrize("kind,norm", [("qwen3_moe", True), ("qwen3_moe", False),
                                       ("qwen3_next", True), ("qwen3_next", False),
                                       ("qwen3_5_moe", True)])
def test_sparse_moe_block_matches_hf(kind, norm):
    hf = _hf_block(kind, norm)
    shared = getattr(hf, "shared_expert", None)
    ours = SparseMoeBlock(32, 8, 2, 16, norm_topk_prob=norm,
                          shared_expert_intermediate_size=24 if shared is not None else 0,
                          shared_expert_gate=shared is not None)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        if shared is not None:
            ours.shared_expert.gate_up_proj.weight.copy_(
                torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    # The same parameter names as HF, but for the shared expert's packed gate/up.
    hf_names = {n.replace("gate_proj", "gate_up_proj").replace(".up_proj", ".gate_up_proj")
                for n, _ in hf.named_parameters()}
    assert {n for n, _ in ours.named_parameters()} == hf_names
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        ref = hf(x)
        got = ours(x.view(-1, 32)).view_as(ref)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,num_experts,top_k,renorm", CASES)
def test_sync_free_experts_match_reference_without_host_reads(tokens, num_experts, top_k,
                                                              renorm, activation, monkeypatch):
    """The CUDA path (SyncFreeFusedMoEMethod): the same sums, and the expert groups never
    reach the host (no tolist / item / nonzero / bincount: those stall a CUDA stream and cannot be
    captured in a graph); chunked gathers (a tiny GATHER_BYTES) change nothing."""
    torch.manual_seed(tokens)
    moe = _experts(num_experts, 24, 12, seed=num_experts, activation=activation)
    moe.set_method(SyncFreeFusedMoEMethod())
    x = torch.randn(tokens, 24)
    weights, ids = route(torch.randn(tokens, num_experts), top_k, renorm)
    ref = naive_moe(x, moe.gate_up_proj, moe.down_proj, weights, ids, activation)
    monkeypatch.setattr(moe_mod, "GATHER_BYTES", 3 * 24 * 24 * 4)  # 3 pairs per bmm
    for name in ("tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name: pytest.fail(f"host {_n}"))
    for name in ("nonzero", "bincount"):  # (CUDA's bincount reads the max on the host)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, **k: pytest.fail(f"host {_n}"))
    torch.testing.assert_close(moe(x, weights, ids), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,num_experts,top_k,renorm", CASES)
def test_sync_free_grouped_gemm_matches_the_gathered_fallback(tokens, num_experts, top_k,
                                                              renorm, monkeypatch):
    """The grouped GEMM a bf16 model takes on compute capability 9.0+ (torch._grouped_mm
    over the groups' end offsets, idle experts as empty groups), run through PyTorch's
    CPU implementation of the same operator: the sums of the gathered fallback, and
    still no host reads."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    torch.manual_seed(tokens)
    hidden, inter = 32, 24  # rows of 16-byte multiples, as the operator needs
    moe = _experts(num_experts, hidden, inter, seed=num_experts, dtype=torch.bfloat16)
    moe.set_method(SyncFreeFusedMoEMethod())
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    weights, ids = route(torch.randn(tokens, num_experts).to(torch.bfloat16), top_k,
                         renorm)
    gathered = moe(x, weights, ids)
    calls = []

    def grouped_mm(*a, **k):
        calls.append(k["offs"])
        return real(*a, **k)

    real = torch._grouped_mm
    monkeypatch.setattr(moe_mod, "_has_grouped_mm", lambda device: True)
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    for name in ("tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name: pytest.fail(f"host {_n}"))
    got = moe(x, weights, ids)
    assert len(calls) == 2  # gate_up, then down
    counts = torch.zeros(num_experts, dtype=torch.int64).index_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int64))
    assert torch.equal(calls[0], torch.cumsum(counts, 0, dtype=torch.int32))
    torch.testing.assert_close(got, gathered, atol=2e-2, rtol=2e-2)
