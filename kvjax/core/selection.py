"""Which slots a scored policy keeps: NaN-safe ranking, budgets, head-wise selection.

The budget half of `kvjax.policies.eviction.scored_policy`, independent of any scorer:

* `best_first` / `rank` / `keep_top_k`: order slots by score (ties to the
  earlier slot, NaN after every number, empty slots last).
* `BudgetState`, `layer_budgets`, `pyramid_budgets`: the tokens kept per KV
  head and layer, fixed from `ratio` or `budget` at the first update.
* `select`: the keep mask of one layer, per head or (Ada-KV) head-wise.

Example:
    >>> import jax.numpy as jnp
    >>> scores = jnp.array([[[0.5, 2.0, jnp.nan, 1.0]]])
    >>> valid = jnp.array([[[True, True, True, False]]])
    >>> best_first(scores, valid)[0, 0].tolist()     # numbers, then NaN, then the empty slot
    [1, 0, 2, 3]
    >>> keep_top_k(scores, 2, valid)[0, 0].tolist()
    [True, True, False, False]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvjax.core.cache import Cache, num_valid

# ----------------------------------------------------------------------------- ranking


def keep_top_k(scores: jax.Array, k: int, valid: jax.Array | None = None) -> jax.Array:
    """[B, KVH, C] bool: the `k` (static) highest-scoring valid slots of every row.

    Ties go to the earlier slot. A row with fewer than `k` valid slots keeps
    all of them. Invalid slots are never kept.
    """
    c = scores.shape[-1]
    if not 0 <= k <= c:
        raise ValueError(f"keep_top_k: k={k} must be within [0, {c}] slots")
    valid = jnp.ones(scores.shape, bool) if valid is None else valid
    order = best_first(scores, valid)[..., :k]  # [B, KVH, k]
    # put_along_axis, with the leading indices as iotas: jnp.indices needs concrete sizes, so
    # put_along_axis failed to export with a symbolic batch (`kvjax export --method
    # streaming_llm:...`); the scatter is the same
    lead = tuple(jax.lax.broadcasted_iota(jnp.int32, order.shape, d)
                 for d in range(order.ndim - 1))
    rows = jnp.zeros(scores.shape, bool).at[(*lead, order)].set(True)
    return rows & valid


def best_first(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """int32 slot order along the last axis, best first; NaN-safe.

    Three tiers, each in descending score order with ties to the earlier
    slot: valid slots with a number (+-inf included), then valid slots whose
    score is NaN (in slot order), then invalid slots. So a NaN score never
    lets an empty slot take a valid one's place.
    """
    s = scores.astype(jnp.float32)
    nan = jnp.isnan(s)
    tier = jnp.where(valid, nan.astype(jnp.int32), 2)  # 0 number, 1 NaN, 2 invalid
    key = jnp.where(valid & ~nan, -s, 0.0) + 0.0  # + 0.0: -0.0 and 0.0 tie
    slot = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1)
    return jax.lax.sort((tier, key, slot), dimension=s.ndim - 1, num_keys=3)[2]


def rank(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """int32 rank of every entry along the last axis (0 = best; ties to the earlier entry).

    Invalid entries rank after all valid ones, NaN scores after every valid
    number (`best_first`). `rank(...) < k` keeps the top `k` for a `k` that
    may be traced and may differ per row.
    """
    order = best_first(scores, valid)
    return jnp.argsort(order, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- budgets


class BudgetState(NamedTuple):
    """State of a scored policy: its budget, fixed at the first update."""

    ratio: jax.Array  # [] float32 fraction evicted, or -1 when a token budget is given
    tokens: jax.Array  # [] int32 tokens kept per KV head, or -1 when a ratio is given
    layer_budget: jax.Array  # [L, B] int32 tokens per KV head per layer; -1 before the first update
    key: jax.Array  # PRNG key (random scores); layer i scores with fold_in(key, i) at every update


def init_budget(ratio: float | None, budget: int | None, seed: int, cache: Cache) -> BudgetState:
    """The state before the first update: the ratio or token budget, no layer budget yet."""
    return BudgetState(ratio=jnp.float32(-1.0 if ratio is None else ratio),
                       tokens=jnp.int32(-1 if budget is None else budget),
                       layer_budget=jnp.full((len(cache), cache[0].batch), -1, jnp.int32),
                       key=jax.random.key(seed))


def pyramid_budgets(mean: jax.Array, n: jax.Array, num_layers: int, window: int = 64,
                    beta: float = 20) -> jax.Array:
    """[L, B] PyramidKV per-layer budgets averaging `mean` [B] for rows of `n` [B] tokens.

    The KVCache-Factory formula as kvpress 0.5.5 applies it: a linear ramp
    from `max_num` (first layer) down to `min_num = mean / beta`, clipped so
    no layer exceeds `n - window`; where the ramp is impossible every layer
    gets `max(1, round(mean))`.
    """
    mean, n = mean.astype(jnp.float32), n.astype(jnp.float32)
    min_num = mean / beta
    max_num = 2 * mean - min_num
    clip = max_num >= n - window
    max_num = jnp.where(clip, n - window, max_num)
    min_num = jnp.where(clip, 2 * mean - max_num, min_num)
    ok = (n >= max_num) & (max_num >= min_num) & (min_num >= window)
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else jnp.zeros_like(mean)
    ramp = jnp.round(max_num[None] - jnp.arange(num_layers, dtype=jnp.float32)[:, None] * steps)
    return jnp.where(ok, ramp, jnp.maximum(1.0, jnp.round(mean))[None]).astype(jnp.int32)


def layer_budgets(state: BudgetState, cache: Cache, schedule, window: int, beta: float):
    """[L, B] budgets: the state's, or (first update) derived from the ratio or token count."""
    n = jnp.max(num_valid(cache[0]), axis=-1).astype(jnp.float32)  # [B]
    mean = jnp.where(state.ratio >= 0, n * (1 - state.ratio), state.tokens.astype(jnp.float32))
    num_layers = len(cache)
    if schedule == "pyramid":
        new = pyramid_budgets(mean, n, num_layers, window, beta)
    else:
        if schedule != "uniform" and len(schedule) != num_layers:
            raise ValueError(f"schedule has {len(schedule)} layer weights for {num_layers} layers")
        weights = jnp.ones(num_layers) if schedule == "uniform" else jnp.asarray(schedule, jnp.float32)
        weights = weights / weights.mean()
        new = jnp.maximum(1, jnp.floor(mean[None] * weights[:, None])).astype(jnp.int32)
    return jnp.where(state.layer_budget < 0, new, state.layer_budget)


# ----------------------------------------------------------------------------- selection


def select(scores, valid, protect, budget, headwise: bool, alpha: float):
    """[B, KVH, C] keep mask: protected slots first, then the best scores, `budget` [B] per head.

    Head-wise (Ada-KV): every head first keeps its `floor(alpha * budget)`
    (at least 1) best slots, then the layer's `KVH * budget` slots go to the
    best scores across heads.
    """
    scores = jnp.where(protect, jnp.inf, scores.astype(jnp.float32))
    per_row = budget.reshape(-1, 1, 1)
    if not headwise:
        return (rank(scores, valid) < per_row) & valid
    safe = jnp.maximum(1, jnp.floor(budget * alpha).astype(jnp.int32)).reshape(-1, 1, 1)
    # each head's safeguard outranks every protected slot (as in kvpress), then the rest
    protected_max = jnp.finfo(jnp.float32).max
    scores = jnp.where(rank(scores, valid) < safe, jnp.inf, jnp.minimum(scores, protected_max))
    b, kvh, c = scores.shape
    flat = rank(scores.reshape(b, kvh * c), valid.reshape(b, kvh * c)).reshape(b, kvh, c)
    return (flat < kvh * per_row) & valid
