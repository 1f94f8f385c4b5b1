"""The project's import graph: no cycles, and the one-way layering of shared/DESIGN.md §2.

The graph is built from source with `ast` (nothing is imported): every `import X` and
`from X import Y` naming a project module, at module level or inside a function, is an
edge, so a lazy import that closes a circle counts. Layering: experiments → models →
kvjax → kernels_pallas, never back; inside `experiments/`, only the console entry point
imports `experiments.cli`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels_pallas", "kvjax", "models", "experiments")  # lowest layer first


def module_name(path: Path) -> str:
    """`kvjax/quant/__init__.py` -> `kvjax.quant`; `kvjax/cache.py` -> `kvjax.cache`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Module name -> source file, for every .py file of the four packages."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to: itself, or its longest project prefix
    (`kvjax.cache.EMPTY` -> `kvjax.cache`); None outside the project."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports anywhere in its source (function bodies too)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, `level` dots up
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one,
            # else a name defined by `pkg` itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        for name in names:
            target = resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    modules = {"pkg": tmp_path / "pkg/__init__.py", "pkg.a": tmp_path / "pkg/a.py",
               "pkg.b": tmp_path / "pkg/b.py", "pkg.c": tmp_path / "pkg/c.py"}
    for path in modules.values():
        path.parent.mkdir(exist_ok=True)
    modules["pkg.a"].write_text("import os\n\ndef f():\n    from pkg.b import thing\n")
    modules["pkg.b"].write_text("from . import c\nfrom .a import f\n")
    modules["pkg.c"].write_text("import pkg.b.thing\n")
    modules["pkg"].write_text("")
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a", "pkg.c"},
                     "pkg.c": {"pkg.b"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_the_graph_covers_every_package():
    graph = import_graph()
    for pkg in PACKAGES:
        assert pkg in graph and any(m.startswith(pkg + ".") for m in graph)
    assert "experiments.harness" in graph["experiments.cli"]  # lazy imports are edges


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("lower", PACKAGES[:-1])
def test_lower_layers_import_nothing_above_them(lower):
    """kernels_pallas imports nothing of kvjax/models/experiments; kvjax nothing of
    models/experiments; models nothing of experiments."""
    above = PACKAGES[PACKAGES.index(lower) + 1:]
    bad = sorted(f"{m} imports {t}" for m, targets in import_graph().items()
                 if m.split(".")[0] == lower for t in targets if t.split(".")[0] in above)
    assert not bad, "\n".join(bad)


def test_only_the_console_entry_point_imports_the_cli():
    """No library or pipeline module imports the CLI; a standalone script that no module
    imports (the top of the graph, like the console entry point) may drive it."""
    graph = import_graph()
    imported = set().union(*graph.values())
    importers = sorted(m for m, targets in graph.items()
                       if "experiments.cli" in targets and m in imported)
    assert importers == [], importers
    scripts = sorted(m for m, targets in graph.items() if "experiments.cli" in targets)
    assert all(m.startswith("experiments.") for m in scripts), scripts
    scripts = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'kvjax = "experiments.cli:main"' in scripts


def test_experiments_layers():
    """grid <- (cells, kvpress_engine) <- harness <- (report, cli): the grid types import no
    other pipeline module, the engines never import the harness, report or CLI."""
    graph = import_graph()
    pipeline = {"experiments.grid", "experiments.cells", "experiments.kvpress_engine",
                "experiments.harness", "experiments.report", "experiments.cli"}
    assert not graph["experiments.grid"] & pipeline
    for engine in ("experiments.cells", "experiments.kvpress_engine"):
        assert not graph[engine] & {"experiments.harness", "experiments.report",
                                    "experiments.cli"}, engine
    assert not graph["experiments.harness"] & {"experiments.report", "experiments.cli"}
