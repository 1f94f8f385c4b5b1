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
    >>> int(cache.length), nbytes(cache)   # k, v 2*3*16*64*4 B each + pos 2*3*16*4 + length 4
    (4, 49540)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core import attention
from kvjax.core.branches import rare_cond
from kvjax.core.layer import EMPTY, CacheLayer, is_layer, layer_kinds, register_layer
from kvjax.core.stores import (Latent, count_true, is_encoded, put, read, register_export,
                               resize_store, table_rows, table_usage)


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

    Encoded layout (codecs): `k` and `v` may be stores (`kvjax.core.stores`:
    bit-packed codes, low-rank latents) that encode on write; `view` gives
    the dense tensors. A float8 array is a plain dense store.

    `mass` (optional, `[B, KVH, C]` float32) is the attention each slot has
    received so far, summed over queries and the query heads of its group; the
    model accumulates it when present (H2O and other accumulated-attention
    policies). It moves with its slot like `pos`.
    """

    k: Any  # [B*KVH, C, D] keys (after RoPE), row b*KVH + h; pooled: [B, C, D]; or a Store
    v: Any  # [B*KVH, C, D] values; pooled: [B, C, D]; or a Store (kvjax.core.stores)
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

    # ------------------------------------------------ CacheLayer (kvjax.core.layer)
    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "TokenCache":
        return _write_tokens(self, k_new, v_new, pos_new)

    def attend(self, q: jax.Array, q_pos: jax.Array, *, impl: str = "xla",
               window: int | None = None, softcap: float | None = None) -> jax.Array:
        return _attend_tokens(self, q, q_pos, impl, window, softcap)

    def view(self, keep_latent: bool = False) -> "TokenCache":
        decode = lambda s: s if keep_latent and isinstance(s, Latent) else read(s)
        if not (is_encoded(self.k) or is_encoded(self.v)):
            return self
        return self.replace(k=decode(self.k), v=decode(self.v))

    def counters(self) -> dict[str, jax.Array]:
        return _token_counters(self, self.length, self.capacity)

    def free_tokens(self) -> int:
        return (self.capacity - int(self.length)) // self.slots_per_token

    def check(self, index: int, spec: "CacheSpec", batch: int) -> None:
        _check_tokens(index, self, spec, batch)

    def shardings(self, mesh: jax.sharding.Mesh, batch_axis: str | None,
                  kv_axis: str | None) -> "TokenCache":
        return _token_shardings(self, mesh, batch_axis, kv_axis)

    def shrink_usage(self) -> tuple:
        """The cursor, each store's `table_usage` and the most slots in use in a row."""
        valid = valid_rows(self)
        return (self.length, table_usage(self.k, valid), table_usage(self.v, valid),
                jnp.max(count_true(valid, 1)))

    def shrink_plan(self, usage: tuple, room: int, max_write: int, align: int = 1) -> tuple:
        return resize_plan(self, usage, round_up(int(usage[0]) + room * self.slots_per_token,
                                                 align))

    def resized(self, plan: tuple) -> "TokenCache":
        return _resize_tokens(self, plan)

    def parts(self) -> tuple["TokenCache", ...]:
        """The `TokenCache`s attention reads one after the other: this one."""
        return (self,)

    def map_parts(self, fn, *per_slot: jax.Array) -> "TokenCache":
        """`fn(part, *per_slot)` over the parts (here: this layer, with `per_slot` [..., C])."""
        return fn(self, *per_slot)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidualCache:
    """A layer whose older tokens are encoded and whose newest are kept exact (KIVI).

    `body` holds encoded tokens (its `k`/`v` are stores); `recent` is a dense
    `TokenCache` with the newest tokens. Every write first *flushes*: the
    oldest whole blocks of `block` recent slots move into the body while at
    least `residual` stay, then the new tokens are appended to `recent`. So
    the newest `residual` tokens (and the tokens of the current write) are
    always exact, and `recent` never holds more than
    `residual + block - 1 + T` slots for a write of T tokens.
    Attention reads both parts (`view`); eviction scores and compacts both.

    With `residual=KEEP_EXACT` nothing ever flushes: the body keeps what it
    was given and every later token stays exact (ThinK: the prompt's keys on
    the kept channels, later keys whole, as kvpress prunes the prefill only).
    """

    body: TokenCache  # encoded older tokens
    recent: TokenCache  # dense newest tokens, in slot order
    residual: int = dataclasses.field(metadata=dict(static=True))
    block: int = dataclasses.field(metadata=dict(static=True))

    batch = property(lambda self: self.recent.batch)
    kv_heads = property(lambda self: self.recent.kv_heads)
    head_dim = property(lambda self: self.recent.head_dim)
    pooled = property(lambda self: self.recent.pooled)
    slots_per_token = property(lambda self: self.recent.slots_per_token)

    @property
    def pos(self) -> jax.Array:
        """[B, KVH, Cb + Cr] positions of the body's slots, then the recent ones."""
        return jnp.concatenate([self.body.pos, self.recent.pos], axis=-1)

    @property
    def mass(self) -> jax.Array | None:
        if self.recent.mass is None:
            return None
        return jnp.concatenate([self.body.mass, self.recent.mass], axis=-1)

    def replace(self, **changes: Any) -> "ResidualCache":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------ CacheLayer (kvjax.core.layer)
    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "ResidualCache":
        """Flush whole blocks beyond `residual` into the body, then append to `recent`."""
        slots = k_new.shape[2] * self.slots_per_token
        # a layer that can flush keeps up to residual + block - 1 slots after a flush;
        # one that cannot (a short prompt) is a plain dense cache (free_tokens checks the rest)
        held = self.residual + self.block - 1 if flush_span(self) else 0
        if not held and not isinstance(self.recent.length, jax.core.Tracer):
            held = int(self.recent.length)  # outside jit the cursor is known: check it exactly
        if held + slots > self.recent.capacity:
            raise ValueError(
                f"write: {k_new.shape[2]} new tokens do not fit the exact part of a residual "
                f"layer ({self.recent.capacity} slots, of which up to {held} hold the "
                f"residual); shrink with more room")
        layer = flush_residual(self)
        return layer.replace(recent=layer.recent.write(k_new, v_new, pos_new))

    def attend(self, q: jax.Array, q_pos: jax.Array, *, impl: str = "xla",
               window: int | None = None, softcap: float | None = None) -> jax.Array:
        return _attend_tokens(self, q, q_pos, impl, window, softcap)

    def view(self, keep_latent: bool = False) -> TokenCache:
        """Body slots first, then the recent ones, as float32."""
        body, recent = self.body.view(), self.recent
        join = lambda a, b: jnp.concatenate([a.astype(jnp.float32), b.astype(jnp.float32)], axis=1)
        return TokenCache(k=join(body.k, recent.k), v=join(body.v, recent.v), pos=self.pos,
                          length=jnp.int32(body.capacity) + recent.length, mass=self.mass)

    def counters(self) -> dict[str, jax.Array]:
        return _token_counters(self, self.body.length + self.recent.length,
                               self.body.capacity + self.recent.capacity)

    def free_tokens(self) -> int:
        """A layer whose exact part can flush holds at most `residual` tokens beyond its
        body's capacity (every flush then fits the body); one that cannot
        (`flush_span == 0`) holds what its exact part has room for."""
        if flush_span(self) == 0:
            free = self.recent.capacity - int(self.recent.length)
        else:
            free = (self.body.capacity - int(self.body.length) - int(self.recent.length)
                    + self.residual)
        return max(0, free) // self.slots_per_token

    def check(self, index: int, spec: "CacheSpec", batch: int) -> None:
        self.body.check(index, spec, batch)
        self.recent.check(index, spec, batch)

    def shardings(self, mesh: jax.sharding.Mesh, batch_axis: str | None,
                  kv_axis: str | None) -> "ResidualCache":
        return self.replace(body=self.body.shardings(mesh, batch_axis, kv_axis),
                            recent=self.recent.shardings(mesh, batch_axis, kv_axis))

    def shrink_usage(self) -> tuple:
        return self.body.shrink_usage(), self.recent.shrink_usage()

    def shrink_plan(self, usage: tuple, room: int, max_write: int, align: int = 1) -> tuple:
        """Keep `residual + block - 1 + max_write` exact slots and give the body room for
        every token that can flush into it; with `room=0` both parts hold what they hold.
        Each part's capacity is rounded up to a multiple of `align`."""
        spt = self.slots_per_token
        body_usage, recent_usage = usage
        recent = int(recent_usage[0])
        flush = max(0, recent + room * spt - self.residual) if room else 0  # no write, no flush
        if recent + room * spt < self.residual + self.block:  # never a whole block to flush:
            flush = 0  # the exact part holds every token (a short prompt, a short generation)
        keep = max(recent, self.residual + self.block - 1 + max_write * spt) if flush else \
            recent + room * spt
        return (resize_plan(self.body, body_usage, round_up(int(body_usage[0]) + flush, align)),
                resize_plan(self.recent, recent_usage, round_up(keep, align)))

    def resized(self, plan: tuple) -> "ResidualCache":
        return self.replace(body=self.body.resized(plan[0]), recent=self.recent.resized(plan[1]))

    def parts(self) -> tuple[TokenCache, TokenCache]:
        """The body, then the exact part: attention reads one after the other, without
        joining them (joining decodes the body whole)."""
        return (self.body, self.recent)

    def map_parts(self, fn, *per_slot: jax.Array) -> "ResidualCache":
        """`fn(part, *its_slots)` for the body and the exact part, each given its own slots of
        every `per_slot` [..., Cb + Cr] array."""
        split = [split_slots(self, x) for x in per_slot]
        return self.replace(body=fn(self.body, *(b for b, _ in split)),
                            recent=fn(self.recent, *(r for _, r in split)))


