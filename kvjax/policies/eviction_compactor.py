"""Compactor and its two halves: leverage scores and non-causal attention (kvpress 0.5.5).

* `leverage` (kvpress LeverageScorePress): approximate statistical leverage
  of each token's pre-RoPE key among the row's keys (centred, right Gaussian
  sketch to `sketch_dim` columns, Cholesky solve with jitter).
* `non_causal_attn` (NonCausalAttnPress): cut the sequence into chunks of
  `chunk` tokens; inside a chunk every query attends to every key (no causal
  mask, no 1/sqrt(d) scale); a key's score is the attention its chunk's
  queries pay it, averaged over the query heads of its KV head, times ||v||,
  smoothed over 3 neighbours.
* `compactor` (CompactorPress): both, z-normalised, blended as
  `blending * leverage + attention` on the tokens between the first
  `sinks_start` and the last `sinks_end` (which are kept).

Pre-RoPE keys are the cached keys rotated back by their positions
(`kvjax.policies.eviction_sequence.unrope`), so these policies ask the model for its
RoPE frequencies (a one-query statistics window). Non-causal attention needs
the query of every prompt token: the policy asks for a window of `queries`
tokens (default 4096); prompt tokens beyond it have no query and add nothing.

The sketch is drawn from the policy's per-layer key (`seed`), the same for
every sequence of a batch, so a sequence scores the same alone or batched.
z-normalisation is per sequence (kvpress normalises over the whole batch
tensor; at batch 1, the case kvpress is used in, the two are equal).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY
from kvjax.policies.eviction import check_int, check_real, scored_policy
from kvjax.policies.eviction_sequence import (in_sequence, keys_values, pool3, shift, to_slots,
                                              unrope, unshift, zscore)
from kvjax.core.stats import StatsSpec, rope_inv_freq
from kvjax.core.transforms import CacheTransform

JITTER = 1e-2  # kvpress's chol_with_jitter(jitter=1e-2): its first (and in practice only) try

# ----------------------------------------------------------------------------- leverage


def leverage_scores(keys: jax.Array, valid: jax.Array, sketch: jax.Array) -> jax.Array:
    """[B, KVH, C] approximate leverage of each row's keys (kvpress compute_leverage_scores):
    `diag(X (X'X + 0.01 I)^-1 X')` of the centred keys X sketched to k columns.

    Args:
      keys: [B, KVH, C, D] pre-RoPE keys in token order.
      valid: [B, KVH, C] which indices hold a token.
      sketch: [KVH, D, k] standard normal draws (scaled by 1/sqrt(k) here).
    """
    w = valid[..., None].astype(jnp.float32)
    mean = (keys * w).sum(2, keepdims=True) / jnp.maximum(w.sum(2, keepdims=True), 1)
    phi = sketch * (1 / math.sqrt(sketch.shape[-1]))
    x = jnp.einsum("bhcd,hdk->bhck", (keys - mean) * w, phi)  # [B, KVH, C, k]
    # diag(X (X'X + jI)^-1 X') = sum_j U_ij^2 s_j^2 / (s_j^2 + j) from the thin SVD X = U S V':
    # the Gram matrix squares X's condition number, and a float32 Cholesky of it loses
    # ~1e-3 of the score on real keys (the same scores move by that between two compilations)
    u, sv, _ = jnp.linalg.svd(x, full_matrices=False)  # [B, KVH, C, k], [B, KVH, k]
    s2 = jnp.square(sv)
    shrink = s2 / (s2 + JITTER)
    return jnp.maximum((jnp.square(u) * shrink[:, :, None, :]).sum(-1), 0.0)


def _pre_rope_keys(layer, seq, stats, name: str) -> jax.Array:
    if stats is None:
        raise ValueError(f"{name} needs the model's RoPE frequencies: run the model with "
                         f"the policy's StatsSpec (the sampler does this from transform.stats)")
    k, _ = keys_values(seq, layer)
    return jnp.where(seq.valid[..., None], unrope(k, seq.pos, rope_inv_freq(stats, name)), 0.0)


def _sketch(key: jax.Array, kvh: int, d: int, dim: int) -> jax.Array:
    return jax.random.normal(key, (kvh, d, dim), jnp.float32)


@dataclasses.dataclass(frozen=True)
class LeverageScorer:
    """Leverage of pre-RoPE keys, z-normalised per sequence (kvpress LeverageScorePress)."""

    sketch_dim: int = 48

    def __call__(self, layer, stats, budget, key):
        seq = in_sequence(layer)
        keys = _pre_rope_keys(layer, seq, stats, "leverage")
        sketch = _sketch(key, keys.shape[1], keys.shape[-1], self.sketch_dim)
        scores = leverage_scores(keys, seq.valid, sketch)
        return to_slots(seq, zscore(scores, seq.valid)), jnp.zeros(seq.valid.shape, bool)


# ----------------------------------------------------------------------------- non-causal attention


def sequence_queries(stats, seq) -> tuple[jax.Array, jax.Array]:
    """([B, KVH, C, G, D] post-RoPE queries in token order, [B, KVH, C] which were observed).

    The i-th query of a row is the observed query at the i-th token's position.
    """
    if stats is None or stats.queries.shape[1] == 0:
        raise ValueError("non-causal attention needs the prompt's queries: run the model with "
                         "the policy's StatsSpec (the sampler does this from transform.stats)")
    b, kvh, c = seq.order.shape
    big = jnp.iinfo(jnp.int32).max
    qpos = jnp.where(stats.query_pos == EMPTY, big, stats.query_pos)  # [B, W]
    order = jnp.argsort(qpos, axis=-1, stable=True)
    qpos = jnp.take_along_axis(qpos, order, axis=-1)
    q = jnp.take_along_axis(stats.queries, order[:, :, None, None], axis=1)  # [B, W, H, D]
    w = q.shape[1]
    if w < c:
        q = jnp.pad(q, ((0, 0), (0, c - w), (0, 0), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, c - w)), constant_values=big)
    q, qpos = q[:, :c], qpos[:, :c]
    h, d = q.shape[2], q.shape[3]
    q = q.reshape(b, c, kvh, h // kvh, d).transpose(0, 2, 1, 3, 4)  # [B, KVH, C, G, D]
    seen = seq.valid & (qpos[:, None] == seq.pos)
    return q, seen


def non_causal_attention(q: jax.Array, k: jax.Array, n: jax.Array, chunk: int) -> jax.Array:
    """[B, KVH, G, C] attention each key gets from the queries of its chunk (kvpress rule).

    Args:
      q: [B, KVH, C, G, D] queries, zero where missing or past the row's end.
      k: [B, KVH, C, D] keys, zero past the row's end.
      n: [B, KVH] tokens per row.
    Chunks start at token 0. As kvpress: logits are plain dot products; in the
    chunk holding the row's end, the padding keys get the logit -1e-9 (not
    -inf: they take attention) and the padding queries (zero) attend
    uniformly, so every real key of that chunk receives `pad / chunk` more.
    """
    b, kvh, c, g, d = q.shape
    width = -(-c // chunk) * chunk
    q = jnp.swapaxes(q, 2, 3)  # [B, KVH, G, C, D]
    qc = jnp.pad(q, ((0, 0),) * 3 + ((0, width - c), (0, 0))).reshape(b, kvh, g, -1, chunk, d)
    kc = jnp.pad(k, ((0, 0),) * 2 + ((0, width - c), (0, 0))).reshape(b, kvh, -1, chunk, d)
    dots = jnp.einsum("bhgnqd,bhnkd->bhgnqk", qc, kc)
    inside = (jnp.arange(width) < n[..., None]).reshape(b, kvh, 1, -1, 1, chunk)
    probs = jax.nn.softmax(jnp.where(inside, dots, -1e-9), axis=-1)
    return probs.sum(axis=4).reshape(b, kvh, g, width)[..., :c]


def _attention_scores(q, seen, k, v, n, chunk) -> jax.Array:
    """[B, KVH, C] NonCausalAttnPress's score before z-normalisation, in token order."""
    valid = jnp.arange(k.shape[2])[None, None] < n[..., None]
    q = jnp.where(seen[..., None, None], q, 0.0)
    attn = non_causal_attention(q, k, n, chunk).mean(axis=2)  # [B, KVH, C]
    return pool3(attn * jnp.linalg.norm(v, axis=-1), valid)


