"""Sequence order for scorers whose rule depends on where a token sits in its sequence.

Slots are not tokens in order: a left-padded prompt starts with empty slots,
a compacted cache holds its kept tokens first, a pooled (Ada-KV) layer
interleaves heads. Many kvpress presses are defined on the sequence as
kvpress sees it at prefill (token `i` of `n`, `i = 0..n-1`): LagKV's
partitions, CUR's local windows, the chunks of non-causal attention,
Compactor's sinks, pooling over neighbours. `in_sequence(layer)` gives, per
row (batch, KV head), the slots sorted by position with the empty ones last;
`gather` moves any per-slot array into that order (`[B, KVH, C, ...]`, token
`i` of the row at index `i`, valid where `i < n`), `to_slots` moves per-token
scores back. Positions are ranked, not used as indices, so holes left by
earlier evictions and left padding change nothing: index `i` is the `i`-th
token the row still holds, as kvpress's cache would hold it.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=4, head_dim=2)
    >>> layer = layer.replace(pos=jnp.array([[[-1, 5, 3, 4]]]))   # one empty slot, 3 tokens
    >>> seq = in_sequence(layer)
    >>> seq.order[0, 0].tolist(), seq.n.tolist(), seq.valid[0, 0].tolist()
    ([2, 3, 1, 0], [[3]], [True, True, True, False])
    >>> to_slots(seq, jnp.array([[[10., 11., 12., 0.]]]))[0, 0].tolist()   # token order -> slots
    [0.0, 12.0, 10.0, 11.0]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, TokenCache
from kvjax.core.stores import count_true


class Sequence(NamedTuple):
    """One layer's slots in token order, per (batch, KV head) row."""

    order: jax.Array  # [B, KVH, C] int32 slot of the i-th token (empty slots last)
    n: jax.Array  # [B, KVH] int32 tokens in the row
    valid: jax.Array  # [B, KVH, C] bool i < n
    pos: jax.Array  # [B, KVH, C] int32 position of the i-th token (EMPTY past n)


def in_sequence(layer: TokenCache) -> Sequence:
    """The slots of `layer` (dense, `kvjax.view`) sorted by position, empty slots last."""
    valid_slot = layer.pos != EMPTY  # [B, KVH, C]
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(valid_slot, layer.pos, big), axis=-1, stable=True)
    order = order.astype(jnp.int32)
    n = count_true(valid_slot, -1).astype(jnp.int32)  # [B, KVH]
    valid = jnp.arange(layer.capacity)[None, None] < n[..., None]
    pos = jnp.take_along_axis(layer.pos, order, axis=-1)
    return Sequence(order, n, valid, pos)


def gather(seq: Sequence, x: jax.Array) -> jax.Array:
    """[B, KVH or 1, C, ...] per slot -> [B, KVH, C, ...] in token order (pooled rows broadcast)."""
    b, kvh, c = seq.order.shape
    x = jnp.broadcast_to(x, (b, kvh, c) + x.shape[3:])
    index = seq.order.reshape(seq.order.shape + (1,) * (x.ndim - 3))
    return jnp.take_along_axis(x, index, axis=2)


def keys_values(seq: Sequence, layer: TokenCache) -> tuple[jax.Array, jax.Array]:
    """([B, KVH, C, D], [B, KVH, C, D]) float32 keys and values in token order, zero past n."""
    zero = lambda x: jnp.where(seq.valid[..., None], x, 0.0)
    k = gather(seq, layer.logical_k.astype(jnp.float32))
    v = gather(seq, layer.logical_v.astype(jnp.float32))
    return zero(k), zero(v)


def to_slots(seq: Sequence, x: jax.Array) -> jax.Array:
    """[B, KVH, C] per token (token order) -> [B, KVH, C] per slot."""
    inverse = jnp.argsort(seq.order, axis=-1)
    return jnp.take_along_axis(x, inverse, axis=-1)


def shift(seq_x: jax.Array, offset: jax.Array, axis: int = 2) -> jax.Array:
    """`seq_x` with token `i + offset` at index `i` (offset [B, KVH] int); clipped at the end."""
    c = seq_x.shape[axis]
    index = jnp.minimum(jnp.arange(c)[None, None] + offset[..., None], c - 1)  # [B, KVH, C]
    index = index.reshape(index.shape + (1,) * (seq_x.ndim - 3))
    return jnp.take_along_axis(seq_x, index, axis=axis)


def unshift(seq_x: jax.Array, offset: jax.Array) -> jax.Array:
    """Inverse of `shift` for [B, KVH, C]: index `i` back at `i + offset` (zeros before)."""
    c = seq_x.shape[-1]
    index = jnp.arange(c)[None, None] - offset[..., None]  # [B, KVH, C]
    out = jnp.take_along_axis(seq_x, jnp.clip(index, 0, c - 1), axis=-1)
    return jnp.where(index >= 0, out, 0.0)


def rotate_half(x: jax.Array) -> jax.Array:
    """[..., D] -> [-x2, x1] (the rotate-half RoPE convention of Llama)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def unrope(k: jax.Array, pos: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Keys before RoPE: `k` [..., C, D] rotated back by their positions `pos` [..., C].

    Float32 angles `pos * inv_freq`, as the model computes them; the result
    equals the pre-RoPE key up to float32 rounding of the two rotations.
    """
    angles = jnp.maximum(pos, 0).astype(jnp.float32)[..., None] * inv_freq  # [..., C, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)
    return k * cos - rotate_half(k) * sin


def pool3(x: jax.Array, valid: jax.Array) -> jax.Array:
    """[..., C] mean over each token and its two neighbours, zero padded at the row's ends
    (torch's `avg_pool1d(kernel_size=3, padding=1)`, which counts the padding)."""
    x = jnp.where(valid, x, 0.0)
    left = jnp.pad(x[..., :-1], [(0, 0)] * (x.ndim - 1) + [(1, 0)])
    right = jnp.pad(x[..., 1:], [(0, 0)] * (x.ndim - 1) + [(0, 1)])
    return (left + x + right) / 3


def zscore(x: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, KVH, C] standardised per sequence over all its heads and tokens (unbiased std,
    clamped at 1e-6), as kvpress's `(s - s.mean()) / s.std().clamp_min(1e-6)` at batch 1."""
    w = valid.astype(jnp.float32)
    count = w.sum(axis=(1, 2), keepdims=True)
    mean = (x * w).sum(axis=(1, 2), keepdims=True) / jnp.maximum(count, 1)
    var = (jnp.square(x - mean) * w).sum(axis=(1, 2), keepdims=True) / jnp.maximum(count - 1, 1)
    return jnp.where(valid, (x - mean) / jnp.maximum(jnp.sqrt(var), 1e-6), 0.0)
