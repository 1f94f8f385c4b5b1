"""LUKVPress (kvpress 0.5.5; LU-KV, Tang et al. 2026): per-(layer, KV head) budgets from an
offline budget curve, around a scored policy.

A budget curve is `[99, L, KVH]` prune ratios: row `i` holds, for a global compression ratio
of `(i + 1) / 100`, the fraction of tokens each layer's KV head evicts. At compression
ratio `r`, row `clip(round(100 r) - 1, 0, 98)` is read and each head keeps its share of the
row's `n` tokens (kvpress's rounding, `head_keep_counts`) by the inner policy's scores, with
the first `sink` and last `window` tokens kept first. Heads keep different counts, so the
cache is pooled (`TokenCache.pooled`): the freed slots are gone, where kvpress masks them.

kvpress downloads curves (one is published, for Llama-3.1-8B) and has none for other models;
`kvjax calibrate --lukv --out PATH` profiles one (`models.calibration.calibrate_lukv`): per
head, the share of the future queries' attention that the inner scorer's top-k prefix tokens
hold, as a function of k (the head's utility curve), then the paper's allocation: the upper
concave hull of every head's curve, and the budget given greedily to the steepest hull
segments across all layers and heads (`allocate`), for each of the 99 ratios.

Example:
    >>> import numpy as np
    >>> head_keep_counts(np.array([0.5, 0.25, 0.9]), np.array([10])).tolist()  # 5 + 7.5 + 1
    [[5, 8, 1]]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import EMPTY, view
from kvjax.core.layer import is_plain
from kvjax.core.layout import compact, pool_heads
from kvjax.core.selection import rank
from kvjax.core.stores import count_true
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import (ByContent, check_int, check_real, earliest, evict_layers,
                                     expected_attention, latest, read_arrays)

RATIOS = 99  # curve rows: compression ratios 0.01 .. 0.99
KVPRESS_INNER = functools.partial(expected_attention, epsilon=0.02)  # LUKVPress's default press


def load_budget_curve(path: str) -> np.ndarray:
    """[99, L, KVH] float32 prune ratios in [0, 1] of a `.npy` or `.npz` (`budget_curve`)."""
    curve = read_arrays("lukv", "curve", path, ("budget_curve",),
                        "kvjax calibrate --lukv --out PATH", npy=True).get("budget_curve")
    if curve is None or curve.ndim != 3 or curve.shape[0] != RATIOS:
        raise ValueError(f"lukv: {path} holds no [99, L, KVH] budget curve (budget_curve)")
    if not (np.isfinite(curve).all() and (curve >= 0).all() and (curve <= 1).all()):
        raise ValueError(f"lukv: {path}'s prune ratios must be finite and in [0, 1]")
    return curve


def curve_row(ratio: jax.Array) -> jax.Array:
    """The curve row of compression ratio `ratio`: `clip(round(100 r) - 1, 0, 98)` (kvpress)."""
    return jnp.clip(jnp.round(ratio * 100).astype(jnp.int32) - 1, 0, RATIOS - 1)


def protected_scores(scorer, seen, stats, budget, key, sink: int, window: int) -> jax.Array:
    """[B, KVH, C] float32: the inner `scorer`'s scores of the dense layer `seen`, +inf on the
    slots it protects and on the first `sink` and last `window` tokens (kept first)."""
    scores, protect = scorer(seen, stats, budget, key)
    protect = protect | earliest(seen.pos, sink) | latest(seen.pos, window)
    return jnp.where(protect, jnp.inf, scores.astype(jnp.float32))


def head_keep_counts(prune: jax.Array, n: jax.Array) -> jax.Array:
    """[B, KVH] int32 tokens each KV head keeps of rows of `n` [B] tokens, given its prune
    ratio `prune` [KVH] (kvpress's rounding): `floor((1 - p) n)` per head, the remainder up to
    `round(sum((1 - p) n))` (at least KVH, at most KVH n) to the largest fractional parts
    (ties to the lower head), each count in [1, n]."""
    kvh = prune.shape[-1]
    n = jnp.asarray(n, jnp.int32)[:, None]  # [B, 1]
    ideal = jnp.clip(1.0 - jnp.asarray(prune, jnp.float32), 0.0, 1.0)[None] * n  # [B, KVH]
    total = jnp.clip(jnp.round(ideal.sum(-1, keepdims=True)), kvh, kvh * n)
    base = jnp.floor(ideal)
    remainder = (total - base.sum(-1, keepdims=True)).astype(jnp.int32)
    bump = rank(ideal - base, jnp.ones(ideal.shape, bool)) < remainder
    return jnp.clip(base.astype(jnp.int32) + bump, 1, n)


class LUKVState(NamedTuple):
    ratio: jax.Array  # [] float32 compression ratio (picks the curve row)
    counts: jax.Array  # [L, B, KVH] int32 tokens per head, -1 before the first update
    key: jax.Array  # PRNG key of the inner scorer (random scores)


def init_lukv(ratio: float, seed: int, cache) -> LUKVState:
    return LUKVState(jnp.float32(ratio),
                     jnp.full((len(cache), cache[0].batch, cache[0].kv_heads), -1, jnp.int32),
                     jax.random.key(seed))


@dataclasses.dataclass(frozen=True, eq=False)
class LUKVUpdate(ByContent):
    """`lukv`'s update. The first update fixes every layer's per-head counts (the state);
    later ones (`--compress-every`) bring each head back to its count."""

    scorer: object  # the inner policy's Scorer
    curve: np.ndarray  # [99, L, KVH] prune ratios
    sink: int = 4
    window: int = 1

    def __call__(self, cache, state: LUKVState, stats=None):
        _, num_layers, kvh = self.curve.shape
        if len(cache) != num_layers or cache[0].kv_heads != kvh:
            raise ValueError(f"lukv: a budget curve for {num_layers} layers x {kvh} KV heads, "
                             f"the model has {len(cache)} x {cache[0].kv_heads}: profile it on "
                             "this model (`kvjax calibrate --lukv`)")
        prune = jnp.asarray(self.curve)[curve_row(state.ratio)]  # [L, KVH]

        def evict(layer, layer_stats, counts, index):  # counts [B, KVH]
            if not is_plain(layer):
                raise ValueError("lukv: needs plain token caches (put it before any codec)")
            layer = pool_heads(layer)
            seen = view(layer)
            valid = seen.pos != EMPTY
            n = jnp.max(count_true(valid, -1), axis=-1)  # [B] the row's tokens
            counts = jnp.where(counts < 0, head_keep_counts(prune[index], n), counts)
            key = jax.random.fold_in(state.key, index)
            scores = protected_scores(self.scorer, seen, layer_stats, jnp.min(counts, -1), key,
                                      self.sink, self.window)
            keep = (rank(scores, valid) < counts[..., None]) & valid
            return compact(layer, keep), counts

        out = evict_layers(evict, cache, stats, tuple(state.counts))
        return (tuple(layer for layer, _ in out),
                state._replace(counts=jnp.stack([counts for _, counts in out])))


def lukv(inner=None, ratio: float | None = None, curve: str | None = None, sink: int = 4,
         window: int = 1, seed: int = 0) -> CacheTransform:
    """LU-KV (Tang et al. 2026): each layer's KV heads keep the shares of a budget curve, by
    the inner policy's scores (default: ExpectedAttention with epsilon 0.02, kvpress's).

    As kvpress LUKVPress(press=INNER(compression_ratio=ratio), sink, window) given the same
    curve (`curve=PATH`: `kvjax calibrate --lukv --out PATH`, or a `[99, L, KVH]` .npy).
    """
    from kvjax.policies.eviction_wrappers import inner_scorer

    check_real("lukv", "ratio", ratio, 0.0, 1.0, high_open=True)
    check_int("lukv", "sink", sink, 0)
    check_int("lukv", "window", window, 0)
    check_int("lukv", "seed", seed, 0)
    if curve is None:
        raise ValueError("lukv: needs curve=PATH, a [99, L, KVH] budget curve: "
                         "`kvjax calibrate --lukv --out PATH` profiles one")
    scorer, stats = inner_scorer(KVPRESS_INNER if inner is None else inner, "lukv", ratio)
    return CacheTransform(functools.partial(init_lukv, float(ratio), int(seed)),
                          LUKVUpdate(scorer, load_budget_curve(curve), int(sink), int(window)),
                          stats)


# ----------------------------------------------------------------------------- the curve


def utility_curves(scores: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """[..., P + 1]: the share of `importance` [..., P] (a head's future attention per prefix
    token) that the top-k tokens by `scores` [..., P] (+inf: protected, first) hold, k = 0..P.
    Ties go to the earlier token."""
    order = np.argsort(-np.asarray(scores, np.float64), axis=-1, kind="stable")
    held = np.take_along_axis(np.asarray(importance, np.float64), order, axis=-1).cumsum(-1)
    total = np.maximum(held[..., -1:], np.finfo(np.float64).tiny)
    return np.concatenate([np.zeros(held.shape[:-1] + (1,)), held / total], axis=-1)


def _hull_segments(u: np.ndarray) -> list[tuple[int, float]]:
    """(length, slope) of the upper concave hull of the points (k, u[k]), k = 0..P, left to
    right (slopes non-increasing)."""
    hull = [0]
    for k in range(1, len(u)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (u[b] - u[a]) * (k - a) <= (u[k] - u[a]) * (b - a):  # b under the chord a-k
                hull.pop()
            else:
                break
        hull.append(k)
    return [(b - a, (u[b] - u[a]) / (b - a)) for a, b in zip(hull, hull[1:])]


def allocate(utilities: np.ndarray, keep: float) -> np.ndarray:
    """[...] int tokens per head: `round(keep * heads * P)` tokens in all, given greedily to
    the steepest segments of every head's upper concave hull (`utilities` [..., P + 1], each
    non-decreasing from 0): the allocation that maximizes the summed hull utility (LU-KV's
    convex-hull relaxation and marginal-utility greedy). Ties: the lower head, then the
    earlier segment."""
    shape, width = utilities.shape[:-1], utilities.shape[-1] - 1
    flat = utilities.reshape(-1, width + 1)
    segments = [(-slope, head, i, length) for head, u in enumerate(flat)
                for i, (length, slope) in enumerate(_hull_segments(u))]
    segments.sort()
    left = int(round(keep * flat.shape[0] * width))
    counts = np.zeros(flat.shape[0], np.int64)
    for _, head, _, length in segments:
        if left <= 0:
            break
        take = min(length, left)
        counts[head] += take
        left -= take
    return counts.reshape(shape)


def budget_curve(utilities: np.ndarray) -> np.ndarray:
    """[99, ...] float32 prune ratios for compression ratios 0.01 .. 0.99 (`allocate` of
    `1 - r` per row) from the heads' utility curves [..., P + 1]."""
    width = utilities.shape[-1] - 1
    rows = [1.0 - allocate(utilities, 1.0 - (i + 1) / 100) / width for i in range(RATIOS)]
    return np.stack(rows).astype(np.float32)
