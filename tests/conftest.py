"""Shared fixtures: tiny random models for unit tests, the real model for claims about it."""

from __future__ import annotations

import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def smollm2_path():
    """The real SmolLM2 GGUF (fetched once into the kvjax cache if missing)."""
    from models.hub import find_smollm2
    return find_smollm2(download=os.environ.get("KVJAX_NO_DOWNLOAD") is None)


@pytest.fixture(scope="session")
def smollm2_file():
    """Path of the real SmolLM2 GGUF, fetched once if missing (never skipped)."""
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_file):
    """The real SmolLM2 tokenizer without its weights: from the converted store's
    tokenizer.json when `load_model` has filled it (well under a second), else from the GGUF
    (about 5 s)."""
    from models.loading import converted_dir
    from models.tokenizer import load_tokenizer
    saved = converted_dir(smollm2_file) / "tokenizer.json"
    return load_tokenizer(saved.parent if saved.is_file() else smollm2_file)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct in float32."""
    from models.loading import load_model
    return load_model(smollm2_path())


@pytest.fixture(scope="session")
def tiny_model():
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jit caches after each module: the suite compiles many small programs (interpret-mode
    kernels above all), and one process holding them all can run out of memory."""
    yield
    jax.clear_caches()


OPTIONAL = "[optional]"  # skip reasons starting with this are allowed in CI (extras not installed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a skipped test fails unless its reason starts with `[optional]`: model-
    backed tests must never skip silently because a download or an extra went missing."""
    outcome = yield
    report = outcome.get_result()
    if not (os.environ.get("CI") and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not reason.removeprefix("Skipped: ").startswith(OPTIONAL):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run every test: {reason}"


class TraceCounter:
    """Counts jaxpr traces (any `jax.jit` tracing its function) while active, through the
    public `jax.monitoring` events. A warm call of a jitted function traces nothing."""

    EVENT = "/jax/core/compile/jaxpr_trace_duration"

    def __init__(self):
        self.count = 0

    def _listen(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


@pytest.fixture
def count_traces():
    """`with count_traces() as t: ...; assert t.count == 0`."""
    return TraceCounter
