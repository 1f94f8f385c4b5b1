"""Paged attention: each sequence's queries over its pages of a key/value pool.

One kernel serves decode (T = 1 query per sequence), chunked prefill
(T > 1 queries, causal by position), both packed in one call (`ragged_paged_attention`:
blocks of one sequence's tokens, each reading its sequence's pages through `q_seq`) and
every page format of
`page_formats` (dense, bit-packed per token, KIVI per channel): pages are
decoded to float32 inside the kernel, never in HBM.

Layout (docs/DECISIONS.md, "Paged pool"):
- a pool of P pages, each `S` consecutive slots of one (sequence, KV head):
  keys and values as their format's arrays (dense: `[P, S, D]`; packed:
  lane-flat `[P, 1, rows * S]` uint32, see `page_formats`), and
  `pos_pages` `[P, 1, S]` int32 with the absolute position of every slot
  (`EMPTY = -1` for a free or evicted slot);
- `block_tables` `[B, KVH, NP]` int32: the pages of row (b, h) in slot
  order; only the first `num_pages[b, h]` entries are read. Or, when every
  KV head of a sequence uses the same pages, `[B, NP]` shared by its heads
  with a static `head_stride`: head h reads page `block_tables[b, i] + h *
  head_stride` (a `TokenCache`, `[B*KVH, C, D]` read as `[B*KVH*C/S, S, D]`,
  is this with head_stride = C/S). Shared tables are KVH times smaller in
  SMEM; per-head tables remain for head-wise budgets (Ada-KV), whose heads
  hold different pages.

A key slot is visible to a query when `pos != EMPTY`, `pos <= q_pos`,
`q_pos >= 0` and, with a sliding `window`, `q_pos - pos < window`: the
rule of `kvjax.attention_mask`. Scores are `q.k * scale`, soft-capped as
`softcap * tanh(s / softcap)` when asked.

With a `window`, each row starts at its first page that can hold a visible
slot (`window_start_pages`: the leading pages whose largest position is at
or below `min(q_pos) - window`); the pages before it are neither copied nor
computed. The start is computed from the slot positions themselves (one int32
per listed slot, read by XLA), so it is exact for any pool layout.

Backends:
- `"tpu"`: Mosaic. Block tables and page counts are scalar-prefetched to
  SMEM; the pools stay in HBM (`memory_space=pl.ANY`). The grid
  `(B, KVH, splits, blocks per split)` walks blocks of `pages_per_block`
  pages (default >= 512 slots): each page in use is copied to VMEM by its
  own async DMA, the next block's copies start before this block computes
  (two buffers), and pages past a row's count are neither copied nor
  computed. MXU operands are bf16 for bf16 queries (f32 accumulation), f32
  at HIGHEST otherwise. Online softmax state lives in VMEM scratch.
  `tests/test_tpu_compile.py` compiles every variant with Mosaic for v5e
  and v6e (deviceless); no TPU has run it.
- `"gpu"`: Pallas on Triton (a justified fallback, docs/DECISIONS.md): one
  program per (sequence, KV head, split) loops over its pages in steps of
  `pages_per_block` pages (default 64 slots), each step one `[L, D]` tile
  gathered through the block table (L = pages x S, pages side by side; one
  page a step is a scalar page, so Triton sees contiguous slots); packed
  pages decode elementwise where they load (each channel gathers its own code
  word and group parameters: no reshape); bf16 queries make both dots bf16 x
  bf16 -> f32 (tensor cores); query rows are padded to 16 (`tl.dot`'s
  minimum) and no further. Head dim, page size and pages per step must be
  powers of two (ValueError otherwise). Timed on an H200
  (docs/BENCHMARKS.md); `tests/test_gpu_kernel.py` reads the lowered Triton IR.
Both split the pages into `pages_per_split` chunks (flash-decoding; TPU:
a multiple of `pages_per_block`); the
per-split partial softmax states are merged in plain jnp.

Example:
    >>> k_pages, v_pages = jax.random.normal(jax.random.key(0), (2, 4, 8, 16))  # [P, S, D]
    >>> pos_pages = jnp.arange(32).reshape(4, 1, 8)        # page i holds positions 8i..8i+7
    >>> tables, counts = jnp.array([[[0, 1, 2, 3]]]), jnp.array([[4]])   # B = KVH = 1
    >>> q, q_pos = jax.random.normal(jax.random.key(1), (1, 1, 2, 16)), jnp.array([[31]])
    >>> out = paged_attention(q, q_pos, k_pages, v_pages, pos_pages, tables, counts,
    ...                       backend="tpu", interpret=pltpu.InterpretParams())  # on CPU
    >>> ref = jax.nn.softmax(q[0, 0] @ k_pages.reshape(32, 16).T / 4.0) @ v_pages.reshape(32, 16)
    >>> out.shape, bool(jnp.allclose(out[0, 0], ref, atol=1e-5))
    ((1, 1, 2, 16), True)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.page_formats import (DENSE, GPU_OPS, REFERENCE_OPS, TPU_OPS, Dense, Format,
                                         PackedChannelPages, PackedChannelRows,
                                         PackedChannels, PackedTokenRows, PageRef,
                                         unpack_pairs)

EMPTY = -1  # pos of a slot that holds no token (equals kvjax.EMPTY)
NEG_INF = -1e30  # finite: a query that sees no key stays NaN-free
BACKENDS = ("tpu", "gpu")
GPU_MIN_ROWS = 16  # tl.dot needs at least 16 rows
BLOCK_TOKENS = 512  # TPU: slots copied per grid step by default
GPU_BLOCK_TOKENS = 64  # GPU: slots gathered per loop step by default (measured on an H200: DECISIONS.md)


class Partial(NamedTuple):
    """Unnormalised softmax state of each query row: out = acc / l (0 where l = 0)."""

    acc: jax.Array  # [B, KVH, GT, D] float32  sum_s exp(s - m) v_s
    m: jax.Array  # [B, KVH, GT] float32  running max score
    l: jax.Array  # [B, KVH, GT] float32  sum_s exp(s - m)


# ----------------------------------------------------------------------------- shared math


def _softmax_step(q, k, v, kpos, qpos, carry, *, k_slots_last, v_slots_last, scale, window,
                  softcap, owner_shift=None, k_scale=None, k_offset=None):
    """One page into the online softmax.

    q [GT, D] in the MXU operand dtype; k/v [S, D], or [D, S] when
    `*_slots_last`, in the same dtype; kpos [1, S] int32, qpos [GT, 1] int32;
    carry (m [GT, 1], l [GT, 1], acc [GT, Dv]) float32 (Dv: the values' head dim, which may
    differ from the keys' D). Dots accumulate in f32.
    k_scale [NG, S] float32: per-slot key scales of NG groups of D / NG channels applied to
    the scores (k holds codes); k_offset [NG, S] float32: per-slot key offsets, added as
    offset * sum(q) to the scores. NG > 1 needs slots-last keys: one dot per group, with the
    other groups' query lanes zeroed (exact: the zeros add exact zeros).
    """
    m, l, acc = carry
    # f32 operands: full f32 products (Mosaic's default may be one bf16 pass); bf16: one pass
    prec = lambda x: (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                      else jax.lax.Precision.DEFAULT)
    dot = lambda a: jax.lax.dot_general(a, k, (((1,), (0 if k_slots_last else 1,)), ((), ())),
                                        precision=prec(q), preferred_element_type=jnp.float32)
    n_groups = 1 if k_scale is None else k_scale.shape[0]
    if n_groups == 1:
        s = dot(q) * scale
        if k_scale is not None:
            s = s * k_scale
        if k_offset is not None:  # q . (c * scale + offset) = scale * (q . c) + offset * sum(q)
            q_sum = jnp.sum(q.astype(jnp.float32), axis=1, keepdims=True)  # [GT, 1]
            s = s + (q_sum * scale) * k_offset
    else:  # sum_g scale_g (q_g . c_g) + sum_g offset_g sum(q_g)
        width = q.shape[1] // n_groups
        lane = jax.lax.broadcasted_iota(jnp.int32, q.shape, 1)
        s = None
        for g in range(n_groups):
            q_g = jnp.where((lane >= g * width) & (lane < (g + 1) * width), q,
                            jnp.zeros_like(q))  # [GT, D] group g's lanes
            s_g = dot(q_g) * k_scale[g:g + 1]
            if k_offset is not None:
                s_g = s_g + jnp.sum(q_g.astype(jnp.float32), axis=1, keepdims=True) * \
                    k_offset[g:g + 1]
            s = s_g if s is None else s + s_g
        s = s * scale
    m_new, l_new, p, correction = online_softmax(s, kpos, qpos, m, l, window=window,
                                                 softcap=softcap, owner_shift=owner_shift)
    pv = jax.lax.dot_general(p.astype(v.dtype), v,
                             (((1,), (1 if v_slots_last else 0,)), ((), ())),
                             precision=prec(v), preferred_element_type=jnp.float32)  # [GT, Dv]
    return m_new, l_new, acc * correction + pv


def online_softmax(s, kpos, qpos, m, l, *, window, softcap, owner_shift=None):
    """Scaled scores of one step into the running softmax state.

    s [GT, L] float32 scaled scores; kpos [1, L], qpos [GT, 1] int32; m, l [GT, 1] float32 ->
    (m_new, l_new, p [GT, L] (0 where a slot is not visible), correction [GT, 1]): the caller
    adds `p @ v` to its accumulator times `correction`. With `owner_shift` (slots owned by
    heads, `own_positions`) both positions carry their owner above that bit, and a slot is
    visible only to the rows of its owner: then the positions compare as they are.
    """
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    visible = (kpos != EMPTY) & (qpos >= 0) & (kpos <= qpos)
    if owner_shift is not None:
        visible &= jnp.right_shift(kpos ^ qpos, owner_shift) == 0
    if window is not None:
        visible &= (qpos - kpos) < window
    s = jnp.where(visible, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
    correction = jnp.exp(m - m_new)
    return m_new, l * correction + p.sum(axis=1, keepdims=True), p, correction


def merge(a: Partial, b: Partial) -> Partial:
    """Softmax state over the union of two disjoint key sets (flash-decoding's combine)."""
    m = jnp.maximum(a.m, b.m)
    ca, cb = jnp.exp(a.m - m), jnp.exp(b.m - m)
    return Partial(a.acc * ca[..., None] + b.acc * cb[..., None], m, a.l * ca + b.l * cb)


def finish(p: Partial, q_shape: Sequence[int]) -> jax.Array:
    """Normalise and ungroup: [B, KVH, G*T, Dv] -> [B, T, H, Dv] float32 (q_shape [B, T, H, D])."""
    b, t, h, _ = q_shape
    kvh, d = p.acc.shape[1], p.acc.shape[-1]
    out = p.acc / jnp.where(p.l > 0, p.l, 1.0)[..., None]
    out = out[:, :, : (h // kvh) * t]
    return out.reshape(b, kvh, h // kvh, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def group_queries(q: jax.Array, q_pos: jax.Array, kv_heads: int, rows: int | None = None):
    """[B, T, H, D], [B, T] -> queries [B, KVH, G*T, D] (q's dtype) and positions [B, G*T, 1].

    Row order is (g, t), as in `kvjax.core.attention`. `rows` pads the row axis
    (padding rows have position -1 and see nothing).
    """
    b, t, h, d = q.shape
    g = h // kv_heads
    qg = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)
    pos = jnp.broadcast_to(q_pos[:, None, :], (b, g, t)).reshape(b, g * t, 1)
    if rows is not None and rows > g * t:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g * t), (0, 0)))
        pos = jnp.pad(pos, ((0, 0), (0, rows - g * t), (0, 0)), constant_values=-1)
    return qg, pos.astype(jnp.int32)


def owner_shift(owners: int) -> int:
    """The bit above which `own_positions` stores a slot's owner among `owners` heads: positions
    must stay below 2**owner_shift (2**28 for 8 owners, 2**26 for 32)."""
    return 31 - max(1, (owners - 1).bit_length())


def own_positions(pos: jax.Array) -> jax.Array:
    """[B, KVH, C] positions of a pooled layout (each slot owned by one KV head, EMPTY for the
    others) -> [B, 1, C]: the owner's position with its head index above `owner_shift(KVH)`,
    EMPTY where no head holds the slot.

    Example:
        >>> pos = jnp.array([[[0, -1, 2], [-1, 1, -1]]])   # head 0 owns slots 0, 2; head 1 slot 1
        >>> own_positions(pos)[0, 0].tolist() == [0, 1 << owner_shift(2) | 1, 2]
        True
    """
    shift = owner_shift(pos.shape[1])
    heads = jnp.arange(pos.shape[1], dtype=jnp.int32)[None, :, None]
    owned = jnp.where(pos != EMPTY, pos | jnp.left_shift(heads, shift), EMPTY)
    return owned.max(axis=1, keepdims=True).astype(jnp.int32)


def owned_query_positions(qpos: jax.Array, tokens: int, heads: int, owners: int) -> jax.Array:
    """Grouped query positions [B, rows, 1] of one KV row holding every query head (rows in
    (head, token) order, `group_queries` with one KV head) with each row's owner, the KV head
    of its query head (`heads / owners` query heads each), above `owner_shift(owners)`;
    padding rows stay negative."""
    row = jnp.arange(qpos.shape[1], dtype=jnp.int32)[None, :, None]
    owner = jnp.minimum(row // tokens, heads - 1) // (heads // owners)
    return jnp.where(qpos >= 0, qpos | jnp.left_shift(owner, owner_shift(owners)), qpos)


# ----------------------------------------------------------------------------- TPU (Mosaic)


def _math(k_format, v_format, math, compute_dtype):
    return dict(math, k_slots_last=k_format.slots_last, v_slots_last=v_format.slots_last,
                compute_dtype=compute_dtype)


def _page_step(q, k_format, k_blocks, v_format, v_blocks, kpos, qpos, carry, ops, *, k_dim,
               v_dim, compute_dtype, **math):
    if getattr(k_format, "scales_scores", lambda d: False)(k_dim):
        # per-slot key scales on the [GT, S] scores instead of the [D, S] keys (exact)
        k, k_scale, k_offset = k_format.decode_codes(k_blocks, ops, k_dim, compute_dtype)
    else:
        k, k_scale, k_offset = k_format.decode(k_blocks, ops, k_dim, compute_dtype), None, None
    v = v_format.decode(v_blocks, ops, v_dim, compute_dtype)
    return _softmax_step(q.astype(compute_dtype), k, v, kpos, qpos, carry, k_scale=k_scale,
                         k_offset=k_offset, **math)


def _tpu_kernel(tables_ref, counts_ref, starts_ref, windows_ref, seq_ref, qpos_ref, q_ref, *refs,
                k_format,
                v_format, kv_heads, table_len, head_stride, pages_per_block, blocks_per_split,
                math, row_pages=None, slot_axes=None, page_size=None):
    # tables_ref [S*KVH*NP], or shared [S*NP] when head_stride is set, int32 (SMEM), S
    # sequences; seq_ref [B] int32 (SMEM): the sequence query row b reads (its table);
    # counts_ref / starts_ref [B*KVH] int32 (SMEM), per query row: the
    # row's pages [start, count) of its table are read, from start on in blocks;
    # windows_ref [ceil(R * row_pages / 2)] int32 (SMEM): row pool page p's first table row
    # (`PackedChannelRows`' windows, slot axis 0) in bits 16 (p % 2) of word p // 2 (`pack_pairs`:
    # half the SMEM), [1] unused otherwise;
    # qpos_ref [GT, 1], q_ref [GT, D] (VMEM blocks of this (b, h); the values' head dim is
    # the accumulator's, acc_sc [GT, Dv]);
    # refs: the pools in HBM (pos [P, 1, S], then each format array [P, ...]; or, with
    # `row_pages`, row pools [R, X, C] / [R, C, X] whose page p is row p // row_pages's slots
    # (p % row_pages) * S + [0, S) along `slot_axes`; axis 3: [R / n, n, C], row r one
    # sublane at [r // n, r % n], as positions; axis 0: a table [R / n, n, N] so, whose page p
    # reads its window from its first table row, `windows_ref`), the outputs,
    # a VMEM double buffer [2, NPB, ...] per pool, DMA semaphores [2], softmax state.
    nk, nv = k_format.arity(), v_format.arity()
    n = 1 + nk + nv
    pools, (acc_out, m_out, l_out), bufs = refs[:n], refs[n:n + 3], refs[n + 3:2 * n + 3]
    sem, m_sc, l_sc, acc_sc = refs[2 * n + 3:]
    b, h, split, j = (pl.program_id(i) for i in range(4))
    row, seq = b * kv_heads + h, seq_ref[b]
    table_row, head_offset = ((seq * kv_heads + h, 0) if head_stride is None
                              else (seq, h * head_stride))
    count = counts_ref[row]
    start = starts_ref[row]
    first = lambda blk: start + (split * blocks_per_split + blk) * pages_per_block

    formats = (None, *[k_format] * nk, *[v_format] * nv)

    def window_lanes(page, fmt, buf):
        """Page `page`'s table window (`PackedChannelRows`): the buffer's width of lanes from
        its first table row's, a multiple of 128 (`PackedChannelRows.row_align`)."""
        word = windows_ref[jax.lax.div(page, 2)]
        first_row = jax.lax.shift_right_logical(word, jax.lax.rem(page, 2) * 16) & 0xFFFF
        lanes = first_row * (buf.shape[-1] // fmt.window)
        return pl.ds(pl.multiple_of(lanes, 128), buf.shape[-1])

    def copies(blk, slot):
        """The DMAs of block `blk`'s pages in use into buffer `slot`, as (when, copy) pairs."""
        out = []
        for i in range(pages_per_block):
            idx = first(blk) + i
            entry = table_row * table_len + jnp.minimum(idx, table_len - 1)
            page = tables_ref[entry] + head_offset
            n_pages = pools[1].shape[0] * (row_pages or 1)  # pages (rows) of the key pool
            page = jnp.clip(page, 0, n_pages - 1)
            if row_pages is None:
                srcs = [pool.at[page] for pool in pools]
            else:  # a page is a slice of its row: the cache's own layout, no conversion
                r, c = jax.lax.div(page, row_pages), jax.lax.rem(page, row_pages)
                cols = pl.ds(pl.multiple_of(c * page_size, page_size), page_size)

                def sublane(pool, lanes):  # [R / n, n, X]: row r is [r // n, r % n]
                    n = pool.shape[1]
                    return pool.at[jax.lax.div(r, n), pl.ds(jax.lax.rem(r, n), 1), lanes]

                srcs = [sublane(pools[0], cols)] + [
                    pool.at[r, :, cols] if axis == 2 else pool.at[r, cols, :] if axis == 1
                    else sublane(pool, cols) if axis == 3
                    else sublane(pool, window_lanes(page, fmt, buf))
                    for pool, axis, fmt, buf in zip(pools[1:], slot_axes[1:], formats[1:],
                                                    bufs[1:])]
            out.append((idx < count, [pltpu.make_async_copy(src, buf.at[slot, i], sem.at[slot])
                                      for src, buf in zip(srcs, bufs)]))
        return out

    def run(blk, slot, method):
        for when, dmas in copies(blk, slot):
            @pl.when(when)
            def _():
                for dma in dmas:
                    getattr(dma, method)()

    slot = jax.lax.rem(j, 2)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        run(0, 0, "start")

    @pl.when(j + 1 < blocks_per_split)
    def _prefetch():  # the next block's pages copy while this block computes
        run(j + 1, 1 - slot, "start")

    @pl.when(first(j) < count)
    def _block():
        run(j, slot, "wait")
        q, qpos = q_ref[...], qpos_ref[...]

        def page(i, carry):
            pos, *blocks = [buf.at[slot, i] for buf in bufs]
            return _page_step(q, k_format, blocks[:nk], v_format, blocks[nk:], pos[...], qpos,
                              carry, TPU_OPS, k_dim=q_ref.shape[-1], v_dim=acc_sc.shape[-1],
                              **math)

        in_use = jnp.minimum(count - first(j), pages_per_block)
        m, l, acc = jax.lax.fori_loop(0, in_use, page, (m_sc[...], l_sc[...], acc_sc[...]))
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    @pl.when(j == blocks_per_split - 1)
    def _store():
        acc_out[...] = acc_sc[...]
        m_out[...] = m_sc[...]
        l_out[...] = l_sc[...]


def _tpu_call(qg, qpos, k_arrays, v_arrays, pos_pages, tables, counts, starts, q_seq, *,
              k_format, v_format, pages_per_split, pages_per_block, splits, math, interpret,
              read_pages, head_stride, value_dim, rows_=None, table_windows=None):
    b, kvh, rows, d = qg.shape
    dv = value_dim
    pools = (pos_pages, *k_arrays, *v_arrays)
    # rows_: (row pools, row_pages, slot axes): DMA pages straight out of the cache's rows
    page_shapes = [x.shape[1:] for x in pools]
    row_pages = slot_axes = None
    if rows_ is not None:
        pools, row_pages, slot_axes = rows_
    blocks_per_split = pages_per_split // pages_per_block
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_block = lambda *tail: pl.BlockSpec((None, None, None, rows, *tail),
                                           lambda bi, h, split, j, *_: (split, bi, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(b, kvh, splits, blocks_per_split),
        in_specs=[pl.BlockSpec((None, rows, 1), lambda bi, h, *_: (bi, 0, 0)),
                  pl.BlockSpec((None, None, rows, d), lambda bi, h, *_: (bi, h, 0, 0)),
                  *[hbm] * len(pools)],
        out_specs=[out_block(dv), out_block(1), out_block(1)],
        scratch_shapes=[*[pltpu.VMEM((2, pages_per_block, *shape), x.dtype)
                          for shape, x in zip(page_shapes, pools)],
                        pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, dv), jnp.float32)])
    kernel = functools.partial(_tpu_kernel, k_format=k_format, v_format=v_format,
                               kv_heads=kvh, table_len=tables.shape[-1], head_stride=head_stride,
                               pages_per_block=pages_per_block,
                               blocks_per_split=blocks_per_split, math=math,
                               row_pages=row_pages, slot_axes=slot_axes,
                               page_size=pos_pages.shape[-1])
    state = jax.ShapeDtypeStruct((splits, b, kvh, rows, 1), jnp.float32)
    acc, m, l = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        cost_estimate=cost_estimate(qg, k_format, k_arrays, v_format, v_arrays, pos_pages,
                                    tables, splits, read_pages, dv),
        out_shape=[jax.ShapeDtypeStruct((splits, b, kvh, rows, dv), jnp.float32), state, state],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="kvjax_paged_attention_tpu",
    )(tables.reshape(-1), counts.reshape(-1), starts.reshape(-1),
      jnp.zeros((1,), jnp.int32) if table_windows is None else table_windows, q_seq, qpos, qg,
      *pools)
    return acc, m[..., 0], l[..., 0]


def cost_estimate(qg, k_format, k_arrays, v_format, v_arrays, pos_pages, tables,
                  splits, read_pages: int | None = None,
                  value_dim: int | None = None) -> pl.CostEstimate:
    """What the kernel does with full block tables, counted from its blocks and grid.

    Bytes: `read_pages` pages per row (default: the whole table; with a
    window, `window_pages`) with each format array and the slot positions
    once, the queries once per (row, split), the softmax state out. Flops:
    both dots (2 * rows * S * D, 2 * rows * S * Dv) and each format's decode. Compiled
    programs report this for the custom call (XLA cannot see inside).
    """
    b, kvh, rows, d = qg.shape
    dv = value_dim or d
    n_table = tables.shape[-1]
    pages = b * kvh * (n_table if read_pages is None else min(read_pages, n_table))
    page_size = pos_pages.shape[-1]
    nbytes = lambda x: x.size // x.shape[0] * x.dtype.itemsize  # one page of a pool array
    per_page = sum(nbytes(x) for x in (pos_pages, *k_arrays, *v_arrays))
    io = splits * b * kvh * (rows * (d * qg.dtype.itemsize + dv * 4) + rows * 4 * 3)
    flops = pages * (2 * rows * page_size * (d + dv) + k_format.decode_flops(d, page_size)
                     + v_format.decode_flops(dv, page_size))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(pages * rows * page_size),
                           bytes_accessed=int(pages * per_page + io))


