"""CI's skip guard (the root `conftest.py`) catches a skip wherever it happens.

Each case runs pytest in a subprocess under `CI=true` on a small test file, with the real
guard (the repository's root `conftest.py`, copied next to the file), and checks that the run
fails, naming the skip; and that the same file passes outside CI, so the failure is the
guard's. The last case hides libtpu from the interpreter (a `sitecustomize` that blanks the
module) and runs the real `tests/test_tpu_compile.py`: the file behind "every kernel variant
compiles for TPU" must not vanish from CI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OK = (0, 5)  # passed; or nothing ran (the one module skipped at import)

CASES = {
    "module_skip": """
        import pytest
        pytest.skip("no libfoo here", allow_module_level=True)
        def test_a():
            pass
    """,
    "module_importorskip": """
        import pytest
        pytest.importorskip("kvjax_no_such_module_at_all")
        def test_a():
            pass
    """,
    "fixture_skip": """
        import pytest
        @pytest.fixture
        def model():
            pytest.skip("model not downloaded")
        def test_a(model):
            pass
    """,
    "test_skip": """
        import pytest
        def test_a():
            pytest.skip("not today")
    """,
    "skipif_mark": """
        import pytest
        @pytest.mark.skipif(True, reason="needs a TPU")
        def test_a():
            pass
    """,
    "class_skip": """
        import pytest
        @pytest.mark.skip(reason="later")
        class TestLater:
            def test_a(self):
                pass
    """,
}

OPTIONAL_CASES = {
    "doctest_skip_in_the_source": """
        def f():
            \'\'\'
            >>> f()  # doctest: +SKIP
            1
            \'\'\'
    """,
    "optional_module_skip": """
        import pytest
        pytest.skip("[optional] the compare extra is not installed", allow_module_level=True)
        def test_a():
            pass
    """,
    "optional_test_skip": """
        import pytest
        def test_a():
            pytest.skip("[optional] needs AVX2")
        def test_b():
            pass
    """,
}


def _pytest(folder: Path, *args: str, ci: bool, extra_env: dict | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci:
        env["CI"] = "true"
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder),
         "-c", str(folder / "pytest.ini"), *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def _project(tmp_path: Path, source: str) -> Path:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")  # the guard under test
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_case.py").write_text(textwrap.dedent(source))
    return tmp_path


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_skip_fails_in_ci_and_passes_outside(tmp_path, case):
    folder = _project(tmp_path, CASES[case])
    run = _pytest(folder, "-p", "no:xdist", ci=True)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "skipped in CI, which must run every test" in out, out
    summary = run.stdout.strip().splitlines()[-1]  # a skip in setup is an error, in a test a failure
    assert re.search(r"\b1 (failed|error)\b", summary) and "skipped" not in summary, out
    outside = _pytest(folder, "-p", "no:xdist", ci=False)
    assert outside.returncode in OK and "1 skipped" in outside.stdout, outside.stdout


def test_a_module_skip_fails_under_xdist_as_ci_runs_it(tmp_path):
    """`-n 2`: the workers collect, the controller reports; the run still fails."""
    folder = _project(tmp_path, CASES["module_skip"])
    (folder / "test_other.py").write_text("def test_b():\n    pass\n")
    run = _pytest(folder, "-n", "2", ci=True)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 1 passed" in out and "no libfoo here" in out, out


@pytest.mark.parametrize("case", sorted(OPTIONAL_CASES))
def test_an_optional_skip_passes_in_ci(tmp_path, case):
    """`[optional]` reasons, and a docstring whose examples are all `+SKIP` in the source."""
    doctests = ["--doctest-modules"] if case.startswith("doctest") else []
    run = _pytest(_project(tmp_path, OPTIONAL_CASES[case]), "-p", "no:xdist", *doctests, ci=True)
    assert run.returncode in OK, run.stdout + run.stderr
    assert "1 skipped" in run.stdout, run.stdout


@pytest.mark.parametrize("value", ["false", "0", ""])
def test_ci_off_values_do_not_arm_the_guard(tmp_path, value):
    run = _pytest(_project(tmp_path, CASES["module_skip"]), "-p", "no:xdist", ci=False,
                  extra_env={"CI": value})
    assert run.returncode in OK and "1 skipped" in run.stdout, run.stdout + run.stderr


def test_tpu_compile_tests_fail_in_ci_when_libtpu_is_missing(tmp_path):
    """With libtpu hidden, `tests/test_tpu_compile.py` skips its module at import; under
    `CI=true` that is a failure, not a silently missing file."""
    shim = tmp_path / "shim"
    shim.mkdir()
    # sys.modules[name] = None: `import libtpu` raises and importlib.util.find_spec returns None
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['libtpu'] = None\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS",)}
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    hidden = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('libtpu'))"],
        env=env, capture_output=True, text=True, timeout=120)
    assert hidden.stdout.strip() == "None", hidden.stdout + hidden.stderr  # the shim works
    env["CI"] = "true"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "-o", "addopts=", "tests/test_tpu_compile.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "test_tpu_compile.py::skipped_in_ci" in out and "libtpu is not importable" in out, out
    assert "1 failed" in out and "passed" not in out, out
