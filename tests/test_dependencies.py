"""The dependencies in pyproject.toml are the ones the installed packages import, exactly.

Every third-party module that `kvjax/`, `models/`, `kernels_pallas/` or `experiments/`
imports (outside a `try: ... except ImportError`) must come from a declared distribution: a
runtime dependency, or an extra for code that only runs with it (the `compare` engines).
Every runtime dependency must be imported by them, unless `NEEDED_INDIRECTLY` says why it is
there; and the test-only libraries (chex, hypothesis, pytest) must not be runtime ones.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvjax", "models", "kernels_pallas", "experiments")
NEEDED_INDIRECTLY = {
    "flatbuffers": "jax.export's serialization imports it lazily; jax does not require it",
}
TEST_ONLY = {"chex", "hypothesis", "pytest"}


def _name(requirement: str) -> str:
    """PEP 503 normal form of a requirement's distribution name."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _optional(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a `try` that catches ImportError."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is not None and any(isinstance(n, ast.Name) and n.id in
                                           ("ImportError", "ModuleNotFoundError")
                                           for n in ast.walk(h.type)) for h in node.handlers):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


@functools.cache
def third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files importing it (required imports only)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            optional = _optional(tree)
            for node in ast.walk(tree):
                if id(node) in optional:
                    continue
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {n.split(".")[0] for n in names}:
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _module_owners() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    dists = _module_owners().get(module, [module])
    return {_name(d) for d in dists}


def test_every_import_is_declared_and_every_runtime_dependency_is_used():
    project = _project()
    runtime = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    imports = third_party_imports()
    undeclared = {m: sorted(files) for m, files in imports.items()
                  if not _distributions(m) & (runtime | extras)}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    used = set().union(*(_distributions(m) for m in imports))
    unused = runtime - used - set(NEEDED_INDIRECTLY)
    assert not unused, f"runtime dependencies nothing imports: {sorted(unused)}"


def test_runtime_imports_of_the_library_are_runtime_dependencies():
    """An extra is enough only for `experiments/` scripts that run with it; the library
    (`kvjax`, `models`, `kernels_pallas`) imports only runtime dependencies."""
    runtime = {_name(r) for r in _project()["dependencies"]}
    library = {m: files for m, files in third_party_imports().items()
               if any(not f.startswith("experiments/") for f in files)}
    missing = {m: sorted(f) for m, f in library.items() if not _distributions(m) & runtime}
    assert not missing, missing
    assert "huggingface-hub" in runtime  # models/hub.py:from_hugging_face


def test_test_only_libraries_are_not_runtime_dependencies():
    project = _project()
    runtime = {_name(r) for r in project["dependencies"]}
    test = {_name(r) for r in project["optional-dependencies"]["test"]}
    assert not runtime & TEST_ONLY, runtime & TEST_ONLY
    assert "chex" in test  # tests/test_cache.py checks recompilation with chex.assert_max_traces
    assert "chex" not in third_party_imports()
