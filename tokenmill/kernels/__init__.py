"""Native kernels, compiled on first use with torch's C++ extension builder, once per
CPU capability level.

The same sources are built with each level's explicit flags (never -march=native:
a build runs on every CPU of its level, whichever machine compiled it). On x86-64
the levels are `default` (the baseline ISA), `avx2`, `avx512` and `avx512_vnni`
(LEVELS has their flags); elsewhere (aarch64) there is `default` only. Each level is
its own extension module, tokenmill_cpu_ops_<level>_<digest>, built lazily the first
time it is asked for and kept in torch's extension cache.

`cpu_ops()` is the module of the chosen level, `cpu_capability()`: the best level
this CPU runs (`runnable_levels()`), unless TOKENMILL_CPU_CAPABILITY names another
(an error if the CPU cannot run it) or ATEN_CPU_CAPABILITY, torch's own override,
names a lower one. `cpu_ops(level)` is a given level's module (tests run every level
the CPU can). When no compiler is at hand (or TOKENMILL_NO_NATIVE=1), they return
None and callers use their plain PyTorch path.

What a module can do at its level: `ops.capability` (its level),
`ops.has_fast_linear_bf16` and `ops.has_greedy_lm_head` (the AVX-512 kernels; below
that, Linear layers keep their fp32 GEMM and the runner its full lm_head).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SOURCES = ("bindings.cpp", "cpu_paged_attention.cpp", "cpu_linear.cpp", "cpu_norm.cpp",
           "cpu_fused.cpp", "cpu_greedy_head.cpp", "cpu_decode_layers.cpp")
HEADERS = ("ops.h", "vec.h")
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
            Level("avx512_vnni", avx512 + ("-mavx512vnni",), avx512_cpu | {"avx512_vnni"}))


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


# This architecture's levels, lowest first. aarch64 (and anything else): the compiler's
# default target only, for now.
LEVELS: dict[str, Level] = {lv.name: lv for lv in
                            (_x86_levels() if _is_x86() else (Level("default", (), frozenset()),))}

_TORCH_CAPABILITY_LEVEL = {"AVX2": "avx2", "AVX512": "avx512"}


def all_levels() -> list[str]:
    """Every level of this architecture, lowest first (whether this CPU runs it or not)."""
    return list(LEVELS)


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def runnable_levels() -> list[str]:
    """Every level this CPU can execute, lowest first."""
    return list(_runnable())


@functools.cache
def _runnable() -> tuple[str, ...]:
    flags = _cpu_flags()
    if flags is None:  # no /proc/cpuinfo (macOS, Windows): what torch detected
        import torch
        top = _TORCH_CAPABILITY_LEVEL.get(torch.backends.cpu.get_cpu_capability(), "default")
        names = all_levels()
        return tuple(names[:names.index(top) + 1]) if top in LEVELS else ("default",)
    return tuple(lv.name for lv in LEVELS.values() if lv.cpu_flags <= flags)


def _check(level: str, source: str = "level") -> str:
    level = level.strip().lower()
    if level not in LEVELS:
        raise ValueError(f"{source}={level!r} is not a CPU capability level of "
                         f"{platform.machine()}; the levels are {', '.join(LEVELS)}")
    if level not in runnable_levels():
        missing = sorted(LEVELS[level].cpu_flags - (_cpu_flags() or frozenset()))
        raise RuntimeError(f"{source}={level!r}: this CPU cannot run the {level} kernels "
                           f"(missing {', '.join(missing) or 'support'}); it runs "
                           f"{', '.join(runnable_levels())}")
    return level


@functools.cache
def _chosen_level() -> str:
    forced = os.environ.get("TOKENMILL_CPU_CAPABILITY", "").strip()
    if forced:
        return _check(forced, "TOKENMILL_CPU_CAPABILITY")
    runnable = runnable_levels()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in LEVELS:  # torch's override: at most that level (torch ignores higher ones too)
        names = all_levels()
        runnable = [lv for lv in runnable if names.index(lv) <= names.index(aten)] or ["default"]
    return runnable[-1]


_override: str | None = None  # capability_override()


def cpu_capability() -> str:
    """The level `cpu_ops()` uses (see the module docstring for how it is chosen)."""
    return _override if _override is not None else _chosen_level()


@contextlib.contextmanager
def capability_override(level: str):
    """Inside the block, cpu_capability() is `level` and cpu_ops() its module: the
    tests run the engine (which calls cpu_ops() wherever it uses a kernel) per level."""
    global _override, _chosen_ops
    level = _check(level)
    saved = _override, _chosen_ops
    _override, _chosen_ops = level, _UNSET
    try:
        yield level
    finally:
        _override, _chosen_ops = saved


_UNSET = object()
_chosen_ops = _UNSET
_lock = threading.Lock()


def _forget_choice() -> None:
    """Choose the level again (tests that change the environment or the CPU flags)."""
    global _chosen_ops
    _runnable.cache_clear()
    _chosen_level.cache_clear()
    _chosen_ops = _UNSET


def cpu_ops(level: str | None = None):
    """The kernels module of `level` (None: the chosen level), or None without a compiler
    or with TOKENMILL_NO_NATIVE=1. A level this CPU cannot run raises."""
    if level is None:
        ops = _chosen_ops
        return _load_chosen() if ops is _UNSET else ops
    return _build(_check(level))


def _load_chosen():
    global _chosen_ops
    level = cpu_capability()
    ops = _build(level)
    if ops is not None and _override is None:
        logger.info("native CPU kernels: %s level (this CPU runs %s)", level,
                    ", ".join(runnable_levels()))
    _chosen_ops = ops
    return ops


def _digest(level: Level) -> str:
    """Keyed on the sources, the flags, this checkout and torch: two checkouts (or venvs)
    never share, and keep rebuilding, one build folder."""
    import torch
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha1()
    for f in SOURCES + HEADERS:
        with open(os.path.join(here, f), "rb") as fh:
            h.update(fh.read())
    h.update(repr((level.name, level.flags, COMMON_FLAGS, here, torch.__version__,
                   os.path.dirname(torch.__file__))).encode())
    return h.hexdigest()[:8]


def _already_built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        folder = _get_build_directory(name, verbose=False)
        return any(f.startswith(name + ".") for f in os.listdir(folder))
    except Exception:  # a private torch helper: assume nothing is built
        return False


def _build(level: str):
    with _lock:  # the engine thread and the caller may both ask first
        return _build_locked(level)


@functools.cache
def _build_locked(level: str):
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        return None
    lv = LEVELS[level]
    try:
        from torch.utils.cpp_extension import load
        here = os.path.dirname(os.path.abspath(__file__))
        name = f"tokenmill_cpu_ops_{level}_{_digest(lv)}"
        fresh = not _already_built(name)
        if fresh:
            logger.warning("compiling tokenmill's native CPU kernels for the %s level, once per "
                           "level and kernel version: about %s on this machine's %d cores ...",
                           level, _estimate(), os.cpu_count() or 1)
        t0 = time.monotonic()
        ops = load(name=name, sources=[os.path.join(here, f) for f in SOURCES],
                   extra_cflags=[*COMMON_FLAGS, f"-DTOKENMILL_CPU_LEVEL={level}", *lv.flags],
                   verbose=False)
        if fresh:
            logger.info("compiled the %s kernels in %.0f s", level, time.monotonic() - t0)
        return ops
    except Exception as e:  # no compiler, no ninja, unsupported flags...
        logger.warning("native CPU kernels (%s) unavailable, using the PyTorch path: %s",
                       level, e)
        return None


def _estimate() -> str:
    # Measured on 2 idle cores: ~35 s in all (bindings.cpp ~24 s of CPU, each of the six
    # kernel files ~8 s); more while other work shares the cores.
    seconds = max(25, 70 / max(1, os.cpu_count() or 1))
    return f"{5 * round(seconds / 5):.0f} s"
