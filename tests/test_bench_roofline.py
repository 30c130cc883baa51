"""The roofline of the benches: model FLOP counts by hand, the GEMM peak, the ratios."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.bench import roofline as rl


def test_flops_of_tiny_llama_by_hand(llama_tiny):
    """Llama, hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 384,
    tied embeddings (lm_head is the embedding matrix); norms and biases are not GEMMs."""
    f = rl.count_model_flops(llama_tiny.path)
    per_layer = (64 * 64 + 2 * (64 * 32) + 64 * 64  # q, k, v, o
                 + 3 * (64 * 128))                   # gate, up, down
    assert f.layer_params == 2 * per_layer == 73728
    assert f.lm_head_params == 384 * 64
    assert (f.attention_layers, f.num_heads, f.head_dim) == (2, 4, 16)
    # A 5-token prompt and 3 outputs: positions 0..6 go through the layers (the last
    # output is never fed back), lm_head runs on the 3 rows that sample, position p
    # attends to p + 1 keys.
    r = f.request(5, 3)
    assert r["dense"] == 2 * 73728 * 7
    assert r["lm_head"] == 2 * 24576 * 3
    assert r["attention"] == 4 * 2 * 4 * 16 * (1 + 2 + 3 + 4 + 5 + 6 + 7)
    assert r["total"] == r["dense"] + r["lm_head"] + r["attention"] == 1_193_984
    w = f.workload([5, 2], [3, 1])
    r2 = f.request(2, 1)
    assert w == {k: r[k] + r2[k] for k in r}


def test_flops_hybrid_moe_by_hand(tmp_path):
    """Only full-attention layers count attention; experts count their active share;
    convolutions count (2 FLOPs a weight); vision towers, embeddings and 1-D tensors don't."""
    cfg = dict(hidden_size=8, num_attention_heads=2, head_dim=4, num_hidden_layers=2,
               layer_types=["linear_attention", "full_attention"], num_experts=4,
               num_experts_per_tok=1, vocab_size=10, intermediate_size=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shapes = {
        "model.embed_tokens.weight": (10, 8),
        "model.layers.0.linear_attn.in_proj.weight": (16, 8),      # 128
        "model.layers.0.linear_attn.conv1d.weight": (16, 1, 4),    # 64
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.1.self_attn.q_proj.weight": (8, 8),          # 64
        "model.layers.1.self_attn.q_proj.bias": (8,),
        "model.layers.1.mlp.gate.weight": (4, 8),                  # 32 (router)
        "model.layers.1.mlp.experts.gate_up_proj": (4, 16, 8),     # 512 x 1/4
        "model.visual.layers.0.qkv.weight": (24, 8),
        "lm_head.weight": (10, 8),
    }
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(tmp_path / "model.safetensors"))
    f = rl.count_model_flops(str(tmp_path))
    assert f.layer_params == 128 + 64 + 64 + 32 + 128
    assert f.lm_head_params == 80
    assert (f.attention_layers, f.num_heads, f.head_dim) == (1, 2, 4)
    assert f.request(3, 2) == {"dense": 2 * 416 * 4, "lm_head": 2 * 80 * 2,
                               "attention": 4 * 1 * 2 * 4 * 10, "total": 3328 + 320 + 320}
    assert rl.gemm_shapes(str(tmp_path), m=32) == [(32, 8, 8), (32, 8, 32), (32, 16, 8)]


def test_roofline_ratios():
    f = rl.ModelFlops(layer_params=1000, lm_head_params=100, attention_layers=1, num_heads=1,
                      head_dim=2)
    peaks = {"bfloat16": {"peak_gflops": 2e-6}, "float32": {"peak_gflops": 4e-6}}
    block = rl.roofline(f, peaks, {"a": ([3], [2], 2.0), "skipped": ([3], [2], None)}, "float32")
    total = f.request(3, 2)["total"]  # 2*1000*4 + 2*100*2 + 4*2*10 = 8480
    assert total == 8480
    a = block["systems"]["a"]
    assert set(block["systems"]) == {"a"}
    assert a["achieved_gflops"] == pytest.approx(total / 2.0 / 1e9)
    assert a["ratio_bfloat16"] == pytest.approx(total / 2.0 / 1e9 / 2e-6)
    assert a["ratio_float32"] == pytest.approx(a["ratio_bfloat16"] / 2)
    assert block["tokenmill_gemm_dtype"] == "float32"
    text = rl.format_roofline(block)
    assert "float32 peak" in text and "tokenmill GEMMs run in float32" in text


def test_gemm_peak_measures_every_shape():
    shapes = [(64, 32, 32), (64, 32, 96)]
    p = rl.measure_gemm_peak("float32", torch.device("cpu"), shapes, reps=2, min_rep_s=0.001)
    assert [s["shape_mkn"] for s in p["per_shape"]] == [list(s) for s in shapes]
    assert p["peak_gflops"] == max(s["gflops"] for s in p["per_shape"]) > 0
    assert p["peak_shape_mkn"] in [list(s) for s in shapes]


def test_decode_bytes_by_hand(llama_tiny):
    """A decode step reads every layer weight (norms too), the lm_head (the tied
    embedding) and each row's K/V: 2 layers x 2 KV heads x 16 x (K and V) per token."""
    c = rl.count_decode_bytes(llama_tiny.path)
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128) + 2 * 64  # + 2 norms
    assert c.dense_params == 2 * per_layer
    assert (c.expert_params, c.num_experts, c.lm_head_params) == (0, 0, 384 * 64)
    assert c.kv_per_token == 2 * 2 * 2 * 16
    step = c.step(batch=3, context_len=10, dtype_bytes=2)
    assert step["weights"] == (2 * per_layer + 384 * 64) * 2
    assert step["kv"] == 128 * 3 * 10 * 2
    bound = rl.decode_bound(c, 3, 10, "bfloat16", bandwidth_gbps=1.0, measured_s=1.0)
    assert bound["bound_s"] == pytest.approx(step["total"] / 1e9)
    assert bound["bound_fraction"] == pytest.approx(bound["bound_s"])


def test_decode_bytes_count_the_experts_a_batch_touches():
    c = rl.DecodeBytes(dense_params=10, expert_params=800, num_experts=8, top_k=2,
                       lm_head_params=0, kv_per_token=0)
    assert c.step(1, 0, 1)["weights"] == pytest.approx(10 + 800 * 2 / 8)
    assert c.step(64, 0, 1)["weights"] == pytest.approx(10 + 800, rel=1e-6)


def test_measure_bandwidth_on_cpu():
    bw = rl.measure_bandwidth("cpu", nbytes=1 << 20, reps=2)
    assert bw["bytes"] == 2 << 20 and bw["gbps"] > 0


def test_decode_step_bench_runs_on_cpu(llama_tiny, tmp_path, capsys):
    from tokenmill.bench import decode_step
    out = tmp_path / "d.json"
    assert decode_step.main(["--model", llama_tiny.path, "--device", "cpu", "--dtype",
                             "float32", "--batch", "1,2", "--context", "8", "--steps", "2",
                             "--output-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [s["batch"] for s in doc["steps"]] == [1, 2]
    assert all(s["measured_s"] > 0 and s["bound_s"] > 0 for s in doc["steps"])
    assert "bandwidth bound" in capsys.readouterr().out
