"""`python -m tokenmill.bench.quant_rows` runs (tiny shapes), in both modes, at the torch
thread count it prints (torch.utils.benchmark.Timer runs on one thread unless told)."""
from __future__ import annotations

import re

import pytest
import torch

from tokenmill import kernels


@pytest.fixture
def timer_threads(monkeypatch):
    """The num_threads each benchmark.Timer the bench makes is given."""
    from torch.utils import benchmark
    seen = []
    real = benchmark.Timer

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_threads", 1))
        return real(*args, **kwargs)
    monkeypatch.setattr(benchmark, "Timer", spy)
    return seen


def needs_kernels():
    if not kernels.runnable_levels() or kernels.cpu_ops() is None:
        pytest.skip("no native kernels")


@pytest.fixture
def two_threads():
    """torch at 2 threads for the test (the suite may run at 1), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_quant_rows_table_runs_at_torch_threads(capsys, timer_threads, two_threads):
    needs_kernels()
    from tokenmill.bench.quant_rows import main
    assert main(["--shapes", "64x64", "--rows", "1,3", "--formats", "int4-g32",
                 "--min-run-time", "0.001"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"int4-g32 64x64 +1: [0-9.]+ / [0-9.]+ / [0-9.]+", out)
    assert timer_threads and set(timer_threads) == {2}


def test_quant_rows_layers_mode(capsys, timer_threads, two_threads):
    needs_kernels()
    from tokenmill.bench.quant_rows import main
    assert main(["--layers", "2", "--shapes", "64x64,32x128", "--formats", "int4-g32,int8",
                 "--min-run-time", "0.001"]) == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if "one row through 2 x 2 linears" in l]
    assert [l.split()[0] for l in lines] == ["int4-g32", "int8"]
    for line in lines:
        ms, mb = map(float, re.search(r": ([0-9.]+) ms, ([0-9.]+) MB packed", line).groups())
        assert ms > 0 and mb > 0
    assert set(timer_threads) == {2}


def test_quant_rows_refuses_negative_layers():
    from tokenmill.bench.quant_rows import main
    with pytest.raises(SystemExit):
        main(["--layers", "-1"])


@pytest.mark.parametrize("dtype,quad", [(torch.bfloat16, True), (torch.float32, False)])
def test_quant_rows_layers_keep_the_models_layout(monkeypatch, dtype, quad):
    """--layers packs as a model of --dtype does: the quad layout for bf16 models only."""
    needs_kernels()
    from tokenmill.bench import quant_rows
    from tokenmill.models.layers.linear_methods import quantized_cpu
    asked = []
    real = quantized_cpu.PackedQuantizedWeight

    def spy(ops, qw, **kwargs):
        asked.append(kwargs.get("quad", False))
        return real(ops, qw, **kwargs)
    monkeypatch.setattr(quantized_cpu, "PackedQuantizedWeight", spy)
    gen = torch.Generator().manual_seed(0)
    ms, mb = quant_rows.stream_layers(kernels.cpu_ops(), "int4-g32", [(64, 64)], 2, dtype, gen,
                                      lambda fn: (fn(), 1.0)[1])
    assert asked == [quad, quad] and ms == 1.0 and mb > 0


def test_quant_rows_formats_parsed_or_refused_by_name(capsys):
    from tokenmill.bench.quant_rows import main, parse_format
    assert parse_format("int8") == (8, None)
    assert parse_format("int4-g128") == (4, 128)
    assert parse_format("int8-g32") == (8, 32)
    for bad in ("fp8", "int3", "int4-g0", "int4-gx", "int8-g"):
        with pytest.raises(ValueError, match="--formats"):
            parse_format(bad)
    with pytest.raises(SystemExit):  # refused before any weight is made
        main(["--formats", "int8,fp8"])
    assert "'fp8' is not int8" in capsys.readouterr().err
