"""ThinK (Xu et al. 2024): prune the key channels the latest queries use least, and store fewer.

Per layer, sequence and KV head, a key channel `c` scores
`mean_w(q_wc^2) * mean_t(k_tc^2)`: the mean square of the channel over the
last `window` (post-RoPE) queries, averaged over the query heads of the KV
head, times its mean square over the cached (post-RoPE) keys. The
`floor(head_dim * ratio)` lowest-scoring channels are dropped.

kvpress (ThinKPress) zeroes those channels of the prefill's keys, once, and
keeps every later key whole. kvjax's first update (prompt compression) turns
each layer into a `ResidualCache` with `residual=KEEP_EXACT`: its body holds
the prompt's keys on the kept channels only, a `Latent` key store whose basis
is, per storage row, the 0/1 columns of its kept channels (`[B*KVH, D, r]`,
`r = D - pruned`), so `q . k` is computed exactly on the kept channels (what
kvpress's zeroed keys give), `view` gives kvpress's zeroed keys, and those
keys take `r / D` of their bytes. Every later token goes to the dense exact
part, keys whole, and never flushes into the body (kvpress never prunes later
keys). Values are untouched. Later updates leave the layer as it is.

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> t = think(ratio=0.5)                 # ThinKPress(key_channel_compression_ratio=0.5)
    >>> t.stats.window
    32
    >>> channel_keep(jnp.array([[[3., 1., 2., 0.]]]), 2)[0, 0].tolist()   # 2 of 4 pruned
    [True, False, True, False]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, KEEP_EXACT, ResidualCache, view
from kvjax.core.layer import has_exact_part, is_plain
from kvjax.core.layout import map_layers
from kvjax.core.selection import rank
from kvjax.core.stats import LayerStats, StatsSpec
from kvjax.core.stores import Latent, is_encoded, put
from kvjax.core.transforms import CacheTransform, EmptyState
from kvjax.policies.eviction import check_int, check_real


def channel_scores(queries: jax.Array, query_pos: jax.Array, keys: jax.Array,
                   valid: jax.Array) -> jax.Array:
    """[B, KVH, D] ThinK's channel scores (kvpress ThinKPress.compress).

    Args:
      queries: [B, W, H, D] post-RoPE queries of the window; query_pos [B, W] (EMPTY: none).
      keys: [B, KVH, C, D] post-RoPE cached keys; valid [B, KVH, C] which slots hold one.
    """
    b, w, h, d = queries.shape
    kvh = keys.shape[1]
    q_ok = (query_pos != EMPTY).astype(jnp.float32)[:, :, None, None]  # [B, W, 1, 1]
    q_sq = (jnp.square(queries) * q_ok).sum(1) / jnp.maximum(q_ok.sum(1), 1)  # [B, H, D]
    q_sq = q_sq.reshape(b, kvh, h // kvh, d).mean(2)  # [B, KVH, D]
    k_ok = valid.astype(jnp.float32)[..., None]
    k_sq = (jnp.square(keys.astype(jnp.float32)) * k_ok).sum(2) / jnp.maximum(k_ok.sum(2), 1)
    return q_sq * k_sq


def channel_keep(scores: jax.Array, pruned: int) -> jax.Array:
    """[..., D] bool: all but the `pruned` (static) lowest-scoring channels (ties: the later
    channel is pruned first)."""
    d = scores.shape[-1]
    return rank(scores, jnp.ones(scores.shape, bool)) < d - pruned


def selection_basis(keep: jax.Array, kept: int) -> jax.Array:
    """[..., D, kept] float32 0/1 columns of the kept channels, in channel order.

    Example:
        >>> import jax.numpy as jnp
        >>> selection_basis(jnp.array([True, False, True]), 2).tolist()
        [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]
    """
    column = jnp.cumsum(keep, axis=-1) - 1  # [..., D] the kept channel's column
    onehot = jax.nn.one_hot(jnp.where(keep, column, kept), kept + 1, dtype=jnp.float32)
    return onehot[..., :kept]  # a pruned channel's "column" `kept` falls off


def is_thinned(layer) -> bool:
    """True for a layer `think_layer` made: a never-flushing residual layer over a `Latent`
    key store."""
    return (has_exact_part(layer) and layer.residual == KEEP_EXACT
            and isinstance(layer.body.k, Latent))


def think_layer(layer, stats: LayerStats | None, pruned: int, window: int):
    """One layer as a `ResidualCache`: its keys so far stored on the kept channels (the body,
    written once), later tokens exact (a layer think already made: unchanged)."""
    if is_thinned(layer):
        return layer  # channels chosen by the first update; later keys stay whole
    if not is_plain(layer) or layer.pooled:
        raise ValueError("think: needs a plain per-head token cache (put it before codecs and "
                         f"head-wise eviction); got {type(layer).__name__}"
                         f"{' (pooled)' if is_plain(layer) and layer.pooled else ''}")
    if is_encoded(layer.k):
        raise ValueError("think: the keys are already encoded by another codec; put "
                         "think before it")
    if stats is None or stats.queries.shape[1] < window:
        raise ValueError(f"think needs the last {window} queries: run the model with "
                         f"StatsSpec(window={window}) (the sampler does this)")
    seen = view(layer)
    scores = channel_scores(stats.queries[:, -window:], stats.query_pos[:, -window:],
                            seen.logical_k, seen.pos != EMPTY)  # [B, KVH, D]
    d = layer.head_dim
    basis = selection_basis(channel_keep(scores, pruned), d - pruned)  # [B, KVH, D, r]
    basis = basis.reshape(-1, d, d - pruned).astype(layer.k.dtype)  # one per storage row
    rows, capacity, _ = layer.k.shape
    body = layer.replace(k=put(Latent.empty(rows, capacity, basis, layer.k.dtype), layer.k, 0))
    recent = layer.replace(k=jnp.zeros_like(layer.k), v=jnp.zeros_like(layer.v),
                           pos=jnp.full(layer.pos.shape, EMPTY, jnp.int32),
                           length=jnp.zeros((), jnp.int32),
                           mass=None if layer.mass is None else jnp.zeros_like(layer.mass))
    return ResidualCache(body=body, recent=recent, residual=KEEP_EXACT, block=1)


@dataclasses.dataclass(frozen=True)
class ThinKUpdate:
    """`think`'s update: every layer's keys so far moved to their kept channels, once (later
    keys stay whole); the pruned count `floor(head_dim * ratio)` is static (head_dim is a
    shape)."""

    ratio: float
    window: int = 32

    def __call__(self, cache, state, stats=None):
        pruned = int(cache[0].head_dim * self.ratio)
        if pruned == 0:
            return cache, state
        stats = stats if stats is not None else (None,) * len(cache)
        return map_layers(lambda layer, s: think_layer(layer, s, pruned, self.window),
                          cache, stats), state


def think(ratio: float = 0.0, window: int = 32) -> CacheTransform:
    """ThinK (Xu et al. 2024): drop the fraction `ratio` of key channels the last `window`
    queries and the keys use least; the prompt's keys are stored on the rest (bytes shrink),
    later keys whole.

    As kvpress ThinKPress(key_channel_compression_ratio=ratio, window_size=window): the
    same channels (`floor(head_dim * ratio)` pruned per KV head), `view` gives its zeroed
    prompt keys, and keys written after the update keep every channel. kvpress's default
    ratio 0 prunes nothing.
    """
    check_real("think", "ratio", ratio, 0.0, 1.0, high_open=True)
    check_int("think", "window", window)
    return CacheTransform(lambda cache: EmptyState(), ThinKUpdate(float(ratio), window),
                          StatsSpec(window=window))
