"""Query-free scorers on the cached keys and values: KeyDiff, LagKV, CUR, QFilter (kvpress 0.5.5).

Each is a `Scorer` (see `kvjax.policies.eviction`) behind `scored_policy`, so budgets,
per-layer schedules, Ada-KV head-wise budgets, compaction and `shrink` are
shared with every other policy. Defaults are kvpress's. They need no
statistics from the model: they read only the cache, so they also run during
decode (`--compress-every`), where kvpress runs them at prefill only.

Sequence-structured rules (LagKV's partitions, CUR's local windows, sinks)
count tokens in position order per row (`kvjax.policies.eviction_sequence`), so a
left-padded prompt in a batch scores exactly as it does alone.

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 2, 4), batch=1, capacity=8)
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 2, 8, 4))
    >>> cache = (kvjax.write(cache[0], k, v, jnp.arange(8)[None]),)
    >>> t = keydiff(ratio=0.5)
    >>> out, _ = t.update(cache, t.init(cache), None)
    >>> kvjax.num_valid(out[0]).tolist()
    [[4, 4]]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.policies.eviction import (ByContent, check_int, no_protect, read_arrays,
                                     scored_policy)
from kvjax.policies.eviction_sequence import in_sequence, keys_values, to_slots
from kvjax.core.transforms import CacheTransform

# ----------------------------------------------------------------------------- KeyDiff


def _normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / max(||x||, eps) over the last axis (torch's F.normalize / cosine_similarity)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def keydiff_scores(layer, stats, budget, key):
    """KeyDiff: minus the cosine similarity of each key to the mean of the unit keys.

    anchor = mean over the row's tokens of k / ||k||; score = -cos(k, anchor):
    keys least like the average are kept (kvpress KeyDiffPress).
    """
    seq = in_sequence(layer)
    k, _ = keys_values(seq, layer)  # [B, KVH, C, D] token order, zero past n
    n = jnp.maximum(seq.n, 1).astype(jnp.float32)[..., None]  # [B, KVH, 1]
    anchor = _normalize(k, 1e-12).sum(axis=2) / n  # [B, KVH, D]
    cos = (_normalize(k, 1e-8) * _normalize(anchor, 1e-8)[:, :, None]).sum(-1)  # [B, KVH, C]
    return to_slots(seq, jnp.where(seq.valid, -cos, 0.0)), jnp.zeros(seq.valid.shape, bool)


# ----------------------------------------------------------------------------- LagKV


def _lag_block_scores(x: jax.Array, lag: int) -> jax.Array:
    """[B, KVH, NB, lag, D] blocks -> [B, KVH, NB, lag]: softmax over the block of the std
    (over D) of each token min-max normalised by the NEXT block's per-channel range."""
    ref = jnp.concatenate([x[:, :, 1:], jnp.zeros_like(x[:, :, :1])], axis=2)
    lo, hi = ref.min(axis=3, keepdims=True), ref.max(axis=3, keepdims=True)
    spread = jnp.std((x - lo) / (hi - lo), axis=-1, ddof=1)
    return jax.nn.softmax(spread, axis=-1)


