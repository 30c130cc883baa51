"""tokenmill/kernels/vec.h, the portable vector the native kernels are written
against, checked lane by lane (tests/kernels/vec_check.cpp) at every x86-64 level
this CPU runs, on the plain-array fallback, and on aarch64 NEON under qemu-user.
The kernel sources themselves are cross-compiled for aarch64 too.

The aarch64 checks need Debian's g++-aarch64-linux-gnu and qemu-user (`make test`
installs them); without them they skip, except in CI (CI=true), where they fail.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig

import pytest
import torch

from tokenmill import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK_SRC = os.path.join(ROOT, "tests", "kernels", "vec_check.cpp")
KERNELS = os.path.join(ROOT, "tokenmill", "kernels")
TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")
BASE_FLAGS = ["-std=c++20", "-O2", "-ffp-contract=off", f"-I{TORCH_INCLUDE}"]
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        msg = f"{tool} is not installed (Debian: g++-aarch64-linux-gnu, qemu-user)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{msg}; CI must run the aarch64 checks")
        pytest.skip(msg)
    return path


def _build_and_run(tmp_path, compiler, flags, runner=()):
    exe = tmp_path / "vec_check"
    build = subprocess.run([compiler, *BASE_FLAGS, *flags, CHECK_SRC, "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    return run.stdout


@pytest.mark.parametrize("level", kernels.all_levels())
def test_vec_header_at_each_level(tmp_path, level):
    if level not in kernels.runnable_levels():
        pytest.skip(f"this CPU cannot run the {level} build (it runs "
                    f"{', '.join(kernels.runnable_levels())})")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = _build_and_run(tmp_path, compiler, list(kernels.LEVELS[level].flags))
    lanes = {"avx2": 8, "avx512": 16, "avx512_vnni": 16}.get(level, 4)
    assert f"W={lanes}: 0 failures" in out


def test_vec_header_generic_fallback(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    assert "W=4: 0 failures" in _build_and_run(tmp_path, compiler, ["-DTM_VEC_FORCE_GENERIC"])


@pytest.mark.skipif(not IS_X86, reason="the cross-compile checks run on x86-64 hosts")
def test_vec_header_on_aarch64_neon_under_qemu(tmp_path):
    gxx = _need("aarch64-linux-gnu-g++")
    qemu = _need("qemu-aarch64")
    assert "W=4: 0 failures" in _build_and_run(tmp_path, gxx, ["-static"], runner=(qemu,))


@pytest.mark.skipif(not IS_X86, reason="the cross-compile checks run on x86-64 hosts")
def test_kernels_cross_compile_for_aarch64(tmp_path):
    """Every kernel source compiles for aarch64 (its default level: NEON) against
    torch's headers. Object files only: linking needs an aarch64 libtorch."""
    gxx = _need("aarch64-linux-gnu-g++")
    py_include = sysconfig.get_paths()["include"]
    flags = [*BASE_FLAGS[:1], "-O1", "-fopenmp", "-ffp-contract=off", "-fPIC",
             f"-I{TORCH_INCLUDE}", f"-I{os.path.join(TORCH_INCLUDE, 'torch', 'csrc', 'api', 'include')}",
             f"-I{py_include}", "-DTOKENMILL_CPU_LEVEL=default",
             "-DTORCH_EXTENSION_NAME=tokenmill_cpu_ops_aarch64_check"]
    sources = sorted(f for f in os.listdir(KERNELS) if f.endswith(".cpp"))
    assert "cpu_linear.cpp" in sources
    # bindings.cpp needs Python's headers, whose pyconfig.h is the host's: compile the
    # kernels only (the bindings hold no arch-specific code).
    sources.remove("bindings.cpp")
    procs = {f: subprocess.Popen([gxx, *flags, "-c", os.path.join(KERNELS, f), "-o",
                                  str(tmp_path / (f + ".o"))],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for f in sources}
    errors = {}
    for f, p in procs.items():
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            errors[f] = "\n".join(line for line in out.splitlines() if "error" in line)[:2000]
    assert not errors, errors
    file_tool = shutil.which("file")
    if file_tool:
        desc = subprocess.run([file_tool, str(tmp_path / "cpu_linear.cpp.o")],
                              capture_output=True, text=True).stdout
        assert "aarch64" in desc, desc
