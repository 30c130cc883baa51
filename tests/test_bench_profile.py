"""`python -m tokenmill.bench.profile_step` on a tiny model: the top-ops table with the
engine's stage ranges and the model's module ranges, from every thread."""
from __future__ import annotations

import pytest

from tokenmill.bench import profile_step


@pytest.mark.parametrize("argv", [["--steps", "2", "--warmup-steps", "1"],
                                  ["--phase", "prefill", "--no-async-scheduling"],
                                  ["--steps", "2", "--warmup-steps", "1", "--cpu-kernels",
                                   "torch", "--greedy-head-max-rows", "0"]])
def test_profile_step_table(llama_tiny, tmp_path, capsys, argv):
    trace = tmp_path / "trace.json"
    assert profile_step.main(["--model", llama_tiny.path, "--dtype", "float32",
                              "--batch-size", "2", "--input-len", "8", "--row-limit", "200",
                              "--trace", str(trace), *argv]) == 0
    text = capsys.readouterr().out
    # The model's module ranges: its Linear layers where the decode steps run them (the
    # PyTorch path; the native decode loop and greedy head run none).
    for name in ("engine.step", "stage::ModelRunner.execute_model",
                 "stage::Scheduler.schedule", "module::", "aten::"):
        assert name in text, name
    assert ("module::Linear" in text) == ("torch" in argv or "prefill" in argv)
    assert "ms per step under the profiler" in text
    assert "platform: " in text  # which kernels ran
    assert ("kernels PyTorch (cpu_kernels=torch)" in text) == ("torch" in argv)
    assert trace.stat().st_size > 0
