"""Shared fixtures: tiny random models for unit tests, the real model for claims about it."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def share_compiled_programs() -> Path | None:
    """Every program the suite compiles goes to one persistent cache, `jit-tests` in the kvjax
    cache folder, however fast it compiled (the library's own cache keeps only those over 1 s).

    XLA:CPU takes 0.1-0.2 s to compile even a one-operation program, and the suite compiles the
    same small programs again and again: eager array operations compile one program each, the
    jit caches are dropped after every module (`_free_compiled_programs`), and the two xdist
    workers, the notebooks, the eval workers and the CLI's subprocesses start from nothing.
    The environment variables carry the setting into those subprocesses. A user's own
    `JAX_COMPILATION_CACHE_DIR`, or `KVJAX_COMPILATION_CACHE=0`, is left alone.
    """
    from models.hub import cache_dir, compilation_cache_opted_out, repair_compilation_cache
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or compilation_cache_opted_out():
        return None
    folder = cache_dir() / "jit-tests"
    repair_compilation_cache(folder)  # an entry cut short by a killed run would never heal
    settings = {"jax_compilation_cache_dir": str(folder),
                "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)
        jax.config.update(name, value)
    return folder


share_compiled_programs()

# Hypothesis's stateful pool machines (tests/test_pool_property.py) run a third of their
# examples in the default profile, all of them with `pytest --hypothesis-profile thorough`
# (DECISIONS "Property-test lengths: a profile").
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("thorough")
# the first-run notices ("kvjax: compiling ...", "kvjax: building the CPU attention kernel ...")
# would add lines to the stderr that the error tests count; tests/test_first_run.py unsets it
os.environ.setdefault("KVJAX_QUIET", "1")


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


# Each XLA:CPU executable holds a few hundred memory mappings (LLVM's JIT code and data), and
# Linux allows a process 65,530 (`vm.max_map_count`). A module that compiles ~170 programs
# (tests/test_families_methods.py: every method on every family) reached the limit: LLVM
# failed with "Cannot allocate memory" and the worker crashed. Past this many mappings the
# jit caches are dropped between tests, whatever module is running.
MAX_MAPPINGS_BETWEEN_TESTS = 30_000


def memory_mappings() -> int:
    """How many memory mappings this process holds (0 where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _bound_memory_mappings():
    yield
    if memory_mappings() > MAX_MAPPINGS_BETWEEN_TESTS:
        import gc
        jax.clear_caches()
        gc.collect()


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
