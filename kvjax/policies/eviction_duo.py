"""DuoAttentionPress (kvpress 0.5.5; DuoAttention, Xiao et al. 2024): retrieval and streaming
heads.

Every (layer, KV head) has a score; the `round(L * KVH * head_ratio)` lowest-scored ones are
*streaming* heads, which keep only their first `sink` and last `recent` tokens; the others
(*retrieval* heads) keep everything. kvpress masks the streaming heads' middle tokens in
attention and keeps them in memory; `duo_attention` evicts them, in the pooled layout (one
`[B, P, D]` slot pool per layer shared by its heads, as head-wise budgets), so the cache
really shrinks.

The scores: DuoAttention's are trained per model and published for a few (kvpress downloads
them); kvjax trains them the same way for any model (`models.duo_training`, `kvjax calibrate
--duo-train`: per-KV-head gates between full and streaming attention, `gated_attention`).
kvpress's `on_the_fly_scoring=True` approximates them instead, and so does kvjax
(`models.calibration.calibrate_duo_attention`, the same rule: `duo_head_scores`). Either is
an `.npz` with `head_scores` [L, KVH] that `scores=PATH` reads.

Example:
    >>> import numpy as np
    >>> streaming_heads(np.array([[0.3, 0.1], [0.2, 0.4]]), 0.5).tolist()
    [[False, True], [True, False]]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import EMPTY
from kvjax.core.layer import is_plain
from kvjax.core.layout import compact, pool_heads
from kvjax.core.stores import is_encoded
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import check_int, check_real, evict_layers, read_arrays
from kvjax.policies.eviction_sequence import rotate_half

SINK, RECENT = 128, 256  # kvpress's sink_size and recent_size under on-the-fly scoring
Q_LEN = 500  # duo_attention_on_the_fly's q_len


def duo_head_scores(q_mean: jax.Array, k_mean: jax.Array, inv_freq: jax.Array,
                    q_len: int = Q_LEN) -> jax.Array:
    """[L, KVH] float32 kvpress's on-the-fly DuoAttention score of one text.

    The mean pre-RoPE query and key of every head, repeated at positions 0..q_len-1 and
    rotated; the last query's softmax attention over those keys, cumulated along the positions
    and averaged (the area under the cumulated attention curve: high when the attention sits
    early, on far tokens); the query heads of a KV head averaged.

    Args:
      q_mean: [L, H, D] mean pre-RoPE query per head; k_mean: [L, KVH, D] mean pre-RoPE key.
      inv_freq: [D/2] RoPE inverse frequencies.
    """
    num_layers, h, d = q_mean.shape
    kvh = k_mean.shape[1]
    angles = jnp.arange(q_len, dtype=jnp.float32)[:, None] * inv_freq  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)
    q = q_mean * cos[-1] + rotate_half(q_mean) * sin[-1]  # [L, H, D] at position q_len - 1
    k = k_mean[:, :, None] * cos + rotate_half(k_mean[:, :, None]) * sin  # [L, KVH, T, D]
    k = jnp.repeat(k, h // kvh, axis=1)  # [L, H, T, D]
    logits = jnp.einsum("lhd,lhtd->lht", q, k, precision=jax.lax.Precision.HIGHEST) / d ** 0.5
    attn = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    area = jnp.cumsum(attn, axis=-1).mean(-1)  # [L, H]
    return area.reshape(num_layers, kvh, h // kvh).mean(-1)


def streaming_visible(length: int, sink: int, recent: int) -> np.ndarray:
    """[T, T] bool: what a streaming head's query i sees during DuoAttention's training: keys
    j <= i among the first `sink` or the last `recent` (i - j < recent, itself included)."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    return (j <= i) & ((j < sink) | (i - j < recent))


