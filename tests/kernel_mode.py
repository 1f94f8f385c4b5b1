"""How the kernel tests run their Pallas kernels: interpret mode (default) or compiled.

By default every kernel test runs the kernel body in interpret mode on
whatever host runs pytest (CPU in CI): the semantics of the TPU and GPU
kernels are checked without a chip. With

    KVJAX_PALLAS_COMPILED=1 python -m pytest -q tests/test_paged_attention.py \
        tests/test_kernel_attention.py

the same parametrized cases run the kernel *compiled* on the accelerator
that is present (`jax.default_backend()`: a GPU runs the `backend="gpu"`
cases through Triton, a TPU the `backend="tpu"` cases through Mosaic), and
compare with the same plain-jnp references at the same tolerances. Cases
for the other backend, and TPU-semantics interpret cases
(`pltpu.InterpretParams`), are skipped with an "[optional]" reason there:
they need the other chip. Compiled mode without an accelerator is an error,
not a silent interpret run.
"""

from __future__ import annotations

import os

import jax
import pytest

ENV = "KVJAX_PALLAS_COMPILED"


def compiled() -> bool:
    """True when the tests should run the kernels compiled (KVJAX_PALLAS_COMPILED=1)."""
    return os.environ.get(ENV, "0") not in ("", "0", "false", "False")


def device_backend() -> str | None:
    """The kernel backend of the default device ("tpu", "gpu"), None on CPU."""
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend())


def mode(backend: str, interpret=True):
    """(backend, interpret) for a kernel call in a test.

    Default: as asked (interpret mode). Compiled mode: `interpret=False` when
    `backend` is the device's; otherwise the test is skipped ([optional]).
    """
    if not compiled():
        return backend, interpret
    device = device_backend()
    if device is None:
        raise RuntimeError(f"{ENV}=1 needs a TPU or GPU; jax sees {jax.default_backend()}")
    if backend != device:
        pytest.skip(f"[optional] {ENV}=1 on a {device}: the {backend} kernel needs a {backend}")
    return backend, False
