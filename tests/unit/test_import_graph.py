"""The package's import graph has no cycle.

Every `import` / `from ... import` of a tokenmill module counts, at the top of a file
or inside a function: an import deferred into a function only hides a circle from the
interpreter, and the modules of a circle can be neither read nor changed alone.
"""
from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("tokenmill",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the tokenmill modules it imports (a package's __init__ when only the
    package is named)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, level - 1 up
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # "from a.b import c": c may be a module of a.b, else a name in a.b
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("tokenmill") else None
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "tokenmill.engine.llm_engine" in graph["tokenmill.llm"]  # edges are found


def test_tensor_parallel_knows_no_model():
    """models/tensor_parallel.py holds the generic mechanics only: which tensors split and
    where the ranks' partial sums are reduced is declared by the layers (their `tp`
    roles and `tp_plan`s), so it imports no model or layer module."""
    imported = import_graph()["tokenmill.models.tensor_parallel"]
    assert imported <= {"tokenmill.models.checkpoint_io"}, sorted(imported)


def test_gemm_kernels_are_chosen_by_the_methods_and_the_platform():
    """The GEMM kernels of the Linear and expert layers are called from their methods
    (models/layers/linear_methods/) only, chosen by the platform only; the layers
    call their method."""
    import re
    kernels = re.compile(r"_linear_pointwise|_reorder_linear_weight|\.linear_(bf16|f32)\b"
                         r"|pack_(bf16|f32)_weight|_grouped_mm\(")
    allowed = ("models/layers/linear_methods/", "platforms/", "kernels/")
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(allowed):
            found += [f"{rel}: {m.group(0)}" for m in kernels.finditer(path.read_text())]
    assert not found, found
    choosers = ("Prepacked", "PackedBf16", "PackedF32", "SyncFree")
    outside = [f"{path.relative_to(ROOT)}: {c}" for path in ROOT.rglob("*.py")
               for c in choosers if c + "LinearMethod" in path.read_text()
               or c + "FusedMoEMethod" in path.read_text()
               if not path.relative_to(ROOT).as_posix().startswith(
                   ("models/layers/linear_methods/", "platforms/"))]
    assert not outside, outside
