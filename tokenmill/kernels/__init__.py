"""Native kernels, built once per CPU capability level with torch's C++ extension
builder: at install time (setup.py), or at run time when no valid prebuilt module is there.

The same sources are built with each level's explicit flags (never -march=native:
a build runs on every CPU of its level, whichever machine compiled it). On x86-64
the levels are `default` (the baseline ISA), `avx2`, `avx512`, `avx512_vnni`,
`avx512_bf16` and `amx` (levels.LEVELS has their flags); elsewhere (aarch64) there is
`default` only.

Installing tokenmill (`make install`, `pip install --no-build-isolation .`, `pip wheel`)
compiles every level of the build machine's architecture into `tokenmill.kernels._C_<level>`
with a build record `_C_<level>.json` beside it (levels.py). A level is loaded from there
when its record matches this torch (version and C++ ABI) and the current sources (their
digest), checked before the module is imported. Otherwise (no prebuilt module, stale
sources in an edited checkout, a module built against another torch: refused, with both
versions named) the level is compiled now, as tokenmill_cpu_ops_<level>_<digest> in
torch's extension cache, and one WARNING line says why and how long it takes.

`cpu_ops()` is the module of the chosen level, `cpu_capability()`: the best level
this CPU runs (`runnable_levels()`), unless TOKENMILL_CPU_CAPABILITY names another
(an error if the CPU cannot run it) or ATEN_CPU_CAPABILITY, torch's own override,
names a lower one. `cpu_ops(level)` is a given level's module (tests run every level
the CPU can). When no compiler is at hand (or TOKENMILL_NO_NATIVE=1), they return
None and callers use their plain PyTorch path.

What a module can do at its level: `ops.capability` (its level),
`ops.vector_lanes`, `ops.has_fast_linear_bf16` and `ops.has_greedy_lm_head` (True at
every level but a plain-array build, which has no SIMD type in kernels/vec.h; the CPU
platform reads them), `ops.has_bf16_dot` (avx512_bf16: paged_prefill's products over
a bf16 cache on vdpbf16ps), `ops.has_bf16_dot_gemm` (avx512_bf16: linear_bf16's bf16
inputs of `ops.bf16_dot_gemm_min_rows` rows and more on vdpbf16ps, cpu_linear_dot.cpp;
on AMX tiles at amx, `ops.has_amx_gemm`, cpu_linear_amx.cpp).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
import time

# The level table and how a level is built live in levels.py (no torch import there:
# setup.py reads it to build every level at install).
from tokenmill import envs

from . import levels as _levels
from .levels import COMMON_FLAGS, LEVELS, Level  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

# Where the prebuilt modules and their build records are (tests point it elsewhere);
# the sources are always levels.KERNELS_DIR's.
_PREBUILT_DIR = _levels.KERNELS_DIR

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
    return tuple(lv.name for lv in LEVELS.values() if lv.cpu_flags <= flags
                 and ("amx_tile" not in lv.cpu_flags or (amx_permitted() and _buildable(lv))))


def _buildable(level: Level) -> bool:
    """A valid prebuilt module of `level`, or a compiler that takes its flags (the install
    leaves out a level its compiler cannot build: the AMX flags need gcc 11)."""
    return _prebuilt_problem(level.name)[0] is None or _levels.compiler_accepts(level)


# Linux (5.16+) gives a process the AMX tile state only on request: arch_prctl
# ARCH_REQ_XCOMP_PERM for XTILEDATA. Refused (an older kernel, a hypervisor hiding the
# state), the first tile instruction faults, so the amx level is not runnable.
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


@functools.cache
def amx_permitted() -> bool:
    """Whether this process may use the AMX tiles (asks the OS for them once)."""
    if platform.system() != "Linux" or not _levels._is_x86():
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        args = (_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        return libc.syscall(*map(ctypes.c_long, args)) == 0  # variadic: longs, as C passes
    except (OSError, AttributeError):
        return False


def _check(level: str, source: str = "level") -> str:
    level = level.strip().lower()
    if level not in LEVELS:
        raise ValueError(f"{source}={level!r} is not a CPU capability level of "
                         f"{platform.machine()}; the levels are {', '.join(LEVELS)}")
    if level not in runnable_levels():
        missing = sorted(LEVELS[level].cpu_flags - (_cpu_flags() or frozenset()))
        if not missing and "amx_tile" in LEVELS[level].cpu_flags:
            missing = ["the OS's grant of the AMX tiles, or a compiler that builds them"]
        raise RuntimeError(f"{source}={level!r}: this CPU cannot run the {level} kernels "
                           f"(missing {', '.join(missing) or 'support'}); it runs "
                           f"{', '.join(runnable_levels())}")
    return level


@functools.cache
def _chosen_level() -> str:
    forced = envs.forced_cpu_capability()
    if forced:
        return _check(forced, "TOKENMILL_CPU_CAPABILITY")
    runnable = runnable_levels()
    aten = envs.aten_cpu_capability()
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
        logger.info("native CPU kernels: %s level, %s (this CPU runs %s)", level,
                    _origin.get(level, "?"), ", ".join(runnable_levels()))
    _chosen_ops = ops
    return ops


_origin: dict[str, str] = {}  # level -> where its loaded module came from (the log line)


def _build(level: str):
    with _lock:  # the engine thread and the caller may both ask first
        return _build_locked(level)


@functools.cache
def _build_locked(level: str):
    if envs.no_native_kernels():
        return None
    problem, refused = _prebuilt_problem(level)
    if problem is None:
        try:
            ops = _import_prebuilt(level)
        except Exception as e:  # e.g. an undefined symbol despite a matching record
            problem, refused = f"the prebuilt module failed to load ({e})", True
        else:
            if getattr(ops, "capability", None) == level:
                _origin[level] = "prebuilt at install"
                return ops
            problem, refused = (f"the prebuilt module says it is the "
                                f"{getattr(ops, 'capability', '?')} level"), True
    ops = _jit(level, problem, refused)
    if ops is not None:
        _origin[level] = "compiled at run time"
    return ops


def _prebuilt_file(level: str) -> str | None:
    """The prebuilt module of `level` for this Python, if there is one."""
    import importlib.machinery
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_PREBUILT_DIR, _levels.module_name(level) + suffix)
        if os.path.isfile(path):
            return path
    return None


def _prebuilt_problem(level: str) -> tuple[str | None, bool]:
    """Why `level`'s prebuilt module cannot be used, read from its build record without
    importing it (a module built against another torch can crash on import), and whether
    that is a refusal worth a warning even when nothing is compiled: (None, False) when
    it can be used."""
    import torch
    path = _prebuilt_file(level)
    record_path = _levels.record_path(_PREBUILT_DIR, level)
    if path is None:
        if os.path.exists(record_path):
            return (f"no prebuilt module for this Python ({sys.implementation.cache_tag}) "
                    f"in {_PREBUILT_DIR}"), False
        return "no prebuilt module (tokenmill was installed without building its kernels)", False
    try:
        record = _levels.read_record(record_path)
    except (OSError, ValueError) as e:
        return f"the prebuilt module has no readable build record ({e})", True
    built_torch, built_abi = record.get("torch"), record.get("cxx11_abi")
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    if built_torch != torch.__version__ or built_abi != abi:
        return (f"refusing the prebuilt module: it was built against torch {built_torch} "
                f"(C++11 ABI {built_abi}), this is torch {torch.__version__} (C++11 ABI "
                f"{abi}); reinstall tokenmill under this torch to prebuild it again (make "
                f"install, or pip install --no-build-isolation .)"), True
    if (record.get("level"), record.get("digest")) != (level, _levels.source_digest(LEVELS[level])):
        return ("the prebuilt module is stale (the kernel sources or flags changed since it "
                "was built; make install prebuilds it again)"), False
    return None, False


def _import_prebuilt(level: str):
    """Import the validated prebuilt module from its own file (never another one on the path)."""
    import importlib.util
    import torch  # noqa: F401 (the module links against torch's libraries)
    name, path = f"{__name__}.{_levels.module_name(level)}", _prebuilt_file(level)
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _digest(level: Level) -> str:
    """Keyed on the sources, the flags, this checkout and torch: two checkouts (or venvs)
    never share, and keep rebuilding, one build folder."""
    import torch
    h = hashlib.sha1()
    h.update(repr((_levels.source_digest(level), _levels.KERNELS_DIR, torch.__version__,
                   os.path.dirname(torch.__file__))).encode())
    return h.hexdigest()[:8]


def _already_built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        folder = _get_build_directory(name, verbose=False)
        return any(f.startswith(name + ".") for f in os.listdir(folder))
    except Exception:  # a private torch helper: assume nothing is built
        return False


def _jit(level: str, why: str | None, refused: bool = False):
    """Today's fallback: compile `level` now with torch's JIT extension builder (kept in
    torch's extension cache, keyed by _digest), saying so in one line and why."""
    lv = LEVELS[level]
    try:
        from torch.utils.cpp_extension import load
        name = f"tokenmill_cpu_ops_{level}_{_digest(lv)}"
        fresh = not _already_built(name)
        if fresh:
            logger.warning("tokenmill's native CPU kernels, %s level: %s. Compiling them now: "
                           "about %s on this machine's %d cores (once per level and kernel "
                           "version) ...", level, why, _estimate(), os.cpu_count() or 1)
        elif refused:
            logger.warning("tokenmill's native CPU kernels, %s level: %s. Using the ones "
                           "compiled at run time earlier.", level, why)
        t0 = time.monotonic()
        sources = [os.path.join(_levels.KERNELS_DIR, f) for f in _levels.sources()]
        ops = load(name=name, sources=sources,
                   extra_cflags=_levels.compile_flags(lv), verbose=False)
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
