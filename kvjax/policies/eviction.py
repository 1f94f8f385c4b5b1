"""Eviction policies: score every slot, keep a budget, compact the rest away.

The contract a policy implements is one function, a **scorer**:

    scorer(layer, stats, budget, key) -> (scores, protect)

* `layer`: one layer's cache as dense slots (`kvjax.view`): `layer.k`,
  `layer.v` are `[R, C, D]` storage rows (`R = B*KVH`, or `B` in the pooled
  layout, where every row serves all heads), `layer.pos` is `[B, KVH, C]`
  int32 absolute positions (`EMPTY` = -1 for a free slot), `layer.mass` the
  accumulated attention when the policy asked for it.
* `stats`: this layer's `kvjax.LayerStats` (observed queries, query moments)
  when the policy declared a `StatsSpec`, else None.
* `budget`: `[B]` int32 tokens kept per KV head in this layer (traced).
* `key`: a PRNG key for this layer, the same at every update of one transform
  state (so a token's random draw is fixed for its life in the cache).
* returns `scores` `[B, KVH, C]` (higher = keep; any float, NaN ranks last)
  and `protect` `[B, KVH, C]` bool (slots kept before any scored slot).

`scored_policy(name, scorer, ratio=..., budget=...)` turns a scorer into a
`CacheTransform` with everything else shared: ratio/budget handling, per-layer
schedules (PyramidKV), Ada-KV head-wise budgets, compaction. Compiled code is
keyed on the scorer *by value*: give a module-level function, or a frozen
(hashable, value-compared) dataclass for a parameterised scorer, as the
built-in ones below are; two equal scorers share one compilation. Helpers for
scorers: `broadcast_heads`, `no_protect`, `earliest`, `latest`.

Every built-in policy is such a factory. Its `update` scores the slots of
each layer, forces the protected slots to stay (sinks, the observation
window), keeps each row's budget of the best slots and compacts them to the
front of the cache, in slot order (`kvjax.core.layout.compact`). Positions travel
with their keys, so RoPE'd keys keep their meaning and masks stay right. The
budget is fixed at the first update (prompt compression) and every later
update (during decode) brings the cache back to it.

Budgets. `ratio` is the fraction of tokens *evicted* (kvpress's
`compression_ratio`): each sequence keeps `max(1, floor(n * (1 - ratio)))` of
its `n` tokens per KV head. `budget` is a token count per KV head instead.
Both are traced state, not compile-time constants: changing them does not
recompile. `schedule="pyramid"` (PyramidKV) or a tuple of per-layer weights
spreads the same total unevenly over layers. `headwise=True` (Ada-KV) shares
one layer's total budget unevenly over its KV heads; the cache then switches
to the pooled layout (`TokenCache.pooled`), where every head stores exactly
its own tokens. Ranking and budgets live in `kvjax.core.selection`.

GQA rule: a KV head's score aggregates its group of query heads by the mean
(SnapKV, ExpectedAttention; kvpress's choice) or the sum (H2O's accumulated
mass); TOVA averages over all query heads, as kvpress does.

Memory. Compaction is in place: capacity is static inside jit. `shrink`
(`kvjax.core.layout`, host side) then cuts every layer to its kept slots plus room
for new tokens, so `nbytes` falls to the budget.

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=16)
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 8, 4))  # 8 tokens [B, KVH, T, D]
    >>> cache = tuple(kvjax.write(layer, k, v, jnp.arange(8)[None]) for layer in cache)
    >>> t = knorm(ratio=0.5)     # needs no stats; snapkv & co. take the model's (kvjax.core.stats)
    >>> cache, state = t.update(cache, t.init(cache), None)
    >>> kvjax.num_valid(cache[0]).tolist(), kvjax.nbytes(cache)   # 4 of 8 kept, in place
    ([[4]], 1160)
    >>> kvjax.nbytes(kvjax.shrink(cache, room=2))   # 2 layers x 6 slots x (2 x 4 x 4 B + 4 B) + 2 x 4 B
    440
    >>> knorm(ratio=0.25).update == knorm(ratio=0.75).update   # one compiled update for both
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.attention import attention_weights
from kvjax.core.cache import EMPTY, Cache, TokenCache, view
from kvjax.core.layout import compact, map_layers, pool_heads
from kvjax.core.selection import BudgetState, init_budget, keep_top_k, layer_budgets, rank, select
from kvjax.core.stores import count_true
from kvjax.core.stats import (NO_STATS, LayerStats, StatsSpec, mean_rotation, query_mean_cov,
                              rope_inv_freq)
from kvjax.core.transforms import CacheTransform

# ----------------------------------------------------------------------------- the contract


class Scorer(Protocol):
    """`scorer(layer, stats, budget [B], key) -> (scores [B, KVH, C] f32, protect [B, KVH, C] bool)`.

    Must be hashable and compare by value (a module-level function, or a
    frozen dataclass with `__call__`): compiled updates are keyed on it.

    A scorer whose rule holds constants per layer (QFilter's filters) also has
    `for_layer(index, num_layers) -> Scorer`: the scorer of layer `index` (a traced int32
    under jit, as layers of equal shapes share one compiled body) of a `num_layers`-layer
    cache (static: check it there).
    """

    def __call__(self, layer: TokenCache, stats: LayerStats | None, budget: jax.Array,
                 key: jax.Array) -> tuple[jax.Array, jax.Array]: ...


def _digest_into(h, value) -> None:
    """Fold `value` into the hash `h`: an array by its shape and bytes, a dict by its sorted
    items and a tuple or list by its elements (so arrays inside them count by content too),
    anything else by its repr."""
    if hasattr(value, "tobytes"):
        h.update(str(value.shape).encode() + value.tobytes())
    elif isinstance(value, dict):
        for k in sorted(value):
            h.update(repr(k).encode())
            _digest_into(h, value[k])
    elif isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__}{len(value)}".encode())
        for v in value:
            _digest_into(h, v)
    else:
        h.update(repr(value).encode())


class ByContent:
    """Hashed and compared by a digest of its dataclass fields, arrays by their bytes: a
    scorer or update holding calibrated arrays (filters, statistics, a curve) keys jit's cache
    by value, so two parses of the same file share one compilation. For frozen dataclasses
    declared with `eq=False`."""

    @functools.cached_property
    def digest(self) -> str:
        h = hashlib.sha256(type(self).__name__.encode())
        for f in dataclasses.fields(self):
            h.update(f.name.encode())
            _digest_into(h, getattr(self, f.name))
        return h.hexdigest()

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self.digest == other.digest


def broadcast_heads(x: jax.Array, layer: TokenCache) -> jax.Array:
    """[R, C] per storage row -> [B, KVH, C] per head (pooled rows serve every head).

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> layer = kvjax.init_cache(batch=1, kv_heads=2, capacity=3, head_dim=4)
        >>> norms = jnp.linalg.norm(layer.k, axis=-1)      # [R=2, C=3] one per storage row
        >>> broadcast_heads(norms, layer).shape
        (1, 2, 3)
    """
    return jnp.broadcast_to(x.reshape(layer.batch, -1, layer.capacity), layer.pos.shape)


def no_protect(layer: TokenCache) -> jax.Array:
    """[B, KVH, C] all False: a scorer that protects no slot."""
    return jnp.zeros(layer.pos.shape, bool)


def latest(pos: jax.Array, n: jax.Array | int) -> jax.Array:
    """[B, KVH, C] bool: the `n` latest tokens of each row (n may be traced, [B] or scalar).

    Example:
        >>> import jax.numpy as jnp
        >>> latest(jnp.array([[[3, 0, 2, -1]]]), 2)[0, 0].tolist()   # -1 = EMPTY
        [True, False, True, False]
    """
    n = jnp.asarray(n).reshape(-1, 1, 1)
    return (rank(pos, pos != EMPTY) < n) & (pos != EMPTY)


def earliest(pos: jax.Array, n: int) -> jax.Array:
    """[B, KVH, C] bool: the `n` (static) earliest tokens of each row (attention sinks).

    Example:
        >>> import jax.numpy as jnp
        >>> earliest(jnp.array([[[3, 0, 2, -1]]]), 2)[0, 0].tolist()
        [False, True, True, False]
    """
    return keep_top_k(-pos.astype(jnp.float32), n, pos != EMPTY) if n else jnp.zeros(pos.shape, bool)


# ----------------------------------------------------------------------------- argument checks


def check_int(name: str, arg: str, value, low: int = 1) -> None:
    """ValueError unless `value` is an int (not a bool) >= `low`; names the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: need {arg} >= {low} (an int), got {value!r}")


def read_arrays(name: str, arg: str, path, keys: tuple[str, ...], writer: str,
                npy: bool = False) -> dict[str, np.ndarray]:
    """The float32 arrays `keys` of the `.npz` a method's `arg=path` names (a calibrated
    artifact), those it holds; with `npy`, a bare `.npy` stands for the one key. A ValueError
    naming the method, argument and path when it is not a file; {} for a file numpy cannot
    read as arrays (the caller says what it lacks)."""
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ValueError(f"{name}: {arg}={path!r} is not a file; give the .npz that "
                         f"`{writer}` writes")
    try:
        with open(path, "rb") as f:
            loaded = np.load(f)
            if isinstance(loaded, np.ndarray):
                return {keys[0]: loaded.astype(np.float32)} if npy and len(keys) == 1 else {}
            with loaded:
                return {k: np.asarray(loaded[k], np.float32) for k in keys if k in loaded.files}
    except (OSError, ValueError):  # not an .npz or .npy; pickled objects
        return {}


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


def evict_layers(evict, cache, stats, budgets, debug: bool = False) -> tuple:
    """`evict(layer, layer_stats, budget, index)` on every layer: one compiled layer body per
    group of equal layers (`map_layers`), or layer by layer with `debug=True` passed on (so a
    failed check names its layer)."""
    per_layer = (cache, stats if stats is not None else (None,) * len(cache), tuple(budgets),
                 tuple(range(len(cache))))
    if debug:
        return tuple(evict(*args, debug=True) for args in zip(*per_layer))
    return map_layers(evict, *per_layer)


@dataclasses.dataclass(frozen=True)
class ScoredUpdate:
    """The `update` of a scored policy; equal fields (the scorer by value) = one compilation."""

    scorer: Scorer
    schedule: str | tuple[float, ...] = "uniform"
    window: int = 64
    beta: float = 20.0
    headwise: bool = False
    alpha: float = 0.2
    debug: bool = False

    def __call__(self, cache: Cache, state: BudgetState, stats=None):
        budgets = layer_budgets(state, cache, self.schedule, self.window, self.beta)  # [L, B]

        def evict(layer, layer_stats, budget, index, debug=False):
            if self.headwise:
                layer = pool_heads(layer)
            seen = view(layer)  # dense slots of an encoded or residual layer
            # derived where it is used: a scorer that ignores its key compiles no PRNG code
            key = jax.random.fold_in(state.key, index)
            scorer = (self.scorer.for_layer(index, len(cache))
                      if hasattr(self.scorer, "for_layer") else self.scorer)
            scores, protect = scorer(seen, layer_stats, budget, key)
            if debug:  # the per-layer loop, so a failure names its layer
                _check_scores(index, scores, seen.pos != EMPTY)
            keep = select(scores, seen.pos != EMPTY, protect, budget, self.headwise, self.alpha)
            return compact(layer, keep)

        return evict_layers(evict, cache, stats, budgets, self.debug), state._replace(
            layer_budget=budgets)


def scored_policy(name: str, scorer: Scorer, *, ratio: float | None, budget: int | None,
                  stats: StatsSpec = NO_STATS, schedule="uniform", headwise: bool = False,
                  alpha: float = 0.2, window: int = 64, beta: float = 20,
                  seed: int = 0) -> CacheTransform:
    """A `CacheTransform` that keeps, per layer and KV head, the budget of best-scored slots.

    Args:
      scorer: `(layer, layer_stats, budget, key) -> (scores, protect)` (`Scorer`);
        hashable and compared by value (a module-level function or a frozen
        dataclass): compiled code is keyed on it.
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
    if not callable(scorer):
        raise ValueError(f"{name}: scorer must be callable, got {scorer!r}")
    try:
        hash(scorer)
    except TypeError:
        raise ValueError(f"{name}: scorer {scorer!r} is not hashable; compiled updates are "
                         "keyed on it: use a module-level function or a frozen dataclass "
                         "(@dataclasses.dataclass(frozen=True))") from None
    if not (schedule in ("uniform", "pyramid") or isinstance(schedule, tuple)):
        raise ValueError(f"{name}: schedule must be 'uniform', 'pyramid' or a tuple of "
                         f"per-layer weights, got {schedule!r}")
    if isinstance(schedule, tuple):
        for weight in schedule:
            check_real(name, "every schedule weight", weight, 1e-6)
        schedule = tuple(float(w) for w in schedule)
    check_real(name, "alpha", alpha, 0.0, 1.0)
    update = ScoredUpdate(scorer, schedule, window, float(beta), bool(headwise), float(alpha),
                          debug_checks_enabled())
    return CacheTransform(functools.partial(init_budget, ratio, budget, seed), update, stats)


# ----------------------------------------------------------------------------- scorers


def _pool1d(x: jax.Array, kernel: int) -> jax.Array:
    """Mean over a `kernel`-wide window along the last axis, zero padded (avg_pool1d)."""
    if kernel <= 1:
        return x
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)]
    summed = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1,) * (x.ndim - 1) + (kernel,),
                                   (1,) * x.ndim, pad)
    return summed / kernel


def knorm_scores(layer, stats, budget, key):
    """Knorm: minus the key's L2 norm (small keys kept)."""
    norm = jnp.linalg.norm(layer.k.astype(jnp.float32), axis=-1)  # [R, C]
    return -broadcast_heads(norm, layer), no_protect(layer)


def random_scores(layer, stats, budget, key):
    """Uniform scores drawn per (KV head, token position): the same token gets the
    same draw whatever its slot, batch or padding."""
    heads = jnp.arange(layer.kv_heads)[None, :, None]
    draw = lambda h, p: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, h), p))
    ids = jnp.broadcast_to(heads, layer.pos.shape)
    return jax.vmap(draw)(ids.ravel(), layer.pos.ravel()).reshape(layer.pos.shape), no_protect(layer)


