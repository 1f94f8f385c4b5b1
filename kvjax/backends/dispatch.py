"""`attend`: the one attention entry point, dispatching on `impl=` and the cache's layout.

`"xla"` and `"reference"` are `kvjax.core.attention`'s paths; `"pallas"` the paged
attention kernels (`kvjax.backends.pallas`), or `PallasOnMesh(mesh)` for the
kernel per shard of a mesh-split cache (`kvjax.backends.sharded`). Kept apart
from `kvjax.core.attention` so the kernel path can read XLA's block loop (the KIVI
fallback in `kvjax.backends.pallas`) without an import cycle.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from kvjax.core.layer import CacheLayer
from kvjax.backends.pallas import (TILE_SLOTS, attend_pallas, has_host_tier, kernel_layout,
                                    kernel_refusal, pallas_backend, supports_pallas)
from kvjax.backends.sharded import PallasOnMesh, attend_on_mesh

IMPLS = ("xla", "reference", "pallas")


def tile_slots(impl) -> int:
    """The slot multiple a cache decoded with `impl` is shrunk to (`kvjax.shrink(align=)`):
    the Pallas kernel's tile where a compiled kernel runs (`TILE_SLOTS`: 128 on TPU, 64 on
    GPU), so it reads the cache in place rather than padding a copy of it per call; 1 for
    `"xla"`, `"reference"` and where no compiled kernel runs (CPU).

    Example:
        >>> tile_slots("xla"), tile_slots("pallas")   # on this CPU: no compiled kernel
        (1, 1)
    """
    if isinstance(impl, PallasOnMesh):
        backend = impl.backend or pallas_backend()
    elif impl == "pallas":
        backend = pallas_backend()
    else:
        return 1
    return TILE_SLOTS.get(backend, 1) if backend else 1


class KernelFallbackWarning(UserWarning):
    """`attend(impl="pallas")` on a TPU or GPU read a key/value layer through XLA because the
    kernel refused it (the message names `kernel_refusal`'s reason). Make it an error with
    `warnings.simplefilter("error", KernelFallbackWarning)` to require the kernel."""


def attend(q: jax.Array, q_pos: jax.Array, cache: CacheLayer, *, impl: str = "xla",
           window: int | None = None, softcap: float | None = None) -> jax.Array:
    """Attention of queries over a layer cache; dispatches on `impl`.

    `"xla"` (default) is `attend_blockwise`; `"reference"` is
    `attend_reference`, the plain definition tests compare against;
    `"pallas"` runs the paged attention kernel on TPU or GPU
    (`kvjax.backends.pallas`: token, encoded, KIVI, paged, tiered, pooled and low-rank layers)
    and falls back to `"xla"` on CPU and for layers the kernel does not read: a key/value
    layer it refuses on a TPU or GPU warns (`KernelFallbackWarning`, naming
    `kernel_refusal`'s reason, e.g. a GPU head dim that is not a power of two; an error
    under `warnings.simplefilter("error", KernelFallbackWarning)`), and `kvjax compile`
    reports the kernel calls and refusals. Every other path is the
    layer's own `attend` (`kvjax.core.layer.CacheLayer`: a `PagedLayer` gathers a dense
    view, a recurrent layer reads its state).
    `PallasOnMesh(mesh)` (kvjax.backends.sharded) runs that kernel under
    `jax.shard_map`, per shard of a cache split over `mesh` by `shard_cache`.
    A layer with pages in host memory (`has_host_tier`) takes XLA's path under a mesh.

    Example:
        >>> from kvjax import init_cache, write
        >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 3, 4))  # [B, KVH, T, D]
        >>> cache = write(init_cache(1, 1, 8, 4), k, v, jnp.arange(3)[None])
        >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 4))      # [B, T, H, D]
        >>> out = attend(q, jnp.array([[2]]), cache)
        >>> out.shape, bool(jnp.allclose(out, attend(q, jnp.array([[2]]), cache,
        ...                                          impl="reference"), atol=1e-6))
        ((1, 1, 2, 4), True)
    """
    if isinstance(impl, PallasOnMesh):  # the kernel per shard of a mesh-split cache
        backend = impl.backend or pallas_backend()
        if backend is not None and supports_pallas(cache, backend) and not has_host_tier(cache):
            return attend_on_mesh(q, q_pos, cache, impl._replace(backend=backend),
                                  window=window, softcap=softcap)
        # no kernel here or for this layout: as plain "pallas" (falls back); host pages
        # are not split over the mesh: XLA
        impl = "xla" if has_host_tier(cache) else "pallas"
    if impl not in IMPLS:
        raise ValueError(f"attend: unknown impl {impl!r}; available: {IMPLS} or a "
                         f"kvjax.backends.sharded.PallasOnMesh")
    if impl == "pallas":
        backend = pallas_backend()
        refusal = None if backend is None else kernel_refusal(cache, backend)
        if backend is not None and refusal is None:
            return attend_pallas(q, q_pos, cache, window=window, softcap=softcap,
                                 backend=backend)
        if refusal is not None and kernel_layout(cache) is not None:  # a KV layer it refused
            warnings.warn(f"attend(impl='pallas'): the {backend} kernel does not read this "
                          f"layer ({refusal}); it attends through XLA", KernelFallbackWarning,
                          stacklevel=2)
        impl = "xla"
    return cache.attend(q, q_pos, impl=impl, window=window, softcap=softcap)
