"""Eviction policies: score every slot, keep a budget, compact the rest away.

Every policy is a factory returning a `CacheTransform`. Its `update` scores
the slots of each layer (`[B, KVH, C]`, higher = keep), forces some slots to
stay (sinks, the observation window), keeps each row's budget of the best
slots and compacts them to the front of the cache, in slot order. Positions
travel with their keys, so RoPE'd keys keep their meaning and masks stay
right. The budget is fixed at the first update (prompt compression) and
every later update (during decode) brings the cache back to it.

Budgets. `ratio` is the fraction of tokens *evicted* (kvpress's
`compression_ratio`): each sequence keeps `max(1, floor(n * (1 - ratio)))` of
its `n` tokens per KV head. `budget` is a token count per KV head instead.
Both are traced state, not compile-time constants: changing them does not
recompile. `schedule="pyramid"` (PyramidKV) or a tuple of per-layer weights
spreads the same total unevenly over layers. `headwise=True` (Ada-KV) shares
one layer's total budget unevenly over its KV heads; the cache then switches
to the pooled layout (`TokenCache.pooled`), where every head stores exactly
its own tokens.

GQA rule: a KV head's score aggregates its group of query heads by the mean
(SnapKV, ExpectedAttention; kvpress's choice) or the sum (H2O's accumulated
mass); TOVA averages over all query heads, as kvpress does.

Memory. Compaction is in place: capacity is static inside jit. `shrink`
(host side) then cuts every layer to its kept slots plus room for new
tokens, so `nbytes` falls to the budget.

Example:
    >>> import kvjax
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=16)
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 8, 4))  # 8 tokens [B, KVH, T, D]
    >>> cache = tuple(kvjax.write(layer, k, v, jnp.arange(8)[None]) for layer in cache)
    >>> t = knorm(ratio=0.5)     # needs no stats; snapkv & co. take the model's (kvjax.stats)
    >>> cache, state = t.update(cache, t.init(cache), None)
    >>> kvjax.num_valid(cache[0]).tolist(), kvjax.nbytes(cache)   # 4 of 8 kept, in place
    ([[4]], 1160)
    >>> kvjax.nbytes(shrink(cache, room=2))   # 2 layers x 6 slots x (2 x 4 x 4 B + 4 B) + 2 x 4 B
    440
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.attention import attention_weights
from kvjax.cache import EMPTY, Cache, Layer, ResidualCache, TokenCache, split_slots, view
from kvjax.stores import fold_rows, resize_store, take
from kvjax.stats import NO_STATS, StatsSpec, mean_rotation, query_mean_cov
from kvjax.transforms import CacheTransform

# ----------------------------------------------------------------------------- primitives


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
    rows = jnp.zeros(scores.shape, bool)
    rows = jnp.put_along_axis(rows, order, True, axis=-1, inplace=False)
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


def _latest(pos: jax.Array, n: jax.Array | int) -> jax.Array:
    """[B, KVH, C] bool: the `n` latest tokens of each row (n may be traced, [B] or scalar)."""
    n = jnp.asarray(n).reshape(-1, 1, 1)
    return (rank(pos, pos != EMPTY) < n) & (pos != EMPTY)


def _earliest(pos: jax.Array, n: int) -> jax.Array:
    """[B, KVH, C] bool: the `n` earliest tokens of each row (attention sinks)."""
    return keep_top_k(-pos.astype(jnp.float32), n, pos != EMPTY) if n else jnp.zeros(pos.shape, bool)


def compact(cache: Layer, keep: jax.Array, capacity: int | None = None) -> Layer:
    """Move the kept slots of every row to the front, in slot order.

    Encoded stores move their codes and parameters bit for bit. A
    `ResidualCache` compacts its body and its exact part separately
    (`keep` covers the body's slots, then the recent ones).

    Args:
      cache: the layer cache (per-head or pooled layout).
      keep: [B, KVH, C] bool; each row may keep at most `capacity` slots
        (extra slots beyond `capacity` in a row are dropped, latest last).
        In the pooled layout a slot stays when its owner head keeps it.
      capacity: slots of the returned cache (default: unchanged). Smaller
        means less memory; larger leaves room for new tokens.
    Returns:
      A cache whose rows hold their kept slots at `[0, n_row)` and EMPTY after,
      with the write cursor at the largest `n_row`.
    """
    if isinstance(cache, ResidualCache):
        if capacity is not None:
            raise ValueError("compact: a residual layer keeps its capacity; use shrink to cut it")
        if keep.shape != cache.pos.shape:
            raise ValueError(f"compact: keep mask {keep.shape} does not match slots "
                             f"{cache.pos.shape}")
        body, recent = split_slots(cache, keep)
        return cache.replace(body=compact(cache.body, body), recent=compact(cache.recent, recent))
    b, kvh, c = cache.pos.shape
    capacity = c if capacity is None else capacity
    if keep.shape != (b, kvh, c):
        raise ValueError(f"compact: keep mask {keep.shape} does not match slots {(b, kvh, c)}")
    if c == 0 and capacity == 0:  # no slots, nothing to move (the empty body of a short prompt)
        return cache
    if capacity < 1:
        raise ValueError(f"compact: capacity must be positive, got {capacity}")
    keep = keep & (cache.pos != EMPTY)
    rows = cache.k.shape[0]
    keep_rows = keep.any(axis=1) if cache.pooled else keep.reshape(rows, c)  # [R, C]
    slot = jnp.arange(c, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(keep_rows, slot, c + slot), axis=-1)  # kept first, in order
    if capacity <= c:
        order = order[..., :capacity]
    else:  # grow: pad with an index that is never kept (masked below)
        order = jnp.pad(order, ((0, 0), (0, capacity - c)), constant_values=c - 1)
    kept = jnp.take_along_axis(keep_rows, order, axis=-1)
    kept &= jnp.arange(capacity) < jnp.sum(keep_rows, axis=-1, keepdims=True)  # [R, C']
    by_head = lambda x: jnp.broadcast_to(x.reshape(b, -1, capacity), (b, kvh, capacity))
    order_h, kept_h = by_head(order), by_head(kept)
    kept_h &= jnp.take_along_axis(keep, order_h, axis=-1)  # pooled: only the owner head
    pos = jnp.where(kept_h, jnp.take_along_axis(cache.pos, order_h, axis=-1), EMPTY)
    mass = cache.mass
    if mass is not None:
        mass = jnp.where(kept_h, jnp.take_along_axis(mass, order_h, axis=-1), 0.0)
    return TokenCache(k=take(cache.k, order, kept), v=take(cache.v, order, kept), pos=pos,
                      length=jnp.max(jnp.sum(kept, axis=-1)).astype(jnp.int32), mass=mass)


def _pool(x: jax.Array, fill) -> jax.Array:
    """[B, KVH, C] per-head slot data -> [B, KVH, KVH*C]: head h owns slots [h*C, (h+1)*C)."""
    b, kvh, c = x.shape
    own = jnp.eye(kvh, dtype=bool)[None, :, :, None]  # [1, head, owner, 1]
    return jnp.where(own, x[:, :, None, :], fill).reshape(b, kvh, kvh * c)


def pool_heads(cache: Layer) -> Layer:
    """The same tokens in the pooled layout: `[B*KVH, C, D]` rows become `[B, KVH*C, D]`.

    Same bytes for keys and values (a reshape); each head's slots are marked
    in `pos` by head. Compact afterwards to let heads share the freed slots.
    """
    if cache.pooled:
        return cache
    if isinstance(cache, ResidualCache):
        return cache.replace(body=pool_heads(cache.body), recent=pool_heads(cache.recent))
    b, kvh, c = cache.pos.shape
    return TokenCache(k=fold_rows(cache.k, b), v=fold_rows(cache.v, b), pos=_pool(cache.pos, EMPTY),
                      length=jnp.int32(kvh * c),
                      mass=None if cache.mass is None else _pool(cache.mass, 0.0))


def resize(cache: TokenCache, capacity: int) -> TokenCache:
    """Cut or extend the slot axis to `capacity`; slots past the cursor must be free.

    Host-side (capacity is a shape); raises if a written slot would be lost.
    """
    c = cache.capacity
    if capacity < int(cache.length):
        raise ValueError(f"resize: capacity {capacity} would drop written slots "
                         f"(the cursor is at {int(cache.length)})")
    if capacity <= c:
        cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, capacity, axis=axis)
    else:
        cut = lambda x, axis: jnp.pad(
            x, [(0, capacity - c if a == axis % x.ndim else 0) for a in range(x.ndim)],
            constant_values=EMPTY if x.dtype == jnp.int32 else 0)
    valid = cache.pos != EMPTY
    valid = valid.any(axis=1) if cache.pooled else valid.reshape(math.prod(valid.shape[:2]), c)  # [R, C]
    return TokenCache(k=resize_store(cache.k, capacity, valid),
                      v=resize_store(cache.v, capacity, valid), pos=cut(cache.pos, 2),
                      length=cache.length, mass=None if cache.mass is None else cut(cache.mass, 2))


def shrink(cache: Cache, room: int = 0, max_write: int | None = None) -> Cache:
    """Cut every layer to its written slots plus room for `room` more tokens (host side).

    After a policy compacted the cache, `nbytes(shrink(cache))` is the kept
    tokens' bytes: budget x (2 x head_dim x itemsize) per KV head, plus the
    int32 position per slot and head and the 4-byte cursor.
    A `ResidualCache` keeps `residual + block - 1 + max_write` exact slots
    (default `max_write = room`: one write of all the room) and gives the
    body room for every token that can flush into it; with `room=0` both
    parts are cut to the tokens they hold.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=64)
        >>> cache = shrink(cache, room=8)   # nothing written yet: room for 8 tokens
        >>> cache[0].k.shape, cache[0].pos.shape
        ((1, 8, 4), (1, 1, 8))
    """
    return tuple(_shrink_layer(layer, room, room if max_write is None else max_write)
                 for layer in cache)


def _shrink_layer(layer: Layer, room: int, max_write: int) -> Layer:
    if hasattr(layer, "shrink"):  # a layer that shrinks itself (kvjax.recurrent)
        return layer.shrink(room, max_write)
    spt = layer.slots_per_token
    if not isinstance(layer, ResidualCache):
        return resize(layer, int(layer.length) + room * spt)
    recent = int(layer.recent.length)
    flush = max(0, recent + room * spt - layer.residual) if room else 0  # no write, no flush
    if recent + room * spt < layer.residual + layer.block:  # never a whole block to flush:
        flush = 0  # the exact part holds every token (a short prompt, a short generation)
    body = resize(layer.body, int(layer.body.length) + flush)
    keep = max(recent, layer.residual + layer.block - 1 + max_write * spt) if flush else \
        recent + room * spt
    return layer.replace(body=body, recent=resize(layer.recent, keep))


# ----------------------------------------------------------------------------- budgets


class BudgetState(NamedTuple):
    """State of a scored policy: its budget, fixed at the first update."""

    ratio: jax.Array  # [] float32 fraction evicted, or -1 when a token budget is given
    tokens: jax.Array  # [] int32 tokens kept per KV head, or -1 when a ratio is given
    layer_budget: jax.Array  # [L, B] int32 tokens per KV head per layer; -1 before the first update
    key: jax.Array  # PRNG key (random scores)


def _init_budget(ratio: float | None, budget: int | None, seed: int, cache: Cache) -> BudgetState:
    return BudgetState(ratio=jnp.float32(-1.0 if ratio is None else ratio),
                       tokens=jnp.int32(-1 if budget is None else budget),
                       layer_budget=jnp.full((len(cache), cache[0].batch), -1, jnp.int32),
                       key=jax.random.key(seed))


def check_int(name: str, arg: str, value, low: int = 1) -> None:
    """ValueError unless `value` is an int (not a bool) >= `low`; names the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: need {arg} >= {low} (an int), got {value!r}")


