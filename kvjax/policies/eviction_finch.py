"""FINCH (kvpress FinchPress): SnapKV whose observation window is the question.

The prompt is `context + question`; the caller knows the question's token
count `window`. Per layer and KV head:

1. the attention of the `window` question queries over every key (softmax
   over all keys, causal), its context columns kept;
2. with `normalize`, question query `i` (at position `p_i`) has its row
   multiplied by `p_i`, the number of tokens before it (kvpress's
   `non_zero_counts = arange(k_len - window, k_len)`): a later query spreads
   its attention over more keys, so its row counts for more;
3. the mean over the question's rows, then over the KV head's query heads;
4. the question's own slots are kept first (kvpress pads them with the
   layer's maximum + 1), then the best scores up to the budget
   (`max(1, floor(n * (1 - ratio)))`); no pooling kernel (unlike SnapKV);
5. with `rerotate` (kvpress's default `rerotate_keys=True`) the kept tokens
   move to positions 0..n_kept-1 and their keys are re-rotated (`rerotate`).

Example:
    >>> t = finch(ratio=0.5, window=12)    # FinchPress(0.5) on a 12-token question
    >>> t.stats.window                     # the question's queries are collected
    12
    >>> finch(ratio=0.5, window=12, rerotate=False).update.scorer
    FinchScorer(window=12, normalize=True)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.core.attention import attention_weights
from kvjax.core.cache import EMPTY, TokenCache
from kvjax.core.stats import LayerStats, StatsSpec
from kvjax.core.stores import count_true
from kvjax.core.transforms import CacheTransform, chain
from kvjax.policies.eviction import _check_bool, check_int, latest, scored_policy
from kvjax.policies.eviction_wrappers import rerotate as rerotate_keys


def question_attention(layer: TokenCache, stats: LayerStats | None, window: int,
                       normalize: bool) -> jax.Array:
    """[B, KVH, G, C] attention of the last `window` queries, each row times its position when
    `normalize`, averaged over the rows.

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=4, head_dim=2)
        >>> layer = kvjax.write(layer, jnp.zeros((1, 1, 3, 2)), jnp.zeros((1, 1, 3, 2)),
        ...                     jnp.arange(3)[None])
        >>> stats = kvjax.LayerStats(jnp.zeros((1, 2, 1, 2)), jnp.array([[1, 2]]),
        ...                          *[jnp.zeros((1, 0))] * 5)
        >>> a = question_attention(layer, stats, 2, True)  # (1 [.5 .5 0] + 2 [1/3] * 3) / 2
        >>> a.shape, [round(x, 4) for x in a[0, 0, 0].tolist()]   # [B, KVH, G, C]
        ((1, 1, 1, 4), [0.5833, 0.5833, 0.3333, 0.0])
    """
    if stats is None or stats.queries.shape[1] < window:
        raise ValueError(f"finch needs the question's {window} queries; run the model with "
                         f"StatsSpec(window={window}) (the sampler does this from "
                         f"transform.stats)")
    q, q_pos = stats.queries[:, -window:], stats.query_pos[:, -window:]  # [B, W, H, D], [B, W]
    weights = attention_weights(q.astype(layer.k.dtype), q_pos, layer)  # [B, KVH, G, W, C]
    if normalize:  # a padding query's row is all zeros already
        weights = weights * jnp.maximum(q_pos, 0).astype(jnp.float32)[:, None, None, :, None]
    n = jnp.maximum(count_true(q_pos != EMPTY, 1), 1).astype(jnp.float32)  # [B]
    return weights.sum(axis=3) / n[:, None, None, None]


@dataclasses.dataclass(frozen=True)
class FinchScorer:
    """FINCH: question attention (optionally position-weighted), mean over the group; the
    question's `window` slots protected."""

    window: int
    normalize: bool = True

    def __call__(self, layer, stats, budget, key):
        protect = latest(layer.pos, self.window)  # the question
        attn = question_attention(layer, stats, self.window, self.normalize)  # [B, KVH, G, C]
        return jnp.where(protect, 0.0, attn.mean(axis=2)), protect


def finch(ratio: float | None = None, budget: int | None = None, window: int | None = None,
          normalize: bool = True, rerotate: bool = True, **options) -> CacheTransform:
    """FINCH (Corallo & Papotti 2024): keep what the question attends to; `window` = its tokens.

    As kvpress FinchPress(compression_ratio=ratio, normalize_scores=normalize,
    rerotate_keys=rerotate) on `context + delimiter + question`, the question being the
    prompt's last `window` tokens (the same count for every batch row): the question's
    attention over the context, each query row times its position when `normalize`,
    mean over rows and query heads; the question always kept; with `rerotate` the kept
    keys re-rotated to positions 0..n-1 (`finch:...,rerotate=false+rerotate` is the same).
    """
    check_int("finch", "window", window)
    _check_bool("finch", "normalize", normalize)
    _check_bool("finch", "rerotate", rerotate)
    if rerotate and options.get("headwise"):
        raise ValueError("finch: rerotate=true needs one budget per KV head; with "
                         "headwise=true pass rerotate=false")
    policy = scored_policy("finch", FinchScorer(window, normalize), ratio=ratio, budget=budget,
                           stats=StatsSpec(window=window), window=window, **options)
    return chain(policy, rerotate_keys()) if rerotate else policy
