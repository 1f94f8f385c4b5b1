"""Compile a function for a real TPU on a host without one (deviceless, with libtpu).

`jax.experimental.topologies` describes a TPU slice from libtpu alone; jitting
with arguments sharded on one of its devices and calling `.compile()` runs
XLA:TPU and Mosaic exactly as on the chip, so a kernel Mosaic rejects fails
here (`docs/DECISIONS.md`, "Deviceless Mosaic compile in the test suite"). Nothing runs: `cost_analysis()` and
`memory_analysis()` of the result are the compiler's static estimates.

Needs the `tpu-compile` extra (`jax[tpu]` at the installed jax version).

Example:
    >>> import jax.numpy as jnp
    >>> dev = tpu_device("v5e")
    >>> compiled = compile_for(dev, jnp.sin, abstract((128, 128), jnp.float32, dev))
    >>> compiled.memory_analysis().argument_size_in_bytes   # 128 x 128 x 4, nothing ran
    65536
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable

import jax
import numpy as np

CHIPS = ("v5e", "v6e")


def libtpu_available() -> bool:
    """True if libtpu can be imported (the `tpu-compile` extra is installed)."""
    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def tpu_device(chip: str):
    """One device of a deviceless 2x2 slice of `chip` ("v5e" or "v6e")."""
    if chip not in CHIPS:
        raise ValueError(f"tpu_device: chip must be one of {CHIPS}, got {chip!r}")
    # several processes on one host may load libtpu for compiling only
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{chip}:2x2", chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
    return topo.devices[0]


def _sharding(device, memory_kind: str | None = None):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    return NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec(),
                         memory_kind=memory_kind)


def abstract(shape, dtype, device, memory_kind: str | None = None) -> jax.ShapeDtypeStruct:
    """An argument of `shape`/`dtype` placed on `device` (in its `memory_kind`, e.g.
    "pinned_host"; default: device memory)."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=_sharding(device, memory_kind))


def _host_kind(x: Any) -> str | None:
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind if kind in ("pinned_host", "unpinned_host") else None


def abstract_like(tree: Any, device) -> Any:
    """Every array leaf of `tree` (concrete or abstract) as an abstract argument on `device`;
    a leaf in host memory (a tiered cache's host pages) stays in host memory."""
    return jax.tree.map(lambda x: abstract(x.shape, x.dtype, device, _host_kind(x)), tree)


def compile_for(device, fn: Callable, *args, **kwargs):
    """`jax.jit(fn).lower(*args, **kwargs).compile()` for `device`'s chip."""
    return jax.jit(fn).lower(*args, **kwargs).compile()
