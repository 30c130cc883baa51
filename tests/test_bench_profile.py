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


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_profile_step_host_time(llama_tiny, tmp_path, capsys, kernels):
    """--host-time: plain, instrumented and host-only steps, the stages' own times adding
    up to the step, the kernels by name (native ones only with the native kernels)."""
    import json
    out = tmp_path / "host.json"
    assert profile_step.main(["--model", llama_tiny.path, "--dtype", "bfloat16",
                              "--batch-size", "2", "--input-len", "8", "--steps", "4",
                              "--round-steps", "2", "--warmup-steps", "1", "--host-time",
                              "--cpu-kernels", kernels, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "not kernel" in text and "host-only step" in text
    s = json.loads(out.read_text())
    assert s["plain_steps"] == s["timed_steps"] == 4
    assert s["host_only_steps"] == 4 * profile_step.HOST_STEPS_PER_STEP
    stages = s["stages"]
    for name in ("step", "Scheduler.schedule", "ModelRunner.execute_model",
                 "ModelRunner._prepare_inputs", "model.forward", "ModelRunner.sample_tokens",
                 "Scheduler.update_from_output", "OutputProcessor.process"):
        assert name in stages, name
    assert sum(st["wall_ms"] for st in stages.values()) == pytest.approx(s["step_ms"])
    assert s["kernel_ms"] == pytest.approx(sum(k["ms"] for k in s["kernels"].values()))
    assert s["kernel_ms"] > 0 and s["aten_ms"] > 0
    native = [k for k, v in s["kernels"].items() if v["kind"] == "native"]
    assert bool(native) == (kernels == "auto"), native
    # Host-only steps replay the model's calls: their forward takes next to nothing.
    assert stages["model.forward"]["host_only_ms"] < stages["model.forward"]["wall_ms"]


def test_profile_step_host_time_refuses_async(llama_tiny):
    with pytest.raises(SystemExit):
        profile_step.main(["--model", llama_tiny.path, "--host-time", "--async-scheduling"])


def test_kernel_clock_counts_a_native_call_once():
    """A native function's own aten ops are its time, not counted again as aten ops;
    aten ops outside it are counted; nothing is timed outside kernels()."""
    import types

    import torch

    from tokenmill.bench.kernel_clock import KernelClock
    ops = types.ModuleType("fake_ops")
    ops.lin = torch._C._nn.linear  # a builtin that dispatches aten ops itself
    clock = KernelClock()
    clock.wrap_native(ops)
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    ops.lin(x, w)  # not timed: outside kernels()
    assert not clock._kernel_calls
    with clock.kernels():
        ops.lin(x, w)
        torch.relu(x)
    native = {name for kind, name in clock._kernel_calls if kind == "native"}
    aten = {name for kind, name in clock._kernel_calls if kind == "aten"}
    assert native == {"lin"}
    assert "aten::relu" in aten
    assert not any("linear" in n or "addmm" in n or n == "aten::mm" for n in aten), aten


def test_profile_step_block_size(llama_tiny, capsys, caplog):
    """--block-size reaches the engine's KV cache (the steps of a long context are what
    a larger block changes: docs/benchmarks.md, session 31)."""
    import logging
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.engine_core"):
        assert profile_step.main(["--model", llama_tiny.path, "--dtype", "float32",
                                  "--batch-size", "2", "--input-len", "40", "--steps", "2",
                                  "--warmup-steps", "1", "--block-size", "32"]) == 0
    assert "blocks of 32 tokens" in caplog.text and "blocks of 16 tokens" not in caplog.text
    assert "ms per step under the profiler" in capsys.readouterr().out