# ----------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(tables_ref, counts_ref, starts_ref, seq_ref, qpos_ref, q_ref, pos_ref, *refs,
                k_format, v_format, pages_per_split, pages_per_step, math, head_stride):
    # tables_ref [S, KVH, NP] or shared [S, NP] (S sequences), counts_ref / starts_ref [B, KVH]
    # per query row, seq_ref [B] the sequence (table) query row b reads: whole arrays;
    # qpos_ref [GT, 1]; q_ref [GT, D]; acc_out [GT, Dv]; pos_ref [P, 1, S] and every format
    # array [P, ...]: whole
    # pools. Each loop step gathers `pages_per_step` pages side by side: L = pages_per_step * S
    # columns, column j being slot j % S of the step's page j // S.
    nk, nv = k_format.arity(), v_format.arity()
    k_refs, v_refs = refs[:nk], refs[nk:nk + nv]
    acc_out, m_out, l_out = refs[nk + nv:]
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, d = q_ref.shape
    dv = acc_out.shape[-1]
    qpos = qpos_ref[...]
    first = starts_ref[b, h] + split * pages_per_split
    last = jnp.minimum(first + pages_per_split, counts_ref[b, h])
    page_size = pos_ref.shape[-1]
    cols = pages_per_step * page_size
    col = jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)
    # the column's page within the step: [1, L], or one scalar page a step, whose gathers
    # Triton can see are contiguous along the slots (vector loads)
    which = jax.lax.div(col, page_size) if pages_per_step > 1 else 0
    slot = jax.lax.rem(col, page_size)
    q = q_ref[...]
    seq = seq_ref[b]
    lookup = lambda i: (tables_ref[seq, h, i] if head_stride is None
                        else tables_ref[seq, i] + h * head_stride)

    def body(step, carry):
        idx = first + step * pages_per_step + which  # [1, L] table entries (or one)
        live = idx < last
        # a column past the row's pages re-reads the row's last page (finite data), masked EMPTY
        page = lookup(jnp.minimum(idx, last - 1))
        kpos = jnp.where(live, pos_ref[page, 0, slot], EMPTY)  # [1, L]
        blocks = lambda fmt_refs: [PageRef(r, page) for r in fmt_refs]
        return _page_step(q, k_format, blocks(k_refs), v_format, blocks(v_refs), kpos, qpos,
                          carry, GPU_OPS, k_dim=d, v_dim=dv, **math)

    init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, dv), jnp.float32))
    steps = jax.lax.div(jnp.maximum(last - first, 0) + pages_per_step - 1, pages_per_step)
    m, l, acc = jax.lax.fori_loop(0, steps, body, init)
    acc_out[...] = acc
    m_out[...], l_out[...] = m, l


