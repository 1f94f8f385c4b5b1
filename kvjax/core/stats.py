"""Statistics the model collects for cache policies, passed to `CacheTransform.update`.

Scoring policies need more than the cache: SnapKV and TOVA score slots by
the attention of the latest queries, ExpectedAttention by the mean and
covariance of the queries seen so far, H2O by the attention each slot has
received. A policy declares what it needs in a `StatsSpec`; the model fills
one `LayerStats` per layer while it runs (prefill chunk by chunk, then every
decode step), so no statistic ever needs a `T x T` matrix:

* `window`: the post-RoPE queries of the last `window` tokens and their
  positions (a rolling buffer).
* `chunk_length` (with `window`): also the post-RoPE queries of the last
  `window` positions of every whole chunk of `chunk_length` positions
  (`LayerStats.chunk_queries`), for a method that scores each chunk by its
  own window (ChunkPress around SnapKV or TOVA).
* `query_moments`: running sums of the pre-RoPE queries and of their outer
  products, over tokens at positions `>= moments_skip`, with the model's RoPE
  frequencies (to rotate the statistics to future positions).
* `attention_mass`: not here but in the cache (`TokenCache.mass`), because it
  belongs to slots and must move with them when a policy compacts the cache.
* `output_projection`: the layer's attention output projection `W_o`
  ([H*D, hidden], the model's own weight, not a copy), for scorers that weigh
  a value by what it adds to the layer's output (CriticalKV's `||V W_o||_1`).
* `reconstruction`: a pass the model runs once after prefill, feeding the
  context again behind a "repeat" prompt (KVzip); each slot's score from it
  arrives as `LayerStats.position_scores` (`models.reconstruction` runs it,
  `kvjax.policies.eviction_kvzip` says what it is).
* `token_scores`: a small model of each token's attention input (KVzap's
  surrogate, `kvjax.policies.eviction_kvzap`) scores every token as it enters,
  prefill and decode alike; its scores arrive by position in
  `LayerStats.position_scores` [B, KVH, P], P the capacity the statistics were
  made for (positions past it are not scored).

Example:
    >>> from flax import nnx
    >>> from kvjax import init_model_cache
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))   # 4 query heads of 16
    >>> cache = init_model_cache(model.config.cache_spec, batch=1, capacity=16)
    >>> spec = StatsSpec(window=4)
    >>> stats = model.init_stats(spec, cache)   # init_stats(spec, cache, 4, inv_freq)
    >>> tokens = jnp.arange(8)[None]             # 8 tokens at positions 0..7
    >>> h, cache, stats = model.forward(tokens, tokens, cache, stats, spec)
    >>> stats[0].queries.shape, stats[0].query_pos.tolist()   # [B, window, H, D]: the last 4
    ((1, 4, 4, 16), [[4, 5, 6, 7]])
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.attention import attention_mass
from kvjax.core.cache import EMPTY, Layer, TokenCache


@dataclasses.dataclass(frozen=True)
class StatsSpec:
    """What a policy needs the model to collect (hashable: it keys compilation)."""

    window: int = 0  # keep the post-RoPE queries of the last `window` tokens
    query_moments: bool = False  # running mean / covariance of pre-RoPE queries
    moments_skip: int = 0  # positions below this are left out of the moments (sinks)
    attention_mass: bool = False  # the cache accumulates attention per slot
    output_projection: bool = False  # each layer's W_o [H*D, hidden] rides along (CriticalKV)
    reconstruction: Any = None  # a hashable request for a pass after prefill (KVzip), or None
    token_scores: Any = None  # a hashable per-token scorer (`TokenScorer`), or None
    chunk_length: int = 0  # also keep each whole chunk's last `window` queries (0: no)

    def __post_init__(self):
        if self.window < 0 or self.moments_skip < 0 or self.chunk_length < 0:
            raise ValueError(f"StatsSpec: window, moments_skip and chunk_length must be >= 0, "
                             f"got {self}")
        if self.chunk_length and not 0 < self.window < self.chunk_length:
            raise ValueError(f"StatsSpec: chunk_length={self.chunk_length} keeps each chunk's "
                             f"last `window` queries: window must be in [1, chunk_length), "
                             f"got {self.window}")
        if self.reconstruction is not None and self.token_scores is not None:
            raise ValueError("StatsSpec: a reconstruction pass (KVzip) and a token scorer "
                             "(KVzap) both write position_scores; a chain may use one of them")

    @property
    def needed(self) -> bool:
        return bool(self.window or self.query_moments or self.attention_mass
                    or self.output_projection or self.reconstruction is not None
                    or self.token_scores is not None)

    def merge(self, other: "StatsSpec") -> "StatsSpec":
        """The union of two needs (the larger window; moments must skip alike)."""
        if self.query_moments and other.query_moments and self.moments_skip != other.moments_skip:
            raise ValueError("StatsSpec.merge: two policies want query moments skipping "
                             f"{self.moments_skip} and {other.moments_skip} positions")
        if None not in (self.reconstruction, other.reconstruction) and \
                self.reconstruction != other.reconstruction:
            raise ValueError("StatsSpec.merge: two policies want different reconstruction "
                             f"passes, {self.reconstruction} and {other.reconstruction}")
        if None not in (self.token_scores, other.token_scores) and \
                self.token_scores != other.token_scores:
            raise ValueError("StatsSpec.merge: two policies want different token scorers")
        if self.chunk_length and other.chunk_length and (
                self.chunk_length, self.window) != (other.chunk_length, other.window):
            raise ValueError("StatsSpec.merge: two policies want the windows of chunks of "
                             f"{self.chunk_length} and {other.chunk_length} positions (windows "
                             f"{self.window} and {other.window})")
        return StatsSpec(
            window=max(self.window, other.window),
            query_moments=self.query_moments or other.query_moments,
            moments_skip=self.moments_skip if self.query_moments else other.moments_skip,
            attention_mass=self.attention_mass or other.attention_mass,
            output_projection=self.output_projection or other.output_projection,
            reconstruction=(self.reconstruction if self.reconstruction is not None
                            else other.reconstruction),
            token_scores=(self.token_scores if self.token_scores is not None
                          else other.token_scores),
            chunk_length=self.chunk_length or other.chunk_length)

    @property
    def per_step(self) -> bool:
        """True when the model fills `LayerStats` for this spec (attention mass lives in the
        cache and a reconstruction pass runs after prefill: neither needs them)."""
        return bool(self.window or self.query_moments or self.output_projection
                    or self.token_scores is not None)


NO_STATS = StatsSpec()


def can_project(collected: StatsSpec, spec: StatsSpec) -> bool:
    """True when `project_stats` and `project_cache` can cut what a run collecting `spec` holds
    from what a run collecting `collected` made: `spec`'s window no longer, its moments
    skipping alike, attention mass only if tracked (the cache's `mass`, dropped for a method
    that does not ask), and a later pass or per-token scorer (reconstruction, token scorer,
    chunk windows) the same in both.

    Example:
        >>> can_project(StatsSpec(window=64, query_moments=True), StatsSpec(window=1))
        True
        >>> can_project(StatsSpec(window=64, attention_mass=True), StatsSpec())  # mass dropped
        True
        >>> can_project(StatsSpec(window=64), StatsSpec(attention_mass=True))  # H2O's mass
        False
    """
    return (spec.window <= collected.window
            and (not spec.query_moments or (collected.query_moments
                                            and collected.moments_skip == spec.moments_skip))
            and (not spec.output_projection or collected.output_projection)
            and (not spec.attention_mass or collected.attention_mass)
            and (spec.reconstruction, spec.token_scores, spec.chunk_length)
            == (collected.reconstruction, collected.token_scores, collected.chunk_length)
            and (not spec.chunk_length or spec.window == collected.window))


def project_cache(cache: Sequence[Layer], collected: StatsSpec, spec: StatsSpec) -> tuple:
    """A prefilled cache as a run collecting `spec` would hold it, from one collecting
    `collected` (`can_project`): the attention mass dropped unless `spec` tracks it. Keys,
    values and positions are the same arrays (tracking mass adds a sum beside attention and
    changes neither: `tests/test_stats.py`)."""
    if not can_project(collected, spec):
        raise ValueError(f"project_cache: a cache collected for {collected} cannot serve "
                         f"{spec} (can_project)")
    if spec.attention_mass or not collected.attention_mass:
        return tuple(cache)
    return tuple(layer.map_parts(lambda part: part.replace(mass=None)) for layer in cache)


def covering(a: StatsSpec, b: StatsSpec) -> StatsSpec | None:
    """The union of `a` and `b` when the statistics of both can be cut from it
    (`can_project`), else None: one prefill collecting it serves both."""
    try:
        union = a.merge(b)
    except ValueError:
        return None
    return union if can_project(union, a) and can_project(union, b) else None


def project_stats(stats: Sequence[LayerStats] | None, collected: StatsSpec,
                  spec: StatsSpec) -> tuple[LayerStats, ...] | None:
    """The statistics a run collecting `spec` would hold, cut from `stats`, which a run
    collecting `collected` made (`can_project(collected, spec)`): the last `spec.window` of
    the window queries (the buffer keeps the latest last), the moments only if `spec` asks
    for them, W_o only if it does. The same values, not recomputed: one prefill collecting
    the union of several policies' needs serves each as its own would
    (`experiments/eval/cells.py` prefills a grid's contexts once so).

    Example:
        >>> from kvjax.core.cache import init_cache
        >>> layer = init_stats(StatsSpec(window=4, query_moments=True),
        ...                    [init_cache(1, 2, 16, 8)], 2, np.ones(4))[0]   # 2 query heads
        >>> cut, = project_stats([layer], StatsSpec(window=4, query_moments=True),
        ...                      StatsSpec(window=1))
        >>> cut.queries.shape, cut.q_sum.shape   # [B, 1, H, D]; no moments
        ((1, 1, 2, 8), (1, 2, 0))
    """
    if not can_project(collected, spec):
        raise ValueError(f"project_stats: the statistics of {spec} cannot be cut from those "
                         f"collected for {collected} (can_project)")
    if not spec.per_step:
        return None
    if spec == collected:
        return tuple(stats)

    def cut(layer: LayerStats) -> LayerStats:
        b, h = layer.q_sum.shape[:2]
        start = collected.window - spec.window
        layer = layer._replace(queries=layer.queries[:, start:],
                               query_pos=layer.query_pos[:, start:])
        if not spec.query_moments:
            layer = layer._replace(q_sum=jnp.zeros((b, h, 0), jnp.float32),
                                   q_outer=jnp.zeros((b, h, 0, 0), jnp.float32),
                                   q_count=jnp.zeros((b,), jnp.float32))
        if not spec.output_projection:
            layer = layer._replace(out_proj=jnp.zeros((0, 0), jnp.float32))
        return layer
    return tuple(map(cut, stats))


class LayerStats(NamedTuple):
    """One layer's statistics; a field that was not requested has a zero-sized axis."""

    queries: jax.Array  # [B, W, H, D] float32 post-RoPE queries of the last W tokens
    query_pos: jax.Array  # [B, W] int32 their positions, EMPTY where fewer tokens exist
    q_sum: jax.Array  # [B, H, D'] float32 sum of pre-RoPE queries (D' = D or 0)
    q_outer: jax.Array  # [B, H, D', D'] float32 sum of their outer products
    q_count: jax.Array  # [B] float32 tokens in the sums
    inv_freq: jax.Array  # [D/2] float32 the model's RoPE inverse frequencies
    out_proj: jax.Array  # [H*D, hidden] the layer's attention output projection W_o (or [0, 0])
    position_scores: Any = None  # [B, KVH, P] float32 a reconstruction pass's or a token
    #                              scorer's score of the token at position p (< P), or None
    scorer: Any = None  # the token scorer's parameters for this layer (arrays), or None
    chunk_queries: Any = None  # [B, P // N, W, H, D] float32 post-RoPE queries of positions
    #                            c N + N - W + j of each whole chunk c of N = chunk_length, or None


class TokenScorer(Protocol):
    """What `StatsSpec.token_scores` holds: hashable (it keys compilation), with one
    layer's parameters and the rule that scores a step's tokens from their attention input."""

    def layer_params(self, index: int) -> Any: ...  # arrays: they ride in `LayerStats.scorer`

    def apply(self, params: Any, inputs: jax.Array) -> jax.Array: ...  # [B, T, hidden] -> [B, T, KVH]

    def check_model(self, num_layers: int, hidden_size: int, kv_heads: int) -> None: ...


def rope_inv_freq(stats: LayerStats, who: str) -> jax.Array:
    """`stats.inv_freq` for `who`, a policy that undoes or redoes RoPE; a ValueError naming it
    when the model has no one set of frequencies (LongRoPE's short and long factors, chosen
    per call by the context length: its keys may carry either)."""
    if stats.inv_freq.shape[0] == 0:
        raise ValueError(f"{who} needs the model's RoPE frequencies, and this model's change "
                         f"with the context (rope_scaling 'longrope'): use a method that does "
                         f"not undo or redo RoPE")
    return stats.inv_freq


def init_stats(spec: StatsSpec, cache: Sequence[TokenCache], num_heads: int,
               inv_freq: np.ndarray, out_proj: Sequence[jax.Array] | None = None
               ) -> tuple[LayerStats, ...]:
    """Empty statistics for every layer of `cache`.

    `out_proj`: per layer, its attention output projection `W_o` [H*D, hidden] (the
    model's weight, in its dtype); needed when `spec.output_projection`, ignored otherwise.
    A `spec.token_scores` gets each layer its parameters and zero `position_scores`
    [B, KVH, P], P the largest layer capacity (a prefill's: prompt plus room).
    """
    if spec.output_projection and (out_proj is None or len(out_proj) != len(cache)):
        raise ValueError(f"init_stats: spec.output_projection needs out_proj, one W_o "
                         f"[H*D, hidden] per layer ({len(cache)}); got "
                         f"{None if out_proj is None else len(out_proj)}")
    layer = cache[0]
    b, d = layer.batch, layer.head_dim
    dm = d if spec.query_moments else 0
    empty = LayerStats(
        queries=jnp.zeros((b, spec.window, num_heads, d), jnp.float32),
        query_pos=jnp.full((b, spec.window), EMPTY, jnp.int32),
        q_sum=jnp.zeros((b, num_heads, dm), jnp.float32),
        q_outer=jnp.zeros((b, num_heads, dm, dm), jnp.float32),
        q_count=jnp.zeros((b,), jnp.float32),
        inv_freq=jnp.asarray(inv_freq, jnp.float32),
        out_proj=jnp.zeros((0, 0), jnp.float32))
    stats = [empty._replace(out_proj=w) for w in out_proj] if spec.output_projection else \
        [empty for _ in cache]
    if spec.chunk_length:
        chunks = max(layer.capacity for layer in cache) // spec.chunk_length
        zeros = jnp.zeros((b, chunks, spec.window, num_heads, d), jnp.float32)
        stats = [s._replace(chunk_queries=zeros) for s in stats]
    if spec.token_scores is not None:
        p = max(layer.capacity for layer in cache)
        zeros = jnp.zeros((b, layer.kv_heads, p), jnp.float32)
        stats = [s._replace(position_scores=zeros, scorer=spec.token_scores.layer_params(i))
                 for i, s in enumerate(stats)]
    return tuple(stats)


def observe(spec: StatsSpec, stats: LayerStats, q_pre: jax.Array, q: jax.Array,
            positions: jax.Array, inputs: jax.Array | None = None) -> LayerStats:
    """Fold one step's queries (and, for a token scorer, its attention inputs
    `inputs` [B, T, hidden]) into a layer's statistics.

    Args:
      q_pre: [B, T, H, D] queries before RoPE; q: the same after RoPE.
      positions: [B, T] int32, negative on padding tokens (ignored).
    """
    if spec.window:
        w = spec.window
        pos = jnp.where(positions < 0, EMPTY, positions).astype(jnp.int32)
        queries = jnp.concatenate([stats.queries, q.astype(jnp.float32)], axis=1)[:, -w:]
        query_pos = jnp.concatenate([stats.query_pos, pos], axis=1)[:, -w:]
        stats = stats._replace(queries=queries, query_pos=query_pos)
    if spec.chunk_length:
        stats = stats._replace(chunk_queries=observe_chunk_windows(
            stats.chunk_queries, q, positions, spec.chunk_length))
    if spec.query_moments:
        use = (positions >= spec.moments_skip).astype(jnp.float32)  # [B, T]
        x = q_pre.astype(jnp.float32) * use[:, :, None, None]
        stats = stats._replace(
            q_sum=stats.q_sum + x.sum(axis=1),
            q_outer=stats.q_outer + jnp.einsum("bthi,bthj->bhij", x, x),
            q_count=stats.q_count + use.sum(axis=1))
    if spec.token_scores is not None:
        if inputs is None or stats.scorer is None:
            raise ValueError("a token scorer (kvzap, fastkvzip) reads each token's attention "
                             "input: the model must make its statistics with the scorer's "
                             "parameters and pass observe(..., inputs=[B, T, hidden]); kvjax's "
                             "decoder (models.llama) does")
        scores = spec.token_scores.apply(stats.scorer, inputs).astype(jnp.float32)  # [B, T, KVH]
        stats = stats._replace(position_scores=scatter_by_position(
            stats.position_scores, scores.transpose(0, 2, 1), positions))
    return stats


def observe_chunk_windows(table: jax.Array, q: jax.Array, positions: jax.Array,
                          chunk_length: int) -> jax.Array:
    """`table` [B, NC, W, H, D] with the queries `q` [B, T, H, D] of positions `positions`
    [B, T] that are among the last W of their chunk of `chunk_length` written in (positions of
    chunk NC and later, and padding, are dropped).

    Example (chunks of 4 positions, the last 2 of each kept; position p's query is p):
        >>> q = jnp.arange(10, dtype=jnp.float32).reshape(1, 10, 1, 1)
        >>> t = observe_chunk_windows(jnp.zeros((1, 2, 2, 1, 1)), q, jnp.arange(10)[None], 4)
        >>> t[0, :, :, 0, 0].tolist()   # chunk 0: positions 2, 3; chunk 1: 6, 7
        [[2.0, 3.0], [6.0, 7.0]]
    """
    b, chunks, w = table.shape[:3]
    chunk, offset = positions // chunk_length, positions % chunk_length - (chunk_length - w)
    inside = (positions >= 0) & (offset >= 0)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
    return table.at[rows, jnp.where(inside, chunk, chunks), jnp.where(inside, offset, 0)].set(
        q.astype(jnp.float32), mode="drop")


def scatter_by_position(table: jax.Array, scores: jax.Array, positions: jax.Array) -> jax.Array:
    """`table` [B, KVH, P] with `scores` [B, KVH, T] written at `positions` [B, T] (a
    negative position, padding, or one past P is dropped).

    Example:
        >>> table = jnp.zeros((1, 1, 4))
        >>> scatter_by_position(table, jnp.array([[[5., 6., 7.]]]), jnp.array([[-1, 2, 9]])).tolist()
        [[[0.0, 0.0, 6.0, 0.0]]]
    """
    b, kvh, p = table.shape
    where = jnp.where(positions >= 0, positions, p)[:, None, :]  # [B, 1, T]
    rows = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]
    return table.at[(*rows, where)].set(scores, mode="drop")