@dataclasses.dataclass(frozen=True)
class RecencyScorer:
    """StreamingLLM: the position is the score; the first `sinks` tokens are protected."""

    sinks: int = 0

    def __call__(self, layer, stats, budget, key):
        return layer.pos.astype(jnp.float32), earliest(layer.pos, self.sinks)


def window_attention(layer: TokenCache, stats: LayerStats | None, window: int) -> jax.Array:
    """[B, KVH, G, C] attention of the last `window` observed queries, averaged over them."""
    if stats is None or stats.queries.shape[1] < window:
        raise ValueError(f"this policy needs the last {window} queries; run the model with "
                         f"StatsSpec(window={window}) (the sampler does this from transform.stats)")
    q, q_pos = stats.queries[:, -window:], stats.query_pos[:, -window:]
    weights = attention_weights(q.astype(layer.k.dtype), q_pos, layer)  # [B, KVH, G, W, C]
    n = jnp.maximum(count_true(q_pos != EMPTY, 1), 1).astype(jnp.float32)
    return weights.sum(axis=3) / n[:, None, None, None]


@dataclasses.dataclass(frozen=True)
class SnapKVScorer:
    """SnapKV: window attention, pooled over `kernel` slots, mean over the group."""

    window: int = 64
    kernel: int = 5

    def __call__(self, layer, stats, budget, key):
        protect = latest(layer.pos, self.window)  # the observation window
        attn = jnp.where(protect[:, :, None], 0.0, window_attention(layer, stats, self.window))
        return _pool1d(attn, self.kernel).mean(axis=2), protect