def gated_attention(q: jax.Array, k: jax.Array, v: jax.Array, gates: jax.Array, sink: int,
                    recent: int, softcap: float | None = None) -> jax.Array:
    """DuoAttention's training attention: each KV head's output is `gate * full + (1 - gate) *
    streaming`, full = causal softmax attention, streaming = the same over only the keys
    `streaming_visible` leaves (the paper's eq. 1, gates clipped to [0, 1]).

    Args:
      q: [B, T, H, D] queries after RoPE; k, v: [B, T, KVH, D] keys after RoPE and values.
      gates: [KVH] float32, one per KV head, shared by its query heads.
    Returns:
      [B, T, H, D] float32.
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k) * np.float32(d ** -0.5)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    causal = np.tril(np.ones((t, t), bool))

    def attend(visible):
        p = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bkgts,bskd->btkgd", p, v)

    gate = jnp.clip(gates, 0.0, 1.0)[:, None, None]  # [KVH, 1, 1] against [.., KVH, G, D]
    out = gate * attend(causal) + (1 - gate) * attend(streaming_visible(t, sink, recent))
    return out.reshape(b, t, h, d)


def streaming_heads(scores: np.ndarray, head_ratio: float) -> np.ndarray:
    """[L, KVH] bool: the `round(scores.size * head_ratio)` lowest-scored heads (kvpress's
    `np.argsort(head_scores, axis=None)[:n_pruned]`)."""
    scores = np.asarray(scores)
    mask = np.zeros(scores.shape, bool)
    n = round(scores.size * head_ratio)
    if n > 0:
        mask[np.unravel_index(np.argsort(scores, axis=None)[:n], scores.shape)] = True
    return mask


def duo_keep(pos: jax.Array, streaming: jax.Array, sink: int, recent: int) -> jax.Array:
    """[B, KVH, C] bool: every token of a retrieval head; a streaming head's (`streaming` [KVH])
    first `sink` and last `recent` tokens by position (kvpress masks its `[sink:-recent]`, so
    a head of at most `sink + recent` tokens keeps all)."""
    valid = pos != EMPTY
    order = jnp.argsort(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    index = jnp.argsort(order, axis=-1)  # [B, KVH, C] rank by position among valid slots
    n = valid.sum(-1, keepdims=True)
    middle = (index >= sink) & (index < n - recent)
    return valid & ~(streaming[None, :, None] & middle)


def load_head_scores(path: str) -> np.ndarray:
    """[L, KVH] float32 `head_scores` of a `.npz` (what `calibrate_duo_attention` saves)."""
    scores = read_arrays("duo_attention", "scores", path, ("head_scores",),
                         "kvjax calibrate --duo --out PATH").get("head_scores")
    if scores is None or scores.ndim != 2:
        raise ValueError(f"duo_attention: {path} holds no head_scores [L, KVH] array")
    return scores


@dataclasses.dataclass(frozen=True)
class DuoUpdate:
    """`duo_attention`'s update: streaming heads cut to sinks + recent tokens, pooled."""

    streaming: tuple[tuple[bool, ...], ...]  # [L][KVH]
    sink: int = SINK
    recent: int = RECENT

    def __call__(self, cache, state, stats=None):
        if len(cache) != len(self.streaming) or cache[0].kv_heads != len(self.streaming[0]):
            raise ValueError(f"duo_attention: head scores for {len(self.streaming)} layers x "
                             f"{len(self.streaming[0])} KV heads, the model has {len(cache)} x "
                             f"{cache[0].kv_heads}: calibrate them on this model")
        table = jnp.asarray(self.streaming, bool)  # [L, KVH]

        def evict(layer, layer_stats, budget, index, debug=False):
            if not is_plain(layer) or is_encoded(layer.k) or is_encoded(layer.v):
                raise ValueError("duo_attention: needs plain float token caches (put it before "
                                 f"any codec); got {type(layer).__name__}")
            layer = pool_heads(layer)
            return compact(layer, duo_keep(layer.pos, table[index], self.sink, self.recent))

        budgets = jnp.zeros((len(cache), cache[0].batch), jnp.int32)
        return evict_layers(evict, cache, stats, budgets), state


def _no_state(cache) -> tuple:
    return ()


def duo_attention(head_ratio: float = 0.0, scores: str | None = None, sink: int = SINK,
                  recent: int = RECENT) -> CacheTransform:
    """DuoAttention (Xiao et al. 2024): the `head_ratio` lowest-scored (layer, KV head)s keep
    only their first `sink` and last `recent` tokens, the others everything.

    As kvpress DuoAttentionPress(head_compression_ratio=head_ratio, on_the_fly_scoring=True)
    when `scores` holds the on-the-fly scores (`models.calibration.calibrate_duo_attention`
    computes them with kvpress's rule; kvpress's own calibration texts come from the hub), and
    as DuoAttentionPress(head_compression_ratio=head_ratio) loading `scores` as its pattern
    (trained by `models.duo_training`; kvpress clips patterns to [0, 1], which trained gates
    already are).
    """
    check_real("duo_attention", "head_ratio", head_ratio, 0.0, 1.0)
    check_int("duo_attention", "sink", sink, 0)
    check_int("duo_attention", "recent", recent, 1)
    if scores is None:
        raise ValueError("duo_attention: needs scores=PATH, the .npz of per-(layer, KV head) "
                         "scores that models.calibration.calibrate_duo_attention saves")
    mask = streaming_heads(load_head_scores(scores), head_ratio)
    return CacheTransform(_no_state, DuoUpdate(tuple(map(tuple, mask.tolist())),
                                                      int(sink), int(recent)))
