"""`tokenmill bench serve` end to end: it starts a server on the demo model, drives it,
reports, and stops the server."""
from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("httpx")

from tokenmill.bench import serve as bench_serve  # noqa: E402
from tokenmill.bench.throughput import make_workload  # noqa: E402
from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model  # noqa: E402
from tokenmill.entrypoints.cli import main  # noqa: E402


def test_bench_serve_end_to_end(tmp_path, monkeypatch, capsys):
    model = ensure_demo_model(str(tmp_path / DEMO_MODEL_NAME))
    procs: list[subprocess.Popen] = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            procs.append(self)

    monkeypatch.setattr(bench_serve.subprocess, "Popen", RecordingPopen)
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--model", model, "--num-prompts", "6", "--input-len", "8:16",
               "--output-len", "4:8", "--concurrency", "3", "--dtype", "float32",
               "--num-kv-blocks", "64", "--output-json", str(out)])
    assert rc == 0

    assert len(procs) == 1 and procs[0].poll() is not None  # the server is gone
    result = json.loads(out.read_text())
    for key in ("request_throughput", "output_tok_s", "duration_s", "completed", "failed",
                "total_output_tokens", "ttft_ms", "itl_ms", "e2e_ms", "workload", "errors",
                "single_chunk_requests"):
        assert key in result
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(result[key]) == {"mean", "p50", "p99"}
        assert all(v is not None and v > 0 for v in result[key].values())
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    expected = make_workload(6, (8, 16), (4, 8), vocab, 0).total_output_tokens
    assert result["total_output_tokens"] == expected
    assert result["workload"]["total_output_tokens"] == expected
    assert result["completed"] == 6 and result["failed"] == 0 and result["errors"] == []
    assert result["workload"]["concurrency"] == 3
    assert "TTFT" in capsys.readouterr().out


def test_bench_serve_compares_engine_process(tmp_path, monkeypatch, capsys):
    model = ensure_demo_model(str(tmp_path / DEMO_MODEL_NAME))
    cmds: list[list[str]] = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, cmd, *a, **kw):
            super().__init__(cmd, *a, **kw)
            cmds.append(cmd)

    monkeypatch.setattr(bench_serve.subprocess, "Popen", RecordingPopen)
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--model", model, "--num-prompts", "4", "--input-len", "8:16",
               "--output-len", "4:8", "--concurrency", "2", "--dtype", "float32",
               "--num-kv-blocks", "64", "--compare-engine-process", "--output-json", str(out)])
    assert rc == 0
    # One server each way, in that order.
    assert [c[-1] for c in cmds] == ["--no-engine-process", "--engine-process"]
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["in_process"]["completed"] == 4
    assert result["engine_process_ratio"]["output_tok_s"] > 0
    assert "own process / in process" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--url", "localhost:8000"], "--url must start with"),
    (["--url", "http://127.0.0.1:1", "--dtype", "float32"], "--dtype: only for the server"),
    (["--api-key", "k"], "--api-key only applies with --url"),
    (["--url", "http://127.0.0.1:1", "--compare-engine-process"],
     "--compare-engine-process: only for the server"),
])
def test_bench_serve_bad_args(argv, message, capsys):
    assert main(["bench", "serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_serve_bad_range(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--input-len", "9:3"])
    assert "1 <= A <= B" in capsys.readouterr().err


def test_bench_serve_url(tmp_path, capsys):
    """--url: drive a running server; the model name and vocab come from /v1/models."""
    import argparse
    model = ensure_demo_model(str(tmp_path / DEMO_MODEL_NAME))
    server_args = argparse.Namespace(dtype="float32", seed=0, device=None, num_kv_blocks=64,
                                     max_num_seqs=None, max_num_batched_tokens=None,
                                     server_timeout=120.0)
    out = tmp_path / "result.json"
    with bench_serve.local_server(model, server_args, 64) as url:
        rc = main(["bench", "serve", "--url", url, "--num-prompts", "4", "--input-len", "8:16",
                   "--output-len", "4:8", "--concurrency", "2", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["workload"]["url"] == url
    assert result["workload"]["served_model_name"] == model
    assert result["total_output_tokens"] == result["workload"]["total_output_tokens"]


def test_bench_serve_passes_engine_flags_to_its_server(monkeypatch):
    """The CPU kernel flags and --speculative-config reach the server it starts."""
    import argparse
    seen = {}

    class Stop(Exception):
        pass

    def fake_popen(cmd, **kw):
        seen["cmd"] = cmd
        raise Stop

    monkeypatch.setattr(bench_serve.subprocess, "Popen", fake_popen)
    p = argparse.ArgumentParser()
    bench_serve.add_serve_bench_args(p)
    args = p.parse_args(["--cpu-kernels", "torch", "--greedy-head-max-rows", "0",
                         "--no-decode-layers", "--speculative-config",
                         '{"method": "ngram"}'])
    with pytest.raises(Stop):
        with bench_serve.local_server("/some/model", args, 128):
            pass
    cmd = seen["cmd"]
    for flag, value in (("--cpu-kernels", "torch"), ("--greedy-head-max-rows", "0"),
                        ("--speculative-config", '{"method": "ngram"}')):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--no-decode-layers" in cmd
