"""KVComposePress (kvpress 0.5.5; KVCompose, Akulov et al. 2025): per-layer budgets from
composite attention scores, structured (every KV head of a layer keeps as many tokens).

After prefill the model reads its context once more behind itself (one reconstruction pass,
`models.reconstruction`: the context's ids at the next positions, no prompt); a token's score
in a KV head is the most attention any pass query of a query head pays it, averaged over the
KV head's query heads, plus the layer's mean over KV heads. A layer's composite score at
rank j is the mean over its KV heads of their j-th best score; the first layer's is the most
any layer has at that rank. The best `max(1, floor(L n (1 - ratio)))` composite scores of all
layers decide how many tokens each layer keeps (at least 1), and every KV head keeps that
many of its best tokens. Budgets differ by layer, not by head, so the cache stays per head
(not pooled) and `shrink` cuts each layer to its own budget.

Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.array([[[[0.9, 0.1, 0.3, 0.2]]], [[[0.5, 0.6, 0.05, 0.7]]]])  # L=2, B=1, KVH=1
    >>> kvcompose_keep(s, jnp.broadcast_to(jnp.arange(4), s.shape), jnp.float32(0.5)
    ...                )[:, 0, 0].astype(int).tolist()    # 2 tokens a layer of the 4 kept
    [[1, 0, 1, 0], [0, 1, 0, 1]]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, Cache
from kvjax.core.layout import compact, map_layers
from kvjax.core.selection import init_budget, rank
from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import check_real
from kvjax.policies.eviction_kvzip import Reconstruction, ReconstructionPrompt, pass_scores

WHOLE = 1 << 30  # one reconstruction chunk: the whole context in a single pass


def kvcompose_keep(scores: jax.Array, pos: jax.Array, ratio: jax.Array) -> jax.Array:
    """[L, B, KVH, C] bool: what KVCompose keeps of `scores` [L, B, KVH, C] (slots at `pos`).

    Each head's scores get its layer's mean over KV heads added; layer l's composite score at
    rank j is the mean over its KV heads of their j-th best (layer 0's: the max over layers);
    the best `max(1, floor(L n (1 - ratio)))` composite scores of all layers (ties to the
    earlier layer, then rank) set each layer's count `k_l` (at least 1); each head keeps its
    `k_l` best slots (ties to the earlier slot). `n`: the row's tokens per head.
    """
    num_layers, b, kvh, c = scores.shape
    valid = pos != EMPTY
    scores = jnp.where(valid, scores.astype(jnp.float32), 0.0)
    n = jnp.max(jnp.sum(valid, axis=-1), axis=(0, 2))  # [B]
    mean = jnp.sum(scores, axis=2, keepdims=True) / kvh
    scores = jnp.where(valid, scores + mean, -jnp.inf)
    ranked = -jnp.sort(-scores, axis=-1)  # [L, B, KVH, C] best first, empty slots last
    composite = jnp.mean(ranked, axis=2)  # [L, B, C]
    composite = composite.at[0].set(jnp.max(composite, axis=0))
    in_row = jnp.arange(c)[None, None] < n[None, :, None]  # [1, B, C]
    flat = composite.transpose(1, 0, 2).reshape(b, num_layers * c)
    kept = jnp.maximum(1, jnp.floor((num_layers * n).astype(jnp.float32) * (1 - ratio)))
    chosen = rank(flat, jnp.broadcast_to(in_row, (num_layers, b, c)).transpose(1, 0, 2)
                  .reshape(b, -1)) < kept.astype(jnp.int32)[:, None]
    counts = jnp.maximum(1, chosen.reshape(b, num_layers, c).sum(-1)).T  # [L, B]
    return (rank(scores, valid) < counts[:, :, None, None]) & valid


def _evict(layer, keep):
    return compact(layer, keep)


@dataclasses.dataclass(frozen=True)
class KVComposeUpdate:
    """`kvcompose`'s update: per-layer counts from the composite scores, every head alike."""

    def __call__(self, cache: Cache, state, stats=None):
        pos, scores = pass_scores("kvcompose", cache, stats)
        keep = kvcompose_keep(scores, pos, state.ratio)
        return map_layers(_evict, tuple(cache), tuple(keep)), state


def kvcompose(ratio: float | None = None) -> CacheTransform:
    """KVCompose (Akulov et al. 2025), structured: per-layer budgets from composite attention
    scores of a pass that reads the context again, each KV head keeping its best tokens.

    As kvpress KVComposePress(compression_ratio=ratio) at its defaults (structured, max over
    the pass's queries, mean over a KV head's query heads and over its heads' ranked scores,
    the layer's mean over heads added, no value norm, no lower bound). The pass attends over
    the whole context at once (`B x H x n x 2n` attention weights per layer, as kvpress's eager
    pass): prompt only.
    """
    check_real("kvcompose", "ratio", ratio, 0.0, 1.0, high_open=True)
    rec = Reconstruction(chunk_size=WHOLE, n_sink=0, overlap=0, prompt=ReconstructionPrompt(),
                         group_mean=True)
    return CacheTransform(functools.partial(init_budget, ratio, None, 0), KVComposeUpdate(),
                          StatsSpec(reconstruction=rec))