@dataclasses.dataclass(frozen=True)
class LagKVScorer:
    """LagKV (kvpress LagKVPress, `cross_scoring=False`).

    Tokens after `sinks` are cut into partitions of `lag`; each partition is
    scored against the next one (the lag reference): per channel, min-max
    normalise by the reference's range, take the std over channels, softmax
    over the partition, average keys' and values' scores, and replace it by
    its rank in the partition over `lag`. The sinks and the last full
    partition plus the remainder score 1 (always kept first). Rows shorter
    than `sinks + 2 * lag` score `(i - sinks) / (n - sinks)` (recency).
    Many scores tie exactly (every partition holds the ranks 0..lag-1); ties
    go to the earlier slot here, to torch's `topk` order in kvpress.
    """

    sinks: int = 4
    lag: int = 128

    def __call__(self, layer, stats, budget, key):
        seq = in_sequence(layer)
        k, v = keys_values(seq, layer)  # [B, KVH, C, D]
        b, kvh, c, d = k.shape
        i = jnp.arange(c)[None, None]  # [1, 1, C] token index
        n = seq.n[..., None]  # [B, KVH, 1]
        recency = jnp.where(i < self.sinks, 1.0, (i - self.sinks).astype(jnp.float32)
                            / jnp.maximum(n - self.sinks, 1).astype(jnp.float32))
        blocks = -(-max(c - self.sinks, 0) // self.lag)
        width = blocks * self.lag
        pad = lambda x: jnp.pad(x[:, :, self.sinks:], ((0, 0), (0, 0),
                                                      (0, width - (c - self.sinks)), (0, 0)))
        shape = (b, kvh, blocks, self.lag, d)
        score = (_lag_block_scores(pad(k).reshape(shape), self.lag)
                 + _lag_block_scores(pad(v).reshape(shape), self.lag)) / 2
        ranks = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1)
        ranked = (ranks.astype(jnp.float32) / self.lag).reshape(b, kvh, width)
        ranked = jnp.pad(ranked, ((0, 0), (0, 0), (self.sinks, 0)))[:, :, :c]  # token order
        partitions = (n - self.sinks) // self.lag  # [B, KVH, 1] full partitions
        scored = (i >= self.sinks) & (i < self.sinks + (partitions - 1) * self.lag)
        lagged = jnp.where(scored, ranked, 1.0)
        out = jnp.where(n < self.sinks + 2 * self.lag, recency, lagged)
        return to_slots(seq, jnp.where(seq.valid, out, 0.0)), jnp.zeros(seq.valid.shape, bool)


# ----------------------------------------------------------------------------- CUR


def _local_share(x: jax.Array, window: int) -> jax.Array:
    """[B, KVH, C] -> each token's share of its `window`-token block's sum (blocks from token 0)."""
    b, kvh, c = x.shape
    width = -(-c // window) * window
    blocks = jnp.pad(x, ((0, 0), (0, 0), (0, width - c))).reshape(b, kvh, -1, window)
    return (blocks / blocks.sum(-1, keepdims=True)).reshape(b, kvh, width)[:, :, :c]


LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")


@dataclasses.dataclass(frozen=True)
class CURScorer:
    """CurDKV's approximate leverage (kvpress CURPress, `use_random_leverage=False`).

    k2 = ||k||^2 and v2 = ||v||^2 per token, each divided by its local
    window's sum (`local_window` tokens, windows from the first token) when
    `local_approximation`; combined as `leverage_type` (product by default),
    normalised over the row; the first `sinks` tokens are kept.
    """

    sinks: int = 4
    leverage_type: str = "kv_product"
    local_approximation: bool = True
    local_window: int = 16

    def __call__(self, layer, stats, budget, key):
        seq = in_sequence(layer)
        k, v = keys_values(seq, layer)
        k2, v2 = jnp.sum(k * k, -1), jnp.sum(v * v, -1)  # [B, KVH, C] zero past n
        if self.local_approximation:
            k2, v2 = _local_share(k2, self.local_window), _local_share(v2, self.local_window)
        scores = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2,
                  "kv_product": k2 * v2}[self.leverage_type]
        scores = jnp.where(seq.valid, scores, 0.0)
        scores = scores / scores.sum(-1, keepdims=True)
        i = jnp.arange(seq.valid.shape[-1])[None, None]
        protect = seq.valid & (i < self.sinks)
        return to_slots(seq, jnp.where(seq.valid, scores, 0.0)), to_slots(seq, protect)


# ----------------------------------------------------------------------------- policies


def keydiff(ratio: float | None = None, budget: int | None = None, **options) -> CacheTransform:
    """KeyDiff (Park et al. 2025): keep the keys least similar to the mean key direction.

    As kvpress KeyDiffPress: score = -cos(k, mean_t(k_t / ||k_t||)) on the
    cached (post-RoPE) keys; no statistics needed. The paper's block-wise
    prefill is `block` around it.
    """
    return scored_policy("keydiff", keydiff_scores, ratio=ratio, budget=budget, **options)


def lagkv(ratio: float | None = None, budget: int | None = None, sinks: int = 4,
          lag: int = 128, **options) -> CacheTransform:
    """LagKV (Liang et al. 2025): score each partition of `lag` tokens against the next one.

    As kvpress LagKVPress(n_sink=sinks, lag_size=lag); see `LagKVScorer`.
    """
    check_int("lagkv", "sinks", sinks, 0)
    check_int("lagkv", "lag", lag, 1)
    return scored_policy("lagkv", LagKVScorer(sinks, lag), ratio=ratio, budget=budget, **options)


