"""`tokenmill bench throughput` on a tiny model: tokenmill, HF generate, HF continuous
batching and the roofline in one run, and the --skip flags."""
from __future__ import annotations

import json

import pytest

from tokenmill.bench.roofline import count_model_flops
from tokenmill.bench.throughput import make_workload
from tokenmill.entrypoints.cli import main

# (the untimed warmup requests have prompts of up to 32 tokens and 8 outputs: max_model_len,
# the longest prompt + output of the workload, must hold them)
ARGS = ["--num-prompts", "4", "--input-len", "16:32", "--output-len", "8:16", "--dtype", "float32"]


def test_bench_throughput_all_systems(llama_tiny, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS,
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "throughput"
    for key in ("tokenmill_tok_s", "hf_generate_tok_s", "hf_cb_tok_s", "ratio", "ratio_hf_cb",
                "tokenmill_seconds", "hf_generate_seconds", "hf_cb_seconds"):
        assert r[key] > 0, key
    assert r["ratio_hf_cb"] == r["tokenmill_tok_s"] / r["hf_cb_tok_s"]
    assert r["hf_cb_num_prompts"] == 4 and r["hf_cb_error"] is None
    # fp32 on a model whose logits are far from ties: every system makes HF's greedy tokens.
    assert r["greedy_agreement"] == 1.0 and r["hf_cb_greedy_agreement"] == 1.0

    roof = r["roofline"]
    assert set(roof["peaks"]) == {"bfloat16", "float32"}
    assert all(p["peak_gflops"] > 0 for p in roof["peaks"].values())
    assert set(roof["systems"]) == {"tokenmill", "HF generate", "HF continuous batching"}
    work = make_workload(4, (16, 32), (8, 16), llama_tiny.vocab_size, 0)
    flops = count_model_flops(llama_tiny.path).workload([len(p) for p in work.prompts],
                                                        work.output_lens)
    for name, s in roof["systems"].items():
        assert s["model_flops"] == flops, name
        assert s["achieved_gflops"] > 0 and s["ratio_bfloat16"] > 0 and s["ratio_float32"] > 0
        assert abs(s["achieved_gflops"] - flops["total"] / s["seconds"] / 1e9) < 1e-9
    assert roof["systems"]["tokenmill"]["seconds"] == r["tokenmill_seconds"]

    # Which kernels ran: the engine's CPU platform, in the JSON and in the text.
    platform = r["platform"]
    assert platform["model_dtype"] == platform["gemm_dtype"] == "float32"
    assert platform["capability"] in platform["runnable_levels"]
    # fp32: decode-sized inputs take the packed fp32 kernel where the native kernels run
    # vectorised (platform["kernels"] native), and so does the int8-screened greedy head
    assert platform["linear"] in ("packed_f32", "torch")
    assert platform["lm_head"] == ("greedy_int8" if platform["linear"] == "packed_f32"
                                   else "full")
    assert platform["gemm"] in ("onednn_prepacked", "torch")
    assert (platform["linear"] == "packed_f32") == (platform["linear_f32_max_rows"] > 0)
    assert roof["tokenmill_gemm_dtype"] == "float32"

    text = capsys.readouterr().out
    assert "HF continuous batching" in text and "roofline" in text and "float32 peak" in text
    assert f"platform: {platform['description']}" in text and platform["capability"] in text


def test_bench_throughput_skip_flags(llama_tiny, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS, "--skip-hf",
                 "--skip-hf-cb", "--skip-roofline", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokenmill_tok_s"] > 0
    for key in ("hf_generate_tok_s", "hf_cb_tok_s", "ratio", "ratio_hf_cb", "roofline"):
        assert r[key] is None, key
    text = capsys.readouterr().out
    assert "skipped" in text and "roofline" not in text


def test_bench_throughput_bf16_with_cpu_kernel_flags(llama_tiny, tmp_path, capsys):
    """bf16 as well as fp32; the CPU kernel flags reach the engine's platform, which the
    JSON and the text report."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS[:-2],
                 "--dtype", "bfloat16", "--skip-hf", "--skip-hf-cb", "--skip-roofline",
                 "--cpu-kernels", "torch", "--greedy-head-max-rows", "0", "--no-decode-layers",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokenmill_tok_s"] > 0 and r["workload"]["dtype"] == "bfloat16"
    p = r["platform"]
    assert p["cpu_kernels"] == "torch" and p["kernels"] == "torch"
    assert p["model_dtype"] == "bfloat16" and p["gemm_dtype"] in ("bfloat16", "float32")
    assert (p["attention"], p["norm"], p["activation"], p["linear"], p["lm_head"],
            p["decode_layers"]) == ("torch", "torch", "torch", "torch", "full", False)
    assert f"platform: {p['description']}" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, arg", [
    ("--linear-bf16-max-rows", "-1", "linear_bf16_max_rows"),
    ("--greedy-head-max-rows", "129", "greedy_head_max_rows"),
    ("--cpu-capability", "sse9", "cpu_capability")])
def test_bench_throughput_bad_cpu_flag(llama_tiny, capsys, flag, value, arg):
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS, "--skip-hf",
                 "--skip-hf-cb", "--skip-roofline", flag, value]) == 2
    assert arg in capsys.readouterr().err


def test_bench_throughput_bad_cb_prompts(llama_tiny, capsys):
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS,
                 "--hf-cb-num-prompts", "5"]) == 2
    assert "--hf-cb-num-prompts (5) exceeds --num-prompts (4)" in capsys.readouterr().err


def test_bench_throughput_data_parallel(llama_tiny, tmp_path, capsys):
    """DP=2, then one replica on one replica's CPU share and on every CPU, with ratios."""
    out = tmp_path / "dp.json"
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS, "--skip-hf",
                 "--skip-hf-cb", "--skip-roofline", "--data-parallel-size", "2",
                 "--output-json", str(out)]) == 0
    dp = json.loads(out.read_text())["data_parallel"]
    assert dp["data_parallel_size"] == 2 and dp["tok_s"] > 0
    for key in ("one_share", "all_cpus"):
        assert dp[key]["tok_s"] > 0
        assert dp[key]["ratio"] == pytest.approx(dp["tok_s"] / dp[key]["tok_s"])
    assert "data parallel: 2 replicas" in capsys.readouterr().out


