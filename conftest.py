"""Suite-wide hooks, for every test pytest collects (tests/ and the docstring examples of
kvjax/, models/ and kernels_pallas/): CI's skip guard, the `fast` tier, and quick compiles
for every test that does not load the real model (`quick_compiles`).

The guard: in CI (`CI` set and not "false"/"0") a skip fails unless its reason starts with
`[optional]`, wherever it happens: a module that skips at import (`pytest.skip(...,
allow_module_level=True)`, `pytest.importorskip` at module level: a skipped *collection*,
which the per-test hook never sees), a fixture that skips, a test that skips, a skipif mark.
A skipped collection becomes one failing item, `<module>::skipped_in_ci`, so the rest of the
suite still runs and the run fails. `tests/test_ci_guard.py` runs pytest on files that skip
each way (and on `tests/test_tpu_compile.py` with libtpu hidden) and sees the run fail.

The tiers: a test that loads the real SmolLM2 (a real-model fixture, or a call that loads it
in the test, its fixtures or a docstring example) is marked `slow`. A test is `fast` when it is
not slow, not listed in `HEAVY` (by hand: notebooks, subprocess fleets, Mosaic compiles; or
measured, `tests/heavy_tests.txt`), and is the first case of its function. `python -m pytest
-m fast -n 2` is the developer loop (README gives its time); CI runs everything.
`tests/test_tiers.py` checks that the fast tier touches every module of the library and that no
listed test has gone stale.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest

OPTIONAL = "[optional]"  # skip reasons starting with this are allowed in CI (extras not installed)


DOCTEST_SKIP = "all tests skipped by +SKIP option"
"""pytest's reason for a docstring whose every example is marked `# doctest: +SKIP` in the
source (an example that needs the network, e.g. `models.hub.from_hugging_face`): a choice
written where it is read, not a skip the environment caused, so allowed in CI."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads the real SmolLM2 model (set by conftest.py)")
    config.addinivalue_line("markers", "fast: the fast tier (set by conftest.py)")


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist knows no such hook
def pytest_xdist_make_scheduler(config, log):
    """With `-n`, each test file runs whole on one worker (xdist's `--dist loadfile`), so a
    module's real-model fixtures (a prefill, an exported artifact) are built once, not once per
    worker (docs/DECISIONS.md "Tests distributed by file"). A `--dist` given on the command
    line or in `PYTEST_ADDOPTS` is left to xdist."""
    from xdist.scheduler import LoadFileScheduling
    given = [*map(str, config.invocation_params.args),
             *os.environ.get("PYTEST_ADDOPTS", "").split()]
    if not any(a.startswith(("--dist", "-d")) for a in given):
        return LoadFileScheduling(config, log)
    return None


