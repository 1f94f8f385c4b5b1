"""Attention over a token cache that may have holes: the XLA and reference paths.

`kvjax.attend` (`kvjax.backends.dispatch`) is the single entry point every model uses;
it picks these paths or the Pallas kernels by `impl=`. `attend_reference` is
the plain-jnp definition and the ground truth for tests; `attend_blockwise`
(impl="xla") reads only the written slots, a block at a time.

GQA convention (as in Llama / Hugging Face `repeat_kv`): query head `h` reads
KV head `h // G`, where `G = num_heads // kv_heads`. Queries are grouped as
`[B*KVH, G*T, D]`, matching the cache's folded `[B*KVH, S, D]` keys, so one
dot per KV head serves its whole group with no reshape of the cache; KV heads
are never repeated in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core import cpu_kernel
from kvjax.core.layer import EMPTY, CacheLayer

Layer = CacheLayer  # a token layer (`kvjax.core.cache.Layer`: the cache module imports this one)
TokenCache = CacheLayer  # a `kvjax.core.cache.TokenCache`, for the same reason
from kvjax.core.stores import Latent, PackedChannels, is_encoded, map_slot_leaves, read

NEG_INF = -1e30  # finite "minus infinity": a fully masked row stays NaN-free


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


def _group_queries(q: jax.Array, q_pos: jax.Array, cache: TokenCache,
                   exact_dtype: bool = True) -> jax.Array:
    """[B, T, H, D] -> [R, (H/R')*T, D], R = the cache's key rows: one matmul per row.

    Per-head layout: R = B*KVH and each row serves its group of G = H/KVH
    query heads. Pooled layout: R = B and each row serves all H heads (the
    mask then keeps every head to its own slots). Row order is (b, kvh, g, t)
    in both cases. The queries take the dtype of dense keys (bf16 x bf16
    dots), else float32 (`exact_dtype=False`, or encoded keys: decoded to float32).
    """
    b, t, h, d = q.shape
    kvh = cache.kv_heads
    if h % kvh or (b, d) != (cache.batch, cache.head_dim):
        raise ValueError(f"attend: queries {q.shape} do not fit a cache of k {cache.k.shape} "
                         f"(need batch and head_dim equal and heads a multiple of {kvh})")
    if q_pos.shape != (b, t):
        raise ValueError(f"attend: q_pos has shape {q_pos.shape}, expected {(b, t)}")
    qg = q.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, T, D]
    dense = exact_dtype and not is_encoded(cache.k)
    return qg.reshape(cache.k.shape[0], -1, d).astype(cache.k.dtype if dense else jnp.float32)


def _ungroup(out: jax.Array, q_shape: tuple[int, ...], kvh: int) -> jax.Array:
    """[R, ., D] -> [B, T, H, D]."""
    b, t, h, d = q_shape
    return out.reshape(b, kvh, h // kvh, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def _row_mask(q_pos, kv_pos, g, rows, window):
    """[R, G'*T, S] bool: `attention_mask` laid out like the grouped queries."""
    mask = attention_mask(q_pos, kv_pos, window)  # [B, KVH, T, S]
    b, kvh, t, s_len = mask.shape
    return jnp.broadcast_to(mask[:, :, None], (b, kvh, g, t, s_len)).reshape(rows, -1, s_len)


def _slots(store, start, size: int):
    """Slots [start, start + size) of a dense array or a low-rank store."""
    if isinstance(store, Latent):
        return store.replace(z=jax.lax.dynamic_slice_in_dim(store.z, start, size, axis=1))
    return jax.lax.dynamic_slice_in_dim(store, start, size, axis=1)


def _weighted_values(p: jax.Array, v) -> jax.Array:
    """p [R, Q, S] @ values [R, S, D] -> [R, Q, D] f32; a low-rank store is lifted after weighting."""
    if isinstance(v, Latent):
        return v.lift(jnp.einsum("nqs,nsr->nqr", p, v.z.astype(jnp.float32)))
    return jnp.einsum("nqs,nsd->nqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _einsum_scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    return jnp.einsum("nqd,nsd->nqs", qg, k, preferred_element_type=jnp.float32)


def _masked_scores(qg, k, kv_pos, q_pos, g, window, softcap, scale, scores=_einsum_scores):
    """Scores [R, G'*T, S] float32 (masked entries NEG_INF) and the mask.

    Low-rank keys are scored in latent space: q . (P z) = (P^T q) . z.
    """
    if isinstance(k, Latent):
        qg, k = k.project(qg), k.z.astype(jnp.float32)
    s = scores(qg, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = _row_mask(q_pos, kv_pos, g, k.shape[0], window)
    return jnp.where(mask, s, NEG_INF), mask


def _masked_softmax(s: jax.Array) -> jax.Array:
    """Softmax over the last axis of masked scores (masked entries NEG_INF); a row with nothing
    visible is all zeros. Whether a row sees anything is read from its largest score (NEG_INF
    only when every entry is masked), not counted from the mask: a count depends on positions
    alone, so XLA computes every layer's up front and holds them all, a `[B*H, T, C]` float
    array per layer (7 GiB in a 30-layer pass over 8 contexts of 1,024 tokens)."""
    return jax.nn.softmax(s, axis=-1) * (s.max(axis=-1, keepdims=True) > NEG_INF)


def attend_reference(q: jax.Array, q_pos: jax.Array, cache: Layer, *,
                     window: int | None = None, softcap: float | None = None,
                     scale: float | None = None) -> jax.Array:
    """Masked softmax attention of `q` over every slot of `cache`, in float32.

    The plain definition, one softmax over all `capacity` slots: the ground
    truth that every faster path is tested against.

    Args:
      q: [B, T, H, D] queries (after RoPE); H must be a multiple of the
        cache's KV heads.
      q_pos: [B, T] int32 absolute query positions; negative = padding.
      cache: layer cache with k, v [B*KVH, S, D] and pos [B, KVH, S].
    Returns:
      [B, T, H, D] float32. A query that sees no key (padding) returns zeros.
    """
    cache = cache.view(keep_latent=True)
    qg = _group_queries(q, q_pos, cache)
    g = q.shape[2] // cache.kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s, mask = _masked_scores(qg, cache.k, cache.pos, q_pos, g, window, softcap, scale)
    p = _masked_softmax(s)
    out = _weighted_values(p, cache.v)
    return _ungroup(out, q.shape, cache.kv_heads)


def attention_weights(q: jax.Array, q_pos: jax.Array, cache: Layer, *,
                      window: int | None = None, softcap: float | None = None) -> jax.Array:
    """[B, KVH, G, T, C] float32 softmax probabilities of `q` over every slot.

    The probabilities `attend_reference` uses, per KV head `h`, query head
    `h*G + g` and query `t`; a padding query's row is all zeros. Memory is
    `B*H*T*C` floats: call it on a window or chunk of queries, not a whole
    long prompt. Policies score slots with it (SnapKV, TOVA).
    """
    cache = cache.view(keep_latent=True)
    qg = _group_queries(q, q_pos, cache)
    b, t, h, _ = q.shape
    g = h // cache.kv_heads
    s, mask = _masked_scores(qg, cache.k, cache.pos, q_pos, g, window, softcap,
                             q.shape[-1] ** -0.5)
    p = _masked_softmax(s)
    return p.reshape(b, cache.kv_heads, g, t, cache.capacity)


def attention_mass(q: jax.Array, q_pos: jax.Array, cache: Layer, *, block: int = 256,
                   window: int | None = None, softcap: float | None = None) -> jax.Array:
    """[B, KVH, C] float32 attention each slot receives from `q`, summed over queries and heads.

    `attention_weights(...).sum((2, 3))` computed `block` slots at a time in
    two passes (log-sum-exp per query, then column sums), so a long prompt's
    chunk never materialises a `T x C` matrix per head. H2O accumulates it.
    """
    cache = cache.view(keep_latent=True)
    qg = _group_queries(q, q_pos, cache)
    g = q.shape[2] // cache.kv_heads
    scale = q.shape[-1] ** -0.5
    block = min(block, cache.capacity)
    n_blocks = (cache.length + block - 1) // block

    def scores(i):
        start = jnp.minimum(i * block, cache.capacity - block)
        k = _slots(cache.k, start, block)
        pos = jax.lax.dynamic_slice_in_dim(cache.pos, start, block, axis=2)
        pos = jnp.where(start + jnp.arange(block) >= i * block, pos, EMPTY)  # read once
        s, mask = _masked_scores(qg, k, pos, q_pos, g, window, softcap, scale)
        return start, s, mask

    def max_sum(i, carry):
        m, l = carry
        _, s, mask = scores(i)
        m_new = jnp.maximum(m, s.max(axis=-1))
        return m_new, l * jnp.exp(m - m_new) + (jnp.exp(s - m_new[..., None]) * mask).sum(-1)

    rows, n_q, _ = qg.shape
    m, l = jax.lax.fori_loop(0, n_blocks, max_sum, (jnp.full((rows, n_q), NEG_INF),
                                                    jnp.zeros((rows, n_q))))
    lse = m + jnp.log(jnp.where(l > 0, l, 1.0))

    def column_sums(i, mass):
        start, s, mask = scores(i)
        col = (jnp.exp(s - lse[..., None]) * mask).sum(axis=1)  # [R, block]
        old = jax.lax.dynamic_slice_in_dim(mass, start, block, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(mass, old + col, start, axis=1)

    mass = jax.lax.fori_loop(0, n_blocks, column_sums, jnp.zeros((rows, cache.capacity)))
    mass = mass.reshape(cache.batch, -1, cache.capacity)  # [B, KVH or 1, C]
    return jnp.where(cache.pos != EMPTY, mass, 0.0)  # pooled: each slot to its owner head


MATVEC_ROWS = 8
"""Query rows per cache row up to which scores are one matrix-vector product per row.

A decode step has `G*T = 3` query rows per KV head (SmolLM2); XLA:CPU runs the
batched `[Q, D] x [S, D]^T` dot for so few rows 4-8x below its read bandwidth,
and `Q` matrix-vector products `[S, D] x [D]` at it (docs/DECISIONS.md)."""


def _scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """qg [R, Q, D] . k [R, S, D] -> [R, Q, S] float32: few rows as matrix-vector products."""
    n_q = qg.shape[1]
    if n_q > MATVEC_ROWS:
        return jnp.einsum("nqd,nsd->nqs", qg, k, preferred_element_type=jnp.float32)
    rows = [jnp.einsum("nsd,nd->ns", k, qg[:, i], preferred_element_type=jnp.float32)
            for i in range(n_q)]
    return jnp.stack(rows, axis=1)


def read_block(store, start, size: int, length=None):
    """Slots [start, start + size) of a store, decoded to float32 [R, size, D] (Latent stays).

    Only the block is decoded (bit-unpacked, scaled), so a compressed cache
    is never materialised whole: the block stays in the CPU's cache between
    its decode and the dots that read it.
    """
    if isinstance(store, Latent):
        return store.replace(z=jax.lax.dynamic_slice_in_dim(store.z, start, size, axis=1))
    if isinstance(store, PackedChannels):
        return store.read_slots(start, size, length)
    piece = map_slot_leaves(store, lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1))
    return read(piece)


def _parts(cache: Layer) -> tuple[TokenCache, ...]:
    """The `TokenCache`s attention reads, each with its own slots and cursor (`cache.parts()`:
    a residual layer's encoded body, then its exact part, read one after the other without
    joining them, which would decode the body whole); a part of no slots adds nothing."""
    return tuple(part for part in cache.parts() if part.capacity)


def decode_block(rows: int, n_q: int) -> int:
    """Slots per block of `attend_blockwise` when none is given.

    256 for prefill chunks (scores `[R, Q, block]` stay small); for decode
    (`n_q <= MATVEC_ROWS`) about 8192 / `rows` slots, between 256 and 1024,
    so a batch-1 step runs 4x fewer loop iterations (measured on XLA:CPU,
    batch 1, 4096 slots: 1.2 -> 0.86 ms per full layer; docs/DECISIONS.md).

    >>> decode_block(rows=3, n_q=3), decode_block(rows=24, n_q=3), decode_block(3, 768)
    (1024, 256, 256)
    """
    if n_q > MATVEC_ROWS or jax.export.is_symbolic_dim(rows):
        return 256  # symbolic rows: a batch-polymorphic export (kvjax.tools.exported), one block
    return int(min(1024, max(256, 2 ** int(np.log2(max(1, 8192 // max(rows, 1)))))))


def attend_blockwise(q: jax.Array, q_pos: jax.Array, cache: Layer, *, block: int | None = None,
                     window: int | None = None, softcap: float | None = None,
                     scale: float | None = None) -> jax.Array:
    """The same attention, reading only the written slots, `block` slots at a time.

    An online softmax (running max and sum, as in flash attention) runs over
    the blocks `[0, ceil(length / block))`, so the work grows with the
    number of written slots, not the capacity: chunked prefill of a long
    prompt does about half the work of `attend_reference`, and a large,
    mostly empty cache costs nothing. Any capacity works: the last block is
    shifted to end at the capacity and skips the slots an earlier block read.
    `block=None` picks `decode_block(rows, queries)`.

    Encoded layers are read without decoding them whole: each block of codes
    is decoded inside the loop (`kvjax.core.stores.read` of the block), and a
    `ResidualCache` runs the loop over its body, then over its exact part,
    carrying one running softmax. An evicted, shrunk layer reads only its
    kept slots.
    """
    _, l, acc = blockwise_state(q, q_pos, cache, block=block, window=window, softcap=softcap,
                                scale=scale)
    first = cache.parts()[-1]  # a residual layer's exact part: kv heads and key rows
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # a query that saw nothing returns zeros
    return _ungroup(out, q.shape, first.kv_heads)


def blockwise_state(q: jax.Array, q_pos: jax.Array, cache: Layer, *, block: int | None = None,
                    window: int | None = None, softcap: float | None = None,
                    scale: float | None = None):
    """`attend_blockwise`'s running softmax state before it normalises.

    -> (m [R, GT], l [R, GT], acc [R, GT, D]) float32, rows R = B*KVH in (b, kvh) order and GT
    in (g, t) order (`_group_queries`): out = acc / l. The kernel path takes it for layers its
    kernel does not read well (`kvjax.backends.pallas`).
    """
    parts = _parts(cache)
    first = cache.parts()[-1]  # a residual layer's exact part: kv heads and key rows
    # float32 unless the layer is one dense bf16 array (a residual layer, of two parts, is
    # read as float32)
    as_f32 = len(cache.parts()) > 1
    qg = _group_queries(q, q_pos, first, exact_dtype=not as_f32)
    g = q.shape[2] // first.kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, rows, d = qg.shape
    block = decode_block(n, rows) if block is None else block

    def run_part(part: TokenCache, carry):
        size = min(block, part.capacity)

        def step(i, carry):
            m, l, acc = carry  # [N, GT], [N, GT], [N, GT, D]
            start = jnp.minimum(i * size, part.capacity - size)
            k, v = read_block(part.k, start, size, part.length), read_block(part.v, start, size)
            if as_f32:  # a residual layer's exact part in bf16 is read as float32, like its body
                k, v = (x.astype(jnp.float32) if isinstance(x, jax.Array) else x for x in (k, v))
            pos = jax.lax.dynamic_slice_in_dim(part.pos, start, size, axis=2)
            pos = jnp.where(start + jnp.arange(size) >= i * size, pos, EMPTY)  # read once
            s, mask = _masked_scores(qg, k, pos, q_pos, g, window, softcap, scale,
                                     scores=_scores)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None]) * mask
            correction = jnp.exp(m - m_new)
            acc = acc * correction[..., None] + _weighted_values(p, v)
            return m_new, l * correction + p.sum(axis=-1), acc

        n_blocks = (part.length + size - 1) // size
        loop = lambda c: jax.lax.fori_loop(0, n_blocks, step, c)
        if rows > MATVEC_ROWS or not cpu_kernel.usable(part):  # prefill chunks keep the loop
            return loop(carry)
        mask = _row_mask(q_pos, part.pos, g, n, window)  # [N, GT, C]
        kernel = lambda c: cpu_kernel.attend_part(qg, mask, part, c, scale=scale,
                                                  softcap=softcap, exact_dtype=not as_f32)
        # picked when lowering: a TPU or GPU program (deviceless compile) keeps the loop
        return jax.lax.platform_dependent(carry, cpu=kernel, default=loop)

    carry = (jnp.full((n, rows), NEG_INF), jnp.zeros((n, rows)), jnp.zeros((n, rows, d)))
    for part in parts:
        carry = run_part(part, carry)
    return carry