def test_bench_throughput_quantization(llama_tiny, tmp_path, capsys):
    """--quantization int8 reaches the engine and is recorded, with the resident bytes."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS, "--skip-hf",
                 "--skip-hf-cb", "--skip-roofline", "--quantization", "int8",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokenmill_tok_s"] > 0
    assert r["workload"]["quantization"] == r["weights"]["quantization"] == "int8"
    assert r["weights"]["resident_weight_bytes"] > 0
    assert "weights: int8 (--quantization)" in capsys.readouterr().out


def test_bench_throughput_block_size(llama_tiny, tmp_path, caplog, capsys):
    """--block-size reaches the engine's KV cache and is recorded (default: the
    engine's 16); a size that is not a positive int is refused by name."""
    import logging
    out = tmp_path / "tp.json"
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.engine_core"):
        assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS, "--skip-hf",
                     "--skip-hf-cb", "--skip-roofline", "--block-size", "32",
                     "--output-json", str(out)]) == 0
    assert "blocks of 32 tokens" in caplog.text and "blocks of 16 tokens" not in caplog.text
    assert json.loads(out.read_text())["workload"]["block_size"] == 32
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS, "--skip-hf",
                 "--skip-hf-cb", "--skip-roofline", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["workload"]["block_size"] == 16
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--model", llama_tiny.path, *ARGS, "--block-size", "0"])
    assert "--block-size" in capsys.readouterr().err