def accumulate_mass(cache: Layer, q: jax.Array, positions: jax.Array) -> Layer:
    """Add the attention that queries `q` [B, T, H, D] pay to each slot to `cache.mass`."""
    if cache.mass is None:
        return cache
    added = attention_mass(q, positions, cache)  # [B, KVH, C] (body then recent slots)
    return cache.map_parts(lambda part, more: part.replace(mass=part.mass + more), added)


def query_mean_cov(stats: LayerStats) -> tuple[jax.Array, jax.Array]:
    """Mean [B, H, D] and population covariance [B, H, D, D] of the observed pre-RoPE queries."""
    n = jnp.maximum(stats.q_count, 1.0)[:, None, None]
    mean = stats.q_sum / n
    cov = stats.q_outer / n[..., None] - mean[..., :, None] * mean[..., None, :]
    return mean, cov


def mean_rotation(inv_freq: jax.Array, start: jax.Array, count: int) -> jax.Array:
    """[B, D, D] the RoPE rotation (rotate-half convention) averaged over positions
    `start[b] .. start[b] + count - 1`: the expected rotation of a future query."""
    pos = start[:, None].astype(jnp.float32) + jnp.arange(count, dtype=jnp.float32)  # [B, N]
    angles = pos[..., None] * inv_freq  # [B, N, D/2]
    c, s = jnp.cos(angles).mean(axis=1), jnp.sin(angles).mean(axis=1)  # [B, D/2]
    eye = jnp.eye(inv_freq.shape[0], dtype=jnp.float32)
    block = lambda x: x[:, :, None] * eye  # [B, D/2, D/2] diagonal
    top = jnp.concatenate([block(c), -block(s)], axis=2)
    bottom = jnp.concatenate([block(s), block(c)], axis=2)
    return jnp.concatenate([top, bottom], axis=1)
