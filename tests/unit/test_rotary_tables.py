"""The RoPE cos / sin tables: the exact values of the fp32 angles, the same in every
process (torch's CPU sin / cos, MKL's vector math, once got the first call after a
GEMM wrong on one thread's share: ~10% of processes on a 2-core Xeon with AMX)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tokenmill.models.layers.rotary import RotaryEmbedding, compute_inv_freq, cos_sin_table

PARAMS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 1_000_000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 1024},
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 64), (80, 80)])
def test_tables_hold_the_exact_cos_and_sin_of_the_fp32_angles(params, head_dim, rotary_dim):
    max_pos = 8192
    rot = RotaryEmbedding(head_dim, rotary_dim, max_pos, params)
    inv, scale = compute_inv_freq(params, rotary_dim, max_pos)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    angles = torch.cat([freqs, freqs], dim=-1).double().numpy()
    # fp64 rounded once, then scaled (yarn) and rounded again: within an ulp of the
    # exact value (an fp32 cos whose argument reduction slips is off by up to ~1e-4)
    for got, want in ((rot.cos_cache, np.cos(angles)), (rot.sin_cache, np.sin(angles))):
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.double().numpy(), want * scale, rtol=0, atol=1.2e-7 * scale)


def test_the_tables_do_not_come_from_torchs_cpu_sin_and_cos(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("torch's CPU sin / cos called for a RoPE table")
    for name in ("cos", "sin"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
        monkeypatch.setattr(torch, name, refuse)
    rot = RotaryEmbedding(64, 64, 256, PARAMS[0])
    cos, sin = cos_sin_table(torch.tensor([[0.0, 1.0]]))
    assert rot.cos_cache.shape == (256, 64)
    assert cos.tolist() == [[1.0, np.float32(np.cos(1.0))]]
    assert sin.tolist() == [[0.0, np.float32(np.sin(1.0))]]


def test_the_tables_are_exact_in_fresh_processes_that_ran_a_gemm_first():
    # The failure needs a fresh process (the library's first call): a few of them, each
    # running a GEMM and then building the table, as a model load does.
    script = textwrap.dedent("""
        import numpy as np, torch, torch.nn.functional as F
        F.linear(torch.randn(12, 24), torch.randn(40, 24))
        from tokenmill.models.layers.rotary import RotaryEmbedding
        rot = RotaryEmbedding(64, 64, 4096, {"rope_type": "default", "rope_theta": 10000.0})
        inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
        f = torch.arange(4096, dtype=torch.float32)[:, None] * inv[None, :]
        want = np.cos(torch.cat([f, f], -1).double().numpy())
        print(float(np.abs(rot.cos_cache.double().numpy() - want).max()))
    """)
    _worst_in_fresh_processes(script, bound=6e-8)


def test_settled_vector_math_is_right_in_fresh_processes_that_ran_a_gemm_first():
    # settle_vector_math's first calls stand between the GEMM and the first large sin /
    # cos / log / sqrt (torch's own, as an HF reference or a model's Python path runs it)
    script = textwrap.dedent("""
        import numpy as np, torch, torch.nn.functional as F
        from tokenmill.platforms.cpu import settle_vector_math
        settle_vector_math()
        F.linear(torch.randn(12, 24), torch.randn(40, 24))
        x = torch.linspace(1.0, 4000.0, 262144)
        worst = 0.0
        for name in ("cos", "sin", "log", "sqrt"):
            got = getattr(x, name)().double().numpy()
            want = getattr(np, name)(x.double().numpy())
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        print(worst)
    """)
    _worst_in_fresh_processes(script, bound=1e-6)


def _worst_in_fresh_processes(script: str, bound: float, runs: int = 10) -> None:
    """Run `script` in `runs` fresh interpreters; the last number each prints (its worst
    error) must be within `bound`."""
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120, check=True)
        assert float(out.stdout.split()[-1]) <= bound, out.stdout
