"""Wrapper presses: methods that take another scored method (kvpress 0.5.5's wrappers).

* `block` (kvpress BlockPress): compress block by block, as a prompt read in
  blocks would be: start from the first `budget` tokens, then for each next
  block of `block_size` tokens score the kept tokens plus the block with the
  inner scorer (it sees only those tokens) and keep the best `budget`.
* `chunkkv` (kvpress ChunkKVPress): keep whole chunks of `chunk_length`
  tokens, the same chunks in every KV head, ranked by the inner scores
  summed over heads and averaged over the chunk.
* `dms` (kvpress DMSPress): no budget but a threshold on the inner scores;
  the newest `window` tokens of each row always stay.
* `chunk` (kvpress ChunkPress): each chunk of `chunk_length` tokens scored by
  the inner method on its own and compressed by the ratio, so the kept tokens
  spread evenly over the context.

The inner method is a scored-policy factory (`kvjax.keydiff`...; in a spec
string its registered name, `block:inner=keydiff`) and runs at its defaults.

Example:
    >>> t = block(inner=keydiff, ratio=0.5)     # the KeyDiff paper's block-wise prefill
    >>> t.update.scorer.block_size
    128
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, Cache, view
from kvjax.core.layer import is_plain
from kvjax.policies.eviction import (Scorer, ScoredUpdate, _check_budget, check_int, check_real,
                                     evict_layers, knorm, scored_policy, snapkv)
from kvjax.policies.eviction_geometry import keydiff
from kvjax.policies.eviction_sequence import gather, in_sequence, to_slots
from kvjax.core.layout import compact, pool_heads
from kvjax.core.selection import BudgetState, init_budget, layer_budgets, rank
from kvjax.core.stats import StatsSpec, rope_inv_freq
from kvjax.core.transforms import CacheTransform, EmptyState


def inner_scorer(factory, wrapper: str, ratio: float | None) -> tuple[Scorer, StatsSpec]:
    """(scorer, stats) of the scored-policy `factory` at its defaults (and the wrapper's
    ratio, for scorers that depend on it: Compactor's blending)."""
    name = getattr(factory, "__name__", repr(factory))
    if not callable(factory):
        raise ValueError(f"{wrapper}: inner={factory!r} is not a method; give a scored policy "
                         f"such as inner=keydiff")
    try:
        transform = factory(ratio=0.5 if ratio is None else ratio)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{wrapper}: inner={name} takes no ratio, so it is not a scored "
                         f"policy ({e})") from None
    if not isinstance(transform.update, ScoredUpdate) or transform.update.headwise:
        raise ValueError(f"{wrapper}: inner={name} is not a per-head scored policy")
    if hasattr(transform.update.scorer, "for_layer"):
        raise ValueError(f"{wrapper}: inner={name} scores with per-layer constants (a "
                         "calibrated file), which a wrapper cannot index; use it on its own")
    return transform.update.scorer, transform.stats


def _keep_best(scores, protect, valid, budget) -> jax.Array:
    """[B, KVH, C] the `budget` [B, KVH] best valid slots, protected ones first."""
    scores = jnp.where(protect, jnp.inf, scores.astype(jnp.float32))
    return (rank(scores, valid) < budget[..., None]) & valid