def quick_compiles(item) -> bool:
    """Whether `item` compiles with XLA's backend optimizations off
    (`jax_disable_most_optimizations`: LLVM at -O0 without its expensive passes; XLA's own
    HLO passes, fusion and layouts among them, run as usual, so a test that reads the compiled
    HLO sees the same program): every test but those of the real model (`slow`). Tests on tiny
    random configs compile thousands of small programs and run each for milliseconds, so
    compiling costs far more than running, and LLVM's optimizations are most of compiling
    (docs/guide/correctness.md#suite-times). Real-model programs run long enough that the
    optimizations pay: a 2,048-token prefill of SmolLM2 ran 2.4x slower without them."""
    return item.get_closest_marker("slow") is None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Set XLA's optimizations for `item` before its fixtures, so a module's shared fixtures
    compile as the test that first needs them does (`quick_compiles`)."""
    import jax
    jax.config.update("jax_disable_most_optimizations", quick_compiles(item))


def _allowed(reason: str) -> bool:
    return reason.startswith(OPTIONAL) or reason == DOCTEST_SKIP


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _reason(longrepr) -> str:
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


class SkippedInCI(pytest.Item):
    """Stands in for a module (or class) whose collection skipped in CI: it fails."""

    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self):
        pytest.fail(f"collection skipped in CI, which must run every test: {self.reason}",
                    pytrace=False)

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if in_ci() and report.skipped and not _allowed(_reason(report.longrepr)):
        item = SkippedInCI.from_parent(collector, name="skipped_in_ci",
                                       reason=_reason(report.longrepr))
        report = pytest.CollectReport(report.nodeid, "passed", None, [item])
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skipped setup (a fixture), call or teardown fails in CI unless `[optional]`: model-
    backed tests must never skip silently because a download or an extra went missing."""
    report = yield
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report.longrepr)
        if not _allowed(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, which must run every test: {reason}"
    return report


# ----------------------------------------------------------------------------- tiers

REAL_MODEL_FIXTURES = {"smollm2", "smollm2_file", "smollm2_tokenizer"}
REAL_MODEL_CALL = re.compile(r"smollm2_path\(|find_smollm2\(|load_model\(\s*[\"']smollm2[\"']")
"""A test (or one of its fixtures, or a doctest) whose source calls these loads the real model."""

NOT_REAL_MODEL = {"tests/test_loading.py::test_smollm2_env_var_pointing_nowhere"}
"""Tests whose source matches `REAL_MODEL_CALL` but never load the model (an error path)."""

_SUBPROCESS = "subprocesses that start jax (and compile) from nothing"
_COMPILES = "tens of seconds of XLA compiles"
HEAVY: dict[str, str] = {
    "tests/test_notebooks.py": "runs the notebooks end to end",
    "tests/test_tpu_compile.py": "Mosaic compiles of every kernel variant (libtpu)",
    "tests/test_compile_topology.py": "`kvjax compile` for TPU topologies in subprocesses",
    "tests/test_multiprocess.py": "`kvjax launch` of several processes",
    "tests/test_pool_property.py": "hypothesis runs of the page pool against a shadow model",
    "tests/test_sharding.py": "8-device meshes, each test compiling sharded models",
    "tests/test_ci_guard.py::test_tpu_compile_tests_fail_in_ci_when_libtpu_is_missing":
        _SUBPROCESS,
    "tests/test_cpu_kernel.py::test_the_avx2_build_passes_the_kernel_equality_tests":
        "a second g++ build and a pytest subprocess",
    "tests/test_cpu_kernel.py::test_kernel_ab_benchmark_runs_another_source_beside_the_shipped":
        "a g++ build of another source",
    "tests/test_sharded_eval.py::test_eval_rows_on_a_mesh_equal_one_device_rows": _COMPILES,
    "tests/test_paged_kivi.py::test_flushed_pages_bit_identical_to_unpaged_kivi": _COMPILES,
    "tests/test_paged_kivi.py::test_pages_released_by_one_sequence_are_never_read_by_the_other":
        _COMPILES,
    "tests/test_offload.py::test_attention_over_offloaded_pages_equals_all_on_device": _COMPILES,
    "tests/test_offload.py::test_eager_prefetch_returns_before_its_copies_finish": _COMPILES,
    "tests/test_offload.py::test_spill_refuses_last_pages_and_writes_never_reach_the_host":
        _COMPILES,
    "tests/test_export.py::test_artifact_generates_the_live_models_tokens": _COMPILES,
    "tests/test_transforms.py::test_sampler_compression_returns_layers_stacked_and_equals_eager":
        _COMPILES,
    "tests/test_transforms.py::test_compression_under_jit_equals_eager_and_compiles_one_body_per_equal_layers":
        _COMPILES,
    "tests/test_kernel_attention.py::test_shared_table_paged_layer_equals_the_per_head_pool":
        _COMPILES,
    "tests/test_bench_kernels.py::test_smoke_runs_every_format_and_jax_kernel": _COMPILES,
    "tests/test_bench_kernels.py::test_model_check_rows_on_cpu": _SUBPROCESS,
    "tests/test_gpu_report.py::test_missing_file_and_bad_launch_are_argument_errors": _SUBPROCESS,
    "tests/test_checkpoint.py::test_another_process_continues_token_identically": _SUBPROCESS,
    "tests/test_monitor.py::test_monitor_of_a_tiered_paged_cache": _COMPILES,
    "tests/test_attention.py::test_property_random_holes": "a hypothesis property run",
    "tests/test_paged_attention.py::test_mixed_prefill_and_decode_rows_in_one_call": _COMPILES,
    "tests/test_kernel_attention.py::test_kivi_keys_are_read_in_place": _COMPILES,
    "tests/test_paged_kivi.py::test_paged_kivi_attends_through_the_tpu_kernel": _COMPILES,
}
"""Files (`tests/x.py`) or tests (`tests/x.py::name`, any parametrization) left out of the
fast tier though they load no real model, with the reason."""
HEAVY["tests/test_tiers.py::test_tiers_are_disjoint_and_real_model_tests_are_slow"] = \
    HEAVY["tests/test_tiers.py::test_every_listed_heavy_test_still_exists"] = \
    HEAVY["tests/test_tiers.py::test_the_fast_tier_touches_every_library_module"] = \
    HEAVY["tests/test_tiers.py::test_readme_counts_are_the_suites"] = \
    "collects the whole suite in a subprocess"

MEASURED = Path(__file__).with_name("tests") / "heavy_tests.txt"
"""More heavy tests, measured: `<seconds> <tests/x.py::name>` a line (the CPU seconds of the
test's first case in a `-m fast` run); what the fast tier had to drop to fit 3 minutes."""
HEAVY.update({line.split()[1]: f"measured: {line.split()[0]} s of CPU"
              for line in (MEASURED.read_text().splitlines() if MEASURED.is_file() else ())
              if line.strip() and not line.startswith("#")})

FAST_TRAP = "/nonexistent/the-fast-tier-loads-no-real-model.gguf"


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def loads_real_model(item) -> bool:
    """Whether `item` needs SmolLM2: a real-model fixture, or a call that loads it in the test,
    in one of the fixtures it uses, or in a docstring example."""
    if item.nodeid.split("[")[0] in NOT_REAL_MODEL:
        return False
    if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if hasattr(item, "dtest"):  # a docstring example
        return any(REAL_MODEL_CALL.search(e.source) for e in item.dtest.examples)
    sources = [_source(getattr(item, "function", None))]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        sources += [_source(d.func) for d in defs if "_pytest" not in str(getattr(d, "baseid", "_pytest"))]
    return any(REAL_MODEL_CALL.search(s) for s in sources)


def heavy_reason(item) -> str | None:
    path = item.nodeid.split("::")[0]
    name = item.nodeid.split("::", 1)[-1].split("[")[0]
    return HEAVY.get(path) or HEAVY.get(f"{path}::{name}")


def pytest_collection_modifyitems(config, items):
    """Marks each test `slow` (it loads the real model) or `fast`: not slow, not listed in
    `HEAVY` (by hand or measured), and the first case of its function (a parametrized test's
    other cases run in the full suite). `-m fast` also sets `KVJAX_SMOLLM2` to a path that
    does not exist, so a fast test that reaches for the real model anyway fails, naming it."""
    first_cases = set()
    for item in items:
        if loads_real_model(item) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        function = item.nodeid.split("[")[0]
        if (not item.get_closest_marker("slow") and heavy_reason(item) is None
                and function not in first_cases):
            first_cases.add(function)  # one case of each parametrized test: its first
            item.add_marker(pytest.mark.fast)
    if config.getoption("markexpr", "").strip() == "fast":
        os.environ["KVJAX_SMOLLM2"] = FAST_TRAP
    dump = os.environ.get("KVJAX_TIERS_DUMP")  # tests/test_tiers.py reads the tiers from here
    if dump:
        import json
        with open(dump, "w") as f:
            json.dump({item.nodeid: sorted(m.name for m in item.iter_markers()
                                           if m.name in ("fast", "slow")) for item in items}, f)
