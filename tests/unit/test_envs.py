"""The environment variables that steer kernels are read in tokenmill/envs.py only, and
the README lists each of them."""
import pathlib
import re

from tokenmill import envs

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tokenmill"


def test_kernel_variables_are_read_in_envs_only():
    # (setting one, as bench/attention_kernels.py sets TRITON_INTERPRET off CUDA, is not
    # reading it)
    readers = re.compile(r"(environ\.get\(|environ\[|getenv\()\s*[\"'](%s)[\"'](?!\]\s*=)"
                         % "|".join(envs.KERNEL_ENV_VARS))
    offenders = [f"{path.relative_to(ROOT)}:{i}"
                 for path in PACKAGE.rglob("*.py") if path.name != "envs.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if readers.search(line)]
    assert offenders == []
    # and envs.py itself reads each one
    source = (PACKAGE / "envs.py").read_text()
    assert all(f'"{name}"' in source for name in envs.KERNEL_ENV_VARS)


def test_readme_lists_them():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    for name in envs.KERNEL_ENV_VARS:
        assert f"`{name}" in section, name


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_CAPABILITY", " avx2 ")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    monkeypatch.setenv("TOKENMILL_NO_NATIVE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert envs.forced_cpu_capability() == "avx2"
    assert envs.aten_cpu_capability() == "avx2"
    assert envs.no_native_kernels() and envs.triton_interpret()
    for name in envs.KERNEL_ENV_VARS:
        monkeypatch.delenv(name)
    assert envs.forced_cpu_capability() == "" and envs.aten_cpu_capability() == ""
    assert not envs.no_native_kernels() and not envs.triton_interpret()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not envs.triton_interpret()