register_export(TokenCache)
register_export(ResidualCache)
register_layer(TokenCache)
register_layer(ResidualCache)

Layer = TokenCache | ResidualCache
"""A token layer: what `attend_blockwise`, `compact` and the codecs read slot by slot."""
Cache = tuple[CacheLayer, ...]
"""A model's cache: one layer per decoder layer, of any registered kind (`kvjax.core.layer`)."""


KEEP_EXACT = 2 ** 30
"""The `residual` of a `ResidualCache` whose exact part never flushes into its body (larger
than any capacity, so `flush_span` is 0): the body is written once, later tokens stay exact."""


def flush_span(layer: ResidualCache) -> int:
    """The most slots one flush can move (static): whole blocks of `recent` beyond `residual`.

    Zero when the exact part has fewer than `residual + block` slots (a prompt
    shorter than the window and a group, shrunk to its size): then nothing
    ever flushes and the exact part is a plain dense cache of its capacity.
    """
    return max(0, layer.recent.capacity - layer.residual) // layer.block * layer.block


def flush_residual(layer: ResidualCache) -> ResidualCache:
    """Move the oldest whole blocks of `recent` into the body, keeping >= `residual` recent."""
    recent, body, block = layer.recent, layer.body, layer.block
    moved = jnp.maximum(0, (recent.length - layer.residual) // block) * block  # slots to move
    span = flush_span(layer)  # most slots a flush moves; moved <= span since length <= capacity
    if span == 0:
        return layer

    def move(layer):
        first = lambda x, axis: jax.lax.slice_in_dim(x, 0, span, axis=axis)
        new_body = _append(body, first(recent.k, 1), first(recent.v, 1), first(recent.pos, 2),
                           None if recent.mass is None else first(recent.mass, 2), count=moved)
        c = recent.capacity
        gone = jnp.arange(c) >= recent.length - moved  # slots past the new cursor
        roll = lambda x, axis: jnp.roll(x, -moved, axis=axis)
        new_recent = recent.replace(
            k=roll(recent.k, 1), v=roll(recent.v, 1),
            pos=jnp.where(gone, EMPTY, roll(recent.pos, 2)),
            mass=None if recent.mass is None else jnp.where(gone, 0.0, roll(recent.mass, 2)),
            length=recent.length - moved)
        return layer.replace(body=new_body, recent=new_recent)

    return rare_cond(moved > 0, move, lambda layer: layer, layer)


def view(layer: Layer, keep_latent: bool = False) -> TokenCache:
    """A dense `TokenCache` of the same slots: stores decoded, a residual layer's parts joined,
    pages gathered (`CacheLayer.view`).

    The body's slots come first, then the recent ones (attention and
    scores do not depend on slot order). `keep_latent` leaves low-rank
    stores encoded, for attention that scores in latent space.
    """
    return layer.view(keep_latent=keep_latent)


def split_slots(layer: ResidualCache, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split per-slot data [..., Cb + Cr] of a residual layer into its body and recent parts."""
    cb = layer.body.capacity
    return x[..., :cb], x[..., cb:]


def free_tokens(layer: Layer) -> int:
    """How many more tokens fit `layer` (host side), counted in tokens, not slots
    (`CacheLayer.free_tokens`).

    A residual layer whose exact part can flush holds at most `residual`
    tokens beyond its body's capacity (every flush then fits the body); one
    that cannot flush (`flush_span == 0`) holds what its exact part has room for.
    """
    return layer.free_tokens()


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a model needs from its cache: layer count and per-layer KV shape.

    `windows` (optional, one entry per layer): a layer with a window `w` attends only to
    its last `w` tokens (sliding-window attention), so its cache needs at most `w` slots
    whatever the context; None entries are full-attention layers.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] | None = None

    def __post_init__(self):
        if self.windows is not None:
            object.__setattr__(self, "windows", tuple(  # hashable, also when read from JSON
                None if w is None else int(w) if isinstance(w, (int, np.integer)) and
                not isinstance(w, bool) else w for w in self.windows))
            if len(self.windows) != self.num_layers:
                raise ValueError(f"CacheSpec.windows has {len(self.windows)} entries, "
                                 f"num_layers is {self.num_layers}")
            for w in self.windows:
                if w is not None and (not isinstance(w, (int, np.integer)) or w < 1):
                    raise ValueError(f"CacheSpec.windows entries must be ints >= 1 or None, "
                                     f"got {w!r}")

    def layer_capacity(self, layer: int, capacity: int) -> int:
        """Slots of `layer` in a cache of `capacity`: a windowed layer's window when smaller."""
        w = None if self.windows is None else self.windows[layer]
        return capacity if w is None else min(capacity, int(w))


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
    """An empty cache for every layer of a model described by `spec`: `capacity` slots per
    layer, a windowed layer's `min(window, capacity)` (`CacheSpec.windows`).

    Example:
        >>> cache = init_model_cache(CacheSpec(30, 3, 64), batch=1, capacity=2048)
        >>> len(cache), cache[0].k.shape, cache[0].pos.shape
        (30, (3, 2048, 64), (1, 3, 2048))
    """
    return tuple(init_cache(batch, spec.kv_heads, spec.layer_capacity(i, capacity),
                            spec.head_dim, dtype, track_mass)
                 for i in range(spec.num_layers))


def write(cache: Layer, k_new: jax.Array, v_new: jax.Array,
          pos_new: jax.Array) -> Layer:
    """Append `T` tokens for every sequence at the write cursor (`CacheLayer.write`).

    Args:
      cache: the layer cache; `cache.length + T * cache.slots_per_token` must
        not exceed its capacity (callers check this on the host: under jit an
        overflow cannot raise).
      k_new, v_new: [B, KVH, T, D] keys (after RoPE) and values.
      pos_new: [B, T] int32 absolute positions; `EMPTY` (or any negative
        value) marks a padding token, whose slot stays masked.
    """
    return cache.write(k_new, v_new, pos_new)


def _write_tokens(cache: TokenCache, k_new: jax.Array, v_new: jax.Array,
                  pos_new: jax.Array) -> TokenCache:
    """`TokenCache.write`: check the shapes, then append at the cursor."""
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
    pos_new = jnp.where(pos_new < 0, EMPTY, pos_new).astype(jnp.int32)
    return _append(cache, k_new.reshape(-1, slots, d),
                   v_new.reshape(-1, slots, d), _slot_positions(pos_new, h, cache.pooled))


def _attend_tokens(layer: Layer, q, q_pos, impl: str, window, softcap) -> jax.Array:
    """`attend` of a token layer: `attend_reference` for impl="reference", else the
    blockwise XLA path (a backend's kernel is chosen before: `kvjax.attend`)."""
    fn = attention.attend_reference if impl == "reference" else attention.attend_blockwise
    return fn(q, q_pos, layer, window=window, softcap=softcap)


def _token_counters(layer: Layer, slots_used: jax.Array, capacity: int) -> dict[str, jax.Array]:
    """`counters()` of a token layer: tokens held, `slots_used`, `capacity`, no pages."""
    pos = layer.pos
    full = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), pos.shape[:2])
    return dict(tokens=jnp.sum(pos != EMPTY, -1, dtype=jnp.int32), slots_used=full(slots_used),
                capacity=full(capacity), pages_device=full(0), pages_host=full(0),
                prefetch_misses=full(0))


