"""The bytes a single-stream decode token reads (tokenmill/bench/decode_read.py),
counted on the engine's loaded model, for each weight form its kernels read."""
from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.bench import decode_read


def _layer_elements(hf_model) -> int:
    """Every parameter of the decoder layers (linears and norms: the count the bound
    takes from the checkpoint)."""
    return sum(p.numel() for name, p in hf_model.named_parameters() if ".layers." in name)


@pytest.mark.parametrize("dtype,quantization,lo,hi", [
    ("bfloat16", None, 2.0, 2.0),      # packed bf16, the fallback copy not counted
    ("float32", None, 4.0, 4.0),       # packed fp32
    ("bfloat16", "int8", 1.0, 1.0 + 4 / 32),  # int8 codes + a scale per output channel
])
def test_bytes_per_param_follow_the_weight_form(llama_tiny, dtype, quantization, lo, hi):
    llm = LLM(llama_tiny.path, dtype=dtype, quantization=quantization, max_model_len=64)
    runner = llm.llm_engine.engine_core.runner
    counts = decode_read.count_engine_read(runner, llama_tiny.path)
    assert lo <= counts["bytes_per_param"] <= hi
    elements = _layer_elements(llama_tiny.hf)
    assert counts["layer_weight_bytes"] == pytest.approx(elements * counts["bytes_per_param"])
    head = runner.greedy_head
    if head is not None:  # the int8 screen: one byte a weight plus three fp32 per column
        assert counts["lm_head_bytes"] == head.q.numel() + 12 * head.scale.numel()
        assert head.q.numel() >= llama_tiny.hf.lm_head.weight.numel()
    kv = counts["kv_bytes_per_position"]
    c = llama_tiny.hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = 4 if dtype == "float32" else 2
    assert kv == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elem


def test_bandwidth_fraction_arithmetic():
    counts = {"layer_weight_bytes": 1e6, "lm_head_bytes": 5e5, "kv_bytes_per_position": 100,
              "bytes_per_param": 2.0}
    out = decode_read.bandwidth_fraction(counts, input_len=10, output_len=5, tpot_s=1e-3,
                                         bandwidth_gbps=2.0)
    assert out["mean_context"] == 12.0
    assert out["bytes_per_token"] == 1e6 + 5e5 + 1200
    assert out["bound_s"] == pytest.approx(out["bytes_per_token"] / 2e9)
    assert out["bandwidth_fraction"] == pytest.approx(out["bound_s"] / 1e-3)
    assert decode_read.bandwidth_fraction(counts, 1, 1, 0.0, 1.0)["bandwidth_fraction"] is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_read_bandwidth_probes_take_the_best(dtype):
    import torch

    from tokenmill.platforms import create_platform
    platform = create_platform("cpu", getattr(torch, dtype))
    bw = decode_read.measure_read_bandwidth(platform, nbytes=8 << 20, reps=2)
    assert bw["gbps"] == max(bw["probes"].values()) > 0
    assert len(bw["probes"]) == 2 and any(k.startswith("one-row ") for k in bw["probes"])
    assert decode_read.measure_read_bandwidth(None, nbytes=1 << 20, reps=1)["probes"].keys() \
        == {"torch amax fp32"}
