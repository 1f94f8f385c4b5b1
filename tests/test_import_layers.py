"""The project's import graph: no cycles, and the one-way layering of docs/guide/layout.md.

The graph is built from source with `ast` (nothing is imported): every `import X` and
`from X import Y` naming a project module, at module level or inside a function, is an
edge, so a lazy import that closes a circle counts. Layering: experiments → models →
kvjax → kernels_pallas, never back; inside `experiments/`, only the console entry point
imports `experiments.cli.main`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels_pallas", "kvjax", "models", "experiments")  # lowest layer first


def module_name(path: Path) -> str:
    """`kvjax/quant/__init__.py` -> `kvjax.core.quant`; `kvjax/core/cache.py` -> `kvjax.core.cache`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Module name -> source file, for every .py file of the four packages."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to: itself, or its longest project prefix
    (`kvjax.core.cache.EMPTY` -> `kvjax.core.cache`); None outside the project."""
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
    assert "experiments.eval.harness" in graph["experiments.cli.main"]  # lazy imports are edges


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
                       if "experiments.cli.main" in targets and m in imported)
    assert importers == [], importers
    scripts = sorted(m for m, targets in graph.items() if "experiments.cli.main" in targets)
    assert all(m.startswith("experiments.") for m in scripts), scripts
    scripts = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'kvjax = "experiments.cli.main:main"' in scripts


def test_experiments_layers():
    """grid <- (cells, kvpress_engine) <- harness <- (report, cli): the grid types import no
    other pipeline module, the engines never import the harness, report or CLI."""
    graph = import_graph()
    pipeline = {"experiments.eval.grid", "experiments.eval.cells", "experiments.eval.kvpress_engine",
                "experiments.eval.harness", "experiments.eval.report", "experiments.cli.main"}
    assert not graph["experiments.eval.grid"] & pipeline
    for engine in ("experiments.eval.cells", "experiments.eval.kvpress_engine"):
        assert not graph[engine] & {"experiments.eval.harness", "experiments.eval.report",
                                    "experiments.cli.main"}, engine
    assert not graph["experiments.eval.harness"] & {"experiments.eval.report", "experiments.cli.main"}


# ----------------------------------------------------------------------------- kvjax subsystems
SUBSYSTEMS = ("core", "memory", "backends", "policies", "tools")
"""kvjax's subsystems; each imports only those allowed below (README "Layout")."""
ALLOWED = {"core": set(), "memory": {"core"}, "backends": {"core", "memory"},
           "policies": {"core"}, "tools": {"core", "memory"}}


def subsystem(module: str) -> str:
    """`kvjax.memory.tiers` -> `kvjax.memory`; other project modules -> their package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvjax" and len(parts) > 2 else parts[0]


def test_every_kvjax_module_lives_in_a_subsystem():
    """kvjax's top level holds only `__init__.py` (the public API); every module sits in one
    of the subsystems, each with a docstring saying what it holds."""
    flat = sorted(p.name for p in (ROOT / "kvjax").glob("*.py") if p.name != "__init__.py")
    assert flat == [], flat
    folders = sorted(p.parent.name for p in (ROOT / "kvjax").glob("*/__init__.py"))
    assert folders == sorted(SUBSYSTEMS)
    for name in SUBSYSTEMS:
        assert ast.get_docstring(ast.parse((ROOT / "kvjax" / name / "__init__.py").read_text()))


def test_kvjax_subsystems_import_only_those_below_them():
    bad = sorted(f"{m} imports {t}" for m, targets in import_graph().items()
                 if subsystem(m).startswith("kvjax.") for t in targets
                 if subsystem(t).startswith("kvjax.") and subsystem(t) != subsystem(m)
                 and subsystem(t).split(".")[1] not in ALLOWED[subsystem(m).split(".")[1]])
    assert not bad, "\n".join(bad)


def private_imports(module: str, path: Path, modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(project module, private name) pairs that `module` reads: `from m import _x`, and
    `alias._x` where `alias` names a project module (`from pkg import m`, `import m as alias`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases, found = {}, set()
    private = lambda name: name.startswith("_") and not name.startswith("__")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                elif private(a.name) and resolve(node.module, modules):
                    found.add((resolve(node.module, modules), a.name))
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names
                            if a.asname and a.name in modules})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and private(node.attr)):
            found.add((aliases[node.value.id], node.attr))
    return found


def test_private_names_stay_inside_their_kvjax_subsystem(tmp_path):
    """No module (of kvjax, models or experiments) reads a private name of a kvjax module in
    another subsystem. Tests may: they check internals."""
    modules = project_modules()
    bad = sorted(f"{m} reads {t}.{name}" for m, p in modules.items()
                 for t, name in private_imports(m, p, modules)
                 if t.startswith("kvjax.") and subsystem(t) != subsystem(m))
    assert not bad, "\n".join(bad)
    # the check sees both spellings
    probe = tmp_path / "probe.py"
    probe.write_text("from kvjax.memory import tiers\nfrom kvjax.core.cache import _x\n"
                     "tiers._y\n")
    assert private_imports("experiments.probe", probe, modules) == {
        ("kvjax.core.cache", "_x"), ("kvjax.memory.tiers", "_y")}


def test_importing_the_packages_changes_no_jax_setting():
    """`import kvjax, models, experiments.cli.main` leaves every jax setting alone (the compilation
    cache is switched on by `load_model` and the CLI, not by an import)."""
    import subprocess
    import sys
    code = ("import jax; before = dict(jax.config.values); import kvjax, models, models.loading, "
            "models.sampler, experiments.cli.main; after = dict(jax.config.values); "
            "changed = {k for k in before if before[k] != after.get(k)}; "
            "assert not changed, changed; print(after['jax_compilation_cache_dir'])")
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "KVJAX_COMPILATION_CACHE"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "None"


def bench_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The benchmark scripts (`experiments.bench`, the package or a script) `path` imports."""
    return {m for m in imports_of(f"tests.{path.stem}", path, modules)
            if m == "experiments.bench" or m.startswith("experiments.bench.")}


def test_tests_import_no_benchmark_script(tmp_path):
    """Tests import no benchmark script (issue 47): what a test needs is in the library or a
    shared test helper (tests/random_layers.py, tests/offload_decode.py), and a benchmark
    is tested through its command line (`python -m experiments.bench.NAME ...` in a
    subprocess, asserting on what it writes)."""
    modules = project_modules()
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from experiments.bench.attention import make_layer\n"
                     "from experiments import bench\n")
    assert bench_imports(probe, modules) == {"experiments.bench", "experiments.bench.attention"}
    found = {p.name: sorted(bench_imports(p, modules))
             for p in sorted((ROOT / "tests").glob("*.py")) + [ROOT / "conftest.py"]}
    assert not {name: m for name, m in found.items() if m}, found


def test_the_command_line_and_the_evaluation_import_no_benchmark_script():
    """experiments.bench sits on top: the CLI, the eval pipeline and the goldens never import
    it (what both need, like the bandwidth floor, lives in experiments.eval)."""
    bad = sorted(f"{m} imports {t}" for m, targets in import_graph().items()
                 if m.startswith(("experiments.cli", "experiments.eval", "experiments.golden"))
                 for t in targets if t.startswith("experiments.bench"))
    assert not bad, "\n".join(bad)
