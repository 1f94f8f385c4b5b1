"""Explicit KV-cache state: fixed capacity, static shapes, pure updates.

A model's cache is a tuple with one `TokenCache` per layer. Every slot of a
layer cache holds one token's key and value for each KV head, together with
the absolute position of that token (`pos`); a slot whose `pos` is `EMPTY`
holds nothing and is masked by attention. Eviction empties slots or compacts
them; writes append at the shared write cursor `length`.

Example:
    >>> cache = init_cache(batch=2, kv_heads=3, capacity=16, head_dim=64)
    >>> k = v = jnp.ones((2, 3, 4, 64))           # four new tokens [B, KVH, T, D]
    >>> cache = write(cache, k, v, jnp.arange(4)[None].repeat(2, 0))
    >>> int(cache.length), nbytes(cache)
    (4, 49348)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

EMPTY = -1
"""`pos` value of a slot that holds no token (never written, padding, or evicted)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenCache:
    """One layer's token cache.

    Slots `[0, length)` have been written; slots at or after `length` are free
    and have `pos == EMPTY`. Within the written range a slot may still be
    `EMPTY` (left padding of a shorter prompt, or a token a policy evicted).
    Keys are stored after RoPE, at their original absolute positions.

    Logically keys and values are `[B, KVH, C, D]`; they are stored with batch
    and KV heads folded into one leading axis, `[B*KVH, C, D]` (row
    `b * KVH + h`), because on XLA:CPU any reshape between the cache write and
    the attention dot copies the whole cache (docs/DECISIONS.md). `logical_k`
    and `logical_v` give the 4-D view.

    Pooled layout (head-wise budgets, Ada-KV): keys and values are `[B, C, D]`
    and the KV heads of a sequence share its `C` slots; `pos[b, h, s]` is the
    token's position for the one head `h` that owns slot `s` and `EMPTY` for
    the others, so attention masks by head and each head holds exactly its own
    budget. A write then takes `KVH` slots per token (`slots_per_token`).

    `mass` (optional, `[B, KVH, C]` float32) is the attention each slot has
    received so far, summed over queries and the query heads of its group; the
    model accumulates it when present (H2O and other accumulated-attention
    policies). It moves with its slot like `pos`.
    """

    k: jax.Array  # [B*KVH, C, D] keys (after RoPE), row b*KVH + h; pooled: [B, C, D]
    v: jax.Array  # [B*KVH, C, D] values; pooled: [B, C, D]
    pos: jax.Array  # [B, KVH, C] int32 absolute token position, EMPTY for a free slot
    length: jax.Array  # [] int32 write cursor shared by the batch
    mass: jax.Array | None = None  # [B, KVH, C] float32 attention received, or None

    @property
    def batch(self) -> int:
        return self.pos.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.pos.shape[1]

    @property
    def capacity(self) -> int:
        return self.pos.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    @property
    def pooled(self) -> bool:
        """True when the KV heads of a sequence share slots (head-wise budgets)."""
        return self.k.shape[0] != self.batch * self.kv_heads

    @property
    def slots_per_token(self) -> int:
        """Slots one new token takes: 1, or `kv_heads` in the pooled layout."""
        return self.kv_heads if self.pooled else 1

    @property
    def logical_k(self) -> jax.Array:
        """[B, KVH, C, D] view of the keys ([B, 1, C, D] when pooled: shared by the heads)."""
        return self.k.reshape(self.batch, -1, *self.k.shape[1:])

    @property
    def logical_v(self) -> jax.Array:
        """[B, KVH, C, D] view of the values ([B, 1, C, D] when pooled)."""
        return self.v.reshape(self.batch, -1, *self.v.shape[1:])

    def replace(self, **changes: Any) -> "TokenCache":
        return dataclasses.replace(self, **changes)


jax.export.register_pytree_node_serialization(
    TokenCache, serialized_name="kvjax.TokenCache",
    serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())