def cur(ratio: float | None = None, budget: int | None = None, sinks: int = 4,
        leverage_type: str = "kv_product", local_approximation: bool = True,
        local_window: int = 16, **options) -> CacheTransform:
    """CurDKV (Sengupta et al. 2025): approximate key and value leverage scores.

    As kvpress CURPress (without its random projection); see `CURScorer`.
    `leverage_type` is one of key, value, kv_avg, kv_product.
    """
    check_int("cur", "sinks", sinks, 0)
    check_int("cur", "local_window", local_window, 1)
    if leverage_type not in LEVERAGE_TYPES:
        raise ValueError(f"cur: leverage_type must be one of {', '.join(LEVERAGE_TYPES)}, "
                         f"got {leverage_type!r}")
    if not isinstance(local_approximation, bool):
        raise ValueError(f"cur: local_approximation must be true or false, "
                         f"got {local_approximation!r}")
    scorer = CURScorer(sinks, leverage_type, local_approximation, local_window)
    return scored_policy("cur", scorer, ratio=ratio, budget=budget, **options)



# ----------------------------------------------------------------------------- QFilter


def load_qfilters(path: str) -> np.ndarray:
    """[L, KVH, D] float32 `q_filters` of a `.npz` (what `calibrate_qfilters` saves)."""
    writer = "kvjax calibrate --qfilters --out PATH"
    filters = read_arrays("qfilter", "filters", path, ("q_filters",), writer).get("q_filters")
    if filters is None or filters.ndim != 3:
        raise ValueError(f"qfilter: {path} holds no q_filters [L, KVH, D] array (write it with "
                         f"`{writer}`)")
    if not np.isfinite(filters).all():
        raise ValueError(f"qfilter: {path}'s q_filters are not all finite")
    return filters


class PerLayer(ByContent):
    """A scorer holding constants per layer (`[L, ...]` arrays, compared by content):
    `for_layer(index, L)` checks the cache's layer count against the arrays' and gives layer
    `index`'s scorer (`layer_scorer`); calling the whole scorer is an error."""

    name = ""  # the method's name, for errors
    what = ""  # what the constants are, for errors
    per_layer = ()  # names of the [L, ...] fields

    def for_layer(self, index, num_layers: int):
        count = getattr(self, self.per_layer[0]).shape[0]
        if num_layers != count:
            raise ValueError(f"{self.name}: {self.what} for {count} layers, the cache has "
                             f"{num_layers}: calibrate them on this model")
        return functools.partial(self.layer_scores,
                                 *(jnp.asarray(getattr(self, f))[index] for f in self.per_layer))

    def layer_scores(self, *constants_then_scorer_args):
        raise NotImplementedError

    def __call__(self, layer, stats, budget, key):
        raise TypeError(f"{type(self).__name__} scores one layer at a time: call "
                        "for_layer(index, L) first")