@dataclasses.dataclass(frozen=True)
class BlockScorer:
    """BlockPress around `inner`: iterative block-wise selection; scores 1 = kept, 0 = not."""

    inner: Scorer
    block_size: int = 128

    def __call__(self, layer, stats, budget, key):
        seq = in_sequence(layer)
        b, kvh, c = seq.order.shape
        i = jnp.arange(c)[None, None]  # token index
        n_kept = jnp.minimum(budget.reshape(-1, 1), seq.n)  # [B, KVH]
        kept = seq.valid & (i < n_kept[..., None])  # the first n_kept tokens

        def step(s, kept):
            lo = n_kept + s * self.block_size
            block = seq.valid & (i >= lo[..., None]) & (i < lo[..., None] + self.block_size)
            current = kept | block  # token order
            sub = layer.replace(pos=to_slots(seq, jnp.where(current, seq.pos, EMPTY)))
            scores, protect = self.inner(sub, stats, budget, key)
            keep = _keep_best(scores, protect, sub.pos != EMPTY, n_kept)  # slots
            return gather(seq, keep[..., None])[..., 0]

        steps = -(-c // self.block_size)
        kept = jax.lax.fori_loop(0, steps, step, kept)
        return to_slots(seq, kept.astype(jnp.float32)), jnp.zeros(seq.valid.shape, bool)


def block(inner=keydiff, ratio: float | None = None, budget: int | None = None,
          block_size: int = 128, **options) -> CacheTransform:
    """BlockPress (KeyDiff paper, Park et al. 2025): compress block by block with `inner`.

    As kvpress BlockPress(press=INNER(compression_ratio=ratio), block_size).
    kvpress hands the kept tokens to the next block's scoring in score order;
    kvjax in position order: scorers that read neighbours (LagKV, CUR, SnapKV's
    window) differ there, order-free ones (KeyDiff, Knorm) do not.
    """
    check_int("block", "block_size", block_size, 1)
    scorer, stats = inner_scorer(inner, "block", ratio)
    return scored_policy("block", BlockScorer(scorer, block_size), ratio=ratio, budget=budget,
                         stats=stats, **options)


# ----------------------------------------------------------------------------- ChunkKV


def _press_scores(scores: jax.Array, protect: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, KVH, C] scores as a kvpress press returns them: protected slots (SnapKV's window)
    at the row's largest unprotected score over all heads + 1."""
    free = valid & ~protect
    top = jnp.max(jnp.where(free, scores, -jnp.inf), axis=(1, 2), keepdims=True)
    return jnp.where(protect, top + 1, scores)


def press_in_order(seq, scores: jax.Array, protect: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, KVH, T] the inner scores as kvpress presses return them (`_press_scores`), moved
    to token order (`seq = in_sequence(layer)`), zero past each row's tokens."""
    press = _press_scores(jnp.where(valid, scores.astype(jnp.float32), 0.0), protect, valid)
    return jnp.where(seq.valid, gather(seq, press[..., None])[..., 0], 0.0)


def chunk_keep(scores: jax.Array, n: jax.Array, chunk: int, n_chunks: jax.Array) -> jax.Array:
    """[B, C] bool in token order: the `n_chunks` [B] best chunks of `chunk` tokens.

    Args:
      scores: [B, KVH, C] press scores in token order (zero past `n`).
      n: [B] tokens per row. Chunks start at token 0; the last, partial chunk
        (`n % chunk` tokens) competes with the mean of its own tokens.
    """
    b, _, c = scores.shape
    width = -(-c // chunk) * chunk
    summed = jnp.pad(scores.sum(axis=1), ((0, 0), (0, width - c))).reshape(b, -1, chunk)
    i = jnp.arange(width).reshape(-1, chunk)  # [NC, chunk] token index
    inside = (i[None] < n[:, None, None]).astype(jnp.float32)  # [B, NC, chunk]
    count = inside.sum(-1)
    means = jnp.where(count > 0, (summed * inside).sum(-1) / jnp.maximum(count, 1), -jnp.inf)
    chosen = rank(means, count > 0) < n_chunks[:, None]  # [B, NC]
    return jnp.repeat(chosen, chunk, axis=1)[:, :c] & (jnp.arange(c)[None] < n[:, None])


@dataclasses.dataclass(frozen=True)
class ChunkKVUpdate:
    """The `update` of `chunkkv`: whole chunks kept, their number set by the ratio.

    First update: `max(1, floor(chunks * (1 - ratio)))` chunks (kvpress's
    rule; with a token `budget`, `max(1, budget // chunk_length)`), so the
    kept count is a multiple of the chunk (plus the partial chunk when it
    wins), not `n * (1 - ratio)`. Later updates keep `kept // chunk_length`
    chunks of what the row holds then. Rows shorter than one chunk fall back to
    the inner scorer's own top-k, as kvpress does.
    """

    scorer: Scorer
    chunk_length: int = 20

    def __call__(self, cache, state: BudgetState, stats=None):
        budgets = layer_budgets(state, cache, "uniform", 64, 20.0)  # [L, B] n_kept
        first = state.layer_budget[0] < 0  # [B]
        ratio = state.ratio

        def evict(layer, layer_stats, budget, index):
            seen = view(layer)
            key = jax.random.fold_in(state.key, index)
            scores, protect = self.scorer(seen, layer_stats, budget, key)
            valid = seen.pos != EMPTY
            seq = in_sequence(seen)
            press = press_in_order(seq, scores, protect, valid)
            n = seq.n[:, 0]  # [B] (every head holds the same tokens)
            chunks = -(-n // self.chunk_length)
            by_ratio = jnp.floor(chunks.astype(jnp.float32) * (1 - ratio)).astype(jnp.int32)
            n_chunks = jnp.where(first & (ratio >= 0), by_ratio, budget // self.chunk_length)
            keep = jnp.broadcast_to(chunk_keep(press, n, self.chunk_length,
                                               jnp.maximum(n_chunks, 1))[:, None], seq.valid.shape)
            keep = to_slots(seq, keep)
            top = (rank(jnp.where(protect, jnp.inf, scores), valid) < budget[:, None, None])
            short = (n < self.chunk_length)[:, None, None]
            keep = jnp.where(short, top, keep) & valid
            kept = jnp.max(jnp.sum(keep, axis=-1), axis=-1).astype(jnp.int32)  # [B]
            return compact(layer, keep), kept

        return evict_chunks(evict, cache, stats, budgets, state)


def evict_chunks(evict, cache, stats, budgets, state: BudgetState):
    """`evict(...) -> (layer, kept [B])` on every layer (`evict_layers`); a layer's first
    compression sets its budget to the tokens it kept (whole chunks: not the ratio's count),
    which later compressions (`compress_every`) hold."""
    out = evict_layers(evict, cache, stats, budgets)
    kept = jnp.stack([o[1] for o in out])  # [L, B]
    return tuple(o[0] for o in out), state._replace(
        layer_budget=jnp.where(state.layer_budget < 0, kept, state.layer_budget))


def chunkkv(inner=snapkv, ratio: float | None = None, budget: int | None = None,
            chunk_length: int = 20, seed: int = 0) -> CacheTransform:
    """ChunkKV (Liu et al. 2025): keep whole chunks, ranked by the inner method's scores.

    As kvpress ChunkKVPress(press=INNER(compression_ratio=ratio),
    chunk_length): the inner scores (protected slots at the row's maximum + 1,
    as kvpress presses return them) summed over KV heads and averaged over
    each chunk of `chunk_length` tokens; the best chunks are kept in every
    head. kvpress picks batch row 0's chunks for every row; kvjax each row's own.
    """
    check_int("chunkkv", "chunk_length", chunk_length, 1)
    check_int("chunkkv", "seed", seed, 0)
    _check_budget("chunkkv", ratio, budget)
    scorer, stats = inner_scorer(inner, "chunkkv", ratio)
    return CacheTransform(functools.partial(init_budget, ratio, budget, seed),
                          ChunkKVUpdate(scorer, chunk_length), stats)


# ----------------------------------------------------------------------------- ChunkPress


def each_chunk_keep(inner: Scorer, layer, stats, key, ratio: jax.Array,
               chunk_length: int) -> jax.Array:
    """[B, KVH, C] what ChunkPress keeps: each chunk of `chunk_length` positions (positions
    `[c L, (c + 1) L)`) scored by `inner` as if it were the whole cache (its other slots
    hidden), and its `max(1, floor(n_c (1 - ratio)))` best tokens kept per KV head (n_c: the
    chunk's tokens).

    Example:
        >>> import jax, jax.numpy as jnp, kvjax
        >>> from kvjax.policies.eviction import knorm_scores
        >>> k = jnp.array([3., 1., 2., 5., 4., 0.5, 6.])[None, :, None] * jnp.ones((1, 1, 2))
        >>> layer = kvjax.write(kvjax.init_cache(batch=1, kv_heads=1, capacity=7, head_dim=2),
        ...                     k[:, None], k[:, None], jnp.arange(7)[None])
        >>> ratio = jnp.float32(0.5)
        >>> keep = each_chunk_keep(knorm_scores, layer, None, jax.random.key(0), ratio, 3)
        >>> keep[0, 0].astype(int).tolist()   # chunks [0, 3), [3, 6), [6]: the smallest keys
        [0, 1, 0, 0, 0, 1, 1]
    """
    pos = layer.pos
    valid = pos != EMPTY
    chunk = jnp.where(valid, pos // chunk_length, -1)
    seen = jnp.max(pos, axis=(1, 2)) + 1  # [B] the row's tokens

    def one_chunk(c, keep):
        in_chunk = chunk == c
        n = jnp.sum(in_chunk, axis=-1)  # [B, KVH]
        kept = jnp.where(n > 0, jnp.maximum(1, jnp.floor(n * (1 - ratio)).astype(jnp.int32)),
                         0)
        sub = layer.replace(pos=jnp.where(in_chunk, pos, EMPTY))
        own = chunk_window(stats, c, seen, chunk_length)
        scores, protect = inner(sub, own, jnp.max(kept, axis=1), key)
        return keep | _keep_best(scores, protect, in_chunk, kept)

    return jax.lax.fori_loop(0, jnp.max(chunk) + 1, one_chunk, jnp.zeros_like(valid))


def chunk_window(stats, c: jax.Array, seen: jax.Array, chunk_length: int):
    """`stats` with chunk `c`'s own window in `queries` / `query_pos`, as kvpress's ChunkPress
    hands its inner press the chunk's hidden states: the queries of the chunk's last W
    positions, RoPE-rotated at the sequence's last W positions (kvpress rotates every chunk's
    window with the prompt's position embeddings, `cos[:, -W:]`), i.e. the post-RoPE queries
    turned on by `seen - (c + 1) N` positions; the positions stay the queries' own (the causal
    mask within the chunk). The row's last chunk (`seen` [B] tokens) is the rolling window
    itself. Without `chunk_queries` (a key-only inner), `stats` as they are."""
    if stats is None or stats.chunk_queries is None:
        return stats
    w = stats.queries.shape[1]
    own = jax.lax.dynamic_index_in_dim(stats.chunk_queries, c, axis=1, keepdims=False)
    shift = jnp.broadcast_to((seen - (c + 1) * chunk_length)[:, None, None], (own.shape[0], 1, w))
    turned = rotate(own.transpose(0, 2, 1, 3), shift, rope_inv_freq(stats, "chunk"))
    own_pos = c * chunk_length + chunk_length - w + jnp.arange(w, dtype=jnp.int32)
    last = (c >= (seen - 1) // chunk_length)[:, None]  # [B, 1]
    return stats._replace(
        queries=jnp.where(last[:, :, None, None], stats.queries, turned.transpose(0, 2, 1, 3)),
        query_pos=jnp.where(last, stats.query_pos, own_pos[None]))


@dataclasses.dataclass(frozen=True)
class ChunkUpdate:
    """`chunk`'s update: every layer's chunks ranked each on its own (`each_chunk_keep`)."""

    inner: Scorer
    chunk_length: int = 1024

    def __call__(self, cache: Cache, state: BudgetState, stats=None):
        def evict(layer, layer_stats, budget, index, debug=False):
            key = jax.random.fold_in(state.key, index)
            keep = each_chunk_keep(self.inner, view(layer), layer_stats, key, state.ratio,
                              self.chunk_length)
            return compact(layer, keep)

        unused = jnp.zeros((len(cache), cache[0].batch), jnp.int32)  # each chunk sets its own
        return evict_layers(evict, cache, stats, unused), state


def chunk(inner=knorm, ratio: float | None = None, chunk_length: int = 1024,
          seed: int = 0) -> CacheTransform:
    """ChunkPress (kvpress; FINCH's chunking, Corallo & Papotti 2024): compress each chunk of
    `chunk_length` tokens on its own with the inner method, so the kept tokens spread evenly
    over the context.

    As kvpress ChunkPress(press=INNER(compression_ratio=ratio), chunk_length): the inner
    method scores each chunk as if it were the whole context, and each chunk keeps its
    `max(1, int(n_c (1 - ratio)))` best tokens per KV head. An inner method that reads the
    last W queries (snapkv, pyramidkv, tova, leverage) gets each chunk's own, as kvpress
    recomputes them from the chunk's hidden states (`chunk_window`: the model keeps every
    chunk's last W queries, `StatsSpec.chunk_length`), so W must be below `chunk_length`.
    Methods that read other statistics of the prompt (query moments, attention mass: cap,
    expected_attention, h2o) or a window as long as the chunk (compactor, non_causal_attn)
    are refused by name.
    """
    check_real("chunk", "ratio", ratio, 0.0, 1.0, high_open=True)
    check_int("chunk", "chunk_length", chunk_length, 1)
    check_int("chunk", "seed", seed, 0)
    scorer, stats = inner_scorer(inner, "chunk", ratio)
    name = getattr(inner, "__name__", repr(inner))
    if stats.query_moments or stats.attention_mass:
        raise ValueError(f"chunk: inner={name} reads statistics of the whole prompt (query "
                         f"moments or attention mass), not of one chunk as kvpress's "
                         f"ChunkPress recomputes them; use a method that reads keys or the "
                         f"last queries (knorm, keydiff, lagkv, cur, snapkv, tova, ...)")
    if stats.window >= chunk_length:
        raise ValueError(f"chunk: inner={name} reads its last {stats.window} queries, a window "
                         f"of a whole chunk or more; chunk_length must exceed it, got "
                         f"{chunk_length}")
    if stats.window:
        stats = dataclasses.replace(stats, chunk_length=chunk_length)
    return CacheTransform(functools.partial(init_budget, ratio, None, seed),
                          ChunkUpdate(scorer, chunk_length), stats)


# ----------------------------------------------------------------------------- key re-rotation


def rotate(k: jax.Array, delta: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Keys `k` [..., C, D] moved by `delta` [..., C] positions in RoPE (rotate-half):
    `k cos(delta f) + rotate_half(k) sin(delta f)`, float32 angles (kvpress's formula)."""
    from kvjax.policies.eviction_sequence import rotate_half
    angles = delta.astype(jnp.float32)[..., None] * inv_freq  # [..., C, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)
    return k * cos + rotate_half(k) * sin


def rerotate_layer(layer, inv_freq: jax.Array):
    """One plain layer with its tokens moved to positions 0..n-1 in order, keys re-rotated."""
    if not is_plain(layer) or layer.pooled or layer.k.dtype.kind != "f":
        raise ValueError("rerotate: needs plain float token caches (put it before any codec, "
                         f"without headwise budgets); got {type(layer).__name__}")
    seq = in_sequence(layer)
    index = to_slots(seq, jnp.broadcast_to(jnp.arange(layer.capacity), seq.order.shape))
    valid = layer.pos != EMPTY
    delta = jnp.where(valid, index - layer.pos, 0)  # [B, KVH, C]
    k = rotate(layer.logical_k.astype(jnp.float32), delta, inv_freq).astype(layer.k.dtype)
    return layer.replace(k=k.reshape(layer.k.shape),
                         pos=jnp.where(valid, index, EMPTY).astype(layer.pos.dtype))


@dataclasses.dataclass(frozen=True)
class RerotateUpdate:
    """`rerotate`'s update: every layer's kept tokens at contiguous positions."""

    def __call__(self, cache, state, stats=None):
        if stats is None:
            raise ValueError("rerotate needs the model's RoPE frequencies: run the model with "
                             "the transform's StatsSpec (the sampler does this)")
        return tuple(rerotate_layer(layer, rope_inv_freq(s, "rerotate"))
                     for layer, s in zip(cache, stats)), state


def rerotate() -> CacheTransform:
    """Key re-rotation (kvpress KeyRerotationPress): after the parts before it evict, move
    the kept tokens to positions 0..n_kept-1 in order and re-rotate their keys to match.

    `knorm:ratio=0.5+rerotate` equals KeyRerotationPress(KnormPress(0.5)): the same kept
    tokens, keys rotated by `new - old` positions with float32 angles. New tokens keep
    their own positions (the prompt's length onwards), as in kvpress; under decode-time
    compression every update closes the gaps again.
    """
    return CacheTransform(lambda cache: EmptyState(), RerotateUpdate(), StatsSpec(window=1))


# ----------------------------------------------------------------------------- DMS threshold


@dataclasses.dataclass(frozen=True)
class ThresholdUpdate:
    """kvpress DMSPress's rule: a token older than the newest `window` of its row whose score
    is below `threshold` goes (the scorer's raw score, its `protect` unused, as DMSPress
    calls only `score`). The kept counts differ by head and text: `headwise` pools the layer
    (`pool_heads`) so heads share the freed slots and `shrink` frees the bytes, where kvpress
    only masks; without it each head keeps its row (the bytes of the longest), which
    per-channel codecs (KIVI) after it need."""

    scorer: Scorer
    threshold: float
    window: int
    headwise: bool = True

    def __call__(self, cache, state, stats=None):
        def evict(layer, layer_stats, budget, index, debug=False):
            layer = pool_heads(layer) if self.headwise else layer
            seen = view(layer)  # dense slots of an encoded or residual layer
            valid = seen.pos != EMPTY
            everything = jnp.full(seen.pos.shape[:1], seen.capacity, jnp.int32)  # [B]
            scores, _ = self.scorer(seen, layer_stats, everything, jax.random.key(0))
            newest = jnp.max(seen.pos, axis=-1, keepdims=True)  # [B, KVH, 1]
            recent = seen.pos > newest - self.window
            return compact(layer, valid & ((scores >= self.threshold) | recent))

        return evict_layers(evict, cache, stats, (None,) * len(cache)), state


def threshold_policy(name: str, scorer: Scorer, stats: StatsSpec, threshold: float,
                     window: int, headwise: bool = True) -> CacheTransform:
    """A `CacheTransform` applying `ThresholdUpdate`, its arguments checked under `name`."""
    check_real(name, "threshold", threshold, -math.inf)
    check_int(name, "window", window, 0)
    if not isinstance(headwise, bool):
        raise ValueError(f"{name}: headwise must be true or false, got {headwise!r}")
    return CacheTransform(lambda cache: EmptyState(),
                          ThresholdUpdate(scorer, float(threshold), window, headwise), stats)


def dms(inner=knorm, threshold: float | None = None, window: int = 128,
        headwise: bool = True) -> CacheTransform:
    """DMS's inference rule (kvpress DMSPress(press=inner, threshold, sliding_window_size),
    prefill, and with `--compress-every` during decode): evict every token older than the
    newest `window` of its row whose `inner` score is below `threshold`. The kept count
    follows the scores, so it differs by head and text. `inner`: a per-head scored policy
    (`kvzap:threshold=T` is this around KVzap's surrogate). `headwise` (default): heads
    share one pooled row, so the evicted tokens' bytes are freed; `headwise=false` keeps a
    row per head (the longest head's bytes), as a per-channel codec after it (KIVI) needs.
    """
    if threshold is None:
        raise ValueError("dms: needs threshold=T (tokens scoring below T are evicted)")
    scorer, stats = inner_scorer(inner, "dms", None)
    return threshold_policy("dms", scorer, stats, threshold, window, headwise)