def tova_scores(layer, stats, budget, key):
    """TOVA: the latest query's attention averaged over all query heads; the latest kept."""
    attn = window_attention(layer, stats, 1)  # [B, KVH, G, C]
    score = attn.mean(axis=(1, 2), keepdims=True)[:, :, 0]  # over all query heads: [B, 1, C]
    return jnp.broadcast_to(score, layer.pos.shape), latest(layer.pos, 1)


@dataclasses.dataclass(frozen=True)
class H2OScorer:
    """H2O: accumulated attention; `recent` (or `recent_fraction` of the budget) protected."""

    recent: int | None = None
    recent_fraction: float = 0.5

    def __call__(self, layer, stats, budget, key):
        if layer.mass is None:
            raise ValueError("h2o needs the attention mass; make the cache with track_mass=True "
                             "(the sampler does this from transform.stats)")
        n_recent = self.recent if self.recent is not None else \
            jnp.floor(budget * self.recent_fraction)
        return layer.mass, latest(layer.pos, n_recent)


@dataclasses.dataclass(frozen=True)
class ExpectedAttentionScorer:
    """Expected attention of future queries (see `expected_attention`)."""

    n_future: int = 512
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __call__(self, layer, stats, budget, key):
        if stats is None or stats.q_sum.shape[-1] == 0:
            raise ValueError("expected_attention needs query moments: run the model with "
                             "StatsSpec(query_moments=True)")
        mean, cov = query_mean_cov(stats)  # [B, H, D], [B, H, D, D]
        return self.scores(layer, stats, mean, cov)

    def scores(self, layer, stats, mean, cov):
        """(scores, protect) given the pre-RoPE queries' `mean` [B, H, D] and `cov`
        [B, H, D, D] (the prompt's, or calibrated: `ExpectedAttentionStatsScorer`)."""
        start = jnp.max(layer.pos, axis=(1, 2)) + 1  # [B] the next position
        rot = mean_rotation(rope_inv_freq(stats, "expected_attention"), start, self.n_future)  # [B, D, D]
        b, kvh, c = layer.pos.shape
        d = layer.head_dim
        mean = jnp.einsum("bij,bhj->bhi", rot, mean).reshape(b, kvh, -1, d)  # [B, KVH, G, D]
        keys = layer.logical_k.astype(jnp.float32)  # [B, KVH or 1, C, D]
        logits = jnp.einsum("bkgd,bkcd->bkgc", mean, jnp.broadcast_to(keys, (b, kvh, c, d))) / d ** 0.5
        if self.use_covariance:
            cov = jnp.einsum("bij,bhjk,blk->bhil", rot, cov, rot).reshape(b, kvh, -1, d, d)
            quad = jnp.einsum("bkcd,bkgde,bkce->bkgc", keys, cov, keys)
            logits = logits + quad / d / 2
        sink = earliest(layer.pos, self.sinks)
        scored = (layer.pos != EMPTY) & ~sink
        logits = jnp.where(scored[:, :, None], logits, -jnp.inf)
        probs = jnp.where(scored[:, :, None], jax.nn.softmax(logits, axis=-1), 0.0).mean(axis=2)
        if self.use_vnorm:
            vnorm = broadcast_heads(jnp.linalg.norm(layer.v.astype(jnp.float32), axis=-1), layer)
            probs = (probs + self.epsilon) * vnorm
        return probs, sink


