"""Primitives that eviction policies share: pick slots, then compact them.

A policy scores every slot (`[B, KVH, C]`, higher = keep), `keep_top_k`
turns scores into a keep mask with a fixed budget per (sequence, KV head),
and `compact` gathers the kept slots to the front of a cache whose static
capacity may be smaller, so memory really shrinks. Positions travel with
their keys, so RoPE'd keys keep their meaning and masks stay correct.

Example:
    >>> keep = keep_top_k(scores, k=128, valid=cache.pos != EMPTY)   # [B, KVH, C] bool
    >>> small = compact(cache, keep, capacity=160)                   # 128 kept + 32 free
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache import EMPTY, TokenCache


def keep_top_k(scores: jax.Array, k: int, valid: jax.Array | None = None) -> jax.Array:
    """[B, KVH, C] bool: the `k` highest-scoring valid slots of every row.

    Ties go to the earlier slot. A row with fewer than `k` valid slots keeps
    all of them. Invalid slots are never kept.
    """
    c = scores.shape[-1]
    if not 0 <= k <= c:
        raise ValueError(f"keep_top_k: k={k} must be within [0, {c}] slots")
    valid = jnp.ones(scores.shape, bool) if valid is None else valid
    scores = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    order = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]  # [B, KVH, k]
    rows = jnp.zeros(scores.shape, bool)
    rows = jnp.put_along_axis(rows, order, True, axis=-1, inplace=False)
    return rows & valid


def compact(cache: TokenCache, keep: jax.Array, capacity: int | None = None) -> TokenCache:
    """Move the kept slots of every row to the front, in slot order.

    Args:
      cache: the layer cache.
      keep: [B, KVH, C] bool; each row may keep at most `capacity` slots
        (extra slots beyond `capacity` in a row are dropped, latest last).
      capacity: slots of the returned cache (default: unchanged). Smaller
        means less memory; larger leaves room for new tokens.
    Returns:
      A cache whose rows hold their kept slots at `[0, n_row)` and EMPTY after,
      with the write cursor at the largest `n_row`.
    """
    b, kvh, c = cache.pos.shape
    capacity = c if capacity is None else capacity
    if keep.shape != (b, kvh, c):
        raise ValueError(f"compact: keep mask {keep.shape} does not match slots {(b, kvh, c)}")
    if capacity < 1:
        raise ValueError(f"compact: capacity must be positive, got {capacity}")
    slot = jnp.arange(c, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(keep, slot, c + slot), axis=-1)  # kept first, in slot order
    if capacity <= c:
        order = order[..., :capacity]
    else:  # grow: pad with an index that is never kept (marked EMPTY below)
        order = jnp.pad(order, ((0, 0), (0, 0), (0, capacity - c)), constant_values=c - 1)
    kept = jnp.take_along_axis(keep, order, axis=-1)
    kept &= jnp.arange(capacity) < jnp.sum(keep, axis=-1, keepdims=True)
    pos = jnp.where(kept, jnp.take_along_axis(cache.pos, order, axis=-1), EMPTY)
    rows = order.reshape(b * kvh, capacity, 1)
    gather = lambda x: jnp.take_along_axis(x, rows, axis=1)
    zero = lambda x: jnp.where(kept.reshape(b * kvh, capacity, 1), x, 0).astype(x.dtype)
    return TokenCache(k=zero(gather(cache.k)), v=zero(gather(cache.v)), pos=pos,
                      length=jnp.max(jnp.sum(kept, axis=-1)).astype(jnp.int32))


def _per_layer(select) -> "CacheTransform":
    """A stateless transform that compacts every layer to the slots `select(layer)` keeps."""
    from kvjax.transforms import CacheTransform

    def update(cache, state, stats=None):
        return tuple(compact(layer, select(layer)) for layer in cache), state

    return CacheTransform(init=lambda cache: (), update=update)


def streaming_llm(sinks: int = 4, window: int = 1020) -> "CacheTransform":
    """StreamingLLM: keep the first `sinks` tokens (attention sinks) and the last `window`.

    Tokens are ranked by absolute position, so padding and holes do not
    count: every (sequence, KV head) keeps its `sinks` earliest and `window`
    latest tokens, `min(n, sinks + window)` in all.
    Capacity is unchanged: kept slots move to the front and the freed slots
    take new tokens.

    Example:
        >>> t = streaming_llm(sinks=4, window=508)
        >>> cache, state = t.update(cache, t.init(cache), None)   # <= 512 tokens per head
    """
    if sinks < 0 or window < 1:
        raise ValueError(f"streaming_llm: need sinks >= 0 and window >= 1, got {sinks}, {window}")

    def select(layer):
        valid = layer.pos != EMPTY
        if sinks + window >= layer.capacity:
            return valid
        pos = layer.pos.astype(jnp.float32)
        sink = keep_top_k(-pos, sinks, valid)
        return sink | keep_top_k(pos, window, valid & ~sink)

    return _per_layer(select)


def sliding_window(window: int) -> "CacheTransform":
    """Keep only the last `window` tokens of every sequence (StreamingLLM without sinks)."""
    return streaming_llm(sinks=0, window=window)
