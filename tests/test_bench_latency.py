"""`tokenmill bench latency` on a tiny model: tokenmill vs HF generate, one stream."""
from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.cli import main

ARGS = ["--input-len", "8", "--output-len", "6", "--num-iters", "2", "--dtype", "float32"]
METRICS = ("ttft_ms", "tpot_ms", "e2e_s", "tok_s")


def test_bench_latency_against_hf(llama_tiny, tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", llama_tiny.path, *ARGS,
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "latency"
    for system in ("tokenmill", "hf_generate"):
        for m in METRICS:
            s = r[system][m]
            assert len(s["values"]) == 2 and all(v > 0 for v in s["values"]), (system, m)
            assert s["median"] > 0 and s["mean"] > 0
        # e2e covers the first token and the 5 after it
        for t, e in zip(r[system]["ttft_ms"]["values"], r[system]["e2e_s"]["values"]):
            assert t / 1e3 <= e
        assert r[system]["tok_s"]["values"] == [6 / e for e in r[system]["e2e_s"]["values"]]
    assert r["tokenmill_tok_s"] == r["tokenmill"]["tok_s"]["median"]
    assert r["hf_generate_tok_s"] == r["hf_generate"]["tok_s"]["median"]
    assert r["ratio"]["tok_s"] == r["tokenmill_tok_s"] / r["hf_generate_tok_s"]
    assert r["ratio"]["tpot"] > 0 and r["ratio"]["ttft"] > 0
    assert r["greedy_agreement"] == 1.0
    w = r["workload"]
    assert (w["input_len"], w["output_len"], w["num_iters"]) == (8, 6, 2)
    assert w["async_scheduling"] in (True, False)
    roof = r["roofline"]
    assert set(roof["systems"]) == {"tokenmill", "HF generate"}
    assert roof["systems"]["tokenmill"]["model_flops"]["lm_head"] == 2 * 64 * 384 * 6
    assert all(s["achieved_gflops"] > 0 for s in roof["systems"].values())
    platform = r["platform"]
    assert platform["model_dtype"] == platform["gemm_dtype"] == w["tokenmill_gemm_dtype"]
    assert platform["capability"] in platform["runnable_levels"]
    # the decode bandwidth bound: bytes a token reads, from the HF model's own shapes
    band = r["decode_bandwidth"]
    layers, kv_per_position = _hf_decode_elements(llama_tiny.path)
    counts = band["counts"]
    assert counts["bytes_per_param"] == 4.0  # fp32 weights, read once from the packed copy
    assert counts["layer_weight_bytes"] == 4 * layers
    assert counts["kv_bytes_per_position"] == 4 * kv_per_position
    assert band["mean_context"] == 8 + 5 / 2
    assert band["bytes_per_token"] == pytest.approx(
        counts["layer_weight_bytes"] + counts["lm_head_bytes"]
        + counts["kv_bytes_per_position"] * band["mean_context"])
    assert band["bandwidth"]["gbps"] == max(band["bandwidth"]["probes"].values()) > 0
    assert band["bound_s"] == pytest.approx(band["bytes_per_token"] / band["bandwidth_gbps"] / 1e9)
    assert band["tpot_s"] == pytest.approx(r["tokenmill"]["tpot_ms"]["median"] / 1e3)
    assert r["bandwidth_fraction"] == band["bandwidth_fraction"] == pytest.approx(
        band["bound_s"] / band["tpot_s"])
    text = capsys.readouterr().out
    assert "of the bandwidth bound" in text
    assert "TTFT ms" in text and "tokenmill speedup" in text
    assert f"platform: {platform['description']}" in text


def _hf_decode_elements(path: str) -> tuple[int, int]:
    """(parameters of the decoder layers, norms included; K/V elements per cached
    position) of the HF model at `path`."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layers = sum(p.numel() for name, p in hf.named_parameters() if ".layers." in name)
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return layers, 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim


def test_bench_latency_bf16_and_cpu_flags(llama_tiny, tmp_path, capsys):
    """bf16 as well as fp32; the CPU kernel flags reach the engine's platform."""
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", llama_tiny.path, *ARGS[:-2], "--dtype",
                 "bfloat16", "--num-warmup", "0", "--skip-hf", "--skip-roofline",
                 "--linear-bf16-max-rows", "0", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    p = r["platform"]
    assert r["workload"]["dtype"] == p["model_dtype"] == "bfloat16"
    assert r["workload"]["tokenmill_gemm_dtype"] == p["gemm_dtype"]
    # No packed linears: nothing that needs them either.
    assert (p["linear"], p["lm_head"], p["decode_layers"]) == ("torch", "full", False)
    assert p["description"] in capsys.readouterr().out


@pytest.mark.parametrize("flag, expected", [("--no-async-scheduling", False),
                                            ("--async-scheduling", True)])
def test_bench_latency_async_flag(llama_tiny, tmp_path, flag, expected):
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", llama_tiny.path, *ARGS, "--num-warmup", "0",
                 "--skip-hf", "--skip-roofline", flag, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["workload"]["async_scheduling"] is expected
    assert r["hf_generate"] is None and r["ratio"] is None and r["roofline"] is None
    assert r["tokenmill"]["tok_s"]["median"] > 0


def test_bench_latency_too_long(llama_tiny, capsys):
    assert main(["bench", "latency", "--model", llama_tiny.path, "--input-len", "200",
                 "--output-len", "100"]) == 2
    assert "exceeds the model's max_position_embeddings (256)" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_bench_latency_quantization(llama_tiny, tmp_path, capsys, method):
    """--quantization reaches the engine and is recorded with the resident weight bytes
    (the int8 greedy screen and oneDNN's prepacked copies included), below those of the
    unquantized model, and against the checkpoint's bytes. (Not below the fp32
    checkpoint itself: on this tiny model the unquantized lm_head's packed, prepacked
    and screen copies outweigh what the layers save.)"""
    import os
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", llama_tiny.path, *ARGS, "--num-warmup", "0",
                 "--skip-hf", "--skip-roofline", "--quantization", method,
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["workload"]["quantization"] == r["weights"]["quantization"] == method
    stored = os.path.getsize(os.path.join(llama_tiny.path, "model.safetensors"))
    w = r["weights"]
    plain = tmp_path / "plain.json"
    assert main(["bench", "latency", "--model", llama_tiny.path, *ARGS, "--num-warmup", "0",
                 "--skip-hf", "--skip-roofline", "--output-json", str(plain)]) == 0
    unquantized = json.loads(plain.read_text())["weights"]
    assert 0 < w["resident_weight_bytes"] < unquantized["resident_weight_bytes"]
    assert w["checkpoint_bytes"] == unquantized["checkpoint_bytes"] == stored
    assert w["resident_over_checkpoint"] == w["resident_weight_bytes"] / stored
    text = capsys.readouterr().out
    assert f"weights: {method} (--quantization)" in text
    assert f"x the checkpoint's {stored / 2**20:.1f} MiB)" in text
    assert main(["bench", "latency", "--model", llama_tiny.path, *ARGS,
                 "--quantization", "int4"]) == 2
    assert "quantization 'int4' is not a method" in capsys.readouterr().err


def test_bench_latency_on_a_quantized_bench_model(tmp_path, monkeypatch, capsys):
    """NAME-gptq-int4: the bench model's GPTQ copy, written once by tokenmill's writer
    beside the bf16 model; tokenmill serves the copy, the HF baseline the bf16 base."""
    from tokenmill.bench import throughput as tp
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    monkeypatch.setitem(tp.BENCH_MODELS, "bench-tiny", ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=256)))
    assert tp.quantized_variant("bench-tiny-gptq-int4") == ("bench-tiny", "gptq-int4")
    assert tp.quantized_variant("bench-tiny-awq") is None
    assert tp.quantized_variant("elsewhere-gptq-int4") is None
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", "bench-tiny-gptq-int4", *ARGS,
                 "--num-warmup", "0", "--skip-roofline", "--output-json", str(out)]) == 0
    path = tmp_path / "bench-tiny-gptq-int4"
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"]) == ("gptq", 4, 32, True)
    r = json.loads(out.read_text())
    assert r["weights"]["quantization"] == "gptq"
    assert r["hf_generate"]["tok_s"]["median"] > 0
    assert not r["weights"]["quantized_at_load"]
    assert "weights: gptq (the checkpoint's)" in capsys.readouterr().out
    base = tmp_path / "base.json"
    assert main(["bench", "latency", "--model", "bench-tiny", *ARGS, "--num-warmup", "0",
                 "--skip-hf", "--skip-roofline", "--output-json", str(base)]) == 0
    unquantized = json.loads(base.read_text())["weights"]
    assert unquantized["quantization"] is None
    assert r["weights"]["resident_weight_bytes"] < unquantized["resident_weight_bytes"]