@dataclasses.dataclass(frozen=True)
class NonCausalAttnScorer:
    """Chunked non-causal attention times ||v||, pooled, z-normalised (NonCausalAttnPress)."""

    chunk: int = 256

    def __call__(self, layer, stats, budget, key):
        seq = in_sequence(layer)
        k, v = keys_values(seq, layer)
        q, seen = sequence_queries(stats, seq)
        scores = _attention_scores(q, seen, k, v, seq.n, self.chunk)
        return to_slots(seq, zscore(scores, seq.valid)), jnp.zeros(seq.valid.shape, bool)


# ----------------------------------------------------------------------------- Compactor


@dataclasses.dataclass(frozen=True)
class CompactorScorer:
    """`blending * leverage + attention` on the middle tokens; the ends kept (CompactorPress)."""

    blending: float = 0.35
    sinks_start: int = 8
    sinks_end: int = 4
    chunk: int = 256
    sketch_dim: int = 48

    def __call__(self, layer, stats, budget, key):
        seq = in_sequence(layer)
        k, v = keys_values(seq, layer)
        pre = _pre_rope_keys(layer, seq, stats, "compactor")
        q, seen = sequence_queries(stats, seq)
        left = jnp.minimum(self.sinks_start, seq.n)  # [B, KVH]
        right = jnp.minimum(self.sinks_end, jnp.maximum(0, seq.n - left))
        m = seq.n - left - right  # middle tokens, from index `left`
        c = seq.valid.shape[-1]
        mid = jnp.arange(c)[None, None] < m[..., None]  # [B, KVH, C] in middle order
        cut = lambda x: jnp.where(mid[..., None], shift(x, left), 0.0)  # [B, KVH, C, D]
        qm = jnp.where(mid[..., None, None], shift(q, left), 0.0)
        seen_m = mid & (shift(seen.astype(jnp.float32)[..., None], left)[..., 0] > 0)
        sketch = _sketch(key, k.shape[1], k.shape[-1], self.sketch_dim)
        lev = zscore(leverage_scores(cut(pre), mid, sketch), mid)
        att = zscore(_attention_scores(qm, seen_m, cut(k), cut(v), m, self.chunk), mid)
        scores = unshift(jnp.where(mid, self.blending * lev + att, 0.0), left)
        i = jnp.arange(c)[None, None]
        protect = seq.valid & ((i < left[..., None]) | (i >= (seq.n - right)[..., None]))
        return to_slots(seq, scores), to_slots(seq, protect)


