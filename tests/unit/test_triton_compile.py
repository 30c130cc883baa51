"""The Triton attention kernels compiled for NVIDIA GPUs on this GPU-less machine
(tokenmill/ops/triton_compile.py): every launch the wrappers make, for the head
shapes of the served model families, through Triton's compiler and the ptxas of
its wheel, to a cubin. What the interpreter tests cannot show: that the compiled
forms exist (bf16 dots, the masked tails of head sizes 80 / 96, head 512 with its
8 warps and 2 stages), fit the shared memory of each GPU generation, and keep
half-precision kernels free of register spills on the H100 / H200.

In subprocesses: the suite's interpreter tests set TRITON_INTERPRET, and Triton
picks interpreted or compiled when it is imported."""
import json
import os
import subprocess
import sys

import pytest

from tokenmill.ops.triton_compile import KERNELS, MAX_SHARED, SHAPES

pytest.importorskip("triton")


def _start(tmp_path, name, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / f"{name}.json"
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.ops.triton_compile", *args,
                             "--output-json", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def _finish(proc, out):
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
def test_kernels_compile_for_the_h100_and_fit_the_smallest_shared_memory(tmp_path):
    # sm_90 (H100 / H200): every shape. sm_86 (A10, RTX 30xx; sm_89 and sm_120 have the
    # same 99 KB): the shapes with the largest tiles. Both at once, one per core.
    h100 = _start(tmp_path, "sm90", "--arch", "90")
    small = _start(tmp_path, "sm86", "--arch", "86", "--head-sizes", "256,512")
    sm90, sm86 = _finish(*h100), _finish(*small)

    assert {r["shape"] for r in sm90} == {s.label for s in SHAPES}
    for shape in SHAPES:  # each shape reaches all five kernels
        assert {r["kernel"] for r in sm90 if r["shape"] == shape.label} == set(KERNELS)
    for r in sm90 + sm86:
        assert r["max_shared"] == MAX_SHARED[r["arch"]]
        assert 0 <= r["shared"] <= r["max_shared"], r
    # Head 512 (Gemma 4's global layers) takes 8 warps and 2 stages; the fp32 cache is
    # the largest tile set and still fits the 99 KB parts.
    wide = [r for r in sm86 if r["shape"].startswith("head 512") and r["kernel"] != "_kv_write_kernel"
            and r["kernel"] != "_combine_splits_kernel"]
    assert wide and all((r["num_warps"], r["num_stages"]) == (8, 2) for r in wide)
    assert max(r["shared"] for r in wide) > MAX_SHARED[86] // 2  # the limit is what binds
    # Half-precision models (what a GPU serves) never spill on the H100 / H200.
    half = [r for r in sm90 if "float32" not in r["shape"]]
    assert half and all(r["spill_bytes"] == 0 for r in half), \
        [r for r in half if r["spill_bytes"]]


def test_cli_refuses_an_unknown_architecture(tmp_path):
    proc, _ = _start(tmp_path, "bad", "--arch", "75")
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--arch" in log and "75" in log


@pytest.mark.timeout(600)
def test_quantized_gemms_compile_for_the_a100_and_h100_without_spills(tmp_path):
    # The W4A16 / W8A16 / FP8 GEMMs (ops/triton_quant_linear.py): every format and
    # activation dtype at a decode- and a prefill-sized input, on sm_80 (no fp8 type:
    # the e4m3 decode is integer ops) and sm_90.
    from tokenmill.ops.triton_compile import QUANT_KERNELS, QUANT_SHAPES
    results = _finish(*_start(tmp_path, "quant", "--quantized", "--arch", "80,90"))
    assert {r["arch"] for r in results} == {80, 90}
    assert {r["shape"] for r in results} == set(QUANT_SHAPES)
    assert {r["kernel"] for r in results} == set(QUANT_KERNELS)
    for r in results:
        assert 0 <= r["shared"] <= r["max_shared"], r
        assert r["spill_bytes"] == 0, r
