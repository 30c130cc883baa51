"""The capability levels of tokenmill's native kernels and how each one is built.

This module imports neither torch nor the rest of tokenmill: setup.py, which builds
every level of the build machine's architecture at install time, loads it by path and
so compiles with the same flags, the same sources and the same digest that the run-time
loader (`tokenmill.kernels`) checks.

A prebuilt level is the extension module `tokenmill.kernels._C_<level>` with a build
record `_C_<level>.json` beside it: the torch it was compiled against (version and C++
ABI), the digest of the sources and flags, and the Python it was built for. The loader
reads the record before it imports the module.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import shlex
import subprocess
from dataclasses import dataclass

KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))

COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off",
                # Several levels load into one process (the tests): each module's own
                # symbols must bind to its own code, never to another level's.
                "-fvisibility=hidden", "-fvisibility-inlines-hidden")


@dataclass(frozen=True)
class Level:
    name: str
    flags: tuple[str, ...]      # compiler flags
    cpu_flags: frozenset[str]   # /proc/cpuinfo flags a CPU needs to run the build


def _x86_levels() -> tuple[Level, ...]:
    avx2 = ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2")
    avx2_cpu = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2"})
    avx512 = avx2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
    avx512_cpu = avx2_cpu | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    return (Level("default", (), frozenset()),
            Level("avx2", avx2, avx2_cpu),
            Level("avx512", avx512, avx512_cpu),
            # int8 x int16 dot products in one instruction (the greedy lm_head's screen)
            Level("avx512_vnni", avx512 + ("-mavx512vnni",), avx512_cpu | {"avx512_vnni"}),
            # bf16 pair dot products into fp32 (vdpbf16ps: the prefill attention kernel's
            # products over a bf16 cache); everything of avx512_vnni too
            Level("avx512_bf16", avx512 + ("-mavx512vnni", "-mavx512bf16"),
                  avx512_cpu | {"avx512_vnni", "avx512_bf16"}),
            # bf16 tile products (TDPBF16PS: the packed GEMMs' many-row path); everything
            # of avx512_bf16 too. The OS must also grant the tiles (kernels.amx_permitted).
            Level("amx", avx512 + ("-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
                  avx512_cpu | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}))


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


# This architecture's levels, lowest first. aarch64 (and anything else): the compiler's
# default target only, for now.
LEVELS: dict[str, Level] = {lv.name: lv for lv in
                            (_x86_levels() if _is_x86() else (Level("default", (), frozenset()),))}


def compile_flags(level: Level) -> list[str]:
    """Every flag of `level`'s build beyond the ones torch's extension builder adds."""
    return [*COMMON_FLAGS, f"-DTOKENMILL_CPU_LEVEL={level.name}", *level.flags]


def compiler_accepts(level: Level, cxx: str | None = None) -> bool:
    """Whether the C++ compiler (CXX, else c++) takes `level`'s ISA flags: an older one
    lacks some (-mamx-tile / -mamx-bf16 need gcc 11 or clang 12), and a level it cannot
    build is left out of the install rather than failing it."""
    if not level.flags:
        return True
    command = shlex.split(cxx or os.environ.get("CXX", "c++"))
    try:
        done = subprocess.run([*command, "-x", "c++", "-fsyntax-only", *level.flags, "-"],
                              input=b"int main() { return 0; }\n", capture_output=True,
                              timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def sources(folder: str = KERNELS_DIR) -> list[str]:
    """The kernel translation units (file names in `folder`): every *.cpp, so a new
    kernel file needs no list updated here."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.cpp")))


def headers(folder: str = KERNELS_DIR) -> list[str]:
    """Every *.h under `folder`, subfolders too (paths relative to `folder`)."""
    return sorted(glob.glob("**/*.h", root_dir=folder, recursive=True))


def source_digest(level: Level, folder: str = KERNELS_DIR) -> str:
    """What a build of `level` is made from: every source and header (names and bytes)
    and the flags. A prebuilt module whose recorded digest differs is stale."""
    h = hashlib.sha256()
    for name in sources(folder) + headers(folder):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    h.update(repr(compile_flags(level)).encode())
    return h.hexdigest()[:16]


PREBUILT_PREFIX = "_C_"


def module_name(level: str) -> str:
    """The prebuilt module's name inside tokenmill.kernels."""
    return PREBUILT_PREFIX + level


def record_path(folder: str, level: str) -> str:
    return os.path.join(folder, module_name(level) + ".json")


def make_record(level: Level, torch_version: str, cxx11_abi: bool | None, python: str,
                folder: str = KERNELS_DIR) -> dict:
    return {"level": level.name, "digest": source_digest(level, folder),
            "torch": torch_version, "cxx11_abi": cxx11_abi, "python": python,
            "flags": compile_flags(level)}


def write_record(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def read_record(path: str) -> dict:
    """The record at `path` (raises OSError / ValueError when absent or unreadable)."""
    with open(path) as f:
        record = json.load(f)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return record
