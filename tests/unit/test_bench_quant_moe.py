"""`python -m tokenmill.bench.quant_moe` runs (tiny shapes) and prints both paths."""
from __future__ import annotations

import pytest

from tokenmill import kernels


def test_quant_moe_bench_runs(capsys):
    if not kernels.runnable_levels() or kernels.cpu_ops() is None:
        pytest.skip("no native kernels")
    from tokenmill.bench.quant_moe import main
    assert main(["--experts", "4", "--hidden", "64", "--intermediate", "64", "--top-k", "2",
                 "--group", "32", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("dequantized per call") == (8 if kernels.cpu_ops().has_quant_quad else 4)
