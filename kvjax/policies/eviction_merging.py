"""MergingPress (kvpress 0.5.5): evicted tokens' values folded into the kept ones.

`merging` wraps a scored method (`inner`, at its defaults): the inner
scores choose the kept slots exactly as the inner method alone does, but
before the rest are dropped every evicted token's value is blended into the
kept token of its KV head whose *key* is most cosine-similar to its own:

* `sim, target` = the largest cosine similarity of the evicted key to the
  kept keys, and the kept slot that has it;
* the merge happens when `sim >= similarity_threshold` and, for
  `merge_fraction < 1`, `sim` is at least the `1 - merge_fraction` quantile
  of the row's evicted similarities (those failing the threshold count as
  -inf, as kvpress counts them);
* weight `w = max(sim, 0) * |v_e| / (|v_e| + |v_t| + 1e-6)` (value L2 norms);
* a kept value that received merges becomes
  `(v_t + sum_e w_e v_e) / (1 + sum_e w_e)`, in float32; the others and every
  key stay as they were (the keys carry RoPE, so they are never blended).

The cache then holds the kept slots only, as after plain eviction, so its
bytes shrink as the ratio says. The cosine matrix of one (row, KV head) is
built at a time: `[C, C]` float32 live.

Example:
    >>> from kvjax.policies.eviction import knorm
    >>> t = merging(inner=knorm, ratio=0.5)          # MergingPress(KnormPress(0.5))
    >>> t.update.merge_fraction, t.update.scored.scorer.__name__
    (1.0, 'knorm_scores')
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, Layer
from kvjax.core.layer import is_plain
from kvjax.core.layout import compact
from kvjax.core.selection import layer_budgets, select
from kvjax.core.stores import is_encoded
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import (ScoredUpdate, _check_scores, check_real, evict_layers,
                                     scored_policy, snapkv)
from kvjax.policies.eviction_wrappers import inner_scorer

EPS = 1e-6  # kvpress's _EPS: norm clamp and the weight's denominator
_HIGHEST = jax.lax.Precision.HIGHEST


def _torch_lerp(a: jax.Array, b: jax.Array, w: jax.Array) -> jax.Array:
    """torch.lerp's formula (what torch.quantile interpolates with): `a + w (b - a)` for
    w < 0.5, else `b - (b - a)(1 - w)`; with a = -inf it gives NaN, resp. -inf, as torch."""
    return jnp.where(w < 0.5, a + w * (b - a), b - (b - a) * (1 - w))


def _row_merge(k, v, keep, evict, threshold: float, fraction: float):
    """One (row, KV head): k, v [C, D]; keep, evict [C] bool -> merged v [C, D] float32."""
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    unit = kf / jnp.maximum(jnp.linalg.norm(kf, axis=-1, keepdims=True), EPS)
    sim = jnp.matmul(unit, unit.T, precision=_HIGHEST)  # [evicted?, kept?]
    sim = jnp.where(keep[None, :], sim, -jnp.inf)
    target = jnp.argmax(sim, axis=-1)  # first of equal maxima, in slot order
    best = jnp.max(sim, axis=-1)
    ok = evict & (best >= threshold)
    if fraction < 1.0:  # torch.quantile(1 - fraction, 'linear') over the evicted tokens
        cand = jnp.where(evict, jnp.where(ok, best, -jnp.inf), jnp.inf)  # non-evicted last
        ordered = jnp.sort(cand)
        m = jnp.sum(evict)
        ranks = jnp.float32(1.0 - fraction) * jnp.maximum(m - 1, 0).astype(jnp.float32)
        below = jnp.floor(ranks).astype(jnp.int32)
        above = jnp.ceil(ranks).astype(jnp.int32)
        cut = _torch_lerp(ordered[below], ordered[above], ranks - below)
        ok = ok & (best >= cut)
    norms = jnp.linalg.norm(vf, axis=-1)  # [C]
    weight = jnp.maximum(best, 0.0) * ok
    weight = weight * norms / (norms + norms[target] + EPS)
    into = (target[:, None] == jnp.arange(k.shape[0])[None, :]) & ok[:, None]  # [evicted, kept]
    w = jnp.where(into, weight[:, None], 0.0)
    added = jnp.matmul(w.T, vf, precision=_HIGHEST)  # [C, D] sum_e w_e v_e per kept slot
    total = w.sum(0)  # [C]
    merged = (vf + added) / (1.0 + total)[:, None]
    return jnp.where(((total > 0) & keep)[:, None], merged, vf)


def merge_values(k: jax.Array, v: jax.Array, keep: jax.Array, valid: jax.Array,
                 similarity_threshold: float = 0.0, merge_fraction: float = 1.0) -> jax.Array:
    """[B, KVH, C, D] values with each evicted token (`valid & ~keep`) merged into its most
    key-similar kept slot (kvpress `MergingPress.merge`); only kept slots change.

    Args:
      k, v: [B, KVH, C, D] keys and values; keep, valid: [B, KVH, C] bool.

    Example:
        >>> import jax.numpy as jnp, numpy as np
        >>> k = jnp.array([[[[1., 0.], [1., 0.1], [0., 1.]]]])   # token 1 points as token 0
        >>> v = jnp.array([[[[2., 0.], [0., 2.], [5., 5.]]]])
        >>> keep = jnp.array([[[True, False, True]]])
        >>> out = merge_values(k, v, keep, keep | True)[0, 0]   # w = 0.995 * 2 / (2 + 2)
        >>> np.asarray(out, np.float64).round(3).tolist()       # ([2, 0] + w [0, 2]) / (1 + w)
        [[1.336, 0.664], [0.0, 2.0], [5.0, 5.0]]
    """
    b, kvh, c, d = v.shape
    rows = lambda x: x.reshape(b * kvh, *x.shape[2:])
    one = lambda args: _row_merge(*args, float(similarity_threshold), float(merge_fraction))
    merged = jax.lax.map(one, (rows(k), rows(v), rows(keep), rows(valid & ~keep)))
    return merged.reshape(b, kvh, c, d).astype(v.dtype)


def _check_mergeable(layer: Layer, name: str = "merging") -> None:
    """ValueError unless `layer` is a plain float per-head token cache (values to merge into)."""
    if not is_plain(layer) or layer.pooled or is_encoded(layer.k) or is_encoded(layer.v):
        raise ValueError(f"{name}: needs plain float token caches to blend values into (put it "
                         "before any codec, without headwise budgets); got "
                         f"{type(layer).__name__}" + (" (pooled)" if is_plain(layer)
                                                      and layer.pooled else ""))


@dataclasses.dataclass(frozen=True)
class MergingUpdate:
    """`merging`'s update: the inner scored policy's selection (`scored`, its fields), the
    evicted values merged into the kept ones, then compaction."""

    scored: ScoredUpdate
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0

    def __call__(self, cache, state, stats=None):
        s = self.scored
        budgets = layer_budgets(state, cache, s.schedule, s.window, s.beta)  # [L, B]

        def evict(layer, layer_stats, budget, index, debug=False):
            _check_mergeable(layer)
            key = jax.random.fold_in(state.key, index)
            scores, protect = s.scorer(layer, layer_stats, budget, key)
            valid = layer.pos != EMPTY
            if debug:
                _check_scores(index, scores, valid)
            keep = select(scores, valid, protect, budget, False, s.alpha)
            v = merge_values(layer.logical_k, layer.logical_v, keep, valid,
                             self.similarity_threshold, self.merge_fraction)
            return compact(layer.replace(v=v.reshape(layer.v.shape)), keep)

        return evict_layers(evict, cache, stats, budgets, s.debug), state._replace(
            layer_budget=budgets)


def merging(inner=snapkv, ratio: float | None = None, budget: int | None = None,
            similarity_threshold: float = 0.0, merge_fraction: float = 1.0,
            **options) -> CacheTransform:
    """MergingPress (kvpress; after ToMe, Bolya et al. 2023, and D2O, Wan et al. 2024): the
    inner method's evicted tokens merged into their most key-similar kept token.

    As kvpress MergingPress(press=INNER(compression_ratio=ratio),
    similarity_threshold, merge_fraction): the kept slots are the inner
    method's; each evicted value is blended into the kept value whose key has
    the largest cosine similarity, weighted by that similarity and the relative
    value norms; keys are never changed. Needs plain float caches (before any
    codec) and per-head budgets.
    """
    check_real("merging", "similarity_threshold", similarity_threshold, 0.0, 1.0)
    check_real("merging", "merge_fraction", merge_fraction, 0.0, 1.0)
    if merge_fraction == 0:
        raise ValueError("merging: merge_fraction must be a finite number in (0, 1] (the "
                         "fraction of evicted tokens merged), got 0")
    if options.get("headwise", False) is not False:
        raise ValueError(f"merging: headwise={options['headwise']!r}: merging needs per-head "
                         f"budgets (headwise=false)")
    scorer, stats = inner_scorer(inner, "merging", ratio)
    t = scored_policy("merging", scorer, ratio=ratio, budget=budget, stats=stats, **options)
    return t._replace(update=MergingUpdate(t.update, float(similarity_threshold),
                                           float(merge_fraction)))
