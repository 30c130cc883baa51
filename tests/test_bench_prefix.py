"""`tokenmill bench prefix` on a tiny model: the batch of shared-prefix requests with
prefix caching off and on, and single requests sent afterwards whose prefix the batch
cached (the TTFT ratio the hybrid prefix-caching goal is stated in)."""
from __future__ import annotations

import json

from tokenmill.entrypoints.cli import main


def run_bench(model, tmp_path, requests: int, prefix: int, singles: int) -> dict:
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--model", model.path, "--dtype", "float32",
                 "--num-requests", str(requests), "--prefix-len", str(prefix),
                 "--suffix-len", "8", "--output-len", "2", "--single-requests", str(singles),
                 "--no-redis", "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_prefix_reports_batch_and_single_request_ratios(llama_tiny, tmp_path, capsys):
    r = run_bench(llama_tiny, tmp_path, requests=3, prefix=64, singles=2)
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
    r = run_bench(llama_tiny, tmp_path, requests=2, prefix=32, singles=0)
    assert all(run["single_ttft_s"] is None for run in r["runs"])
    assert "single_ttft_cold_over_cached" not in r["ratios"]