def check_real(name: str, arg: str, value, low: float, high: float = math.inf,
               high_open: bool = False) -> None:
    """ValueError unless `value` is a finite real number in [low, high] (or [low, high))."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (high_open and value == high):
        bound = ")" if high_open else "]"
        raise ValueError(f"{name}: {arg} must be a finite number in [{low}, {high}{bound}, "
                         f"got {value!r}")


def _check_bool(name: str, arg: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {arg} must be true or false, got {value!r}")


def _check_budget(name: str, ratio: float | None, budget: int | None) -> None:
    if (ratio is None) == (budget is None):
        raise ValueError(f"{name}: give exactly one of ratio (fraction evicted) or budget "
                         f"(tokens kept per KV head); got ratio={ratio}, budget={budget}")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not 0 <= ratio < 1):
        raise ValueError(f"{name}: ratio is the fraction of tokens evicted, in [0, 1); "
                         f"got {ratio!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise ValueError(f"{name}: budget must be a positive int, got {budget!r}")


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


def _layer_budgets(state: BudgetState, cache: Cache, schedule, window: int, beta: float):
    """[L, B] budgets: the state's, or (first update) derived from the ratio or token count."""
    n = jnp.max(jnp.sum(cache[0].pos != EMPTY, axis=-1), axis=-1).astype(jnp.float32)  # [B]
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