def _slot_positions(pos_new: jax.Array, kv_heads: int, pooled: bool) -> jax.Array:
    """[B, T] token positions -> [B, KVH, slots] slot positions of a write."""
    b, t = pos_new.shape
    pos_rows = jnp.broadcast_to(pos_new[:, None, :], (b, kv_heads, t))  # [B, KVH, T]
    if pooled:  # token t of head j goes to slot j*T + t; other heads see EMPTY there
        own = jnp.eye(kv_heads, dtype=bool)[None, :, :, None]  # [1, KVH(head), KVH(owner), 1]
        pos_rows = jnp.where(own, pos_rows[:, None, :, :], EMPTY).reshape(b, kv_heads, kv_heads * t)
    return pos_rows


def _append(cache: TokenCache, k: jax.Array, v: jax.Array, pos: jax.Array,
            mass: jax.Array | None = None, count=None) -> TokenCache:
    """Write slots k, v [R, S, D], pos [B, KVH, S] at the cursor (only the first `count` if given).

    Encoded stores encode the new slots; `mass` (default zeros) goes with them.
    """
    start = cache.length
    by_row = lambda x: x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # [B, KVH, S] -> [B*KVH, S]
    put_meta = lambda old, new: put(by_row(old), by_row(new), start, count).reshape(old.shape)
    valid = None if cache.pooled else by_row(pos != EMPTY)
    new_mass = cache.mass
    if new_mass is not None:
        new_mass = put_meta(new_mass, jnp.zeros(pos.shape, new_mass.dtype) if mass is None else mass)
    return cache.replace(
        k=put(cache.k, k, start, count, valid), v=put(cache.v, v, start, count, valid),
        pos=put_meta(cache.pos, pos), mass=new_mass,
        length=start + (pos.shape[-1] if count is None else count))


