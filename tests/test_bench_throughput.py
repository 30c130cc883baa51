"""`tokenmill bench throughput` on a tiny model: tokenmill, HF generate, HF continuous
batching and the roofline in one run, and the --skip flags."""
from __future__ import annotations

import json

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

    text = capsys.readouterr().out
    assert "HF continuous batching" in text and "roofline" in text and "float32 peak" in text


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


def test_bench_throughput_bad_cb_prompts(llama_tiny, capsys):
    assert main(["bench", "throughput", "--model", llama_tiny.path, *ARGS,
                 "--hf-cb-num-prompts", "5"]) == 2
    assert "--hf-cb-num-prompts (5) exceeds --num-prompts (4)" in capsys.readouterr().err
