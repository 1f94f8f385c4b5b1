"""The Pallas attention kernel per shard of a cache split over a device mesh.

`kvjax.attend(q, q_pos, layer, impl=PallasOnMesh(mesh))` runs `attend_pallas` under
`jax.shard_map`: every device runs the kernel on its own block of sequences and KV
heads, the split `kvjax.shard_cache` gives the cache (`cache_axes`). Plain
`impl="pallas"` inside a jitted model over a sharded cache would leave the kernel's
`pallas_call` to XLA's partitioner, which cannot split a custom call: it gathers the
cache onto every device first. The mesh has to reach `attend` somehow; `impl` is
already threaded through every model call and is a static (hashable) argument of the
jitted steps, so the mesh travels in it and no model code changes. kvjax imports no
model: `models.sharding.pallas_impl(mesh)` builds one with its axis names.

Queries `[B, T, H, D]` are split like the layer's `pos` (sequences over the batch axes,
query heads over the KV axis when the KV heads are), so a device's query heads read exactly
its KV heads (whole GQA groups) and no collective is needed inside attention.

Example:
    >>> mesh = jax.make_mesh((1, 1), ("batch", "kv"))
    >>> impl = PallasOnMesh(mesh, backend="tpu", interpret=True)  # on CPU: interpret mode
    >>> hash(impl) == hash(PallasOnMesh(mesh, backend="tpu", interpret=True))  # a static arg
    True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, PartitionSpec as P


class PallasOnMesh(NamedTuple):
    """`impl=` for `kvjax.attend`: the Pallas kernel under `shard_map` on `mesh`.

    `backend` None means the device's (`pallas_backend()`); where there is none (CPU) and
    `interpret` is False, `attend` falls back to `"xla"` as plain `"pallas"` does, as it
    does for layers the kernel does not read (`kvjax.backends.pallas.kernel_refusal`); layers
    with host pages take `"xla"`.
    `interpret` (True or `pltpu.InterpretParams()`) runs the kernel body in interpret mode.
    The axis names are those the cache was split over (`kvjax.shard_cache`).
    """

    mesh: Mesh
    backend: str | None = None
    interpret: Any = False
    batch_axis: str | None = "batch"  # as kvjax.shard_cache's defaults
    kv_axis: str | None = "kv"


def query_specs(layer: Any, mesh: Mesh, batch_axis: str | None, kv_axis: str | None):
    """(q spec [B, T, H, D], q_pos spec [B, T], the layer's leaf specs): the split of a
    layer by `kvjax.cache_shardings` and the query split that reads it locally."""
    from kvjax.backends.pallas import kernel_layout
    from kvjax.core.cache import cache_shardings

    shardings = cache_shardings((layer,), mesh, batch_axis=batch_axis, kv_axis=kv_axis)[0]
    exact = shardings.recent if kernel_layout(layer) == "parts" else shardings
    pos_spec = tuple(exact.pos.spec)  # a residual layer: its exact part's
    batch_spec = pos_spec[0] if pos_spec else None
    head_spec = pos_spec[1] if len(pos_spec) > 1 else None
    return (P(batch_spec, None, head_spec, None), P(batch_spec, None),
            jax.tree_util.tree_map(lambda s: s.spec, shardings))


def attend_on_mesh(q: jax.Array, q_pos: jax.Array, layer: Any, impl: PallasOnMesh, *,
                   window: int | None = None, softcap: float | None = None) -> jax.Array:
    """`attend_pallas` per shard (see the module docstring): [B, T, H, D] float32, q's split.

    On CPU pass `PallasOnMesh(mesh, backend="tpu", interpret=True)`.
    """
    from kvjax.backends.pallas import attend_pallas

    q_spec, pos_q, layer_specs = query_specs(layer, impl.mesh, impl.batch_axis, impl.kv_axis)
    body = lambda q, q_pos, layer: attend_pallas(q, q_pos, layer, window=window,
                                                 softcap=softcap, backend=impl.backend,
                                                 interpret=impl.interpret)
    run = jax.shard_map(body, mesh=impl.mesh, in_specs=(q_spec, pos_q, layer_specs),
                        out_specs=q_spec, check_vma=False)
    return run(q, q_pos, layer)
