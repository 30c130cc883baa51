"""`tokenmill bench spec` on a tiny model: the same engine with and without n-gram
speculation, loop workload, fp32 (identical tokens on both sides)."""
from __future__ import annotations

import json

from tokenmill.entrypoints.cli import main


def test_bench_spec_loop_workload(llama_tiny, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", llama_tiny.path, "--dtype", "float32",
                 "--concurrency", "1,3", "--input-len", "8", "--loop-len", "40",
                 "--output-len", "24", "--num-iters", "1", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["workload"] == "loop" and r["speculative_config"]["num_speculative_tokens"] == 3
    assert [row["concurrency"] for row in r["results"]] == [1, 3]
    for row in r["results"]:
        assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
        assert row["ratio"] == row["spec_tok_s"] / row["plain_tok_s"]
        # one timed run: the best is the run over all of them
        assert abs(row["ratio_all_runs"] - row["ratio"]) < 1e-9
        assert row["same_tokens"] == 1.0  # fp32: speculation never changes greedy output
        assert 1.0 <= row["mean_acceptance_length"] <= 4.0
        assert len(row["accepted_per_position"]) == 3
    # (acceptance itself depends on the model falling into a loop: tests/test_spec_decode.py)
    assert r["platform"]["description"] in capsys.readouterr().out


def test_bench_spec_bad_arguments(capsys):
    assert main(["bench", "spec", "--concurrency", "0"]) == 2
    assert main(["bench", "spec", "--speculative-config", '{"method": "nope"}']) == 2
    assert "method" in capsys.readouterr().out


def test_bench_spec_builds_the_sides_in_palindromic_order(llama_tiny, tmp_path, monkeypatch):
    """Two engines a side, built plain, spec, spec, plain (an engine built later runs
    faster in the same process: neither side gets the first build); one a side on
    request. The figures of a side come from its engines alone."""
    import tokenmill
    built = []
    real = tokenmill.LLM

    def counting(*args, **kwargs):
        built.append("spec" if kwargs.get("speculative_config") is not None else "plain")
        return real(*args, **kwargs)
    monkeypatch.setattr(tokenmill, "LLM", counting)
    argv = ["bench", "spec", "--model", llama_tiny.path, "--dtype", "float32",
            "--concurrency", "2", "--input-len", "8", "--loop-len", "24", "--output-len", "12",
            "--num-iters", "2", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']
    for per_side, want in ((2, ["plain", "spec", "spec", "plain"]), (1, ["plain", "spec"])):
        built.clear()
        out = tmp_path / f"spec{per_side}.json"
        assert main(argv + ["--engines-per-side", str(per_side), "--output-json", str(out)]) == 0
        assert built == want
        r = json.loads(out.read_text())
        assert r["engines_per_side"] == per_side
        row = r["results"][0]
        assert row["same_tokens"] == 1.0 and row["ratio"] == row["spec_tok_s"] / row["plain_tok_s"]