def cache_axes(batch: int, kv_heads: int, pooled: bool, mesh: jax.sharding.Mesh,
               batch_axis: str | None = "batch", kv_axis: str | None = "kv"):
    """(row axes, pos PartitionSpec) of a layer: the sharding rule of `shard_cache`.

    Rows of the folded `[B*KVH, C, D]` keys and values are split over
    (`batch_axis`, `kv_axis`) together, and `pos` `[B, KVH, C]` the same way:
    1. KV heads over `kv_axis` when every `batch_axis` shard holds exactly one
       sequence and the KV heads divide (then a row block is one sequence's
       heads block, the layout head-split weights write into);
    2. else whole sequences over both axes when the batch divides their product
       (`kv_axis` then splits the batch further: SmolLM2's 3 KV heads on
       `model=4`, or several sequences per data shard);
    3. else sequences over `batch_axis` only, replicated over `kv_axis`;
    4. else replicated.
    The pooled (head-wise) layout shares slots between a sequence's heads, so
    it never splits heads (rules 2-4). Every rule keeps a row's slots, `pos` and
    statistics on one device, so attention, scoring, eviction and codecs run
    shard-local.
    """
    shape = dict(mesh.shape)
    d = shape[batch_axis] if batch_axis else 1
    m = shape[kv_axis] if kv_axis else 1
    both = tuple(a for a, n in ((batch_axis, d), (kv_axis, m)) if a and n > 1)
    rows = lambda axes: axes[0] if len(axes) == 1 else (axes or None)
    if not pooled and m > 1 and kv_heads % m == 0 and batch == d:
        return rows(both), jax.sharding.PartitionSpec(batch_axis if d > 1 else None, kv_axis, None)
    if both and batch % (d * m) == 0:
        return rows(both), jax.sharding.PartitionSpec(rows(both), None, None)
    if d > 1 and batch % d == 0:
        return batch_axis, jax.sharding.PartitionSpec(batch_axis, None, None)
    return None, jax.sharding.PartitionSpec()


