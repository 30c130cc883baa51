"""The native kernels built at install (setup.py) and how tokenmill.kernels loads them.

A prebuilt level (tokenmill.kernels._C_<level> and its build record _C_<level>.json) is
used only when the record matches this torch and the current sources; a module built
against another torch is refused, naming both versions; stale sources are compiled at
run time; either way one WARNING line says why and how long. The first test builds a
real wheel (every level: several minutes on 2 cores); the others fake the record.
"""
from __future__ import annotations

import importlib.machinery
import json
import logging
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels import levels

ROOT = Path(__file__).resolve().parents[2]
ABI = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)


def _project_copy(dest: Path) -> Path:
    """What a wheel is built from (pyproject.toml, setup.py, README.md, tokenmill/), without
    anything a local build left in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "tokenmill", dest / "tokenmill",
                    ignore=shutil.ignore_patterns("__pycache__", "_C_*", "*.egg-info"))
    return dest


# What the child process checks: where tokenmill and each loaded module come from, and
# that the chosen module's rms_norm is HF's formula (the same check as the kernel tests).
CHILD = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import torch
import tokenmill
from tokenmill import kernels
ops = kernels.cpu_ops()
x = (torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
w = torch.randn(96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
xf = x.float()
ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
out = ops.rms_norm(x, w, 1e-6)
close = torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
same = float((out == ref).float().mean())
every = sys.argv[1] == "every-level"
files = {lv: kernels.cpu_ops(lv).__file__ for lv in kernels.runnable_levels()} if every else {}
print(json.dumps(dict(package=tokenmill.__file__, level=kernels.cpu_capability(),
                      capability=ops.capability, file=ops.__file__, close=close, same=same,
                      files=files)))
"""


def _child(target: Path, ext_dir: Path, cwd: Path, which: str,
           **env_overrides) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TOKENMILL_NO_NATIVE", "TOKENMILL_CPU_CAPABILITY", "ATEN_CPU_CAPABILITY")}
    env.update(PYTHONPATH=str(target), TORCH_EXTENSIONS_DIR=str(ext_dir), **env_overrides)
    # cwd: not the checkout, whose tokenmill would come first on sys.path
    done = subprocess.run([sys.executable, "-c", CHILD, which], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow  # compiles every level of this architecture: several minutes on 2 cores
@pytest.mark.timeout(3000)
def test_a_wheel_carries_prebuilt_kernels_that_load_without_compiling(tmp_path):
    src = _project_copy(tmp_path / "src")
    wheel_dir = tmp_path / "wheel"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                           "--no-deps", "-w", str(wheel_dir), str(src)],
                          cwd=src, capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    [wheel] = wheel_dir.glob("tokenmill-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    for f in levels.sources() + levels.headers():  # what the run-time build needs
        assert f"tokenmill/kernels/{f}" in names
    for lv in kernels.all_levels():
        assert f"tokenmill/kernels/_C_{lv}.json" in names
        assert any(n.startswith(f"tokenmill/kernels/_C_{lv}.") and n.endswith(".so")
                   for n in names), f"no {lv} module in the wheel"

    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    kdir = target / "tokenmill" / "kernels"
    record = json.loads((kdir / "_C_default.json").read_text())
    assert record["torch"] == torch.__version__ and record["cxx11_abi"] == ABI
    assert record["digest"] == levels.source_digest(levels.LEVELS["default"])

    ext_dir = tmp_path / "torch_extensions"
    ext_dir.mkdir()
    out, log = _child(target, ext_dir, tmp_path, "every-level")
    assert Path(out["package"]).is_relative_to(target)
    assert out["level"] == out["capability"] == kernels.cpu_capability()
    for lv, f in out["files"].items():  # every level this CPU runs, from the wheel
        assert Path(f).parent == kdir and Path(f).name.startswith(f"_C_{lv}."), (lv, f)
    assert out["close"] and out["same"] > 0.99
    assert list(ext_dir.iterdir()) == [], "a prebuilt level was compiled again"
    assert "Compiling" not in log
    assert f"native CPU kernels: {out['level']} level, prebuilt at install" in log

    # Sources edited after the install: the default level is compiled now, said once.
    with open(kdir / "ops.h", "a") as f:
        f.write("\n// edited after the install\n")
    out, log = _child(target, ext_dir, tmp_path, "chosen", TOKENMILL_CPU_CAPABILITY="default")
    assert out["capability"] == "default" and out["close"]
    assert Path(out["file"]).is_relative_to(ext_dir)
    assert log.count("Compiling them now") == 1, log[-3000:]
    assert "default level: the prebuilt module is stale" in log
    assert "native CPU kernels: default level, compiled at run time" in log


# The rest fake a prebuilt folder: a build record and a module file that is not a real
# module (so importing it, which must not happen before the record is checked, would fail).

@pytest.fixture
def prebuilt(tmp_path, monkeypatch):
    """A prebuilt folder for the default level, and torch's JIT `load` replaced by a stub
    that records what it would compile. `load_level(level)` loads as cpu_ops() would,
    without the cache (the real modules stay as they are)."""
    monkeypatch.setattr(kernels, "_PREBUILT_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_origin", {})
    monkeypatch.setattr(kernels, "_already_built", lambda name: False)
    monkeypatch.delenv("TOKENMILL_NO_NATIVE", raising=False)
    compiled = []

    def fake_load(name, sources, extra_cflags, verbose):
        compiled.append(dict(name=name, sources=sources, flags=extra_cflags))
        return types.SimpleNamespace(capability=name.split("_cpu_ops_")[1].rsplit("_", 1)[0])
    import torch.utils.cpp_extension
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)

    def write(level="default", module=True, **changes):
        if module:
            so = levels.module_name(level) + importlib.machinery.EXTENSION_SUFFIXES[0]
            (tmp_path / so).write_bytes(b"not a shared object")
        record = levels.make_record(levels.LEVELS[level], torch.__version__, ABI,
                                    sys.implementation.cache_tag)
        record.update(changes)
        levels.write_record(levels.record_path(str(tmp_path), level), record)

    return types.SimpleNamespace(write=write, compiled=compiled, dir=tmp_path,
                                 load_level=kernels._build_locked.__wrapped__)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tokenmill.kernels" and r.levelno >= logging.WARNING]


