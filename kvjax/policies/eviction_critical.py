"""CriticalKV and CriticalAdaKV (Feng et al. 2025): scores weighed by what a value adds.

A token's attention score says how much a query looks at it; what the layer
outputs is `attention x (v W_o)`. CriticalKV rescales the inner method's
scores by `||v W_o||_1` (the value projected by the layer's output
projection, L1 norm over the hidden axis, averaged over the query heads of
the KV head), in two stages:

1. the best `floor(budget * first_stage_ratio)` tokens by the inner scores
   are kept outright;
2. the rest of the budget goes to the best `(score + epsilon) * ||v W_o||_1`.

`critical` (kvpress CriticalKVPress) does this per KV head; `critical_ada`
(kvpress CriticalAdaKVPress) first shares the layer's budget over its KV heads
as Ada-KV does (each head keeps at least `alpha` of the per-head budget, the
rest goes to the best inner scores across heads), then runs both stages
inside each head's own budget. `W_o` comes from the model through the
statistics (`StatsSpec(output_projection=True)`: the model's weight itself,
not a copy).

The inner scores are the inner method's as a kvpress press returns them:
slots the inner method protects (SnapKV's observation window) score the
row's largest other score + 1, so they are kept by stage 1 or, weighed, by
stage 2, not unconditionally.

Example:
    >>> t = critical(inner=snapkv, ratio=0.5)      # CriticalKVPress(SnapKVPress(0.5))
    >>> t.stats.output_projection, t.stats.window
    (True, 64)
    >>> critical_ada(inner=snapkv, ratio=0.5).update.headwise
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, TokenCache
from kvjax.core.selection import rank
from kvjax.core.stats import LayerStats, StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import Scorer, check_real, no_protect, scored_policy, snapkv
from kvjax.policies.eviction_wrappers import inner_scorer, _press_scores

FLOAT_MAX = float(jnp.finfo(jnp.float32).max)  # kvpress's torch.finfo(float32).max


def projected_value_norms(values: jax.Array, out_proj: jax.Array) -> jax.Array:
    """[B, KVH, C] `||v W_o,h||_1` averaged over the query heads h of each KV head
    (kvpress `CriticalKVPress.vwl1norm`), one query head at a time ([B, C, hidden] live).

    Args:
      values: [B, KVH, C, D] (a pooled layer's [B, 1, C, D] broadcast by the caller).
      out_proj: [H*D, hidden] the layer's output projection (rows head by head).

    Example:
        >>> import jax.numpy as jnp
        >>> v = jnp.ones((1, 1, 2, 2))                      # 2 tokens, D = 2
        >>> w = jnp.array([[1., -1.], [0., 2.], [3., 0.], [0., 0.]])  # H = 2 heads, hidden 2
        >>> projected_value_norms(v, w).tolist()            # heads: |1|+|1| = 2, |3|+|0| = 3
        [[[2.5, 2.5]]]
    """
    b, kvh, c, d = values.shape
    heads = out_proj.shape[0] // d
    if heads * d != out_proj.shape[0] or heads % kvh:
        raise ValueError(f"projected_value_norms: out_proj {out_proj.shape} is not [H*{d}, "
                         f"hidden] for a multiple H of {kvh} KV heads")
    w = out_proj.reshape(heads, d, -1)  # [H, D, hidden]
    values = values.astype(jnp.float32)

    def one_head(args):
        w_h, kv = args  # [D, hidden], the head's KV head
        v = jax.lax.dynamic_index_in_dim(values, kv, axis=1, keepdims=False)  # [B, C, D]
        return jnp.abs(v @ w_h.astype(jnp.float32)).sum(-1)  # [B, C]

    norms = jax.lax.map(one_head, (w, jnp.arange(heads) // (heads // kvh)))  # [H, B, C]
    return norms.reshape(kvh, heads // kvh, b, c).mean(1).transpose(1, 0, 2)


def _value_norms(layer: TokenCache, stats: LayerStats | None, name: str) -> jax.Array:
    """[B, KVH, C] projected value norms of a layer's slots (pooled rows serve every head)."""
    if stats is None or stats.out_proj.size == 0:
        raise ValueError(f"{name} needs the layer's output projection W_o: run the model with "
                         f"StatsSpec(output_projection=True) (the sampler does this from "
                         f"transform.stats)")
    b, kvh, c = layer.pos.shape
    values = jnp.broadcast_to(layer.logical_v, (b, kvh, c, layer.head_dim))
    return projected_value_norms(values, stats.out_proj)


def _inner_press_scores(inner: Scorer, layer, stats, budget, key) -> jax.Array:
    """[B, KVH, C] the inner scorer's scores as its kvpress press returns them (protected
    slots at the row's largest unprotected score + 1), 0 on empty slots."""
    scores, protect = inner(layer, stats, budget, key)
    valid = layer.pos != EMPTY
    return jnp.where(valid, _press_scores(scores.astype(jnp.float32), protect, valid), 0.0)


def first_stage_count(budget: jax.Array, first_stage_ratio: float) -> jax.Array:
    """Tokens stage 1 keeps for a budget: `floor(budget * first_stage_ratio)`, at least 1
    when the ratio is positive (kvpress's floor; it computes `int((1 - r) * n * f)`, equal
    to this for f = 0.5).

    Example:
        >>> import jax.numpy as jnp
        >>> first_stage_count(jnp.array([75, 1, 320]), 0.5).tolist()
        [37, 1, 160]
    """
    count = jnp.floor(budget * first_stage_ratio).astype(jnp.int32)
    return jnp.maximum(count, 1) if first_stage_ratio > 0 else count


@dataclasses.dataclass(frozen=True)
class CriticalScorer:
    """CriticalKV around `inner`: stage 1 kept (protected), stage 2 weighed by ||v W_o||_1."""

    inner: Scorer
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __call__(self, layer, stats, budget, key):
        scores = _inner_press_scores(self.inner, layer, stats, budget, key)  # [B, KVH, C]
        valid = layer.pos != EMPTY
        count = first_stage_count(budget, self.first_stage_ratio).reshape(-1, 1, 1)
        stage1 = (rank(scores, valid) < count) & valid
        weighed = (scores + self.epsilon) * _value_norms(layer, stats, "critical")
        return weighed, stage1


def head_budgets(scores: jax.Array, valid: jax.Array, budget: jax.Array,
                 alpha: float) -> jax.Array:
    """[B, KVH] Ada-KV's share of a layer's `KVH * budget` tokens over its KV heads.

    Each head's best `max(1, floor(alpha * budget))` slots count first (the
    safeguard), then the best scores across all heads. Ties go to the earlier
    (head, slot).

    Example:
        >>> import jax.numpy as jnp
        >>> s = jnp.array([[[9., 8., 7.], [1., 2., 3.]]])   # head 0 scores higher
        >>> head_budgets(s, s > 0, jnp.array([2]), 0.5).tolist()   # 4 tokens, 1 safe per head
        [[3, 1]]
    """
    b, kvh, c = scores.shape
    safe = jnp.maximum(1, jnp.floor(budget * alpha).astype(jnp.int32)).reshape(-1, 1, 1)
    safeguarded = jnp.where(rank(scores, valid) < safe, FLOAT_MAX, scores)
    flat = rank(safeguarded.reshape(b, kvh * c), valid.reshape(b, kvh * c)).reshape(b, kvh, c)
    chosen = (flat < kvh * budget.reshape(-1, 1, 1)) & valid
    return chosen.sum(-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class CriticalAdaScorer:
    """CriticalAdaKV around `inner`: head budgets as Ada-KV, then CriticalKV's two stages
    inside each head's budget. Scores are 1 for the chosen slots, 0 for the rest: the
    head-wise selection of `scored_policy` (same `alpha`) then keeps exactly them."""

    inner: Scorer
    alpha: float = 0.2
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __call__(self, layer, stats, budget, key):
        scores = _inner_press_scores(self.inner, layer, stats, budget, key)  # [B, KVH, C]
        valid = layer.pos != EMPTY
        heads = head_budgets(scores, valid, budget, self.alpha)[..., None]  # [B, KVH, 1]
        # stage 1 per head, with the safeguard (both are the head's best inner scores; kvpress
        # leaves the safeguard at float32 max through stage 2)
        safe = jnp.maximum(1, jnp.floor(budget * self.alpha)).reshape(-1, 1, 1)
        count = jnp.maximum(safe, jnp.floor(heads * self.first_stage_ratio))
        stage1 = (rank(scores, valid) < count) & valid
        weighed = (scores + self.epsilon) * _value_norms(layer, stats, "critical_ada")
        final = jnp.where(stage1, jnp.inf, weighed)
        keep = (rank(final, valid) < heads) & valid
        return keep.astype(jnp.float32), no_protect(layer)


def _check_critical(name: str, epsilon: float, first_stage_ratio: float) -> None:
    check_real(name, "epsilon", epsilon, 0.0)
    check_real(name, "first_stage_ratio", first_stage_ratio, 0.0, 1.0)


def critical(inner=snapkv, ratio: float | None = None, budget: int | None = None,
             epsilon: float = 1e-4, first_stage_ratio: float = 0.5,
             **options) -> CacheTransform:
    """CriticalKV (Feng et al. 2025): the inner method's scores, half the budget kept by
    them, the rest weighed by the value's projected norm `||v W_o||_1`.

    As kvpress CriticalKVPress(INNER(compression_ratio=ratio), epsilon,
    first_stage_ratio); the inner method runs at its defaults.
    """
    _check_critical("critical", epsilon, first_stage_ratio)
    scorer, stats = inner_scorer(inner, "critical", ratio)
    return scored_policy("critical", CriticalScorer(scorer, float(epsilon),
                                                    float(first_stage_ratio)),
                         ratio=ratio, budget=budget,
                         stats=stats.merge(StatsSpec(output_projection=True)), **options)


def critical_ada(inner=snapkv, ratio: float | None = None, budget: int | None = None,
                 alpha: float = 0.2, epsilon: float = 1e-4, first_stage_ratio: float = 0.5,
                 **options) -> CacheTransform:
    """CriticalAdaKV (Feng et al. 2025): Ada-KV head-wise budgets, then CriticalKV's two
    stages inside each head's budget (pooled layout, as `headwise=true`).

    As kvpress CriticalAdaKVPress(INNER(compression_ratio=ratio), alpha_safeguard=alpha,
    epsilon, first_stage_ratio).
    """
    _check_critical("critical_ada", epsilon, first_stage_ratio)
    check_real("critical_ada", "alpha", alpha, 0.0, 1.0)
    if options.pop("headwise", True) is not True:
        raise ValueError("critical_ada: headwise budgets are what it is; use critical for "
                         "per-head budgets")
    scorer, stats = inner_scorer(inner, "critical_ada", ratio)
    return scored_policy("critical_ada", CriticalAdaScorer(scorer, float(alpha), float(epsilon),
                                                           float(first_stage_ratio)),
                         ratio=ratio, budget=budget, headwise=True, alpha=float(alpha),
                         stats=stats.merge(StatsSpec(output_projection=True)), **options)