def cache_shardings(cache: Cache, mesh: jax.sharding.Mesh, batch_axis: str | None = "batch",
                    kv_axis: str | None = "kv") -> Any:
    """The NamedSharding of every leaf of `cache` (arrays or ShapeDtypeStructs) by `cache_axes`
    (`CacheLayer.shardings`)."""

    return tuple(layer.shardings(mesh, batch_axis, kv_axis) for layer in cache)


def _token_shardings(layer: TokenCache, mesh: jax.sharding.Mesh, batch_axis: str | None,
                     kv_axis: str | None) -> TokenCache:
    """`TokenCache.shardings`: rows and `pos` by `cache_axes`, the cursor replicated; a
    low-rank store's per-KV-head basis `[KVH, D, r]` split like `pos`'s heads, so each shard
    holds the bases of its own rows' heads (a per-row basis goes with its rows)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    row_axes, pos_spec = cache_axes(layer.pos.shape[0], layer.pos.shape[1], layer.pooled,
                                    mesh, batch_axis, kv_axis)
    rows = layer.k.shape[0]
    by_row = lambda x: NamedSharding(mesh, P(row_axes, *[None] * (x.ndim - 1))
                                     if x.ndim and x.shape[0] == rows else P())
    heads = tuple(pos_spec)[1] if len(tuple(pos_spec)) > 1 else None

    def store(s):
        out = jax.tree_util.tree_map(by_row, s)
        if isinstance(s, Latent) and s.basis.shape[0] != rows:  # one basis per KV head
            out = out.replace(basis=NamedSharding(mesh, P(heads, None, None)))
        return out

    pos = NamedSharding(mesh, pos_spec)
    return TokenCache(k=store(layer.k), v=store(layer.v), pos=pos,
                      length=NamedSharding(mesh, P()),
                      mass=None if layer.mass is None else pos)


def shard_cache(cache: Cache, mesh: jax.sharding.Mesh, batch_axis: str | None = "batch",
                kv_axis: str | None = "kv") -> Cache:
    """Place `cache` on `mesh`, split over sequences (`batch_axis`) and KV heads (`kv_axis`).

    The rule (`cache_axes`): KV heads over `kv_axis` when each `batch_axis`
    shard holds one sequence and the heads divide; else whole sequences over
    both axes; else over `batch_axis`; else replicated. Rows, `pos` and `mass`
    of a sequence-head always sit on the same device.

    Example:
        >>> mesh = jax.make_mesh((1, 1), ("batch", "kv"))   # e.g. (4, 2) on 8 devices
        >>> cache = shard_cache(init_model_cache(CacheSpec(2, 1, 4), 1, 8), mesh)
        >>> cache[0].k.sharding.spec, cache[0].pos.sharding.spec   # a 1x1 mesh splits nothing
        (P(None, None, None), P())
    """
    return jax.device_put(cache, cache_shardings(cache, mesh, batch_axis, kv_axis))


def nbytes(tree: Any, float_dtype=None) -> int:
    """Exact bytes held by every array leaf of `tree` (arrays or shape structs).

    `float_dtype` counts every floating-point leaf wider than that dtype at its size: the
    bytes of the same cache stored in it (a float32 run's cache as the bfloat16 cache users
    deploy would hold it; narrower floats such as fp8 codes, integer codes, positions and
    lengths are unchanged).

    Example:
        >>> nbytes(init_cache(1, 3, 2048, 64))   # k + v + pos + length
        3170308
        >>> nbytes(init_cache(1, 3, 2048, 64), float_dtype=jnp.bfloat16)   # k and v halve
        1597444
    """
    def size(x) -> int:
        dtype = jnp.dtype(x.dtype)
        size = dtype.itemsize
        if float_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            size = min(size, jnp.dtype(float_dtype).itemsize)
        return math.prod(x.shape) * size
    return sum(size(x) for x in jax.tree_util.tree_leaves(tree))


def num_valid(cache: TokenCache) -> jax.Array:
    """[B, KVH] number of slots that hold a token."""
    return count_true(cache.pos != EMPTY)


def check_cache(cache: Sequence[Layer], spec: CacheSpec, batch: int) -> None:
    """Raise a ValueError naming the mismatch if `cache` does not fit a model."""
    if not isinstance(cache, (tuple, list)) or len(cache) != spec.num_layers:
        n = len(cache) if isinstance(cache, (tuple, list)) else type(cache).__name__
        raise ValueError(f"cache has {n} layers, the model has {spec.num_layers}")
    for i, layer in enumerate(cache):
        check_layer(i, layer, spec, batch)


def check_layer(i: int, layer: Any, spec: CacheSpec, batch: int) -> None:
    """ValueError unless `layer` is a registered layer kind that fits `spec` at `batch`."""
    if not is_layer(layer):
        raise ValueError(f"cache layer {i} is a {type(layer).__name__}, not a cache layer "
                         f"(registered kinds: {', '.join(k.__name__ for k in layer_kinds())})")
    layer.check(i, spec, batch)


def _check_tokens(i: int, layer: TokenCache, spec: CacheSpec, batch: int) -> None:
    """`TokenCache.check`: pos, k, v and mass shapes against the model's."""
    capacity = layer.pos.shape[-1]
    if layer.pos.shape != (batch, spec.kv_heads, capacity) or layer.pos.dtype != jnp.int32:
        raise ValueError(
            f"cache layer {i} has pos {layer.pos.shape} {layer.pos.dtype}; the model needs "
            f"[batch={batch}, kv_heads={spec.kv_heads}, capacity] int32")
    rows = (batch * spec.kv_heads, batch)  # per-head or pooled layout
    if (layer.k.shape[0] not in rows or tuple(layer.k.shape[1:]) != (capacity, spec.head_dim)
            or tuple(layer.v.shape) != tuple(layer.k.shape)):
        raise ValueError(
            f"cache layer {i} has k {tuple(layer.k.shape)} / v {tuple(layer.v.shape)}; the model "
            f"needs [batch*kv_heads={rows[0]} (or batch={batch} pooled), capacity={capacity}, "
            f"head_dim={spec.head_dim}]")
    if layer.mass is not None and layer.mass.shape != layer.pos.shape:
        raise ValueError(f"cache layer {i} has mass {layer.mass.shape}, expected "
                         f"{layer.pos.shape}")


