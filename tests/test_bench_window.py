"""`tokenmill bench window` on the tiny Gemma 3 (window 12): KV bytes and decode speed of
one long request, with the window and with the same weights at full attention."""
from __future__ import annotations

import json
import os

from tokenmill.bench.window import full_attention_twin
from tokenmill.entrypoints.cli import main


def test_bench_window_reports_the_savings(tiny_model_factory, tmp_path, capsys):
    gemma = tiny_model_factory("gemma3")  # 4 layers: 2 local (window 12), 2 global
    out = tmp_path / "win.json"
    assert main(["bench", "window", "--model", gemma.path, "--context-len", "120",
                 "--output-len", "6", "--dtype", "float32", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    win, full = r["window"], r["full_attention"]
    bs = 16  # the engine's default block size; page = K and V, 2 heads x 32, fp32
    page = 2 * bs * 2 * 32 * 4
    # Full: 4 layers x ceil(126 / 16) blocks (the request at its end: 125 tokens + the
    # slot of its last one). Window: the 2 global layers the same, the 2 local ones
    # only the blocks their window (12) still reads: at most 2 each.
    assert full["kv_bytes_held"] == 4 * 8 * page
    assert 2 * 8 * page + 2 * page <= win["kv_bytes_held"] <= 2 * 8 * page + 2 * 2 * page
    assert r["ratio"]["kv_bytes"] == full["kv_bytes_held"] / win["kv_bytes_held"] > 1.5
    assert win["decode_tok_s"] > 0 and full["decode_tok_s"] > 0 and r["ratio"]["decode_tok_s"] > 0
    assert any("window 12" in g for g in win["kv_groups"])
    assert not any("window" in g for g in full["kv_groups"])
    printed = capsys.readouterr().out
    assert "KV bytes held" in printed and "decode tok/s" in printed


def test_full_attention_twin_links_the_weights(tiny_model_factory, tmp_path):
    gemma = tiny_model_factory("gemma3")
    twin = full_attention_twin(gemma.path, str(tmp_path), 4096)
    cfg = json.load(open(os.path.join(twin, "config.json")))
    assert cfg["sliding_window"] == 4096
    weights = [n for n in os.listdir(twin) if n.endswith(".safetensors")]
    assert weights and all(os.path.islink(os.path.join(twin, n)) for n in weights)


def test_bench_window_refuses_a_model_without_a_window(llama_tiny, capsys):
    assert main(["bench", "window", "--model", llama_tiny.path, "--context-len", "40",
                 "--output-len", "4", "--dtype", "float32"]) != 0
    assert "sliding_window (None) must be shorter" in capsys.readouterr().err


def test_bench_window_mla_reports_the_latent_savings(tiny_model_factory, tmp_path, capsys,
                                                      caplog):
    """An MLA model: its latent cache and absorbed decode against per-head K/V (the naive
    decode), the same greedy tokens in fp32."""
    ds = tiny_model_factory("deepseek_v2")
    cfg = json.load(open(os.path.join(ds.path, "config.json")))
    out = tmp_path / "mla.json"
    assert main(["bench", "window", "--model", ds.path, "--context-len", "60",
                 "--output-len", "5", "--dtype", "float32", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["kind"] == "mla"
    lat, per_head = r["mla_latent"], r["per_head_kv"]
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    bs = 16  # one latent row per token and layer, fp32; 64 tokens: 4 blocks at the end
    assert lat["kv_bytes_held"] == cfg["num_hidden_layers"] * 4 * bs * row * 4
    heads = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
                                          + cfg["v_head_dim"])
    assert r["ratio"]["kv_bytes"] == per_head["kv_bytes_held"] / lat["kv_bytes_held"]
    assert r["ratio"]["kv_bytes"] == heads / row
    assert lat["decode_tok_s"] > 0 and per_head["decode_tok_s"] > 0
    assert "MLA latent" in capsys.readouterr().out
    assert "disagree" not in caplog.text  # fp32: absorbed and naive decode, same tokens
