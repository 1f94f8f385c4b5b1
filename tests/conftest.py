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