def test_a_module_built_against_another_torch_is_refused_before_it_is_imported(
        prebuilt, caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_import_prebuilt",
                        lambda level: pytest.fail("imported a module built for another torch"))
    prebuilt.write(torch="1.99.0+other")
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        ops = prebuilt.load_level("default")
    assert ops.capability == "default" and len(prebuilt.compiled) == 1  # compiled instead
    [line] = _warnings(caplog)
    assert "refusing the prebuilt module" in line
    assert "torch 1.99.0+other" in line and f"this is torch {torch.__version__}" in line
    assert "reinstall tokenmill" in line and "Compiling them now" in line

    # Same version, other C++ ABI: refused as well.
    caplog.clear()
    prebuilt.write(cxx11_abi=not ABI)
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        prebuilt.load_level("default")
    [line] = _warnings(caplog)
    assert f"C++11 ABI {not ABI}" in line and f"C++11 ABI {ABI}" in line and "refusing" in line


def test_a_refusal_is_said_even_when_a_run_time_build_is_cached(prebuilt, caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_already_built", lambda name: True)
    prebuilt.write(torch="1.99.0+other")
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        prebuilt.load_level("default")
    [line] = _warnings(caplog)
    assert "torch 1.99.0+other" in line and "Using the ones compiled at run time" in line


def test_stale_sources_are_compiled_at_run_time(prebuilt, caplog):
    prebuilt.write(digest="0" * 16)
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        ops = prebuilt.load_level("default")
    assert ops.capability == "default"
    [build] = prebuilt.compiled
    assert sorted(Path(s).name for s in build["sources"]) == levels.sources()
    assert build["flags"] == levels.compile_flags(levels.LEVELS["default"])
    [line] = _warnings(caplog)
    assert "default level: the prebuilt module is stale" in line
    assert "Compiling them now: about" in line


def test_a_record_of_another_level_is_not_used(prebuilt, caplog):
    prebuilt.write()
    path = levels.record_path(str(prebuilt.dir), "default")
    record = levels.read_record(path)
    levels.write_record(path, dict(record, level="avx512_vnni"))
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        prebuilt.load_level("default")
    assert len(prebuilt.compiled) == 1
    [line] = _warnings(caplog)
    assert "stale" in line


def test_a_valid_record_loads_the_module_and_a_broken_module_falls_back(prebuilt, caplog):
    prebuilt.write()
    assert kernels._prebuilt_problem("default") == (None, False)
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        ops = prebuilt.load_level("default")  # the module file is not a shared object
    assert ops.capability == "default" and len(prebuilt.compiled) == 1
    [line] = _warnings(caplog)
    assert "the prebuilt module failed to load" in line and "Compiling them now" in line


def test_no_prebuilt_module_is_compiled_at_run_time(prebuilt, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        prebuilt.load_level("default")
    [line] = _warnings(caplog)
    assert "no prebuilt module" in line and "Compiling them now" in line
    caplog.clear()
    prebuilt.write(module=False)  # a record, but no module for this Python
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        prebuilt.load_level("default")
    [line] = _warnings(caplog)
    assert f"no prebuilt module for this Python ({sys.implementation.cache_tag})" in line


def test_the_digest_covers_every_source_and_header_and_the_flags(tmp_path):
    for f in levels.sources() + levels.headers():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(levels.KERNELS_DIR) / f, tmp_path / f)
    lv = levels.LEVELS["default"]
    before = levels.source_digest(lv, str(tmp_path))
    assert before == levels.source_digest(lv)  # names and bytes, not the folder
    (tmp_path / "vec.h").write_text("// a new header\n")
    with_header = levels.source_digest(lv, str(tmp_path))
    assert with_header != before
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "neon.h").write_text("// a header in a subfolder\n")
    assert "arch/neon.h" in levels.headers(str(tmp_path))
    assert levels.source_digest(lv, str(tmp_path)) != with_header
    with_header = levels.source_digest(lv, str(tmp_path))
    (tmp_path / "new_kernel.cpp").write_text("// a new kernel\n")
    assert "new_kernel.cpp" in levels.sources(str(tmp_path))
    assert levels.source_digest(lv, str(tmp_path)) != with_header
    other = levels.Level("default", ("-mfoo",), frozenset())
    assert levels.source_digest(other) != levels.source_digest(lv)


def test_the_level_table_is_read_without_torch():
    """setup.py loads levels.py by path, before torch may be importable."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('lv', {str(Path(levels.__file__))!r})\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['lv'] = m\n"
            "spec.loader.exec_module(m)\n"
            "assert 'torch' not in sys.modules and 'tokenmill' not in sys.modules\n"
            "print(list(m.LEVELS), m.sources())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("]")[0].strip("[") == ", ".join(repr(lv) for lv in kernels.all_levels())