Cache = tuple[TokenCache, ...]
"""A model's cache: one `TokenCache` per decoder layer."""


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a model needs from its cache: layer count and per-layer KV shape."""

    num_layers: int
    kv_heads: int
    head_dim: int


def init_cache(batch: int, kv_heads: int, capacity: int, head_dim: int,
               dtype: Any = jnp.float32, track_mass: bool = False) -> TokenCache:
    """An empty layer cache: all slots EMPTY, zero keys and values.

    `track_mass=True` adds the `mass` field (attention received per slot).
    """
    for name, value in (("batch", batch), ("kv_heads", kv_heads),
                        ("capacity", capacity), ("head_dim", head_dim)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"init_cache: dtype must be floating, got {dtype}")
    shape = (batch * kv_heads, capacity, head_dim)
    return TokenCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        pos=jnp.full((batch, kv_heads, capacity), EMPTY, jnp.int32),
        length=jnp.zeros((), jnp.int32),
        mass=jnp.zeros((batch, kv_heads, capacity), jnp.float32) if track_mass else None,
    )


def init_model_cache(spec: CacheSpec, batch: int, capacity: int,
                     dtype: Any = jnp.float32, track_mass: bool = False) -> Cache:
    """An empty cache for every layer of a model described by `spec`.

    Example:
        >>> cache = init_model_cache(CacheSpec(30, 3, 64), batch=1, capacity=2048)
        >>> len(cache), cache[0].k.shape, cache[0].pos.shape
        (30, (3, 2048, 64), (1, 3, 2048))
    """
    return tuple(init_cache(batch, spec.kv_heads, capacity, spec.head_dim, dtype, track_mass)
                 for _ in range(spec.num_layers))


def write(cache: TokenCache, k_new: jax.Array, v_new: jax.Array,
          pos_new: jax.Array) -> TokenCache:
    """Append `T` tokens for every sequence at the write cursor.

    Args:
      cache: the layer cache; `cache.length + T * cache.slots_per_token` must
        not exceed its capacity (callers check this on the host: under jit an
        overflow cannot raise).
      k_new, v_new: [B, KVH, T, D] keys (after RoPE) and values.
      pos_new: [B, T] int32 absolute positions; `EMPTY` (or any negative
        value) marks a padding token, whose slot stays masked.
    """
    b, h, t, d = k_new.shape
    if (b, h, d) != (cache.batch, cache.kv_heads, cache.head_dim) or v_new.shape != k_new.shape:
        raise ValueError(
            f"write: new keys {k_new.shape} / values {v_new.shape} do not fit a cache "
            f"of [batch={cache.batch}, kv_heads={cache.kv_heads}, capacity, head_dim={cache.head_dim}]")
    slots = t * cache.slots_per_token
    if slots > cache.capacity:
        raise ValueError(f"write: {t} new tokens ({slots} slots) exceed the cache capacity "
                         f"{cache.capacity}")
    if pos_new.shape != (b, t):
        raise ValueError(f"write: positions have shape {pos_new.shape}, expected {(b, t)}")
    start = cache.length
    pos_new = jnp.where(pos_new < 0, EMPTY, pos_new).astype(jnp.int32)
    pos_rows = jnp.broadcast_to(pos_new[:, None, :], (b, h, t))  # [B, KVH, T]
    if cache.pooled:  # token t of head j goes to slot j*T + t; other heads see EMPTY there
        own = jnp.eye(h, dtype=bool)[None, :, :, None]  # [1, KVH(head), KVH(owner), 1]
        pos_rows = jnp.where(own, pos_rows[:, None, :, :], EMPTY).reshape(b, h, h * t)
    zero = jnp.zeros((), jnp.int32)
    fold = lambda x: x.reshape(cache.k.shape[0], slots, d).astype(cache.k.dtype)
    update = lambda x, new, at: jax.lax.dynamic_update_slice(x, new, at)
    mass = cache.mass
    if mass is not None:
        mass = update(mass, jnp.zeros(pos_rows.shape, mass.dtype), (zero, zero, start))
    return cache.replace(
        k=update(cache.k, fold(k_new), (zero, start, zero)),
        v=update(cache.v, fold(v_new), (zero, start, zero)),
        pos=update(cache.pos, pos_rows, (zero, zero, start)),
        length=start + slots, mass=mass,
    )


def shard_cache(cache: Cache, mesh: jax.sharding.Mesh, batch_axis: str | None = "batch",
                kv_axis: str | None = "kv") -> Cache:
    """Place `cache` on `mesh`, split over sequences (`batch_axis`) and KV heads (`kv_axis`).

    The folded `[B*KVH, C, D]` rows are split over both mesh axes together;
    `pos` `[B, KVH, C]` over each. The two splits coincide when every device
    holds one sequence or all KV heads of its sequences; otherwise XLA moves
    the few `pos` rows it needs.

    Example:
        >>> mesh = jax.make_mesh((4, 2), ("batch", "kv"))
        >>> cache = shard_cache(cache, mesh)
    """
    from jax.sharding import NamedSharding, PartitionSpec as P

    def layout(layer):
        axes = tuple(a for a in (batch_axis, None if layer.pooled else kv_axis) if a is not None)
        rows = NamedSharding(mesh, P(axes or None, None, None))
        pos = NamedSharding(mesh, P(batch_axis, kv_axis, None))
        return TokenCache(k=rows, v=rows, pos=pos, length=NamedSharding(mesh, P()),
                          mass=None if layer.mass is None else pos)

    return jax.device_put(cache, tuple(layout(layer) for layer in cache))


def nbytes(tree: Any) -> int:
    """Exact bytes held by every array leaf of `tree` (arrays or shape structs).

    Example:
        >>> nbytes(init_cache(1, 3, 2048, 64))   # k + v + pos + length
        3170308
    """
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def num_valid(cache: TokenCache) -> jax.Array:
    """[B, KVH] number of slots that hold a token."""
    return jnp.sum(cache.pos != EMPTY, axis=-1)


def check_cache(cache: Sequence[TokenCache], spec: CacheSpec, batch: int) -> None:
    """Raise a ValueError naming the mismatch if `cache` does not fit a model."""
    if not isinstance(cache, (tuple, list)) or len(cache) != spec.num_layers:
        n = len(cache) if isinstance(cache, (tuple, list)) else type(cache).__name__
        raise ValueError(f"cache has {n} layers, the model has {spec.num_layers}")
    for i, layer in enumerate(cache):
        if not isinstance(layer, TokenCache):
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}, expected TokenCache")
        capacity = layer.pos.shape[-1]
        if layer.pos.shape != (batch, spec.kv_heads, capacity) or layer.pos.dtype != jnp.int32:
            raise ValueError(
                f"cache layer {i} has pos {layer.pos.shape} {layer.pos.dtype}; the model needs "
                f"[batch={batch}, kv_heads={spec.kv_heads}, capacity] int32")
        rows = (batch * spec.kv_heads, batch)  # per-head or pooled layout
        if (layer.k.shape[0] not in rows or layer.k.shape[1:] != (capacity, spec.head_dim)
                or layer.v.shape != layer.k.shape):
            raise ValueError(
                f"cache layer {i} has k {layer.k.shape} / v {layer.v.shape}; the model needs "
                f"[batch*kv_heads={rows[0]} (or batch={batch} pooled), capacity={capacity}, "
                f"head_dim={spec.head_dim}]")
        if layer.mass is not None and layer.mass.shape != layer.pos.shape:
            raise ValueError(f"cache layer {i} has mass {layer.mass.shape}, expected "
                             f"{layer.pos.shape}")
