"""SimLayerKV (Zhang et al. 2024): trim only the "lazy" layers to their sinks and recent tokens.

A layer is lazy when its last `n_last` queries pay most of their attention
(more than `lazy_threshold`, averaged over the query heads) to the first
`n_initial` tokens and the `n_recent` tokens before them; such a layer keeps
only those (as kvpress does: the first `n_initial` and the last
`n_recent - n_last` tokens), every other layer keeps everything. The
decision is per layer and per sequence (kvpress averages it over the batch;
at batch 1 the two agree). A row of at most `n_initial + n_recent + n_last`
tokens is never trimmed, and `lazy_threshold = 1` turns the method off
(kvpress's default).

Example:
    >>> t = simlayerkv(lazy_threshold=0.9, n_recent=128)
    >>> t.stats.window      # the last query's attention (n_last = 1)
    1
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.core.cache import EMPTY, view
from kvjax.core.layout import compact, map_layers
from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform, EmptyState
from kvjax.policies.eviction import check_int, check_real, earliest, latest, window_attention


def lazy_scores(attention: jnp.ndarray, pos: jnp.ndarray, n_initial: int, n_recent: int,
                n_last: int) -> jnp.ndarray:
    """[B] the attention the last `n_last` queries pay the first `n_initial` tokens and the
    `n_recent` before the last `n_last` (kvpress SimLayerKVPress.is_lazy's score).

    Args:
      attention: [B, KVH, C] attention per slot, averaged over the queries and the query
        heads of each KV head (every KV head holds the same tokens).
      pos: [B, KVH, C] slot positions (EMPTY = free).

    Example:
        >>> import jax.numpy as jnp
        >>> pos = jnp.arange(6)[None, None]
        >>> attn = jnp.array([[[0.5, 0.1, 0.1, 0.1, 0.1, 0.1]]])
        >>> lazy_scores(attn, pos, 1, 2, 1).tolist()        # tokens 0, 3 and 4
        [0.7000000476837158]
    """
    recent = latest(pos, n_recent + n_last) & ~latest(pos, n_last)
    chosen = earliest(pos, n_initial) | recent
    return jnp.where(chosen, attention, 0.0).mean(axis=1).sum(-1)


def lazy_keep(pos: jnp.ndarray, n_initial: int, n_recent: int, n_last: int) -> jnp.ndarray:
    """[B, KVH, C] bool: what a lazy layer keeps, the first `n_initial` tokens and the last
    `n_recent - n_last` (kvpress's `keys[:, :, -n_recent + n_last:]`)."""
    return (earliest(pos, n_initial) | latest(pos, n_recent - n_last)) & (pos != EMPTY)


@dataclasses.dataclass(frozen=True)
class SimLayerUpdate:
    """`simlayerkv`'s update: each layer keeps all its tokens, or (lazy) sinks and recent."""

    lazy_threshold: float = 1.0
    n_last: int = 1
    n_recent: int = 1024
    n_initial: int = 4

    def __call__(self, cache, state, stats=None):
        if self.lazy_threshold >= 1.0:
            return cache, state

        def trim(layer, layer_stats):
            seen = view(layer)
            valid = seen.pos != EMPTY
            n = jnp.max(valid.sum(-1), axis=-1)  # [B] tokens per row
            attention = window_attention(seen, layer_stats, self.n_last).mean(axis=2)  # [B, KVH, C]
            score = lazy_scores(attention, seen.pos, self.n_initial, self.n_recent, self.n_last)
            long_enough = n > self.n_initial + self.n_recent + self.n_last
            lazy = (score > self.lazy_threshold) & long_enough
            keep = jnp.where(lazy[:, None, None],
                             lazy_keep(seen.pos, self.n_initial, self.n_recent, self.n_last), valid)
            return compact(layer, keep)

        if stats is None:
            raise ValueError(f"simlayerkv needs the last {self.n_last} queries: run the model "
                             f"with StatsSpec(window={self.n_last}) (the sampler does this)")
        return map_layers(trim, cache, stats), state


def simlayerkv(lazy_threshold: float = 1.0, n_last: int = 1, n_recent: int = 1024,
               n_initial: int = 4) -> CacheTransform:
    """SimLayerKV (Zhang et al. 2024): lazy layers keep only their first `n_initial` and last
    `n_recent - n_last` tokens; a layer is lazy when its last `n_last` queries pay more than
    `lazy_threshold` of their attention to those tokens.

    As kvpress SimLayerKVPress(lazy_threshold, n_last, n_recent, n_initial), per
    sequence. kvpress's defaults (threshold 1.0) never compress; the paper's thresholds
    are 0.9 (Llama 3), 0.65 (Llama 2), 0.8 (Mistral), 0.85 (Qwen).
    """
    check_real("simlayerkv", "lazy_threshold", lazy_threshold, 0.0, 1.0)
    check_int("simlayerkv", "n_last", n_last, 1)
    check_int("simlayerkv", "n_initial", n_initial, 0)
    check_int("simlayerkv", "n_recent", n_recent, n_last + 1)
    update = SimLayerUpdate(float(lazy_threshold), n_last, n_recent, n_initial)
    return CacheTransform(lambda cache: EmptyState(), update, StatsSpec(window=n_last))