def check_sizes(i: int, layer: Any, spec: CacheSpec, batch: int, kind: str) -> None:
    """ValueError unless `layer`'s batch, KV heads and head dim are the model's (`kind` names
    the layer in the message): the `check` of a layer kind without token slots to check."""
    if (layer.batch, layer.kv_heads, layer.head_dim) != (batch, spec.kv_heads, spec.head_dim):
        raise ValueError(
            f"cache layer {i} is {kind} for [batch={layer.batch}, kv_heads={layer.kv_heads}, "
            f"head_dim={layer.head_dim}]; the model needs [{batch}, {spec.kv_heads}, "
            f"{spec.head_dim}]")


# ----------------------------------------------------------------------------- resizing


def valid_rows(cache: TokenCache) -> jax.Array:
    """[R, C] bool: the slots in use, by storage row."""
    valid = cache.pos != EMPTY
    b, kvh, c = valid.shape
    return valid.any(axis=1) if cache.pooled else valid.reshape(b * kvh, c)


def round_up(n: int, multiple: int) -> int:
    """The least multiple of `multiple` >= n (n itself for `multiple` 1)."""
    return -(-n // multiple) * multiple


def resize_plan(cache: TokenCache, usage: tuple, capacity: int) -> tuple:
    """(capacity, table rows of the keys, of the values): the static part of a resize, from
    the host-side `TokenCache.shrink_usage`; raises if a written slot would be lost."""
    length, used_k, used_v, in_use = usage
    if capacity < int(length):
        raise ValueError(f"resize: capacity {capacity} would drop written slots "
                         f"(the cursor is at {int(length)})")
    return (capacity,) + tuple(table_rows(s, capacity, used, int(in_use))
                               for s, used in ((cache.k, used_k), (cache.v, used_v)))


def _resize_tokens(cache: TokenCache, plan: tuple) -> TokenCache:
    """`TokenCache.resized`: the slot axis cut or padded to the plan's capacity."""
    capacity, rows_k, rows_v = plan
    if capacity <= cache.capacity:
        cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, capacity, axis=axis)
    else:
        cut = lambda x, axis: jnp.pad(
            x, [(0, capacity - cache.capacity if a == axis % x.ndim else 0)
                for a in range(x.ndim)], constant_values=EMPTY if x.dtype == jnp.int32 else 0)
    valid = valid_rows(cache)
    return TokenCache(k=resize_store(cache.k, capacity, valid, rows_k),
                      v=resize_store(cache.v, capacity, valid, rows_v), pos=cut(cache.pos, 2),
                      length=cache.length, mass=None if cache.mass is None else cut(cache.mass, 2))
