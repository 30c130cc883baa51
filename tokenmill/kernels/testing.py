"""pytest fixtures that run a kernel test once per capability level (tokenmill.kernels).

    from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)

`kernel_level` is parametrized over every level of this architecture: a level this
CPU cannot execute is skipped with its name; the others run with the engine's
chosen level forced to them (capability_override), so code that calls `cpu_ops()`
(layers, the model runner) runs that level's kernels too. `ops` is that level's
module, or a skip when there is no compiler (TOKENMILL_NO_NATIVE=1).
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess

import pytest

from tokenmill import kernels


@pytest.fixture(params=kernels.all_levels())
def kernel_level(request):
    level = request.param
    if level not in kernels.runnable_levels():
        pytest.skip(f"this CPU cannot run the {level} kernels "
                    f"(it runs {', '.join(kernels.runnable_levels())})")
    with kernels.capability_override(level):
        yield level


@pytest.fixture
def ops(kernel_level):
    module = kernels.cpu_ops(kernel_level)
    if module is None:
        pytest.skip("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    assert module.capability == kernel_level
    return module


# The levels with native bf16 dot products in the packed GEMMs' many-row path:
# vdpbf16ps (avx512_bf16) and AMX tiles (amx).
BF16_DOT_LEVELS = ("avx512_bf16", "amx")


def bf16_dot_ops(level: str = "avx512_bf16"):
    """The module of `level` (one of BF16_DOT_LEVELS) for the dot-product paths' tests
    (their own module fixture: those paths exist at those levels only), or a skip
    naming why not."""
    if level not in kernels.all_levels() or level not in kernels.runnable_levels():
        pytest.skip(f"this CPU (or its OS) cannot run the {level} level: its dot-product "
                    "path is not tested here")
    module = kernels.cpu_ops(level)
    if module is None:
        pytest.skip("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    return module


# ---- standalone C++ harnesses (tests/kernels/*.cpp) ------------------------------------
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")


def host_compiler() -> str:
    """The host's C++ compiler, or a skip."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    return compiler


def aarch64_tools() -> tuple[str, str]:
    """(aarch64-linux-gnu-g++, qemu-aarch64): Debian's g++-aarch64-linux-gnu and
    qemu-user, which `make test` installs. Missing: a skip, except in CI (CI=true)."""
    gxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if gxx is None or qemu is None:
        msg = "g++-aarch64-linux-gnu or qemu-user is not installed"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{msg}; CI must run the aarch64 checks")
        pytest.skip(msg)
    return gxx, qemu


def build_and_run(source: str, exe, compiler: str, flags, runner=()) -> str:
    """Compile one harness against torch's headers (C++20, as the extension builds) with
    `flags`, run it (under `runner`, e.g. qemu), assert both succeed; -> its stdout."""
    import torch
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    build = subprocess.run([compiler, "-std=c++20", "-O2", "-ffp-contract=off", f"-I{include}",
                            *flags, source, "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    return run.stdout