# ----------------------------------------------------------------------------- policies


def _check_queries(name: str, queries: int) -> None:
    check_int(name, "queries", queries, 1)


def leverage(ratio: float | None = None, budget: int | None = None, sketch_dim: int = 48,
             seed: int = 0, **options) -> CacheTransform:
    """Approximate leverage scores of the pre-RoPE keys (Chari & Van Durme 2025).

    As kvpress LeverageScorePress(sketch_dimension=sketch_dim), with the
    Gaussian sketch drawn from `seed`.
    """
    check_int("leverage", "sketch_dim", sketch_dim, 1)
    return scored_policy("leverage", LeverageScorer(sketch_dim), ratio=ratio, budget=budget,
                         stats=StatsSpec(window=1), seed=seed, **options)


def non_causal_attn(ratio: float | None = None, budget: int | None = None, chunk: int = 256,
                    queries: int = 4096, **options) -> CacheTransform:
    """Chunked non-causal attention of the prompt's own queries (Chari & Van Durme 2025).

    As kvpress NonCausalAttnPress(chunk_size=chunk); `queries` is the window
    of prompt queries kept for it (prompts up to that length score exactly).
    """
    check_int("non_causal_attn", "chunk", chunk, 1)
    _check_queries("non_causal_attn", queries)
    return scored_policy("non_causal_attn", NonCausalAttnScorer(chunk), ratio=ratio,
                         budget=budget, stats=StatsSpec(window=queries), **options)


def compactor(ratio: float | None = None, budget: int | None = None,
              blending: float | None = None, sinks_start: int = 8, sinks_end: int = 4,
              chunk: int = 256, sketch_dim: int = 48, queries: int = 4096, seed: int = 0,
              **options) -> CacheTransform:
    """Compactor (Chari & Van Durme 2025): leverage scores blended with non-causal attention.

    As kvpress CompactorPress: `blending` defaults to the ratio (kvpress's
    choice), or 0.35 when a token `budget` is given; the first `sinks_start`
    and last `sinks_end` tokens are kept. Since the blend is part of the
    scorer, each ratio compiles its own update.
    """
    for arg, value in (("sinks_start", sinks_start), ("sinks_end", sinks_end)):
        check_int("compactor", arg, value, 0)
    check_int("compactor", "chunk", chunk, 1)
    check_int("compactor", "sketch_dim", sketch_dim, 1)
    _check_queries("compactor", queries)
    if blending is None:
        blending = ratio if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) \
            else 0.35
    check_real("compactor", "blending", blending, 0.0)
    scorer = CompactorScorer(float(blending), sinks_start, sinks_end, chunk, sketch_dim)
    return scored_policy("compactor", scorer, ratio=ratio, budget=budget,
                         stats=StatsSpec(window=queries), seed=seed, **options)
