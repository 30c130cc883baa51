"""`tokenmill bench prefix` on a tiny model: the batch of shared-prefix requests with
prefix caching off and on, and single requests sent afterwards whose prefix the batch
cached (the TTFT ratio the hybrid prefix-caching goal is stated in)."""
from __future__ import annotations

import json

from tokenmill.entrypoints.cli import main


def test_bench_prefix_reports_batch_and_single_request_ratios(llama_tiny, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--model", llama_tiny.path, "--dtype", "float32",
                 "--num-requests", "3", "--prefix-len", "64", "--suffix-len", "8",
                 "--output-len", "2", "--single-requests", "2", "--no-redis",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    off, on = r["runs"]
    assert (off["name"], on["name"]) == ("prefix caching off", "prefix caching on")
    assert off["prefix_cache_hit_tokens"] == 0
    # the batch's followers hit the 64-token prefix (4 blocks of 16), and so does each
    # single request afterwards: at least 2 + 2 hits of 64 tokens
    assert on["prefix_cache_hit_tokens"] >= 4 * 64
    assert on["same_outputs_as_off"] == 3
    assert off["single_ttft_s"] > 0 and on["single_ttft_s"] > 0
    assert r["ratios"]["single_ttft_cold_over_cached"] == off["single_ttft_s"] / on["single_ttft_s"]
    text = capsys.readouterr().out
    assert "one request alone, TTFT with its 64-token prefix computed / cached" in text


def test_bench_prefix_without_single_requests(llama_tiny, tmp_path):
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--model", llama_tiny.path, "--dtype", "float32",
                 "--num-requests", "2", "--prefix-len", "32", "--suffix-len", "4",
                 "--output-len", "2", "--single-requests", "0", "--no-redis",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert all(run["single_ttft_s"] is None for run in r["runs"])
    assert "single_ttft_cold_over_cached" not in r["ratios"]