def gpu_launch(rows: int, head_dim: int, cols: int, k_format, v_format) -> tuple[int, int]:
    """(num_warps, num_stages) for a Triton program of `rows` query rows over `cols` slots a step.

    Dense pages: four warps, eight once a step's [cols, D] tile reaches 128 x 128 or the
    rows 64 (as jax's own GPU paged attention uses), and two stages (the loop's gathers of
    step i + 1 overlap step i's math); on an H200 bf16 pages read at 0.97-1.04 of copy
    bandwidth so (docs/BENCHMARKS.md). Packed pages: one stage, because Triton stages each
    channel's `[D, L]` word and parameter gathers in shared memory (int4 at D = 128: 168 KB
    at two stages, one program per multiprocessor; 37 KB at one); four warps, the fewest
    instructions a step, except for KIVI keys, whose per-slot table gathers spill at four
    (eight: none). From `experiments/bench/triton_static.py` (docs/BENCHMARKS.md); not yet
    timed on a GPU.
    """
    big = cols * head_dim >= 128 * 128 or rows >= 64
    if isinstance(k_format, Dense) and isinstance(v_format, Dense):
        return (8 if big else 4), 2
    return (8 if big or isinstance(k_format, PackedChannels) else 4), 1


def _gpu_call(qg, qpos, k_arrays, v_arrays, pos_pages, tables, counts, starts, q_seq, *,
              k_format, v_format, pages_per_split, pages_per_block, splits, math, interpret,
              read_pages, head_stride, value_dim, launch=None):
    b, kvh, rows, d = qg.shape
    dv = value_dim
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    out_block = lambda *tail: pl.BlockSpec((None, None, None, rows, *tail),
                                           lambda bi, h, s: (s, bi, h, 0, 0))
    kernel = functools.partial(_gpu_kernel, k_format=k_format, v_format=v_format,
                               pages_per_split=pages_per_split, pages_per_step=pages_per_block,
                               math=math, head_stride=head_stride)
    num_warps, num_stages = launch or gpu_launch(rows, d, pages_per_block * pos_pages.shape[-1],
                                                 k_format, v_format)
    state = jax.ShapeDtypeStruct((splits, b, kvh, rows, 1), jnp.float32)
    acc, m, l = pl.pallas_call(
        kernel, grid=(b, kvh, splits),
        in_specs=[whole(tables), whole(counts), whole(starts), whole(q_seq),
                  pl.BlockSpec((None, rows, 1), lambda bi, h, s: (bi, 0, 0)),
                  pl.BlockSpec((None, None, rows, d), lambda bi, h, s: (bi, h, 0, 0)),
                  whole(pos_pages), *[whole(x) for x in (*k_arrays, *v_arrays)]],
        out_specs=[out_block(dv), out_block(1), out_block(1)],
        out_shape=[jax.ShapeDtypeStruct((splits, b, kvh, rows, dv), jnp.float32), state, state],
        cost_estimate=cost_estimate(qg, k_format, k_arrays, v_format, v_arrays, pos_pages,
                                    tables, splits, read_pages, dv),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="kvjax_paged_attention_gpu",
    )(tables, counts, starts, q_seq, qpos, qg, pos_pages, *k_arrays, *v_arrays)
    return acc, m[..., 0], l[..., 0]


