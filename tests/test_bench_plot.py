"""`tokenmill bench plot`: a PNG from the bench JSON files; a clear error without matplotlib.

matplotlib is the optional `bench` extra (about 100 MB installed with its
dependencies), not a test dependency: the drawing test skips without it."""
from __future__ import annotations

import json
import sys

import pytest

from tokenmill.entrypoints.cli import main

THROUGHPUT = {"bench": "throughput", "tokenmill_tok_s": 400.0, "hf_generate_tok_s": 90.0,
              "hf_cb_tok_s": 40.0, "ratio": 4.4,
              "workload": {"model": "/x/bench-qwen3-512", "dtype": "bfloat16", "num_prompts": 128,
                           "input_len": "32:512", "output_len": "32:256"},
              "roofline": {"peaks": {"bfloat16": {"peak_gflops": 30.0},
                                     "float32": {"peak_gflops": 120.0}},
                           "systems": {"tokenmill": {"achieved_gflops": 20.0,
                                                     "ratio_bfloat16": 0.66,
                                                     "ratio_float32": 0.16}}}}
LATENCY = {"bench": "latency", "tokenmill_tok_s": 200.0, "hf_generate_tok_s": None,
           "workload": {"model": "m", "dtype": "bfloat16", "input_len": 64, "output_len": 128}}


def write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    from tokenmill.bench.plot import bars, roofline_note
    assert [n for n, _ in bars(THROUGHPUT)] == ["tokenmill", "HF generate",
                                                "HF continuous\nbatching"]
    assert [n for n, _ in bars(LATENCY)] == ["tokenmill"]
    assert "66.0% of the bfloat16 peak" in roofline_note(THROUGHPUT)
    out = tmp_path / "docs" / "bench.png"
    assert main(["bench", "plot", "--inputs", write(tmp_path, "t.json", THROUGHPUT),
                 write(tmp_path, "l.json", LATENCY), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "bench.png"
    assert main(["bench", "plot", "--inputs", write(tmp_path, "t.json", THROUGHPUT),
                 "--output", str(out)]) == 2
    assert "pip install 'tokenmill[bench]'" in capsys.readouterr().err
    assert not out.exists()


def test_plot_bad_input(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["bench", "plot", "--inputs", write(tmp_path, "x.json", {"a": 1}),
                 "--output", str(tmp_path / "p.png")]) == 2
    assert "not a bench throughput / latency" in capsys.readouterr().err
