"""Suite-wide hooks, for every test pytest collects (tests/ and the docstring examples of
kvjax/, models/ and kernels_pallas/): CI's skip guard, and the `fast` tier.

The guard: in CI (`CI` set and not "false"/"0") a skip fails unless its reason starts with
`[optional]`, wherever it happens: a module that skips at import (`pytest.skip(...,
allow_module_level=True)`, `pytest.importorskip` at module level: a skipped *collection*,
which the per-test hook never sees), a fixture that skips, a test that skips, a skipif mark.
A skipped collection becomes one failing item, `<module>::skipped_in_ci`, so the rest of the
suite still runs and the run fails. `tests/test_ci_guard.py` runs pytest on files that skip
each way (and on `tests/test_tpu_compile.py` with libtpu hidden) and sees the run fail.

The tiers: a test is `fast` unless it is marked `slow` or its file or test is listed in
`HEAVY` (real-model tests, subprocess fleets, Mosaic compiles, notebooks). `python -m pytest
-m fast -n 2` runs the unit tests on tiny configs and every docstring example; CI runs
everything.
"""

from __future__ import annotations

import os

import pytest

OPTIONAL = "[optional]"  # skip reasons starting with this are allowed in CI (extras not installed)


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
    if in_ci() and report.skipped and not _reason(report.longrepr).startswith(OPTIONAL):
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
        if not reason.startswith(OPTIONAL):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, which must run every test: {reason}"
    return report