# ----------------------------------------------------------------------------- public entry


def _as_arrays(x) -> tuple[jax.Array, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _check_inputs(q, q_pos, k_arrays, v_arrays, pos_pages, tables, counts, k_format, v_format,
                  pages_per_split, backend, head_stride=None, value_dim=None, q_seq=None):
    if backend not in BACKENDS:
        raise ValueError(f"paged_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if q.ndim != 4 or q_pos.shape != q.shape[:2]:
        raise ValueError(f"paged_attention: q must be [B, T, H, D] and q_pos [B, T]; got "
                         f"{q.shape} and {q_pos.shape}")
    b, _, h, d = q.shape
    if q_seq is not None:  # query rows read the tables of sequences q_seq: S table rows
        if q_seq.shape != (b,) or q_seq.dtype != jnp.int32:
            raise ValueError(f"paged_attention: q_seq must be int32 [B={b}] (the sequence each "
                             f"query row reads), got {q_seq.dtype} {q_seq.shape}")
        b = tables.shape[0] if tables.ndim in (2, 3) else b
    if value_dim is not None and not (isinstance(value_dim, int) and value_dim >= 1):
        raise ValueError(f"paged_attention: value_dim must be a positive int (the values' head "
                         f"dim), got {value_dim!r}")
    dims = {"keys": d, "values": value_dim or d}
    if tables.ndim not in (2, 3) or tables.shape[0] != b or tables.dtype != jnp.int32:
        raise ValueError(f"paged_attention: block_tables must be int32 [B={b}, KVH, NP] (per "
                         f"head) or [B={b}, NP] (shared), got {tables.dtype} {tables.shape}")
    if (tables.ndim == 2) != (head_stride is not None):
        raise ValueError(f"paged_attention: head_stride is required with shared [B, NP] "
                         f"block_tables and only with them; got head_stride={head_stride} with "
                         f"block_tables {tables.shape}")
    if head_stride is not None and head_stride < 0:
        raise ValueError(f"paged_attention: head_stride must be >= 0, got {head_stride}")
    kvh = tables.shape[1] if tables.ndim == 3 else counts.shape[-1]
    if h % kvh:
        raise ValueError(f"paged_attention: {h} query heads are not a multiple of {kvh} KV heads")
    if counts.shape != (b, kvh) or counts.dtype != jnp.int32:
        raise ValueError(f"paged_attention: num_pages must be int32 {(b, kvh)}, got "
                         f"{counts.dtype} {counts.shape}")
    if pos_pages.ndim != 3 or pos_pages.shape[1] != 1 or pos_pages.dtype != jnp.int32:
        raise ValueError(f"paged_attention: pos_pages must be int32 [P, 1, S], got "
                         f"{pos_pages.dtype} {pos_pages.shape}")
    n_pages, _, page_size = pos_pages.shape
    for name, fmt, arrays in (("keys", k_format, k_arrays), ("values", v_format, v_arrays)):
        if backend == "gpu" and isinstance(fmt, (PackedChannelRows, PackedChannelPages)):
            raise ValueError(f"paged_attention: {name} in {fmt} are read by the TPU kernel "
                             f"only; the GPU kernel takes PackedChannels pages")
        if len(arrays) != fmt.arity():
            raise ValueError(f"paged_attention: {name} in format {fmt} take "
                             f"{fmt.arity()} arrays, got {len(arrays)}")
        try:
            fmt.check(arrays, dims[name])
        except ValueError as e:
            dim = "value_dim" if name == "values" and value_dim else "head_dim (q.shape[-1])"
            raise ValueError(f"paged_attention: {name} of {dim} {dims[name]}: {e}") from None
        if arrays[0].shape[0] != n_pages or fmt.page_size(arrays, dims[name]) != page_size:
            raise ValueError(f"paged_attention: {name} pages {arrays[0].shape} do not match "
                             f"pos_pages ({n_pages} pages of {page_size} slots)")
    if pages_per_split < 1:
        raise ValueError(f"paged_attention: pages_per_split must be >= 1, got {pages_per_split}")


def _check_owners(slot_owners, kv_heads: int, heads: int) -> None:
    if slot_owners is None:
        return
    if not (isinstance(slot_owners, int) and 1 <= slot_owners and heads % slot_owners == 0):
        raise ValueError(f"paged_attention: slot_owners must be a positive int dividing the "
                         f"{heads} query heads, got {slot_owners!r}")
    if kv_heads != 1:
        raise ValueError(f"paged_attention: slot_owners reads one KV row per sequence shared by "
                         f"its heads; num_pages must be [B, 1], got {kv_heads} KV heads")


def _compute_dtype(q_dtype, compute_dtype):
    if compute_dtype is None:
        return jnp.bfloat16 if q_dtype == jnp.bfloat16 else jnp.float32
    if jnp.dtype(compute_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"paged_attention: compute_dtype must be bfloat16 or float32, got "
                         f"{compute_dtype}")
    return jnp.dtype(compute_dtype)


def block_sizes(n_table: int, page_size: int, pages_per_split: int,
                pages_per_block: int | None) -> tuple[int, int, int]:
    """(pages per grid step, pages per split (a multiple of it), splits) for a table of n_table.

    By default a TPU grid step copies at least `BLOCK_TOKENS` slots (one DMA
    per page, double-buffered), so per-step overhead amortises over >= 512
    tokens.
    """
    n_table = max(n_table, 1)
    npb = pages_per_block or -(-BLOCK_TOKENS // page_size)
    npb = max(1, min(npb, n_table))
    per_split = -(-max(pages_per_split, npb) // npb) * npb
    per_split = min(per_split, -(-n_table // npb) * npb)
    return npb, per_split, -(-n_table // per_split)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_gpu_shapes(head_dim: int, page_size: int, pages_per_block: int | None,
                     dim_name: str = "head_dim") -> None:
    """Triton loads and dots power-of-two blocks with at least 16 rows on each dot axis.

    Raises ValueError naming the argument for a head dim or page size the
    GPU backend cannot take (at trace time, before Triton fails later).
    """
    if not _pow2(head_dim) or head_dim < GPU_MIN_ROWS:
        where = " (q.shape[-1])" if dim_name == "head_dim" else ""
        raise ValueError(f"paged_attention: backend='gpu' needs a power-of-two {dim_name} >= "
                         f"{GPU_MIN_ROWS}{where}, got {head_dim}")
    if not _pow2(page_size):
        raise ValueError(f"paged_attention: backend='gpu' needs a power-of-two page size "
                         f"(pos_pages.shape[-1]), got {page_size}")
    if pages_per_block is not None and not _pow2(pages_per_block):
        raise ValueError(f"paged_attention: backend='gpu' needs a power-of-two pages_per_block, "
                         f"got {pages_per_block}")


def gpu_block_sizes(n_table: int, page_size: int, pages_per_split: int,
                    pages_per_block: int | None) -> tuple[int, int, int]:
    """GPU: (pages per loop step, pages per split (a multiple of it), splits).

    A step gathers `GPU_BLOCK_TOKENS` slots by default (a power of two: Triton
    blocks are), never more pages than the table's next power of two, and at
    least 16 slots (`tl.dot`'s minimum K for the p @ v dot).
    """
    n_table = max(n_table, 1)
    npb = pages_per_block or max(1, GPU_BLOCK_TOKENS // page_size)
    npb = min(npb, 1 << (n_table - 1).bit_length())
    npb = max(npb, -(-GPU_MIN_ROWS // page_size))
    per_split = -(-max(pages_per_split, npb) // npb) * npb
    per_split = min(per_split, -(-n_table // npb) * npb)
    return npb, per_split, -(-n_table // per_split)


def per_head_tables(block_tables: jax.Array, kv_heads: int,
                    head_stride: int | None) -> jax.Array:
    """[B, KVH, NP] tables: as given, or shared [B, NP] tables expanded by head_stride."""
    if head_stride is None:
        return block_tables
    heads = jnp.arange(kv_heads, dtype=jnp.int32)[None, :, None] * head_stride
    return block_tables[:, None, :] + heads


def window_start_pages(q_pos: jax.Array, pos_pages: jax.Array, block_tables: jax.Array,
                       num_pages: jax.Array, window: int | None) -> jax.Array:
    """[B, KVH] int32: each row's leading pages that no query of its sequence sees (skippable).

    A slot at position p is visible to a query at q only if p > q - window,
    so a page whose largest position is <= min(valid q_pos) - window holds
    nothing visible (EMPTY = -1 included). The count of such pages at the
    head of the row's table (at most `num_pages`) is where the kernel starts.
    Exact for any pool: it reads the positions, one int32 per listed slot
    (XLA fuses the gather into the max). A row with no valid query skips all
    its pages. Without a window: zeros.
    """
    if window is None:
        return jnp.zeros(num_pages.shape, jnp.int32)
    q_min = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max - window), axis=1)
    page_max = pos_pages[block_tables, 0].max(axis=-1)  # [B, KVH, NP]
    dead = page_max <= (q_min - window)[:, None, None]
    lead = jnp.cumprod(dead.astype(jnp.int32), axis=-1).sum(axis=-1)
    return jnp.minimum(lead, num_pages).astype(jnp.int32)


def window_pages(window: int | None, q_len: int, page_size: int) -> int | None:
    """Most pages a row reads with a window when its positions advance one per slot.

    The T queries of a chunk see slots `min(q) - window + 1 .. max(q)`:
    window + T - 1 consecutive slots, spanning at most this many pages. (Rows
    with holes or compacted slots may read more; the kernel reads what
    `window_start_pages` leaves.) None without a window.
    """
    if window is None:
        return None
    span = window + q_len - 1
    return (span + page_size - 2) // page_size + 1


@functools.partial(jax.jit, static_argnames=("k_format", "v_format", "pages_per_split", "window",
                                             "softcap", "scale", "backend", "interpret",
                                             "compute_dtype", "pages_per_block",
                                             "head_stride", "row_pages", "launch",
                                             "value_dim", "slot_owners"))
def paged_attention_partial(q, q_pos, k_pages, v_pages, pos_pages, block_tables, num_pages, *,
                            k_format: Format = DENSE, v_format: Format = DENSE,
                            pages_per_split: int = 8, window: int | None = None,
                            softcap: float | None = None, scale: float | None = None,
                            backend: str = "tpu", interpret=False,
                            compute_dtype=None, pages_per_block: int | None = None,
                            head_stride: int | None = None,
                            row_pages: int | None = None,
                            table_windows: jax.Array | None = None,
                            launch: tuple[int, int] | None = None,
                            value_dim: int | None = None,
                            slot_owners: int | None = None,
                            q_seq: jax.Array | None = None) -> Partial:
    """The kernel's softmax state over each row's pages, splits merged; see `paged_attention`."""
    k_arrays, v_arrays = _as_arrays(k_pages), _as_arrays(v_pages)
    rows_ = None
    if row_pages is not None:  # row pools: the page views below only give shapes to the TPU path
        rows_ = _row_pools(pos_pages, k_arrays, v_arrays, k_format, v_format, row_pages,
                           table_windows)
        pos_pages, k_arrays, v_arrays = rows_as_pages(pos_pages, k_arrays, v_arrays, k_format,
                                                      v_format, row_pages, table_windows)
    elif table_windows is not None:
        raise ValueError("paged_attention: table_windows goes with row_pages (row pools) only")
    _check_inputs(q, q_pos, k_arrays, v_arrays, pos_pages, block_tables, num_pages, k_format,
                  v_format, pages_per_split, backend, head_stride, value_dim, q_seq)
    kvh = num_pages.shape[1]
    tables = per_head_tables(block_tables, kvh, head_stride)
    if q_seq is None:
        q_seq = jnp.arange(q.shape[0], dtype=jnp.int32)
    else:  # each query row's sequence: its page counts and tables
        num_pages, tables = num_pages[q_seq], tables[q_seq]
    _check_owners(slot_owners, kvh, q.shape[2])
    if pages_per_block is not None and pages_per_block < 1:
        raise ValueError(f"paged_attention: pages_per_block must be >= 1, got {pages_per_block}")
    n_table = block_tables.shape[-1]
    if backend == "tpu":
        npb, pages_per_split, splits = block_sizes(n_table, pos_pages.shape[-1], pages_per_split,
                                                   pages_per_block)
    else:
        check_gpu_shapes(q.shape[-1], pos_pages.shape[-1], pages_per_block)
        if value_dim is not None:
            check_gpu_shapes(value_dim, pos_pages.shape[-1], pages_per_block, "value_dim")
        npb, pages_per_split, splits = gpu_block_sizes(n_table, pos_pages.shape[-1],
                                                       pages_per_split, pages_per_block)
    rows = q.shape[1] * q.shape[2] // kvh
    if backend == "gpu":
        rows = max(GPU_MIN_ROWS, 1 << (rows - 1).bit_length())
    cdt = _compute_dtype(q.dtype, compute_dtype)
    qg, qpos = group_queries(q.astype(cdt), q_pos, kvh, rows)
    shift = None
    if slot_owners is not None:
        qpos, shift = (owned_query_positions(qpos, q.shape[1], q.shape[2], slot_owners),
                       owner_shift(slot_owners))
    math = _math(k_format, v_format, dict(scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                          window=window, softcap=softcap, owner_shift=shift),
                 cdt)
    if launch is not None and (backend != "gpu" or not isinstance(launch, tuple) or
                               len(launch) != 2 or
                               not all(isinstance(n, int) and n >= 1 for n in launch)):
        raise ValueError(f"paged_attention: launch must be (num_warps, num_stages), positive "
                         f"ints, with backend='gpu'; got {launch!r} with backend={backend!r}")
    call = (functools.partial(_tpu_call, rows_=rows_, table_windows=table_windows)
            if backend == "tpu" else
            functools.partial(_gpu_call, launch=launch))
    # a row with no query reads nothing (its state stays empty either way)
    starts = jnp.where(jnp.any(q_pos >= 0, axis=1)[:, None],
                       window_start_pages(q_pos, pos_pages, tables, num_pages, window), num_pages)
    acc, m, l = call(qg, qpos, k_arrays, v_arrays, pos_pages, block_tables, num_pages, starts,
                     q_seq, k_format=k_format, v_format=v_format, pages_per_split=pages_per_split,
                     splits=splits, math=math, interpret=interpret,
                     read_pages=window_pages(window, q.shape[1], pos_pages.shape[-1]),
                     head_stride=head_stride, pages_per_block=npb,
                     value_dim=value_dim or q.shape[-1])
    out = Partial(acc[0], m[0], l[0])
    for i in range(1, splits):
        out = merge(out, Partial(acc[i], m[i], l[i]))
    return out


def _slot_axes(k_format, k_arrays, v_format, v_arrays) -> tuple[int, ...]:
    """The slot axis of each row pool (pos first): 2 for slot-last arrays, 1 for [R, C, D],
    3 for [R / n, n, C] (a row a sublane, as positions), 0 for a table so laid out and read in
    per-page windows (`PackedChannelRows`)."""
    axes = lambda fmt, n: getattr(fmt, "row_axes", None) or (2 if fmt.slots_last else 1,) * n
    return (2, *axes(k_format, len(k_arrays)), *axes(v_format, len(v_arrays)))


ROW_FORMATS = (Dense, PackedTokenRows, PackedChannelRows)


def _row_pools(pos_rows, k_arrays, v_arrays, k_format, v_format, row_pages: int,
               table_windows=None):
    """Check row pools -> (pools, row_pages, slot axes) for the TPU kernel."""
    if row_pages < 1:
        raise ValueError(f"paged_attention: row_pages must be >= 1, got {row_pages}")
    for name, fmt in (("keys", k_format), ("values", v_format)):
        if not isinstance(fmt, ROW_FORMATS):
            raise ValueError(f"paged_attention: row_pages reads Dense, PackedTokenRows and "
                             f"PackedChannelRows row pools only; {name} are in format {fmt}")
    pools = (pos_rows, *k_arrays, *v_arrays)
    axes = _slot_axes(k_format, k_arrays, v_format, v_arrays)
    r = k_arrays[0].shape[0]
    if pos_rows.ndim != 3 or pos_rows.shape[0] * pos_rows.shape[1] != r:
        raise ValueError(f"paged_attention: with row_pages, pos_pages must be [R / n, n, C] "
                         f"for the pools' R = {r} rows (row r at [r // n, r % n]: [B, KVH, C] "
                         f"or [R, 1, C]), got {pos_rows.shape}")
    c = pos_rows.shape[2]
    for x, axis in zip(pools[1:], axes[1:]):
        sublanes = axis in (0, 3)  # [R / n, n, X]
        rows = x.shape[0] * x.shape[1] if sublanes and x.ndim == 3 else x.shape[0]
        if x.ndim != 3 or rows != r or (axis and x.shape[min(axis, 2)] != c):
            raise ValueError(f"paged_attention: row pools must all be [R={r}, ..., C={c}] "
                             f"([R / n, n, ...] for ids and tables) along the slot axis "
                             f"{axis}; got {x.shape}")
    if c % row_pages:
        raise ValueError(f"paged_attention: row_pages {row_pages} must divide the rows' "
                         f"{c} slots")
    windows = 0 in axes
    want = (-(-r * row_pages // 2),)
    if windows and (table_windows is None or table_windows.shape != want
                    or table_windows.dtype != jnp.int32):
        got = None if table_windows is None else f"{table_windows.dtype} {table_windows.shape}"
        raise ValueError(f"paged_attention: PackedChannelRows needs table_windows, int32 "
                         f"{list(want)} (each page's first table row, two per word: "
                         f"pack_pairs), got {got}")
    if not windows and table_windows is not None:
        raise ValueError("paged_attention: table_windows is for PackedChannelRows tables only")
    return pools, row_pages, axes


def rows_as_pages(pos_rows, k_arrays, v_arrays, k_format, v_format, row_pages: int,
                  table_windows=None):
    """Row pools [R, X, C] ([R, C, D] for row-major dense) -> page pools of C / row_pages slots.

    Page r * row_pages + i is slots [i*S, (i+1)*S) of row r; a table read in windows
    ([R / n, n, N], slot axis 0) gives page p its window from its first table row
    (`table_windows`, `pack_pairs`). A copy
    in XLA (the reference and GPU paths read these); the TPU kernel reads the rows in place.
    """
    def pages(x, axis, fmt):
        if axis in (0, 3):  # [R / n, n, X] -> [R, 1, X]
            x, axis = x.reshape(-1, 1, x.shape[2]), axis and 2
        r, s = x.shape[0], x.shape[axis] // row_pages
        if axis == 0:  # [R, 1, N] -> [R*n, 1, width]: each page's window
            width = fmt.window_lanes(k_arrays[0] if fmt is k_format else v_arrays[0])
            row = jnp.arange(r * row_pages) // row_pages
            first = unpack_pairs(table_windows, r * row_pages) * (width // fmt.window)
            return x[row[:, None], 0, first[:, None] + jnp.arange(width)][:, None]
        if axis == 1:  # [R, C, X] -> [R*n, S, X]: a reshape
            return x.reshape(r * row_pages, s, x.shape[2])
        y = x.reshape(r, x.shape[1], row_pages, s)  # [R, X, n, S]
        return jnp.swapaxes(y, 1, 2).reshape(r * row_pages, x.shape[1], s)

    axes = _slot_axes(k_format, k_arrays, v_format, v_arrays)
    formats = (None, *[k_format] * len(k_arrays), *[v_format] * len(v_arrays))
    pos_rows = pos_rows.reshape(-1, 1, pos_rows.shape[-1])  # [B, KVH, C] -> [R, 1, C]
    out = [pages(x, a, f) for x, a, f in zip((pos_rows, *k_arrays, *v_arrays), axes, formats)]
    nk = len(k_arrays)
    return out[0], tuple(out[1:1 + nk]), tuple(out[1 + nk:])


def paged_attention(q, q_pos, k_pages, v_pages, pos_pages, block_tables, num_pages, **kwargs):
    """Attention of `q` over the pages each (sequence, KV head) lists, decoded in the kernel.

    Args:
      q: [B, T, H, D] queries (after RoPE); H a multiple of KVH.
      q_pos: [B, T] int32 query positions; negative = padding (output zeros).
      k_pages, v_pages: the key/value pool in `k_format` / `v_format`
        (an array, or a tuple of arrays; dense: [P, S, D]; see `page_formats`).
      pos_pages: [P, 1, S] int32 slot positions, EMPTY = -1.
      block_tables: [B, KVH, NP] int32 page indices in [0, P); or [B, NP]
        shared by a sequence's KV heads, with `head_stride`.
      num_pages: [B, KVH] int32 pages in use per row (<= NP).
      k_format, v_format: `page_formats.Dense()`, `PackedTokens(...)`,
        `PackedChannels(...)`.
      pages_per_split: pages per flash-decoding split (static; TPU: rounded up
        to a multiple of pages_per_block).
      pages_per_block: TPU: pages per grid step (default: >= 512 slots); GPU:
        pages per loop step, a power of two (default: 64 slots).
      head_stride: with shared [B, NP] tables (static): KV head h of row b
        reads page `block_tables[b, i] + h * head_stride`.
      launch: GPU only, (num_warps, num_stages) of the Triton program (static; default
        `gpu_launch`'s choice), for tuning.
      row_pages: (static) the pools are *row pools*, a cache's own rows: pos
        [R / n, n, C] (row r at [r // n, r % n]: a cache's own [B, KVH, C] positions, read
        in place, or [R, 1, C]), dense keys/values [R, C, D] (or [R, D, C] slot-last), page
        r * row_pages + i being slots [i*S, (i+1)*S) of row r (S = C /
        row_pages; `PackedTokenRows` arrays [R, X, C]; `PackedChannelRows`
        words and ids [R, X, C] and a table [R, 1, N]). The TPU kernel DMAs
        pages straight out of the rows (no copy of the cache into a page
        pool); other paths use `rows_as_pages`.
      table_windows: with `PackedChannelRows` row pools, [ceil(R * row_pages / 2)]
        int32: page p's table window starts at table row (table_windows[p // 2] >>
        16 (p % 2)) & 0xFFFF of its row's table (`page_formats.pack_pairs`).
      q_seq: [B] int32, the sequence (row of block_tables and num_pages) each query row
        reads, when query rows are not one per sequence (`ragged_paged_attention`: several
        blocks of one sequence's queries); default query row b reads sequence b.
      slot_owners: (static) a pooled layout (head-wise budgets): one KV row per sequence
        (num_pages [B, 1]) whose slots are each owned by one of `slot_owners` KV heads,
        positions made by `own_positions`; query head j reads only the slots of owner
        j // (H / slot_owners). Each page is read once for every query head.
      value_dim: (static) the values' head dim Dv when it differs from the keys' and
        queries' D (low-rank latents of different ranks, MLA-style heads); default D.
        The output is then [B, T, H, Dv].
      window, softcap, scale: as in `kvjax.attend`; scale defaults to D**-0.5.
        With a window, pages wholly before it are skipped
        (`window_start_pages`).
      backend: "tpu" (Mosaic) or "gpu" (Triton); interpret: as in pallas_call.
      compute_dtype: MXU operand dtype (dots accumulate in float32); default
        bfloat16 for bfloat16 queries, else float32.
    Returns:
      [B, T, H, Dv] float32 (Dv = value_dim, default D).
    """
    return finish(paged_attention_partial(q, q_pos, k_pages, v_pages, pos_pages, block_tables,
                                          num_pages, **kwargs), q.shape)


def ragged_blocks(cu_q_lens: jax.Array, n_tokens: int, block_tokens: int):
    """Packed query tokens cut into blocks of `block_tokens` tokens of one sequence each.

    cu_q_lens [S + 1] int32: sequence s's tokens are `[cu_q_lens[s], cu_q_lens[s + 1])` of
    the packed `n_tokens` (tokens past `cu_q_lens[S]` are padding). Returns (token [NB, Tq]
    int32: the packed index each block slot holds, `n_tokens` where none; seq [NB] int32: the
    block's sequence), NB = ceil(n_tokens / Tq) + S, enough for any lengths (each sequence
    leaves at most one partial block); blocks past the last hold no token.

    Example:
        >>> token, seq = ragged_blocks(jnp.array([0, 1, 6, 6]), 8, 4)   # lengths 1, 5, 0
        >>> token[:3].tolist(), seq[:3].tolist()
        ([[0, 8, 8, 8], [1, 2, 3, 4], [5, 8, 8, 8]], [0, 1, 1])
    """
    n_seq = cu_q_lens.shape[0] - 1
    n_blocks = -(-n_tokens // block_tokens) + n_seq
    lens = jnp.diff(cu_q_lens)
    ends = jnp.cumsum(-(-lens // block_tokens))  # [S] blocks up to and including s
    block = jnp.arange(n_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, block, side="right"), n_seq - 1).astype(jnp.int32)
    local = block - (ends[seq] - -(-lens[seq] // block_tokens))  # the block's index in its seq
    offset = local[:, None] * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    held = (block < ends[-1])[:, None] & (offset < lens[seq][:, None])
    token = jnp.where(held, cu_q_lens[seq][:, None] + offset, n_tokens)
    return token.astype(jnp.int32), seq


def ragged_paged_attention(q, q_pos, cu_q_lens, k_pages, v_pages, pos_pages, block_tables,
                           num_pages, *, block_tokens: int = 16, **kwargs) -> jax.Array:
    """Packed queries of many sequences -- prefill chunks and decode tokens alike -- in one call.

    As jax's `ragged_paged_attention`: q [N, H, D] and q_pos [N] are the tokens of S sequences
    packed back to back, sequence s's at `[cu_q_lens[s], cu_q_lens[s + 1])` (dynamic; tokens
    past `cu_q_lens[S]` are padding and get zeros). The tokens are cut into blocks of
    `block_tokens` tokens of one sequence (`ragged_blocks`), each block a query row of one
    kernel call that reads its sequence's pages (`q_seq`): a decode token costs one block, not
    a row padded to the longest chunk. Blocks holding no token read no page. `kwargs` as
    `paged_attention` (pools, formats, window, ...). Returns [N, H, Dv] float32.

    Example:
        >>> k, v = jax.random.normal(jax.random.key(0), (2, 4, 8, 16))   # [P, S, D]
        >>> pos = jnp.arange(32).reshape(4, 1, 8)
        >>> tables = jnp.array([[[0, 1]], [[2, 3]]])   # two sequences, KVH = 1, 16 slots each
        >>> counts = jnp.array([[2], [2]])
        >>> q = jax.random.normal(jax.random.key(1), (4, 2, 16))   # 3 tokens of seq 0, 1 of seq 1
        >>> q_pos, cu = jnp.array([13, 14, 15, 31]), jnp.array([0, 3, 4])
        >>> out = ragged_paged_attention(q, q_pos, cu, k, v, pos, tables, counts, backend="tpu",
        ...                              interpret=True, block_tokens=2)   # on CPU
        >>> alone = paged_attention(q[None, 3:], q_pos[None, 3:], k, v, pos, tables[1:],
        ...                         counts[1:], backend="tpu", interpret=True)
        >>> out.shape, bool(jnp.allclose(out[3], alone[0, 0], atol=1e-5))
        ((4, 2, 16), True)
    """
    n = q.shape[0]
    if q.ndim != 3 or q_pos.shape != (n,) or cu_q_lens.ndim != 1 or cu_q_lens.shape[0] < 2:
        raise ValueError(f"ragged_paged_attention: q must be [N, H, D], q_pos [N] and "
                         f"cu_q_lens [S + 1]; got {q.shape}, {q_pos.shape}, {cu_q_lens.shape}")
    if cu_q_lens.shape[0] - 1 != num_pages.shape[0]:
        raise ValueError(f"ragged_paged_attention: cu_q_lens has {cu_q_lens.shape[0] - 1} "
                         f"sequences, num_pages {num_pages.shape[0]}")
    if not (isinstance(block_tokens, int) and block_tokens >= 1):
        raise ValueError(f"ragged_paged_attention: block_tokens must be an int >= 1, got "
                         f"{block_tokens!r}")
    token, seq = ragged_blocks(cu_q_lens.astype(jnp.int32), n, block_tokens)
    held = token < n
    qb = q[jnp.minimum(token, n - 1)]  # [NB, Tq, H, D]
    qb_pos = jnp.where(held, q_pos[jnp.minimum(token, n - 1)], -1)
    out = paged_attention(qb, qb_pos.astype(jnp.int32), k_pages, v_pages, pos_pages,
                          block_tables, num_pages, q_seq=seq, **kwargs)  # [NB, Tq, H, Dv]
    flat = out.reshape(-1, *out.shape[2:])
    return jnp.zeros((n, *out.shape[2:]), out.dtype).at[token.reshape(-1)].set(flat, mode="drop")


# ----------------------------------------------------------------------------- reference


def decode_pages(fmt: Format, arrays, head_dim: int) -> jax.Array:
    """Decode every page of a pool in plain jnp: [P, S, D] float32."""
    one = lambda *blocks: fmt.decode(blocks, REFERENCE_OPS, head_dim)
    pages = jax.vmap(one)(*arrays)
    return jnp.swapaxes(pages, 1, 2) if fmt.slots_last else pages


def gather_pages(fmt: Format, arrays, block_tables: jax.Array, head_dim: int) -> jax.Array:
    """Decode every listed page in plain jnp: [B, KVH, NP*S, D] float32."""
    b, kvh, n_table = block_tables.shape
    pages = decode_pages(fmt, arrays, head_dim)[block_tables]  # [B, KVH, NP, S, D]
    return pages.reshape(b, kvh, -1, head_dim)


def paged_attention_reference(q, q_pos, k_pages, v_pages, pos_pages, block_tables, num_pages, *,
                              k_format: Format = DENSE, v_format: Format = DENSE,
                              window: int | None = None, softcap: float | None = None,
                              scale: float | None = None, head_stride: int | None = None,
                              row_pages: int | None = None, table_windows=None,
                              value_dim: int | None = None, slot_owners: int | None = None,
                              q_seq: jax.Array | None = None, **_) -> jax.Array:
    """Plain-jnp paged attention: gather and decode every page, one masked softmax, float32."""
    k_arrays, v_arrays = _as_arrays(k_pages), _as_arrays(v_pages)
    if row_pages is not None:
        pos_pages, k_arrays, v_arrays = rows_as_pages(pos_pages, k_arrays, v_arrays, k_format,
                                                      v_format, row_pages, table_windows)
    block_tables = per_head_tables(block_tables, num_pages.shape[1], head_stride)
    if q_seq is not None:
        block_tables, num_pages = block_tables[q_seq], num_pages[q_seq]
    b, t, h, d = q.shape
    kvh, n_table = block_tables.shape[1:]
    page_size = pos_pages.shape[-1]
    dv = value_dim or d
    k = gather_pages(k_format, k_arrays, block_tables, d)  # [B, KVH, L, D]
    v = gather_pages(v_format, v_arrays, block_tables, dv)  # [B, KVH, L, Dv]
    pos = pos_pages[block_tables, 0].reshape(b, kvh, -1)  # [B, KVH, L]
    in_use = jnp.arange(n_table * page_size) < (num_pages * page_size)[..., None]
    pos = jnp.where(in_use, pos, EMPTY)
    qg = q.reshape(b, t, kvh, h // kvh, d).astype(jnp.float32)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, precision="highest")
    s = s * (d ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    kp, qp = pos[:, :, None, None, :], q_pos[:, None, None, :, None]
    if slot_owners is not None:  # decode the owner; each query head sees its KV head's slots
        shift = owner_shift(slot_owners)
        owner = jnp.where(kp >= 0, jnp.right_shift(kp, shift), -1)
        kp = jnp.where(kp >= 0, kp & ((1 << shift) - 1), EMPTY)
        mine = jnp.arange(h // kvh)[None, None, :, None, None] // (h // slot_owners)
        kp = jnp.where(owner == mine, kp, EMPTY)
    visible = (kp != EMPTY) & (qp >= 0) & (kp <= qp)
    if window is not None:
        visible &= (qp - kp) < window
    p = jax.nn.softmax(jnp.where(visible, s, NEG_INF), axis=-1) * visible.any(-1, keepdims=True)
    out = jnp.einsum("bkgts,bksd->btkgd", p, v, precision="highest")
    return out.reshape(b, t, h, dv)
