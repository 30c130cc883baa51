"""Dependency rules between the packages.

tokenmill.core (scheduler side) moves ids and counters only: no torch, and no
imports of the runner, models, engine or entrypoints. tokenmill.models knows
nothing of the engine, the scheduler or the entrypoints.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path


import tokenmill

PKG = Path(tokenmill.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, source: str | None = None) -> set[str]:
    """Every module a file imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            # `from pkg import sub` may name a submodule.
            for alias in node.names:
                found.add(f"{target}.{alias.name}")
    return found


def _is_forbidden(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def _violations(subpackage: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    files = sorted((PKG / subpackage).rglob("*.py"))
    assert files
    for path in files:
        for name in sorted(imported_modules(path)):
            if _is_forbidden(name, forbidden):
                bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    return bad


def test_scanner_sees_imports():
    """Guard: the scanner finds real imports (absolute and relative)."""
    found = imported_modules(PKG / "core" / "scheduler.py")
    assert "tokenmill.core.kv_cache_manager" in found
    assert "tokenmill.core.sched_output.SchedulerOutput" in found
    found = imported_modules(PKG / "models" / "llama.py")
    assert "torch" in found and "tokenmill.models.layers.attention" in found


def test_scanner_resolves_relative_imports():
    src = "from ..worker import model_runner\nfrom . import block_pool\nimport tokenmill.engine\n"
    found = imported_modules(PKG / "core" / "scheduler.py", source=src)
    assert "tokenmill.worker.model_runner" in found
    assert "tokenmill.core.block_pool" in found
    assert "tokenmill.engine" in found
    assert _is_forbidden("tokenmill.worker.model_runner", ("tokenmill.worker",))
    assert not _is_forbidden("tokenmill.workers", ("tokenmill.worker",))


def test_core_imports_nothing_from_runner_models_engine_entrypoints():
    bad = _violations("core", ("tokenmill.worker", "tokenmill.models", "tokenmill.entrypoints",
                               "tokenmill.engine", "torch"))
    assert bad == []


def test_models_import_nothing_from_engine_core_entrypoints():
    bad = _violations("models", ("tokenmill.engine", "tokenmill.core", "tokenmill.entrypoints"))
    assert bad == []


def test_core_does_not_import_torch():
    # The scheduler pulls in every other tokenmill.core module.
    module = "tokenmill.core.scheduler"
    code = (f"import sys, json; import {module}; "
            "print(json.dumps({'torch': 'torch' in sys.modules, "
            "'tokenmill': sorted(m for m in sys.modules if m.startswith('tokenmill'))}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    assert not loaded["torch"], (f"importing {module} loaded torch; tokenmill modules loaded "
                                 f"with it: {loaded['tokenmill']}")


def test_parsers_are_a_leaf():
    """The tool-call and reasoning parsers are text in, text out: the server, the offline
    LLM and the grammar gate share them, so they import no other tokenmill package and no
    third-party module."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = [f"{path.relative_to(PKG.parent)} imports {name}"
           for path in sorted((PKG / "parsers").rglob("*.py"))
           for name in sorted(imported_modules(path))
           if not (name.startswith("tokenmill.parsers") or name.split(".")[0] in stdlib)]
    assert bad == []