def _select(scores, valid, protect, budget, headwise: bool, alpha: float):
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


Scorer = Callable[..., tuple[jax.Array, jax.Array]]
"""`scorer(layer, stats, budget [B], key) -> (scores [B, KVH, C] f32, protect [B, KVH, C] bool)`."""


DEBUG_ENV = "KVJAX_DEBUG_CHECKS"
_debug_checks = [os.environ.get(DEBUG_ENV, "") not in ("", "0")]


def debug_checks_enabled() -> bool:
    """Whether policies built now check their scores (`debug_checks`, $KVJAX_DEBUG_CHECKS=1
    or `jax.config.update("jax_debug_nans", True)`)."""
    return _debug_checks[-1] or bool(jax.config.jax_debug_nans)


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Policies built inside this block raise when their scorer returns a NaN score.

    The check (a `jax.debug.callback` on "any valid slot scored NaN") is
    compiled into the policy's update, so it is chosen when the policy is
    built, not when it runs. Off by default: NaN scores then rank below every
    valid number (`best_first`) and the policy goes on.

    Example:
        >>> from kvjax import parse_method
        >>> with debug_checks():
        ...     t = parse_method("expected_attention:ratio=0.5")   # this policy checks
        ...     debug_checks_enabled()
        True
    """
    _debug_checks.append(bool(enabled))
    try:
        yield
    finally:
        _debug_checks.pop()


def _raise_on_nan(layer: int, count) -> None:
    if int(count):
        raise FloatingPointError(f"kvjax debug check: the eviction scorer gave {int(count)} "
                                 f"NaN scores in layer {layer}")


def _check_scores(layer: int, scores: jax.Array, valid: jax.Array) -> None:
    jax.debug.callback(functools.partial(_raise_on_nan, layer),
                       jnp.sum(jnp.isnan(scores) & valid))


@functools.lru_cache(maxsize=None)
def _scored_update(scorer: Scorer, schedule, window: int, beta: float, headwise: bool,
                   alpha: float, debug: bool = False) -> Callable:
    def update(cache, state: BudgetState, stats=None):
        budgets = _layer_budgets(state, cache, schedule, window, beta)  # [L, B]
        keys = jax.random.split(state.key, len(cache) + 1)
        out = []
        for i, layer in enumerate(cache):
            if headwise:
                layer = pool_heads(layer)
            seen = view(layer)  # dense slots of an encoded or residual layer
            scores, protect = scorer(seen, None if stats is None else stats[i], budgets[i], keys[i])
            if debug:
                _check_scores(i, scores, seen.pos != EMPTY)
            keep = _select(scores, seen.pos != EMPTY, protect, budgets[i], headwise, alpha)
            out.append(compact(layer, keep))
        return tuple(out), state._replace(layer_budget=budgets, key=keys[-1])
    return update


def scored_policy(name: str, scorer: Scorer, *, ratio: float | None, budget: int | None,
                  stats: StatsSpec = NO_STATS, schedule="uniform", headwise: bool = False,
                  alpha: float = 0.2, window: int = 64, beta: float = 20,
                  seed: int = 0) -> CacheTransform:
    """A `CacheTransform` that keeps, per layer and KV head, the budget of best-scored slots.

    Args:
      scorer: `(layer, layer_stats, budget, key) -> (scores, protect)`; must be
        the same object across calls for compiled code to be reused (define it
        at module level or cache its factory).
      ratio / budget: fraction evicted, or tokens kept per KV head (exactly one).
      stats: what the scorer needs the model to collect.
      schedule: "uniform", "pyramid" (PyramidKV, with `window` and `beta`) or
        a tuple of per-layer weights (normalised to mean 1).
      headwise: Ada-KV head-wise budgets (pooled layout), each head keeping
        at least `alpha` of the per-head budget.
    """
    _check_budget(name, ratio, budget)
    check_int(name, "window", window)
    check_real(name, "beta", beta, 1e-6)
    check_int(name, "seed", seed, 0)
    _check_bool(name, "headwise", headwise)
    if not (schedule in ("uniform", "pyramid") or isinstance(schedule, tuple)):
        raise ValueError(f"{name}: schedule must be 'uniform', 'pyramid' or a tuple of "
                         f"per-layer weights, got {schedule!r}")
    if isinstance(schedule, tuple):
        for weight in schedule:
            check_real(name, "every schedule weight", weight, 1e-6)
    check_real(name, "alpha", alpha, 0.0, 1.0)
    update = _scored_update(scorer, schedule, window, float(beta), bool(headwise), float(alpha),
                            debug_checks_enabled())
    return CacheTransform(functools.partial(_init_budget, ratio, budget, seed), update, stats)


# ----------------------------------------------------------------------------- scorers


def _broadcast_heads(x: jax.Array, layer: TokenCache) -> jax.Array:
    """[R, C] per storage row -> [B, KVH, C] per head (pooled rows serve every head)."""
    return jnp.broadcast_to(x.reshape(layer.batch, -1, layer.capacity), layer.pos.shape)


def _no_protect(layer):
    return jnp.zeros(layer.pos.shape, bool)


def _pool1d(x: jax.Array, kernel: int) -> jax.Array:
    """Mean over a `kernel`-wide window along the last axis, zero padded (avg_pool1d)."""
    if kernel <= 1:
        return x
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)]
    summed = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1,) * (x.ndim - 1) + (kernel,),
                                   (1,) * x.ndim, pad)
    return summed / kernel


def _knorm(layer, stats, budget, key):
    norm = jnp.linalg.norm(layer.k.astype(jnp.float32), axis=-1)  # [R, C]
    return -_broadcast_heads(norm, layer), _no_protect(layer)


def _random(layer, stats, budget, key):
    """Uniform scores drawn per (KV head, token position): the same token gets the
    same draw whatever its slot, batch or padding."""
    heads = jnp.arange(layer.kv_heads)[None, :, None]
    draw = lambda h, p: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, h), p))
    ids = jnp.broadcast_to(heads, layer.pos.shape)
    return jax.vmap(draw)(ids.ravel(), layer.pos.ravel()).reshape(layer.pos.shape), _no_protect(layer)


@functools.lru_cache(maxsize=None)
def _recency_scorer(sinks: int) -> Scorer:
    def score(layer, stats, budget, key):
        return layer.pos.astype(jnp.float32), _earliest(layer.pos, sinks)
    return score


def _window_attention(layer, stats, window: int):
    """[B, KVH, G, C] attention of the last `window` observed queries, averaged over them."""
    if stats is None or stats.queries.shape[1] < window:
        raise ValueError(f"this policy needs the last {window} queries; run the model with "
                         f"StatsSpec(window={window}) (the sampler does this from transform.stats)")
    q, q_pos = stats.queries[:, -window:], stats.query_pos[:, -window:]
    weights = attention_weights(q.astype(layer.k.dtype), q_pos, layer)  # [B, KVH, G, W, C]
    n = jnp.maximum(jnp.sum(q_pos != EMPTY, axis=1), 1).astype(jnp.float32)
    return weights.sum(axis=3) / n[:, None, None, None]


@functools.lru_cache(maxsize=None)
def _snapkv_scorer(window: int, kernel: int) -> Scorer:
    def score(layer, stats, budget, key):
        protect = _latest(layer.pos, window)  # the observation window
        attn = jnp.where(protect[:, :, None], 0.0, _window_attention(layer, stats, window))
        return _pool1d(attn, kernel).mean(axis=2), protect
    return score


def _tova(layer, stats, budget, key):
    attn = _window_attention(layer, stats, 1)  # [B, KVH, G, C]
    score = attn.mean(axis=(1, 2), keepdims=True)[:, :, 0]  # over all query heads: [B, 1, C]
    return jnp.broadcast_to(score, layer.pos.shape), _latest(layer.pos, 1)


@functools.lru_cache(maxsize=None)
def _h2o_scorer(recent: int | None, recent_fraction: float) -> Scorer:
    def score(layer, stats, budget, key):
        if layer.mass is None:
            raise ValueError("h2o needs the attention mass; make the cache with track_mass=True "
                             "(the sampler does this from transform.stats)")
        n_recent = recent if recent is not None else jnp.floor(budget * recent_fraction)
        return layer.mass, _latest(layer.pos, n_recent)
    return score


@functools.lru_cache(maxsize=None)
def _expected_attention_scorer(n_future: int, sinks: int, use_covariance: bool,
                               use_vnorm: bool, epsilon: float) -> Scorer:
    def score(layer, stats, budget, key):
        if stats is None or stats.q_sum.shape[-1] == 0:
            raise ValueError("expected_attention needs query moments: run the model with "
                             "StatsSpec(query_moments=True)")
        mean, cov = query_mean_cov(stats)  # [B, H, D], [B, H, D, D]
        start = jnp.max(layer.pos, axis=(1, 2)) + 1  # [B] the next position
        rot = mean_rotation(stats.inv_freq, start, n_future)  # [B, D, D]
        b, kvh, c = layer.pos.shape
        d = layer.head_dim
        mean = jnp.einsum("bij,bhj->bhi", rot, mean).reshape(b, kvh, -1, d)  # [B, KVH, G, D]
        keys = layer.logical_k.astype(jnp.float32)  # [B, KVH or 1, C, D]
        logits = jnp.einsum("bkgd,bkcd->bkgc", mean, jnp.broadcast_to(keys, (b, kvh, c, d))) / d ** 0.5
        if use_covariance:
            cov = jnp.einsum("bij,bhjk,blk->bhil", rot, cov, rot).reshape(b, kvh, -1, d, d)
            quad = jnp.einsum("bkcd,bkgde,bkce->bkgc", keys, cov, keys)
            logits = logits + quad / d / 2
        sink = _earliest(layer.pos, sinks)
        scored = (layer.pos != EMPTY) & ~sink
        logits = jnp.where(scored[:, :, None], logits, -jnp.inf)
        probs = jnp.where(scored[:, :, None], jax.nn.softmax(logits, axis=-1), 0.0).mean(axis=2)
        if use_vnorm:
            vnorm = _broadcast_heads(jnp.linalg.norm(layer.v.astype(jnp.float32), axis=-1), layer)
            probs = (probs + epsilon) * vnorm
        return probs, sink
    return score


# ----------------------------------------------------------------------------- policies


def knorm(ratio: float | None = None, budget: int | None = None, **options) -> CacheTransform:
    """Keep the keys with the smallest L2 norm (Devoto et al. 2024; kvpress KnormPress).

    `options` (here and below): `schedule`, `headwise`, `alpha` of `scored_policy`.
    """
    return scored_policy("knorm", _knorm, ratio=ratio, budget=budget, **options)


def random(ratio: float | None = None, budget: int | None = None, seed: int = 0,
           **options) -> CacheTransform:
    """Keep a uniformly random subset (baseline); the key lives in the state."""
    return scored_policy("random", _random, ratio=ratio, budget=budget, seed=seed, **options)


def streaming_llm(sinks: int = 4, window: int | None = None, ratio: float | None = None,
                  budget: int | None = None, **options) -> CacheTransform:
    """StreamingLLM: the first `sinks` tokens (attention sinks) and the most recent ones.

    Give `window` (recent tokens: the budget is `sinks + window`), `budget` or
    `ratio`. Tokens are ranked by absolute position, so padding and holes do
    not count.

    Example:
        >>> t = streaming_llm(sinks=4, window=508)   # <= 512 tokens per head
        >>> t = streaming_llm(ratio=0.5)             # as kvpress StreamingLLMPress(0.5)
    """
    check_int("streaming_llm", "sinks", sinks, 0)
    if window is not None:
        check_int("streaming_llm", "window", window)
    if window is not None:
        if ratio is not None or budget is not None:
            raise ValueError("streaming_llm: give window, or ratio / budget, not both")
        budget = sinks + window
    return scored_policy("streaming_llm", _recency_scorer(sinks), ratio=ratio, budget=budget,
                         **options)


def sliding_window(window: int) -> CacheTransform:
    """Keep only the last `window` tokens of every sequence (StreamingLLM without sinks)."""
    return streaming_llm(sinks=0, window=window)


def snapkv(ratio: float | None = None, budget: int | None = None, window: int = 64,
           kernel: int = 5, **options) -> CacheTransform:
    """SnapKV (Li et al. 2024): attention of the last `window` queries, pooled over `kernel` slots.

    As kvpress SnapKVPress: softmax over all keys, mean over the window's
    queries, average pooling (zero padded), mean over the query heads of each
    KV head; the window itself is always kept. Query-agnostic when the window
    is the end of the context, query-aware when it is the question.
    """
    check_int("snapkv", "window", window)
    check_int("snapkv", "kernel", kernel)
    if kernel % 2 == 0:
        raise ValueError(f"snapkv: kernel must be odd (a centred pooling window), got {kernel}")
    return scored_policy("snapkv", _snapkv_scorer(window, kernel), ratio=ratio, budget=budget,
                         stats=StatsSpec(window=window), window=window, **options)


def pyramidkv(ratio: float | None = None, budget: int | None = None, window: int = 64,
              kernel: int = 5, beta: float = 20, **options) -> CacheTransform:
    """PyramidKV (Cai et al. 2024): SnapKV scores, budgets falling linearly with depth."""
    return snapkv(ratio=ratio, budget=budget, window=window, kernel=kernel, beta=beta,
                  schedule="pyramid", **options)


def tova(ratio: float | None = None, budget: int | None = None, **options) -> CacheTransform:
    """TOVA (Oren et al. 2024): keep what the latest query attends to most (mean over heads).

    Run during decode (`compress_every=1`) it drops the lowest-attention
    token each step, as in the paper; the latest token is always kept.
    """
    return scored_policy("tova", _tova, ratio=ratio, budget=budget,
                         stats=StatsSpec(window=1), **options)


def h2o(heavy: int | None = None, recent: int | None = None, ratio: float | None = None,
        recent_fraction: float = 0.5, **options) -> CacheTransform:
    """H2O (Zhang et al. 2023): heavy hitters by accumulated attention plus recent tokens.

    Give `heavy` and `recent` token counts, or a `ratio` whose budget is split
    `recent_fraction` recent / the rest heavy. The cache accumulates the
    attention each slot receives (summed over the query heads of its KV
    head) during prefill and every decode step.
    """
    check_real("h2o", "recent_fraction", recent_fraction, 0.0, 1.0)
    if heavy is not None or recent is not None:
        if heavy is None or recent is None or ratio is not None:
            raise ValueError(f"h2o: give heavy and recent (>= 0) together, or ratio; got "
                             f"heavy={heavy}, recent={recent}, ratio={ratio}")
        check_int("h2o", "heavy", heavy, 0)
        check_int("h2o", "recent", recent, 0)
        budget = heavy + recent
    else:
        budget = None
    return scored_policy("h2o", _h2o_scorer(recent, float(recent_fraction)), ratio=ratio,
                         budget=budget, stats=StatsSpec(attention_mass=True), **options)


def expected_attention(ratio: float | None = None, budget: int | None = None,
                       n_future: int = 512, sinks: int = 4, use_covariance: bool = True,
                       use_vnorm: bool = True, epsilon: float = 0.0,
                       **options) -> CacheTransform:
    """Expected attention of future queries (kvpress ExpectedAttentionPress).

    Queries are modelled as Gaussian (mean and covariance of the pre-RoPE
    queries seen so far, sinks excluded), rotated by the RoPE rotation
    averaged over the next `n_future` positions; a key's score is
    `softmax(k.mu / sqrt(d) + k' S k / 2d)` averaged over its query heads,
    times `||v||`. The first `sinks` tokens are kept.
    """
    check_int("expected_attention", "n_future", n_future)
    check_int("expected_attention", "sinks", sinks, 0)
    check_real("expected_attention", "epsilon", epsilon, 0.0)
    scorer = _expected_attention_scorer(n_future, sinks, bool(use_covariance), bool(use_vnorm),
                                        float(epsilon))
    return scored_policy("expected_attention", scorer, ratio=ratio, budget=budget,
                         stats=StatsSpec(query_moments=True, moments_skip=sinks), **options)
