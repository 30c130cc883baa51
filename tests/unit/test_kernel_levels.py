"""How tokenmill.kernels picks the capability level its native kernels are built for."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenmill import kernels

AVX2_CPU = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"})
x86_only = pytest.mark.skipif(kernels.all_levels() == ["default"],
                              reason="the x86-64 levels (this is not an x86-64 CPU)")


@pytest.fixture
def fresh(monkeypatch):
    """A clean environment and a fresh choice; the real one again afterwards."""
    for var in ("TOKENMILL_CPU_CAPABILITY", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(var, raising=False)
    kernels._forget_choice()
    yield monkeypatch
    monkeypatch.undo()
    kernels._forget_choice()


def test_levels_are_ordered_and_the_best_runnable_is_chosen(fresh):
    names, runnable = kernels.all_levels(), kernels.runnable_levels()
    assert names[0] == "default" and runnable[0] == "default"
    assert runnable == names[:len(runnable)]  # each level includes the ones below it
    assert kernels.cpu_capability() == runnable[-1]
    for name in names:
        lv = kernels.LEVELS[name]
        assert all(f.startswith("-m") for f in lv.flags) and "-march=native" not in lv.flags


@x86_only
def test_x86_levels_and_their_flags():
    levels = kernels.LEVELS
    assert list(levels) == ["default", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"]
    assert levels["default"].flags == ()
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(levels["avx2"].flags)
    assert not any(f.startswith("-mavx512") for f in levels["avx2"].flags)
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"} <= set(levels["avx512"].flags)
    assert "-mavx512vnni" not in levels["avx512"].flags
    assert "-mavx512vnni" in levels["avx512_vnni"].flags
    assert not any("bf16" in f for name, lv in levels.items() for f in lv.flags
                   if name not in ("avx512_bf16", "amx"))
    # avx512_bf16 is avx512_vnni and more: the same sources, every flag of the level below
    assert set(levels["avx512_bf16"].flags) == set(levels["avx512_vnni"].flags) | {"-mavx512bf16"}
    assert levels["avx512_bf16"].cpu_flags == levels["avx512_vnni"].cpu_flags | {"avx512_bf16"}
    # amx is avx512_bf16 and the tile instructions
    assert set(levels["amx"].flags) == set(levels["avx512_bf16"].flags) | {"-mamx-tile",
                                                                          "-mamx-bf16"}
    assert levels["amx"].cpu_flags == levels["avx512_bf16"].cpu_flags | {"amx_tile", "amx_bf16"}


@x86_only
def test_avx512_bf16_is_chosen_where_the_cpu_has_it_and_refused_where_not(fresh):
    vnni_cpu = AVX2_CPU | kernels.LEVELS["avx512_vnni"].cpu_flags
    fresh.setattr(kernels, "_cpu_flags", lambda: vnni_cpu | {"avx512_bf16"})
    assert kernels.runnable_levels()[-2:] == ["avx512_vnni", "avx512_bf16"]
    assert kernels.cpu_capability() == "avx512_bf16"
    kernels._forget_choice()
    fresh.setenv("TOKENMILL_CPU_CAPABILITY", "avx512_vnni")  # forced below the best
    assert kernels.cpu_capability() == "avx512_vnni"
    kernels._forget_choice()
    fresh.delenv("TOKENMILL_CPU_CAPABILITY")
    fresh.setattr(kernels, "_cpu_flags", lambda: vnni_cpu)  # VNNI without BF16 (Ice Lake)
    assert kernels.runnable_levels()[-1] == "avx512_vnni"
    assert kernels.cpu_capability() == "avx512_vnni"
    with pytest.raises(RuntimeError, match=r"cannot run the avx512_bf16 kernels \(missing "
                                           r"avx512_bf16\); it runs default, .*avx512_vnni$"):
        kernels.cpu_ops("avx512_bf16")
    from tokenmill.platforms.cpu import check_cpu_args  # the engine's --cpu-capability
    with pytest.raises(ValueError, match=r"cpu_capability='avx512_bf16'.*missing avx512_bf16"):
        check_cpu_args(cpu_capability="avx512_bf16")
    kernels._forget_choice()
    fresh.setenv("TOKENMILL_CPU_CAPABILITY", "avx512_bf16")
    with pytest.raises(RuntimeError, match="TOKENMILL_CPU_CAPABILITY='avx512_bf16': this CPU"):
        kernels.cpu_capability()


@x86_only
def test_an_avx2_cpu_runs_up_to_avx2(fresh):
    fresh.setattr(kernels, "_cpu_flags", lambda: AVX2_CPU)
    assert kernels.runnable_levels() == ["default", "avx2"]
    assert kernels.cpu_capability() == "avx2"
    with pytest.raises(RuntimeError, match=r"cannot run the avx512 kernels \(missing avx512bw, "
                                           r"avx512dq, avx512f, avx512vl\); it runs default, avx2"):
        kernels.cpu_ops("avx512")


@x86_only
def test_amx_needs_the_flags_and_the_oss_grant(fresh):
    """amx is chosen where the CPU has the tile flags and the OS grants the tile state
    (arch_prctl); a CPU whose OS refuses it runs avx512_bf16, and amx forced is refused
    naming why."""
    bf16_cpu = AVX2_CPU | kernels.LEVELS["avx512_bf16"].cpu_flags
    fresh.setattr(kernels, "_cpu_flags", lambda: bf16_cpu | {"amx_tile", "amx_bf16"})
    fresh.setattr(kernels, "amx_permitted", lambda: True)
    assert kernels.runnable_levels()[-2:] == ["avx512_bf16", "amx"]
    assert kernels.cpu_capability() == "amx"
    kernels._forget_choice()
    fresh.setattr(kernels, "amx_permitted", lambda: False)
    assert kernels.runnable_levels()[-1] == "avx512_bf16"
    assert kernels.cpu_capability() == "avx512_bf16"
    with pytest.raises(RuntimeError, match=r"cannot run the amx kernels \(missing the OS's "
                                           r"grant of the AMX tiles, or a compiler"):
        kernels.cpu_ops("amx")
    kernels._forget_choice()
    fresh.setattr(kernels, "amx_permitted", lambda: True)
    fresh.setattr(kernels, "_buildable", lambda level: False)  # gcc < 11, nothing prebuilt
    assert kernels.cpu_capability() == "avx512_bf16"
    kernels._forget_choice()
    fresh.setattr(kernels, "_cpu_flags", lambda: bf16_cpu | {"amx_tile"})  # no amx_bf16
    fresh.setattr(kernels, "amx_permitted", lambda: True)
    assert "amx" not in kernels.runnable_levels()


def test_the_os_grant_is_asked_for_only_on_x86_linux(monkeypatch):
    granted = kernels.amx_permitted()
    assert isinstance(granted, bool)
    if "amx" in kernels.runnable_levels():
        assert granted
    monkeypatch.setattr(kernels.platform, "system", lambda: "Darwin")  # no arch_prctl there
    assert kernels.amx_permitted.__wrapped__() is False



@x86_only
def test_tokenmill_cpu_capability_forces_a_level(fresh):
    fresh.setattr(kernels, "_cpu_flags", lambda: AVX2_CPU)
    fresh.setenv("TOKENMILL_CPU_CAPABILITY", "default")
    assert kernels.cpu_capability() == "default"
    kernels._forget_choice()
    fresh.setenv("TOKENMILL_CPU_CAPABILITY", "AVX512")
    with pytest.raises(RuntimeError, match="TOKENMILL_CPU_CAPABILITY='avx512': this CPU cannot"):
        kernels.cpu_capability()
    kernels._forget_choice()
    fresh.setenv("TOKENMILL_CPU_CAPABILITY", "sse9")
    with pytest.raises(ValueError, match="'sse9' is not a CPU capability level .* default, avx2"):
        kernels.cpu_ops()


@x86_only
def test_aten_cpu_capability_caps_the_level(fresh):
    fresh.setattr(kernels, "_cpu_flags", lambda: AVX2_CPU | kernels.LEVELS["avx512_vnni"].cpu_flags)
    fresh.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert kernels.cpu_capability() == "avx2"
    kernels._forget_choice()
    fresh.setenv("ATEN_CPU_CAPABILITY", "avx512")  # torch's avx512: no VNNI level above it
    assert kernels.cpu_capability() == "avx512"
    kernels._forget_choice()
    fresh.setenv("ATEN_CPU_CAPABILITY", "zvector")  # not a level here: ignored
    assert kernels.cpu_capability() == "avx512_vnni"
    kernels._forget_choice()
    fresh.setattr(kernels, "_cpu_flags", lambda: AVX2_CPU)
    fresh.setenv("ATEN_CPU_CAPABILITY", "avx512")  # more than the CPU has: as torch, no error
    assert kernels.cpu_capability() == "avx2"
    kernels._forget_choice()
    fresh.setenv("TOKENMILL_CPU_CAPABILITY", "default")  # ours wins
    assert kernels.cpu_capability() == "default"


def test_capability_override_and_restore(fresh):
    chosen = kernels.cpu_capability()
    with kernels.capability_override("default") as level:
        assert level == "default" == kernels.cpu_capability()
    assert kernels.cpu_capability() == chosen
    with pytest.raises(ValueError):
        with kernels.capability_override("no_such_level"):
            pass


def test_no_native_gives_none_at_every_level():
    code = ("import json; from tokenmill import kernels\n"
            "print(json.dumps([kernels.cpu_ops() is None, kernels.cpu_capability()]"
            " + [kernels.cpu_ops(lv) is None for lv in kernels.runnable_levels()]))\n")
    env = dict(os.environ, TOKENMILL_NO_NATIVE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out[0] is True and out[1] == kernels.cpu_capability() and all(out[2:])


@x86_only
def test_the_env_override_reaches_the_engine_in_a_fresh_process():
    """TOKENMILL_CPU_CAPABILITY=avx2: cpu_ops() is the avx2 build, logged once."""
    if "avx2" not in kernels.runnable_levels():
        pytest.skip("this CPU cannot run the avx2 kernels")
    if kernels.cpu_ops("avx2") is None:  # built here (once) so the child only loads it
        pytest.skip("no native CPU kernels (no compiler)")
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from tokenmill.kernels import cpu_ops, cpu_capability\n"
            "ops = cpu_ops(); assert cpu_ops() is ops\n"
            "print(cpu_capability(), ops.capability, ops.has_greedy_lm_head)\n")
    env = dict(os.environ, TOKENMILL_CPU_CAPABILITY="avx2")
    env.pop("TOKENMILL_NO_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["avx2", "avx2", "True"]  # the greedy screen too
    assert done.stderr.count("native CPU kernels: avx2 level") == 1


@x86_only
def test_a_level_forced_below_avx512_takes_the_fp32_gemm_path(fresh):
    """Forcing avx2 on a CPU with AVX512-BF16 must behave like an AVX2 CPU end to end:
    no native bf16 GEMMs (the CPU platform's GEMM dtype rule), whatever /proc/cpuinfo
    says; by the environment or by the engine argument cpu_capability."""
    import torch

    from tokenmill.platforms.cpu import CpuPlatform, cpu_has_native_bf16
    cpu = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    fresh.setattr(kernels, "_cpu_flags", lambda: cpu)
    fresh.setattr("builtins.open", _cpuinfo_with(" ".join(sorted(cpu))))
    assert cpu_has_native_bf16()

    def gemm(**kw):  # the PyTorch kernels: the rule without building any kernels
        return CpuPlatform.create("cpu", torch.bfloat16, cpu_kernels="torch", **kw).gemm_dtype

    assert kernels.cpu_capability() == "avx512" and gemm() == "bfloat16"
    assert gemm(cpu_capability="avx2") == "float32"
    kernels._forget_choice()
    fresh.setenv("TOKENMILL_CPU_CAPABILITY", "avx2")
    assert gemm() == "float32"


def _cpuinfo_with(flags: str):
    import builtins
    import io
    real_open = builtins.open

    def fake(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            return io.StringIO(f"flags\t\t: {flags}\n")
        return real_open(path, *args, **kwargs)
    return fake


def test_a_compiler_without_a_levels_flags_leaves_it_out(tmp_path):
    """setup.py builds only the levels the compiler takes (an old one lacks the AMX
    flags): probed with the level's flags on an empty program."""
    from tokenmill.kernels import levels
    from tokenmill.kernels.testing import host_compiler
    cxx = host_compiler()
    assert levels.compiler_accepts(kernels.LEVELS["default"], cxx)
    assert not levels.compiler_accepts(levels.Level("bogus", ("-mno-such-isa-flag",), frozenset()),
                                       cxx)
    assert not levels.compiler_accepts(levels.Level("bogus", ("-mavx2",), frozenset()),
                                       str(tmp_path / "no-such-compiler"))
    for name in kernels.runnable_levels():  # what this CPU runs, this compiler builds
        assert levels.compiler_accepts(kernels.LEVELS[name], cxx)

