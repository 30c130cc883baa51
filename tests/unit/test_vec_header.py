"""tokenmill/kernels/vec.h, the portable vector the native kernels are written
against, checked lane by lane (tests/kernels/vec_check.cpp) at every x86-64 level
this CPU runs, on the plain-array fallback, and on aarch64 NEON under qemu-user.
The kernel sources themselves are cross-compiled for aarch64 too.

The aarch64 checks need Debian's g++-aarch64-linux-gnu and qemu-user (`make test`
installs them); without them they skip, except in CI (CI=true), where they fail.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels.testing import IS_X86, aarch64_tools, build_and_run, host_compiler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK_SRC = os.path.join(ROOT, "tests", "kernels", "vec_check.cpp")
KERNELS = os.path.join(ROOT, "tokenmill", "kernels")
TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")


@pytest.mark.parametrize("level", kernels.all_levels())
def test_vec_header_at_each_level(tmp_path, level):
    if level not in kernels.runnable_levels():
        pytest.skip(f"this CPU cannot run the {level} build (it runs "
                    f"{', '.join(kernels.runnable_levels())})")
    out = build_and_run(CHECK_SRC, tmp_path / "vec_check", host_compiler(),
                        kernels.LEVELS[level].flags)
    lanes = {"avx2": 8, "avx512": 16, "avx512_vnni": 16, "avx512_bf16": 16,
             "amx": 16}.get(level, 4)
    assert f"W={lanes}: 0 failures" in out


def test_vec_header_generic_fallback(tmp_path):
    assert "W=4: 0 failures" in build_and_run(CHECK_SRC, tmp_path / "vec_check", host_compiler(),
                                              ["-DTM_VEC_FORCE_GENERIC"])


@pytest.mark.skipif(not IS_X86, reason="the cross-compile checks run on x86-64 hosts")
def test_vec_header_on_aarch64_neon_under_qemu(tmp_path):
    gxx, qemu = aarch64_tools()
    assert "W=4: 0 failures" in build_and_run(CHECK_SRC, tmp_path / "vec_check", gxx, ["-static"],
                                              runner=(qemu,))


@pytest.mark.skipif(not IS_X86, reason="the cross-compile checks run on x86-64 hosts")
def test_kernels_cross_compile_for_aarch64(tmp_path):
    """Every kernel source compiles for aarch64 (its default level: NEON) against
    torch's headers. Object files only: linking needs an aarch64 libtorch."""
    gxx, _ = aarch64_tools()
    py_include = sysconfig.get_paths()["include"]
    flags = ["-std=c++20", "-O1", "-fopenmp", "-ffp-contract=off", "-fPIC",
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
