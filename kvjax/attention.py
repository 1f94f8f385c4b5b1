"""Attention over a token cache that may have holes.

`attend` is the single entry point every model uses. `impl="xla"` is the
plain-jnp reference and the ground truth for tests; kernels plug in behind
`impl=` without changing callers.

GQA convention (as in Llama / Hugging Face `repeat_kv`): query head `h` reads
KV head `h // G`, where `G = num_heads // kv_heads`. Queries are grouped as
`[B*KVH, G*T, D]`, matching the cache's folded `[B*KVH, S, D]` keys, so one
dot per KV head serves its whole group with no reshape of the cache; KV heads
are never repeated in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache import EMPTY, TokenCache

IMPLS = ("xla",)


def attention_mask(q_pos: jax.Array, kv_pos: jax.Array, window: int | None = None) -> jax.Array:
    """[B, KVH, T, S] bool: key slot s is visible to query t.

    Visible means the slot holds a token (`kv_pos != EMPTY`), the query is not
    padding (`q_pos >= 0`), the key is not in the future (`kv_pos <= q_pos`)
    and, with a sliding `window`, `q_pos - kv_pos < window`.

    Args:
      q_pos: [B, T] int32 query positions (negative = padding query).
      kv_pos: [B, KVH, S] int32 key positions (EMPTY = free slot).
    """
    q = q_pos[:, None, :, None]  # [B, 1, T, 1]
    k = kv_pos[:, :, None, :]  # [B, KVH, 1, S]
    mask = (k != EMPTY) & (q >= 0) & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    return mask


def attend_reference(q: jax.Array, q_pos: jax.Array, cache: TokenCache, *,
                     window: int | None = None, softcap: float | None = None,
                     scale: float | None = None) -> jax.Array:
    """Masked softmax attention of `q` over every slot of `cache`, in float32.

    Args:
      q: [B, T, H, D] queries (after RoPE); H must be a multiple of the
        cache's KV heads.
      q_pos: [B, T] int32 absolute query positions; negative = padding.
      cache: layer cache with k, v [B*KVH, S, D] and pos [B, KVH, S].
    Returns:
      [B, T, H, D] float32. A query that sees no key (padding) returns zeros.
    """
    b, t, h, d = q.shape
    kvh = cache.kv_heads
    if h % kvh or (b, d) != (cache.batch, cache.head_dim):
        raise ValueError(f"attend: queries {q.shape} do not fit a cache of k {cache.k.shape} "
                         f"(need batch and head_dim equal and heads a multiple of {kvh})")
    if q_pos.shape != (b, t):
        raise ValueError(f"attend: q_pos has shape {q_pos.shape}, expected {(b, t)}")
    g = h // kvh
    scale = d ** -0.5 if scale is None else scale
    # [B, T, KVH, G, D] -> [B*KVH, G*T, D]: one matmul per KV head for its group.
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b * kvh, g * t, d)
    s = jnp.einsum("nqd,nsd->nqs", qg.astype(cache.k.dtype), cache.k,
                   preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = attention_mask(q_pos, cache.pos, window)  # [B, KVH, T, S]
    mask = jnp.broadcast_to(mask[:, :, None], (b, kvh, g, t, mask.shape[-1])).reshape(b * kvh, g * t, -1)
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1) * jnp.any(mask, axis=-1, keepdims=True)
    out = jnp.einsum("nqs,nsd->nqd", p.astype(cache.v.dtype), cache.v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def attend(q: jax.Array, q_pos: jax.Array, cache: TokenCache, *, impl: str = "xla",
           window: int | None = None, softcap: float | None = None) -> jax.Array:
    """Attention of queries over a layer cache; dispatches on `impl`.

    Example:
        >>> cache = write(init_cache(1, 1, 8, 4), k, v, jnp.arange(3)[None])
        >>> out = attend(q, jnp.array([[2]]), cache)   # q: [1, 1, H, 4]
    """
    if impl == "xla":
        return attend_reference(q, q_pos, cache, window=window, softcap=softcap)
    raise ValueError(f"attend: unknown impl {impl!r}; available: {IMPLS}")