# ----------------------------------------------------------------------------- policies


def knorm(ratio: float | None = None, budget: int | None = None, **options) -> CacheTransform:
    """Keep the keys with the smallest L2 norm (Devoto et al. 2024; kvpress KnormPress).

    `options` (here and below): `schedule`, `headwise`, `alpha` of `scored_policy`.
    """
    return scored_policy("knorm", knorm_scores, ratio=ratio, budget=budget, **options)


def random(ratio: float | None = None, budget: int | None = None, seed: int = 0,
           **options) -> CacheTransform:
    """Keep a uniformly random subset (baseline); the key lives in the state."""
    return scored_policy("random", random_scores, ratio=ratio, budget=budget, seed=seed, **options)


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
    return scored_policy("streaming_llm", RecencyScorer(sinks), ratio=ratio, budget=budget,
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
    return scored_policy("snapkv", SnapKVScorer(window, kernel), ratio=ratio, budget=budget,
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
    return scored_policy("tova", tova_scores, ratio=ratio, budget=budget,
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
    return scored_policy("h2o", H2OScorer(recent, float(recent_fraction)), ratio=ratio,
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
    scorer = ExpectedAttentionScorer(n_future, sinks, bool(use_covariance), bool(use_vnorm),
                                     float(epsilon))
    return scored_policy("expected_attention", scorer, ratio=ratio, budget=budget,
                         stats=StatsSpec(query_moments=True, moments_skip=sinks), **options)
