"""Entropy-gated ChunkKV (kvpress EntropyGatedChunkKVPress): ChunkKV that trims spiky chunks.

ChunkKV keeps or drops chunks whole, so a chunk whose importance is one
high-scoring token spends `chunk_length` slots on it. `entropy_chunkkv`
measures how evenly the inner scores spread inside each chunk and spends the
budget chunk by chunk, best chunk mean first:

1. per chunk of `chunk_length` tokens (the last one partial): the mean of the
   inner scores (summed over KV heads) and their normalised entropy
   `H(p) / log(tokens)`, `p` the scores shifted to be non-negative (by the
   chunk's minimum when it is negative) over their sum + 1e-8; a one-token
   chunk has entropy 0;
2. chunks at or above the median mean (the lower median, as torch's) whose
   entropy lies below the median entropy are "spiky": they get only their
   best `low_entropy_chunk_length` tokens; the others are kept whole, until
   the budget (`max(1, floor(n * (1 - ratio)))` tokens) runs out, the last
   chunk taking its best tokens that still fit;
3. budget left over (spiky chunks took less) goes to the best remaining tokens.

Exactly the budget is kept, the same tokens in every KV head. The inner
scores are a kvpress press's (protected slots, SnapKV's window, at the
row's largest other score + 1).

Example:
    >>> t = entropy_chunkkv(ratio=0.5)    # EntropyGatedChunkKVPress(SnapKVPress(0.5))
    >>> t.update.chunk_length, t.update.low_entropy_chunk_length
    (10, 4)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, view
from kvjax.core.layout import compact
from kvjax.core.selection import BudgetState, init_budget, layer_budgets, rank
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import Scorer, _check_budget, check_int, snapkv
from kvjax.policies.eviction_sequence import in_sequence, to_slots
from kvjax.policies.eviction_wrappers import inner_scorer, evict_chunks, press_in_order

EPSILON = 1e-8  # kvpress's, in the entropy's normalisation and logarithm


def _lower_median(x: jax.Array, exists: jax.Array) -> jax.Array:
    """[B] torch's median over the existing entries of each row of `x` [B, N]: the lower of
    the two middle values when their number is even."""
    m = jnp.sum(exists, axis=-1)
    ordered = jnp.sort(jnp.where(exists, x, jnp.inf), axis=-1)
    return jnp.take_along_axis(ordered, jnp.maximum((m - 1) // 2, 0)[:, None], axis=-1)[:, 0]


def entropy_chunk_keep(scores: jax.Array, n: jax.Array, budget: jax.Array, chunk: int,
                       low: int) -> jax.Array:
    """[B, C] bool in token order: the tokens the entropy-gated chunk rule keeps.

    Args:
      scores: [B, C] float32 press scores summed over KV heads, in token order.
      n: [B] tokens per row (the rest of the row is empty).
      budget: [B] tokens to keep (at most `n` are).
      chunk, low: chunk length and tokens kept from a spiky chunk.
    """
    b, c = scores.shape
    width = -(-c // chunk) * chunk
    s = jnp.pad(scores.astype(jnp.float32), ((0, 0), (0, width - c))).reshape(b, -1, chunk)
    i = jnp.arange(width).reshape(-1, chunk)  # [NC, chunk] token index
    inside = i[None] < n[:, None, None]  # [B, NC, chunk]
    count = jnp.sum(inside, axis=-1)  # [B, NC]
    exists = count > 0
    zero = jnp.where(inside, s, 0.0)
    mean = jnp.where(exists, zero.sum(-1) / jnp.maximum(count, 1), -jnp.inf)
    low_point = jnp.min(jnp.where(inside, s, jnp.inf), axis=-1, keepdims=True)
    shifted = jnp.where(inside, s - jnp.minimum(low_point, 0.0), 0.0)
    total = shifted.sum(-1, keepdims=True) + EPSILON
    p = shifted / total  # XLA:CPU's division by a broadcast is not always correctly
    p = p + (shifted - p * total) / total  # rounded: one Newton step gives torch's quotient
    h = -jnp.sum(jnp.where(inside, p * jnp.log(p + EPSILON), 0.0), axis=-1)
    norm = jnp.log(jnp.maximum(count, 2).astype(jnp.float32))
    entropy = jnp.where(count > 1, jnp.clip(h / norm, 0.0, 1.0), 0.0)

    high = mean >= _lower_median(mean, exists)[:, None]
    spiky = high & (entropy < _lower_median(entropy, exists)[:, None]) & exists
    want = jnp.where(spiky, jnp.minimum(count, low), count)  # [B, NC] (0 past n)
    order = rank(mean, exists)  # [B, NC] 0 = best mean (ties to the earlier chunk)
    by_rank = jnp.zeros_like(want).at[jnp.arange(b)[:, None], order].set(want)
    before = jnp.cumsum(by_rank, axis=-1) - by_rank  # tokens the better chunks take
    took = jnp.clip(budget[:, None] - before, 0, by_rank)
    n_kept = jnp.take_along_axis(took, order, axis=-1)  # [B, NC] per chunk
    inner = rank(s, inside) < n_kept[..., None]  # best tokens of each chunk
    keep = (inner & inside).reshape(b, width)[:, :c]

    valid = jnp.arange(c)[None] < n[:, None]
    left = budget - jnp.sum(keep, axis=-1)  # [B] budget the spiky chunks left
    extra = rank(scores.astype(jnp.float32), valid & ~keep) < left[:, None]
    return (keep | (extra & valid & ~keep)) & valid


@dataclasses.dataclass(frozen=True)
class EntropyChunkUpdate:
    """The `update` of `entropy_chunkkv`: the rule above on every layer, `budget` tokens kept.

    First update: `max(1, floor(n * (1 - ratio)))` (or the token `budget`); later updates
    keep the layer's budget again among what the row holds then.
    """

    scorer: Scorer
    chunk_length: int = 10
    low_entropy_chunk_length: int = 4

    def __call__(self, cache, state: BudgetState, stats=None):
        budgets = layer_budgets(state, cache, "uniform", 64, 20.0)  # [L, B] n_kept

        def evict(layer, layer_stats, budget, index):
            seen = view(layer)
            key = jax.random.fold_in(state.key, index)
            scores, protect = self.scorer(seen, layer_stats, budget, key)
            valid = seen.pos != EMPTY
            seq = in_sequence(seen)
            press = press_in_order(seq, scores, protect, valid)
            n = seq.n[:, 0]  # [B] (every head holds the same tokens)
            keep = entropy_chunk_keep(press.sum(axis=1), n, budget, self.chunk_length,
                                      self.low_entropy_chunk_length)
            keep = to_slots(seq, jnp.broadcast_to(keep[:, None], seq.valid.shape)) & valid
            kept = jnp.max(jnp.sum(keep, axis=-1), axis=-1).astype(jnp.int32)  # [B]
            return compact(layer, keep), kept

        return evict_chunks(evict, cache, stats, budgets, state)


def entropy_chunkkv(inner=snapkv, ratio: float | None = None, budget: int | None = None,
                    chunk_length: int = 10, low_entropy_chunk_length: int = 4,
                    seed: int = 0) -> CacheTransform:
    """Entropy-gated ChunkKV: chunks ranked by the inner scores, spiky ones cut to their best.

    As kvpress EntropyGatedChunkKVPress(press=INNER(compression_ratio=ratio),
    chunk_length, low_entropy_chunk_length): chunks of `chunk_length` tokens in
    decreasing mean inner score (summed over KV heads) are kept whole, but those at or
    above the median mean with below-median score entropy keep only their best
    `low_entropy_chunk_length` tokens; leftover budget goes to the best other tokens.
    kvpress picks batch row 0's tokens for every row; kvjax each row's own.
    """
    check_int("entropy_chunkkv", "chunk_length", chunk_length, 2)
    check_int("entropy_chunkkv", "low_entropy_chunk_length", low_entropy_chunk_length, 1)
    if low_entropy_chunk_length >= chunk_length:
        raise ValueError(f"entropy_chunkkv: low_entropy_chunk_length must be in [1, "
                         f"chunk_length - 1] = [1, {chunk_length - 1}], got "
                         f"{low_entropy_chunk_length!r}")
    check_int("entropy_chunkkv", "seed", seed, 0)
    _check_budget("entropy_chunkkv", ratio, budget)
    scorer, stats = inner_scorer(inner, "entropy_chunkkv", ratio)
    return CacheTransform(functools.partial(init_budget, ratio, budget, seed),
                          EntropyChunkUpdate(scorer, chunk_length, low_entropy_chunk_length),
                          stats)