def qfilter_scores(filters: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """Q-Filters: score = -(filter . k) per KV head, as kvpress QFilterPress.

    `filters` [KVH, D] is this layer's; keys are the cached (post-RoPE) ones. A pooled row
    serves every head, so each head scores the row's key with its own filter.
    """
    k = layer.k.astype(jnp.float32).reshape(layer.batch, -1, layer.capacity, layer.head_dim)
    scores = -(k * filters[None, :, None, :]).sum(-1)  # [B, 1|KVH, C, D] -> [B, KVH, C]
    return scores, no_protect(layer)


@dataclasses.dataclass(frozen=True, eq=False)
class QFilterScorer(PerLayer):
    """QFilter's scorer: one filter [KVH, D] per layer."""

    filters: np.ndarray  # [L, KVH, D] float32
    name, what, per_layer = "qfilter", "filters", ("filters",)

    def layer_scores(self, filters, layer, stats, budget, key):
        if filters.shape != (layer.kv_heads, layer.head_dim):
            raise ValueError(f"qfilter: filters of {filters.shape[0]} KV heads x {filters.shape[1]} "
                             f"dims, the cache has {layer.kv_heads} x {layer.head_dim}: calibrate "
                             "them on this model")
        return qfilter_scores(filters, layer)


def qfilter(ratio: float | None = None, budget: int | None = None, filters: str | None = None,
            **options) -> CacheTransform:
    """Q-Filters (Godey et al. 2025): keep the keys that project most on the queries' main
    direction.

    As kvpress QFilterPress given the same filters: score = -(q_filter . k). kvpress downloads
    filters from the hub; `kvjax calibrate --qfilters --out PATH` computes them with the
    paper's rule (`models.calibration.calibrate_qfilters`) and `filters=PATH` reads them.
    """
    if filters is None:
        raise ValueError("qfilter: needs filters=PATH, the .npz of per-(layer, KV head) filters "
                         "that `kvjax calibrate --qfilters --out PATH` writes")
    scorer = QFilterScorer(load_qfilters(filters))
    return scored_policy("qfilter", scorer, ratio=ratio, budget=budget, **options)


# ----------------------------------------------------------------------------- ExpectedAttention
# with calibrated query statistics


def load_query_stats(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(`query_mean` [L, H, D], `query_cov` [L, H, D, D]) float32 of a `.npz` (what
    `kvjax calibrate --query-stats` writes)."""
    found = read_arrays("expected_attention_stats", "stats", path, ("query_mean", "query_cov"),
                        "kvjax calibrate --query-stats --out PATH")
    mean, cov = found.get("query_mean"), found.get("query_cov")
    if mean is None or cov is None or mean.ndim != 3 or cov.shape != mean.shape + mean.shape[-1:]:
        raise ValueError(f"expected_attention_stats: {path} holds no query_mean [L, H, D] and "
                         "query_cov [L, H, D, D]")
    if not (np.isfinite(mean).all() and np.isfinite(cov).all()):
        raise ValueError(f"expected_attention_stats: {path}'s statistics are not all finite")
    return mean, cov


@dataclasses.dataclass(frozen=True, eq=False)
class ExpectedAttentionStatsScorer(PerLayer):
    """ExpectedAttention with each layer's calibrated query mean and covariance in place of the
    prompt's."""

    base: object  # eviction.ExpectedAttentionScorer: n_future, sinks, covariance, vnorm, epsilon
    mean: np.ndarray  # [L, H, D]
    cov: np.ndarray  # [L, H, D, D]
    name, what, per_layer = "expected_attention_stats", "statistics", ("mean", "cov")

    def layer_scores(self, mean, cov, layer, stats, budget, key):
        h, d = mean.shape
        heads = None if stats is None else stats.queries.shape[2]  # the model's query heads
        if d != layer.head_dim or h % layer.kv_heads or heads not in (None, h):
            raise ValueError(f"expected_attention_stats: statistics of {h} query heads x {d} "
                             f"dims, the model has {heads} query heads, {layer.kv_heads} KV "
                             f"heads x {layer.head_dim}: calibrate them on this model")
        b = layer.batch
        return self.base.scores(layer, stats, jnp.broadcast_to(mean, (b,) + mean.shape),
                                jnp.broadcast_to(cov, (b,) + cov.shape))


def expected_attention_stats(ratio: float | None = None, budget: int | None = None,
                             stats: str | None = None, n_future: int = 512, sinks: int = 4,
                             use_covariance: bool = True, use_vnorm: bool = True,
                             epsilon: float = 0.0, **options) -> CacheTransform:
    """ExpectedAttention with query statistics calibrated beforehand (kvpress
    ExpectedAttentionStatsPress): each layer's pre-RoPE query mean and covariance come from
    `stats=PATH` (`kvjax calibrate --query-stats --out PATH`), not from the prompt.
    """
    from kvjax.core.stats import StatsSpec
    from kvjax.policies.eviction import ExpectedAttentionScorer, check_real

    check_int("expected_attention_stats", "n_future", n_future)
    check_int("expected_attention_stats", "sinks", sinks, 0)
    check_real("expected_attention_stats", "epsilon", epsilon, 0.0)
    if stats is None:
        raise ValueError("expected_attention_stats: needs stats=PATH, the .npz of query "
                         "statistics `kvjax calibrate --query-stats --out PATH` writes")
    base = ExpectedAttentionScorer(n_future, sinks, bool(use_covariance), bool(use_vnorm),
                                   float(epsilon))
    scorer = ExpectedAttentionStatsScorer(base, *load_query_stats(stats))
    # window=1: the model's RoPE frequencies ride along with the statistics (nothing else read)
    return scored_policy("expected_attention_stats", scorer, ratio=ratio, budget=budget,
                         stats=StatsSpec(window=1), **options)
