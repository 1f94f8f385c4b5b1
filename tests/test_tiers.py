"""The test tiers (the root `conftest.py`): `fast` touches every module, never the real model.

One collection of the whole suite in a subprocess (no test runs) writes each test's tier
(`KVJAX_TIERS_DUMP`); from it:
- no test is both fast and slow, and every test that asks for a real-model fixture is slow;
- every entry of `HEAVY` and `NOT_REAL_MODEL` still names a collected test or file (a renamed
  test would otherwise fall into the fast tier unseen);
- every module of `kvjax/`, `models/` and `kernels_pallas/` is touched by the fast tier: a fast
  test's file imports it, or one of its docstring examples is fast.
And every module of the four installed packages imports (what `pytest -m fast` cannot promise
for the experiment scripts no test names).
"""

from __future__ import annotations

import ast
import collections
import functools
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("kvjax", "models", "kernels_pallas")
PACKAGES = LIBRARY + ("experiments",)
COMPARE_EXTRA = {"torch", "transformers", "accelerate", "kvpress"}
SCRIPTS: set[str] = set()  # modules that run a measurement on import (none now)


def _modules(packages) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "notebooks" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


@functools.cache
def tiers() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "CI")}
    dump = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvjax_tiers_{os.getpid()}.json"
    env["KVJAX_TIERS_DUMP"] = str(dump)
    # a file that fails to collect fails the suite on its own; here it only lacks tiers
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                          "-p", "no:cacheprovider", "--continue-on-collection-errors"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert dump.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    try:
        return json.loads(dump.read_text())
    finally:
        dump.unlink(missing_ok=True)


def test_tiers_are_disjoint_and_real_model_tests_are_slow():
    t = tiers()
    assert not [n for n, marks in t.items() if {"fast", "slow"} <= set(marks)]
    fast = collections.Counter(n.split("[")[0] for n, marks in t.items() if "fast" in marks)
    assert len(fast) > 300 and fast.most_common(1)[0][1] == 1  # one case of each test
    for known_slow in ("tests/test_smollm2.py::", "tests/test_kvpress_parity.py::",
                       "tests/test_notebooks.py::"):
        members = [n for n in t if n.startswith(known_slow)]
        assert members and not [n for n in members if "fast" in t[n]], known_slow


def test_every_listed_heavy_test_still_exists():
    spec = importlib.util.spec_from_file_location("kvjax_root_conftest", ROOT / "conftest.py")
    tiers_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiers_conftest)
    nodes = tiers()
    files = {n.split("::")[0] for n in nodes}
    functions = {n.split("[")[0] for n in nodes}
    # a file that exists but collected nothing failed to import: its own error reports that
    stale = [e for e in [*tiers_conftest.HEAVY, *tiers_conftest.NOT_REAL_MODEL]
             if e not in files and e not in functions
             and (e.split("::")[0] in files or not (ROOT / e.split("::")[0]).is_file())]
    assert not stale, stale


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:  # `import kvjax.x.y` touches kvjax.x.y and its packages
            parts = name.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known
    return found


def test_the_fast_tier_touches_every_library_module():
    modules = _modules(LIBRARY)
    known = set(modules)
    fast = [n for n, marks in tiers().items() if "fast" in marks]
    touched = set()
    for path in {n.split("::")[0] for n in fast}:
        if path.startswith("tests/"):
            touched |= _imported_modules(ROOT / path, known)
        else:  # a docstring example: kvjax/x.py::kvjax.x
            touched.add(".".join(Path(path).with_suffix("").parts).removesuffix(".__init__"))
    missing = sorted(known - touched)
    assert not missing, f"no fast test imports these, and none of their examples is fast: {missing}"


def test_every_module_imports():
    failed = {}
    for name in sorted(set(_modules(PACKAGES)) - SCRIPTS):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:  # an experiment that runs with the `compare` extra only
            if not (e.name.split(".")[0] in COMPARE_EXTRA and name.startswith("experiments.")):
                failed[name] = repr(e)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failed[name] = repr(e)
    assert not failed, failed


def test_readme_counts_are_the_suites():
    """README's test counts stay within 20% of what pytest collects (a count that drifted
    further is stale: rewrite it with the date, as the times beside it are)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    t = tiers()
    suite = re.search(r"From a clean clone it collects ([\d,]+) tests", text)
    fast = re.search(r"`python -m pytest -m fast -n 2` runs ([\d,]+) of them", text)
    assert suite and fast, "README no longer states the suite's and the fast tier's counts"
    for quoted, actual in [(suite, len(t)), (fast, sum("fast" in m for m in t.values()))]:
        n = int(quoted.group(1).replace(",", ""))
        assert 0.8 * actual <= n <= 1.2 * actual, (quoted.group(0), actual)


def test_with_workers_each_file_runs_on_one_worker():
    """`-n 2` deals whole files to workers (the root conftest's scheduler), so a module's
    fixtures are built once; an explicit `--dist load` still splits a file."""
    def workers(*args):
        run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "-p",
                              "no:cacheprovider", *args, "tests/test_bounds.py",
                              "tests/test_near_ties.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        found = re.findall(r"\[(gw\d)\] .*?PASSED (tests/\w+\.py)", run.stdout)
        per_file = collections.defaultdict(set)
        for worker, path in found:
            per_file[path].add(worker)
        assert len(found) > 20, run.stdout[-3000:]
        return per_file
    assert all(len(w) == 1 for w in workers().values())
    assert len(workers("--dist", "load")["tests/test_bounds.py"]) == 2


def test_a_test_off_the_real_model_compiles_without_llvm_optimizations():
    """The root conftest's `quick_compiles`: set before this test's fixtures ran."""
    import jax
    assert jax.config.read("jax_disable_most_optimizations") is True


@pytest.mark.slow
def test_a_real_model_test_compiles_as_users_do():
    """A `slow` test (here marked by hand; conftest marks every test that loads SmolLM2)
    compiles with XLA's optimizations on."""
    import jax
    assert jax.config.read("jax_disable_most_optimizations") is False
