"""CAMPress (kvpress 0.5.5; CaM, Zhang et al. 2024): evicted values merged into their
sequential kept neighbours while decoding.

`cam` is a decoding-time method (use it with `--compress-every N`, kvpress's
`compression_interval`): like CAMPress it never compresses the prompt, whose update only
resets the attention mass (CAMPress's running attention sum starts with the first decode
step). Every later update that finds more than `budget` (kvpress's `target_size`) tokens:

* scores every slot with the inner method (kvpress's `base_press`, Knorm by default) and
  averages the scores over the KV heads: every head keeps the same `budget` positions;
* the merge candidates are the `k` best-scored evicted tokens (ties to the later position),
  `k` = the tokens added since the last compression (kvpress's `layer_step_counts`);
* a candidate's window is the `merge_budget` kept tokens right after it in position order
  (fewer near the end: `actual` of them); per KV head it merges with probability
  `clamp(A_i / mean(A_window), 0, 1)`, `A` the attention mass the decode steps paid each slot
  (NaN -> 0, inf -> 1, as kvpress); a merged candidate adds `v_i / actual` to every value of
  its window (float32); keys never change;
* the evicted slots are dropped (compaction): the cache holds `budget` tokens.

The Bernoulli draw is `u < p` with `u` uniform from the state's key, folded with the layer,
the row's latest position and each token's (position, KV head): a row draws the same
whatever else is in the batch. kvpress draws with torch's generator, so tests compare the
merge given kvpress's draws (`cam_merge_values(..., merge=u < p)`).

Example:
    >>> t = cam(budget=64, merge_budget=8)             # CAMPress(KnormPress(), target_size=64,
    >>> t.update.merge_budget, t.stats.attention_mass  #          merge_budget=8)
    (8, True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY
from kvjax.core.layout import compact
from kvjax.core.selection import init_budget, layer_budgets, select
from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import ScoredUpdate, check_int, evict_layers, knorm, scored_policy
from kvjax.policies.eviction_merging import _HIGHEST, _check_mergeable
from kvjax.policies.eviction_wrappers import inner_scorer

TARGET_SIZE = 2048  # kvpress CAMPress's target_size default
MERGE_BUDGET = 32  # kvpress CAMPress's merge_budget default


class CamState(NamedTuple):
    """`cam`'s state: a scored policy's (`BudgetState`'s fields) and, per row, the latest
    position at the last compression (or the prompt's update): tokens after it are new."""

    ratio: jax.Array  # [] float32 fraction evicted, or -1 when a token budget is given
    tokens: jax.Array  # [] int32 tokens kept, or -1 when a ratio is given
    layer_budget: jax.Array  # [L, B] int32 tokens per KV head; -1 before the first update
    key: jax.Array  # PRNG key of the merge draws
    mark: jax.Array  # [B] int32 latest position at the last compression; -1 before


class CamPlan(NamedTuple):
    """Which slots CAM keeps and merges, per row and KV head ([B, KVH, C] unless noted)."""

    keep: jax.Array  # bool: the `budget` best mean scores
    merge: jax.Array  # bool: the merge candidates (best-scored evicted, `k` of them)
    targets: jax.Array  # [B, KVH, C, M] int32 slots of each candidate's window (clamped)
    in_window: jax.Array  # [B, KVH, C, M] bool: that window entry exists
    actual: jax.Array  # int32 window size (`actual_budget`), 0..M


def cam_plan(scores: jax.Array, valid: jax.Array, pos: jax.Array, budget: jax.Array,
             new_tokens: jax.Array, merge_budget: int) -> CamPlan:
    """CAMPress's selection from per-slot scores.

    Args:
      scores: [B, KVH, C] the inner method's scores (higher = kept); averaged over KV heads.
      valid: [B, KVH, C] bool slots holding a token; pos: [B, KVH, C] int32 their positions
        (every KV head holds the same positions in the same slots).
      budget: [B] int32 tokens kept; new_tokens: [B] int32 tokens added since the last
        compression (at most this many candidates).
      merge_budget: M, the kept neighbours each candidate merges into.

    Example (6 tokens, 3 kept; the best evicted token, position 1, merges into the next 2):
        >>> import jax.numpy as jnp
        >>> s = jnp.array([[[5., 2., 4., 1., 3., 0.]]]); v = s > -1
        >>> p = cam_plan(s, v, jnp.arange(6)[None, None], jnp.array([3]), jnp.array([1]), 2)
        >>> p.keep[0, 0].tolist(), p.merge[0, 0].tolist(), p.targets[0, 0, 1].tolist()
        ([True, False, True, False, True, False], [False, True, False, False, False, False], [2, 4])
    """
    b, kvh, c = scores.shape
    mean = jnp.mean(jnp.where(valid, scores.astype(jnp.float32), 0.0), axis=1, keepdims=True)
    mean = jnp.broadcast_to(mean, scores.shape)  # [B, KVH, C] one score per slot
    keep = select(mean, valid, jnp.zeros_like(valid), budget, False, 0.0)
    evicted = valid & ~keep
    n_evicted = evicted.sum(-1)  # [B, KVH]
    k = jnp.minimum(new_tokens[:, None], n_evicted)
    # candidates: evicted by score (best first), ties to the later position (kvpress's flip)
    primary = jnp.where(evicted, -mean, jnp.inf)
    order = jnp.lexsort((-pos, primary), axis=-1)
    merge = (jnp.argsort(order, axis=-1) < k[..., None]) & evicted
    # kept slots in position order; a candidate's window starts at the first kept after it
    kept_pos = jnp.where(keep, pos, jnp.iinfo(jnp.int32).max)
    by_pos = jnp.argsort(kept_pos, axis=-1)  # [B, KVH, C] slot of the r-th kept token
    sorted_pos = jnp.take_along_axis(kept_pos, by_pos, axis=-1)
    start = jax.vmap(jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right")))(
        sorted_pos, pos)  # [B, KVH, C] kept tokens at or before each slot's position
    n_kept = keep.sum(-1)[..., None, None]  # [B, KVH, 1, 1]
    rank = start[..., None] + jnp.arange(merge_budget)  # [B, KVH, C, M]
    in_window = rank < n_kept
    rank = jnp.minimum(rank, jnp.maximum(n_kept - 1, 0))
    targets = jnp.take_along_axis(by_pos, rank.reshape(b, kvh, -1), axis=-1).reshape(rank.shape)
    actual = in_window.sum(-1).astype(jnp.int32)
    return CamPlan(keep, merge, targets.astype(jnp.int32), in_window, actual)


def merge_probability(mass: jax.Array, plan: CamPlan) -> jax.Array:
    """[B, KVH, C] float32 CAMPress's merge probability of each candidate (0 elsewhere):
    `clamp(A_i / (sum of A over its window / max(actual, 1)), 0, 1)`, NaN -> 0, inf -> 1.

    Args:
      mass: [B, KVH, C] the attention the decode steps paid each slot (any positive factor:
        kvpress averages the group's query heads, kvjax's mass sums them).
    """
    b, kvh, c, m = plan.targets.shape
    a = mass.astype(jnp.float32)
    window = jnp.take_along_axis(a, plan.targets.reshape(b, kvh, -1), axis=-1).reshape(
        plan.targets.shape)
    mean = jnp.sum(window * plan.in_window, axis=-1) / jnp.maximum(plan.actual, 1)
    p = a / mean
    p = jnp.where(jnp.isnan(p), 0.0, jnp.where(jnp.isinf(p), 1.0, p))
    return jnp.where(plan.merge, jnp.clip(p, 0.0, 1.0), 0.0)


def cam_merge_values(v: jax.Array, plan: CamPlan, merge: jax.Array) -> jax.Array:
    """[B, KVH, C, D] values with every drawn candidate (`merge` [B, KVH, C] bool, within
    `plan.merge`) adding `v_i / actual_i` to each value of its window, in float32."""
    b, kvh, c, d = v.shape
    m = plan.targets.shape[-1]
    vf = v.astype(jnp.float32)
    scale = jnp.where(merge & plan.merge & (plan.actual > 0),
                      1.0 / jnp.maximum(plan.actual, 1).astype(jnp.float32), 0.0)  # [B, KVH, C]

    def one(vr, tr, wr, sr):  # one (row, KV head): [C, D], [C, M], [C, M], [C]
        amount = (sr[:, None] * wr)  # [C, M] the weight of v_i on its m-th target
        into = jnp.zeros((c, c), jnp.float32).at[tr.reshape(-1), jnp.repeat(
            jnp.arange(c), m)].add(amount.reshape(-1))  # [target, source]
        return vr + jnp.matmul(into, vr, precision=_HIGHEST)

    rows = lambda x: x.reshape(b * kvh, *x.shape[2:])
    out = jax.lax.map(lambda a: one(*a), (rows(vf), rows(plan.targets),
                                          rows(plan.in_window), rows(scale)))
    return out.reshape(b, kvh, c, d)


def merge_uniforms(key: jax.Array, latest: jax.Array, pos: jax.Array) -> jax.Array:
    """[B, KVH, C] float32 uniforms in [0, 1), one per (row's latest position, token position,
    KV head): the same for a sequence wherever it sits in a batch."""
    kvh = pos.shape[1]
    ids = jnp.maximum(pos, 0) * kvh + jnp.arange(kvh, dtype=pos.dtype)[None, :, None]

    def row(last, row_ids):
        k = jax.random.fold_in(key, last)
        draw = lambda i: jax.random.uniform(jax.random.fold_in(k, i))
        return jax.vmap(draw)(row_ids.reshape(-1)).reshape(row_ids.shape)

    return jax.vmap(row)(latest, ids)


@dataclasses.dataclass(frozen=True)
class CamUpdate:
    """`cam`'s update: the prompt's update resets the attention mass; later ones plan, draw,
    merge and compact (`scored`: the inner scorer and the budget fields)."""

    scored: ScoredUpdate
    merge_budget: int = MERGE_BUDGET

    def __call__(self, cache, state: CamState, stats=None):
        s = self.scored
        budgets = layer_budgets(state, cache, s.schedule, s.window, s.beta)  # [L, B]
        first = state.layer_budget[0] < 0  # [B] the prompt's update: no compression
        pos0 = cache[0].pos
        latest = jnp.max(pos0.reshape(pos0.shape[0], -1), axis=-1)  # [B]
        new_tokens = latest - state.mark  # [B]

        def evict(layer, layer_stats, budget, index, debug=False):
            _check_mergeable(layer, "cam")
            scores, protect = s.scorer(layer, layer_stats, budget,
                                       jax.random.fold_in(state.key, index))
            valid = layer.pos != EMPTY
            scores = jnp.where(protect, jnp.inf, scores.astype(jnp.float32))
            plan = cam_plan(scores, valid, layer.pos, budget, new_tokens, self.merge_budget)
            mass = layer.mass if layer.mass is not None else jnp.zeros(layer.pos.shape)
            p = merge_probability(mass, plan)
            u = merge_uniforms(jax.random.fold_in(state.key, index), latest, layer.pos)
            v = cam_merge_values(layer.logical_v, plan, u < p)
            later = ~first[:, None, None]
            v = jnp.where(later[..., None], v, layer.logical_v.astype(jnp.float32))
            layer = layer.replace(v=v.astype(layer.v.dtype).reshape(layer.v.shape))
            if layer.mass is not None:  # the decode steps' attention only (kvpress's sum)
                layer = layer.replace(mass=jnp.where(later, layer.mass, 0.0))
            return compact(layer, jnp.where(later, plan.keep, valid))

        out = evict_layers(evict, cache, stats, budgets, s.debug)
        compressed = first | (jnp.max((pos0 != EMPTY).sum(-1), axis=-1) > budgets[0])
        return out, state._replace(layer_budget=budgets,
                                   mark=jnp.where(compressed, latest, state.mark))


def _init(ratio, budget, seed, cache) -> CamState:
    b = init_budget(ratio, budget, seed, cache)
    return CamState(b.ratio, b.tokens, b.layer_budget, b.key,
                    jnp.full((cache[0].batch,), -1, jnp.int32))


def cam(inner=knorm, ratio: float | None = None, budget: int | None = None,
        merge_budget: int = MERGE_BUDGET, seed: int = 0) -> CacheTransform:
    """CAMPress (kvpress; CaM, Zhang et al. 2024): a decoding-time method that merges each
    evicted value into the `merge_budget` kept values after it, with a probability from the
    attention the decode steps paid it, before dropping it.

    As kvpress CAMPress(base_press=INNER(), target_size=budget, merge_budget) with
    `--compress-every N` = its compression_interval: the prompt is not compressed; every N
    decode steps the cache goes back to `budget` tokens per KV head (the same positions in
    every head). `budget` defaults to kvpress's target_size, 2048; `ratio=r` instead keeps
    `(1 - r)` of the prompt's tokens. Needs plain float caches (before any codec).
    """
    if ratio is None and budget is None:
        budget = TARGET_SIZE
    check_int("cam", "merge_budget", merge_budget)
    scorer, inner_stats = inner_scorer(inner, "cam", ratio)
    t = scored_policy("cam", scorer, ratio=ratio, budget=budget, seed=seed,
                      stats=inner_stats.merge(StatsSpec(attention_mass=True)))
    return CacheTransform(functools.partial(_init, ratio, budget, seed),
                          CamUpdate(t.update, int(merge_budget)), t.stats)
