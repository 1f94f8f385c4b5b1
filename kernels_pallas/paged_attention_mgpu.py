"""Paged attention as a Mosaic GPU kernel (Hopper: TMA copies, wgmma, warpgroup semantics).

The same contract as `paged_attention.paged_attention_partial` (the softmax
state of each (sequence, KV head) row over the pages its block table lists,
split into flash-decoding chunks that plain jnp merges), written the way
jax's own Mosaic GPU ops are (`jax/experimental/pallas/ops/gpu/*_mgpu.py`):

- metadata from GMEM refs, not scalar prefetch: the block tables, page counts
  and start pages are whole int32 GMEM refs read by scalar loads, as
  `ragged_dot_mgpu` reads its group sizes; the pipeline's index maps read the
  block table, so each TMA copy fetches the page the table names;
- `plgpu.emit_pipeline` over the row's pages, `pages_per_step` pages a step,
  `max_concurrent_steps` steps in flight (TMA copies GMEM -> SMEM while the
  previous step computes). The pipeline's trip count is the row's own page
  count (a traced int): pages past it are neither copied nor computed;
- both dots are `plgpu.wgmma` (bf16 x bf16 -> f32 accumulators) with the
  query rows padded to one warpgroup's 64 rows (wgmma's M);
  `s = q @ K^T` takes the key page as the B operand `[D, S]`: a slots-last
  page (`Dense(slots_last=True)` or a decoded packed page) directly, a
  `[S, D]` dense page through `plgpu.transpose_ref`; `p @ V` takes a `[S, D]`
  value page directly and a decoded `[D, S]` page through `transpose_ref`;
- packed per-token pages (`PackedTokens`: 2/4/8-bit codes with a scale and
  offset per token and group of channels) are unpacked in registers, as in
  `hopper_mixed_type_matmul_mgpu` (SMEM words -> registers -> shifts and masks
  -> bf16, exact integers), into an SMEM `[D, S]` tile fed to wgmma; the
  per-token parameters act on the `[64, S]` tiles instead of the `[D, S]`
  page: keys as q_g . c * scale_g + sum(q_g) * offset_g per group g (q_g: the
  queries zeroed outside group g's channels), values as (p * scale_g) @ c +
  p . offset_g, kept on group g's channels. Only p (and p * scale) is rounded
  to bf16 before its wgmma;
- online softmax in float32 registers; m and l leave as [64] vectors, the
  accumulator as [64, D], by TMA stores.

Shapes: head dim and page size multiples of 64 (one 128-byte swizzled bf16
row: `TilingTransform((8, 64))` + `SwizzleTransform(128)`, as
`attention_mgpu`), at most 64 query rows per KV head (G * T), packed formats
with `32 // bits` code planes of `D * bits / 32` rows (a multiple of 8) that
each fall in one parameter group. Anything else raises ValueError naming the
argument. KIVI (`PackedChannels`) pages are not read here (Triton reads them).

Status: proven on CPU only. `tests/test_mgpu_kernel.py` runs it in jax's GPU
interpret mode (simulated GMEM/SMEM, TMA, barriers, wgmma) element-wise
against `paged_attention_reference`, and lowers the dense bf16 kernel for
CUDA on a CPU host (wgmma m64n64k16 bf16 -> f32, TMA loads). Two limits of
jax 0.10.2 shape it: (1) its GPU interpreter cannot apply a
`TransposeTransform` to a wgmma operand (AttributeError in
`interpret.utils.to_range`), nor run `run_state` or `layout_cast`; the tests
install `interpret_transposed_wgmma` (that one transform, nothing else), and
the kernel uses fresh accumulators and no layout casts; (2) lowering a packed
format for CUDA fails Mosaic GPU layout inference ("Layout inference failed
to find a solution"): a `[W, S]` code plane (W = 8 rows for 4-bit, D = 64)
stored into a swizzled bf16 SMEM tile has no layout; the packed path is
interpret-proven only. No GPU has run any of it: `attend(impl="pallas")` on a
GPU stays on Triton, and this kernel is chosen explicitly (call
`paged_attention_mgpu`; `experiments/bench/kernels.py` times it).

Example (GPU interpret mode on CPU):
    >>> from kernels_pallas.paged_attention import paged_attention_reference
    >>> k = jax.random.normal(jax.random.key(0), (2, 64, 64), jnp.bfloat16)   # [P, D, S]
    >>> v = jax.random.normal(jax.random.key(1), (2, 64, 64), jnp.bfloat16)   # [P, S, D]
    >>> pos = jnp.arange(128, dtype=jnp.int32).reshape(2, 1, 64)
    >>> tables, counts = jnp.array([[[1, 0]]], jnp.int32), jnp.array([[2]], jnp.int32)
    >>> q = jax.random.normal(jax.random.key(2), (1, 1, 2, 64), jnp.bfloat16)
    >>> q_pos = jnp.array([[100]], jnp.int32)
    >>> kw = dict(k_format=pf.DENSE_T, v_format=pf.DENSE)
    >>> out = paged_attention_mgpu(q, q_pos, k, v, pos, tables, counts, interpret=INTERPRET, **kw)
    >>> ref = paged_attention_reference(q, q_pos, k, v, pos, tables, counts, **kw)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=3e-2))
    ((1, 1, 2, 64), True)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import (EMPTY, NEG_INF, Partial, _as_arrays, _check_inputs,
                                            finish, group_queries, merge, per_head_tables,
                                            window_start_pages)

ROWS = 64  # query rows per (sequence, KV head): one warpgroup's wgmma M
TILE = 64  # bf16 elements in one 128-byte swizzled SMEM row
INTERPRET = InterpretGPUParams()  # GPU interpret mode: pass as `interpret=` on a CPU host


def _swizzled():
    return (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(2 * TILE))


def _is_dense(fmt) -> bool:
    return isinstance(fmt, pf.Dense)


def check_mgpu_shapes(head_dim: int, page_size: int, rows: int, k_format, v_format,
                      pages_per_step: int, max_concurrent_steps: int) -> None:
    """Raise ValueError (naming the argument) for shapes this kernel does not take."""
    if head_dim % TILE:
        raise ValueError(f"paged_attention_mgpu: head_dim (q.shape[-1]) must be a multiple of "
                         f"{TILE}, got {head_dim}")
    if page_size % TILE or page_size > 256:
        raise ValueError(f"paged_attention_mgpu: page size (pos_pages.shape[-1]) must be 64, 128, "
                         f"192 or 256 (a multiple of {TILE}, wgmma N <= 256), got {page_size}")
    if rows > ROWS:
        raise ValueError(f"paged_attention_mgpu: query rows per KV head (query heads per KV "
                         f"head x T) must be <= {ROWS}, got {rows}")
    if pages_per_step < 1:
        raise ValueError(f"paged_attention_mgpu: pages_per_step must be >= 1, got "
                         f"{pages_per_step}")
    if max_concurrent_steps < 1:
        raise ValueError(f"paged_attention_mgpu: max_concurrent_steps must be >= 1, got "
                         f"{max_concurrent_steps}")
    for name, fmt in (("k_format", k_format), ("v_format", v_format)):
        if _is_dense(fmt):
            continue
        if not isinstance(fmt, pf.PackedTokens):
            raise ValueError(f"paged_attention_mgpu: {name} must be Dense or PackedTokens, got "
                             f"{fmt} (KIVI pages: use the Triton kernel)")
        w = head_dim * fmt.bits // 32
        if w % 8:
            raise ValueError(f"paged_attention_mgpu: {name} {fmt}: a code plane of D*bits/32 = "
                             f"{w} word rows must be a multiple of 8 rows (head_dim "
                             f"{head_dim}, bits {fmt.bits}: head_dim * bits >= 256)")


# ----------------------------------------------------------------------------- decode


def _params(words_smem, first_row: int, n: int, dtype: str) -> list:
    """n logical parameter rows of a page (`pf.pack_rows` layout) -> [S] float32 vectors each."""
    if dtype == "float32":
        return [lax.bitcast_convert_type(words_smem[first_row + i], jnp.float32)
                for i in range(n)]
    half = -(-n // 2)
    out = []
    for i in range(n):
        w = lax.bitcast_convert_type(words_smem[first_row + i % half], jnp.int32)  # [S]
        out.append(pf.half_to_f32((w >> (16 * (i // half))) & 0xFFFF, dtype))
    return out


def token_params(fmt: pf.PackedTokens, words_smem, head_dim: int):
    """A packed page's per-token parameters: (scales, offsets), one [S] f32 vector per group.

    Symmetric codes c in [0, 2**bits) decode to scale * (c - 2**(bits-1)): offset =
    -2**(bits-1) * scale, so every page decodes to codes * scale + offset.
    """
    ng = head_dim // fmt.group
    params = _params(words_smem, head_dim * fmt.bits // 32, fmt.n_params(head_dim),
                     fmt.param_dtype)
    scales = params[:ng]
    if fmt.symmetric:
        return scales, [x * (-(2.0 ** (fmt.bits - 1))) for x in scales]
    return scales, params[ng:]


def unpack_codes(fmt: pf.PackedTokens, words_smem, out_smem, head_dim: int) -> None:
    """A packed page's codes, SMEM words [W + NW, S] uint32 -> SMEM [D, S] bf16 (exact integers).

    In registers, as the mixed-type matmul dequantizes: code plane j (channels
    j*W .. j*W + W - 1, `pf.unpack_planes`) is the words shifted by j*bits and masked.
    """
    w = head_dim * fmt.bits // 32
    words = words_smem[0:w]  # [W, S] uint32
    mask = jnp.full(words.shape, (1 << fmt.bits) - 1, jnp.uint32)
    for j in range(32 // fmt.bits):
        plane = (words >> jnp.full(words.shape, j * fmt.bits, jnp.uint32)) & mask
        out_smem[j * w:(j + 1) * w, :] = plane.astype(jnp.int32).astype(out_smem.dtype)


def group_masks(fmt, head_dim: int) -> jax.Array:
    """[NG, D] float32: 1 on the channels of parameter group g (dense: one group of all)."""
    group = fmt.group if isinstance(fmt, pf.PackedTokens) else head_dim
    ch = jnp.arange(head_dim)
    return (ch[None, :] // group == jnp.arange(head_dim // group)[:, None]).astype(jnp.float32)


# ----------------------------------------------------------------------------- kernel


def _kernel(tables_gmem, counts_gmem, starts_gmem, qpos_gmem, q_gmem, qsum_gmem, vmask_gmem,
            pos_gmem, k_gmem, v_gmem, acc_gmem, m_gmem, l_gmem, *, k_format, v_format, kv_heads,
            table_len, head_stride, pages_per_split, pages_per_step, max_concurrent_steps, scale,
            window, softcap):
    # tables_gmem [B*KVH*NP] or shared [B*NP]; counts_gmem / starts_gmem [B*KVH] int32
    # qpos_gmem [B, 64] int32; q_gmem [B, KVH, NGK, 64, D] bf16: the queries (packed keys: one
    # copy per key group, zero outside it); qsum_gmem [B, KVH, NGK, 64] f32: each copy's sum;
    # vmask_gmem [NGV, 64, D] f32: value group g's channels; pos_gmem [P, S] int32
    # k_gmem / v_gmem: dense [P, S, D] / [P, D, S] bf16, or packed words [P, W + NW, S] uint32
    # outputs: acc_gmem [splits, B*KVH, 64, D], m_gmem / l_gmem [splits, B*KVH, 64] float32
    row, split = lax.axis_index("row"), lax.axis_index("split")
    b = lax.div(row, kv_heads)
    h = row - b * kv_heads
    d = q_gmem.shape[-1]
    ngk, ngv = q_gmem.shape[2], vmask_gmem.shape[0]
    s_len = pos_gmem.shape[-1]
    n = pages_per_step
    k_packed, v_packed = not _is_dense(k_format), not _is_dense(v_format)
    table_row, head_offset = (row, 0) if head_stride is None else (b, h * head_stride)
    count = counts_gmem[row]
    first = starts_gmem[row] + split * pages_per_split
    last = jnp.minimum(first + pages_per_split, count)
    steps = lax.div(jnp.maximum(last - first, 0) + n - 1, n)

    def page_of(step, j):
        """Pool page of this row's j-th page in `step` (the last in-use page past the end)."""
        idx = jnp.minimum(first + step * n + j, jnp.maximum(last - 1, 0))
        entry = table_row * table_len + jnp.minimum(idx, table_len - 1)
        return jnp.clip(tables_gmem[entry] + head_offset, 0, pos_gmem.shape[0] - 1)

    def spec(block, j, transforms=()):
        return plgpu.BlockSpec((None, *block), lambda i: (page_of(i, j), 0, 0)[:1 + len(block)],
                               transforms=transforms)

    def pool_spec(fmt, x, j):
        return spec(x.shape[1:], j, _swizzled() if _is_dense(fmt) else ())

    in_specs = ([spec((s_len,), j) for j in range(n)]
                + [pool_spec(k_format, k_gmem, j) for j in range(n)]
                + [pool_spec(v_format, v_gmem, j) for j in range(n)])

    def scope(q_smem, qsum_smem, vmask_smem, qpos_smem, p_smem, kdec_smem, vdec_smem, acc_smem,
              m_smem, l_smem, bar):
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(qpos_gmem.at[b], qpos_smem, bar.at[1])
        plgpu.copy_gmem_to_smem(qsum_gmem.at[b, h], qsum_smem, bar.at[2])
        plgpu.copy_gmem_to_smem(vmask_gmem, vmask_smem, bar.at[3])
        for i in range(4):
            plgpu.barrier_wait(bar.at[i])
        qpos = qpos_smem[...]  # [64] int32
        rows_b = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])  # [64] -> [64, N]
        cols_b = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])  # [N] -> [64, N]

        def dot(a_ref, b_ref, cols):
            def body(acc_ref):
                plgpu.wgmma(acc_ref, a_ref, b_ref)
                return acc_ref[...]
            return pl.run_scoped(body, plgpu.ACC((ROWS, cols), jnp.float32))

        def scores(j, k_ref):
            """[64, S] f32 q.k (before the softmax scale) of page j of the step."""
            if not k_packed:
                kop = k_ref if k_format.slots_last else plgpu.transpose_ref(k_ref, (1, 0))
                return dot(q_smem.at[0], kop, s_len)
            unpack_codes(k_format, k_ref, kdec_smem.at[j], d)
            plgpu.commit_smem()
            k_scales, k_offsets = token_params(k_format, k_ref, d)
            shape = (ROWS, s_len)
            s = None
            for g in range(ngk):  # q_g . (c * scale_g + offset_g) over group g's channels
                part = (dot(q_smem.at[g], kdec_smem.at[j], s_len) * cols_b(k_scales[g], shape)
                        + rows_b(qsum_smem[g], shape) * cols_b(k_offsets[g], shape))
                s = part if s is None else s + part
            return s

        def step(idx, *refs):
            (i,) = idx
            pos_refs, k_refs, v_refs = refs[:n], refs[n:2 * n], refs[2 * n:3 * n]
            m, l, acc = refs[-1]
            shape = (ROWS, s_len)
            tiles = []
            for j in range(n):
                s = scores(j, k_refs[j]) * scale
                if softcap is not None:
                    s = softcap * jnp.tanh(s / softcap)
                # a page past the row's count (re-read, finite) is masked: no position <= -2
                live = first + i * n + j < last
                kmax = jnp.where(live, jnp.iinfo(jnp.int32).max, EMPTY - 1)
                kp = cols_b(pos_refs[j][...], shape)
                qp = rows_b(qpos, shape)
                visible = (kp != EMPTY) & (kp <= kmax) & (qp >= 0) & (kp <= qp)
                if window is not None:
                    visible &= (qp - kp) < window
                # explicit fills: warpgroup lowering does not broadcast a scalar in a select
                tiles.append((jnp.where(visible, s, jnp.full(shape, NEG_INF, jnp.float32)),
                              visible))
            m_new = m
            for s, _ in tiles:
                m_new = jnp.maximum(m_new, s.max(axis=1))
            correction = jnp.exp(m - m_new)
            l = l * correction
            acc = acc * rows_b(correction, acc.shape)
            extra = [None] * ngv  # sum_s p_s * offset_g,s per value group
            for j, (s, visible) in enumerate(tiles):
                p = jnp.where(visible, jnp.exp(s - rows_b(m_new, shape)),
                              jnp.zeros(shape, jnp.float32))
                l = l + p.sum(axis=1)
                if not v_packed:
                    p_smem.at[j, 0][...] = p.astype(p_smem.dtype)
                    continue
                unpack_codes(v_format, v_refs[j], vdec_smem.at[j], d)
                v_scales, v_offsets = token_params(v_format, v_refs[j], d)
                for g in range(ngv):
                    p_smem.at[j, g][...] = (p * cols_b(v_scales[g], shape)).astype(p_smem.dtype)
                    e = (p * cols_b(v_offsets[g], shape)).sum(axis=1)
                    extra[g] = e if extra[g] is None else extra[g] + e
            plgpu.commit_smem()
            for g in range(ngv):
                pv = None
                for j in range(n):
                    vop = (plgpu.transpose_ref(vdec_smem.at[j], (1, 0)) if v_packed else
                           plgpu.transpose_ref(v_refs[j], (1, 0)) if v_format.slots_last
                           else v_refs[j])
                    # a fresh accumulator per product (the GPU interpreter has no run_state)
                    x = dot(p_smem.at[j, g], vop, d)
                    pv = x if pv is None else pv + x
                if v_packed:  # keep group g's channels of (p * scale_g) @ codes, add offsets
                    pv = (pv + rows_b(extra[g], acc.shape)) * vmask_smem[g]
                acc = acc + pv
            return m_new, l, acc

        init = (jnp.full((ROWS,), NEG_INF, jnp.float32), jnp.zeros((ROWS,), jnp.float32),
                jnp.zeros((ROWS, d), jnp.float32))
        # at least one step: a row without pages reads a clamped page, all masked (its state
        # stays m = NEG_INF, l = 0; a constant-filled store would need 128 elements)
        m, l, acc = plgpu.emit_pipeline(
            step, grid=(jnp.maximum(steps, 1),), in_specs=in_specs,
            max_concurrent_steps=max_concurrent_steps, init_carry=init,
        )(*[pos_gmem] * n, *[k_gmem] * n, *[v_gmem] * n)
        acc_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, acc_gmem.at[split, row])
        plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[split, row])
        plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[split, row])
        plgpu.wait_smem_to_gmem(0)

    bf16 = jnp.bfloat16
    pl.run_scoped(
        scope,
        plgpu.SMEM((ngk, ROWS, d), bf16, transforms=_swizzled()),
        plgpu.SMEM((ngk, ROWS), jnp.float32),
        plgpu.SMEM((ngv, ROWS, d), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.int32),
        plgpu.SMEM((n, ngv, ROWS, s_len), bf16, transforms=_swizzled()),
        plgpu.SMEM((n, d, s_len), bf16, transforms=_swizzled()) if k_packed else None,
        plgpu.SMEM((n, d, s_len), bf16, transforms=_swizzled()) if v_packed else None,
        plgpu.SMEM((ROWS, d), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.Barrier(num_barriers=4),
    )


def _pool_array(fmt, arrays, head_dim: int) -> jax.Array:
    """The kernel's view of a pool: dense as is (bf16), packed [P, 1, R*S] -> [P, R, S] (free)."""
    (x,) = arrays
    if _is_dense(fmt):
        return x.astype(jnp.bfloat16)
    return x.reshape(x.shape[0], fmt.rows(head_dim), -1)


@functools.partial(jax.jit, static_argnames=("k_format", "v_format", "pages_per_split", "window",
                                             "softcap", "scale", "interpret", "pages_per_step",
                                             "max_concurrent_steps", "head_stride"))
def paged_attention_mgpu_partial(q, q_pos, k_pages, v_pages, pos_pages, block_tables, num_pages,
                                 *, k_format=pf.DENSE, v_format=pf.DENSE,
                                 pages_per_split: int = 64, pages_per_step: int = 2,
                                 max_concurrent_steps: int = 2, window: int | None = None,
                                 softcap: float | None = None, scale: float | None = None,
                                 head_stride: int | None = None, interpret=False) -> Partial:
    """The Mosaic GPU kernel's softmax state over each row's pages, splits merged.

    Arguments as `paged_attention.paged_attention_partial`; operands are bf16
    (dense pages are cast to bf16; packed pages decode to bf16), accumulation
    float32. `pages_per_step` pages are copied and computed per pipeline step,
    `max_concurrent_steps` steps in flight. Returns `Partial` with rows [:G*T].
    """
    k_arrays, v_arrays = _as_arrays(k_pages), _as_arrays(v_pages)
    _check_inputs(q, q_pos, k_arrays, v_arrays, pos_pages, block_tables, num_pages, k_format,
                  v_format, max(pages_per_split, 1), "gpu", head_stride)
    b, t, hq, d = q.shape
    kvh = num_pages.shape[1]
    page_size = pos_pages.shape[-1]
    check_mgpu_shapes(d, page_size, t * hq // kvh, k_format, v_format, pages_per_step,
                      max_concurrent_steps)
    n_table = block_tables.shape[-1]
    per_split = -(-max(pages_per_split, pages_per_step) // pages_per_step) * pages_per_step
    per_split = min(per_split, -(-max(n_table, 1) // pages_per_step) * pages_per_step)
    splits = -(-max(n_table, 1) // per_split)
    qg, qpos = group_queries(q.astype(jnp.bfloat16), q_pos, kvh, ROWS)  # [B, KVH, 64, D]
    starts = window_start_pages(q_pos, pos_pages, per_head_tables(block_tables, kvh, head_stride),
                                num_pages, window)
    kernel = functools.partial(
        _kernel, k_format=k_format, v_format=v_format, kv_heads=kvh, table_len=n_table,
        head_stride=head_stride, pages_per_split=per_split, pages_per_step=pages_per_step,
        max_concurrent_steps=max_concurrent_steps,
        scale=d ** -0.5 if scale is None else scale, window=window, softcap=softcap)
    state = jax.ShapeDtypeStruct((splits, b * kvh, ROWS), jnp.float32)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits, b * kvh, ROWS, d), jnp.float32), state, state),
        grid=(b * kvh, splits), grid_names=("row", "split"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret)
    kmask = group_masks(k_format, d)  # [NGK, D]
    qk = qg[:, :, None] * kmask[:, None, :].astype(qg.dtype)  # [B, KVH, NGK, 64, D], exact
    qsum = qk.astype(jnp.float32).sum(-1)  # [B, KVH, NGK, 64]
    vmask = jnp.broadcast_to(group_masks(v_format, d)[:, None, :],
                             (group_masks(v_format, d).shape[0], ROWS, d))
    acc, m, l = call(block_tables.reshape(-1), num_pages.reshape(-1), starts.reshape(-1),
                     qpos[..., 0], qk, qsum, vmask,
                     pos_pages.reshape(pos_pages.shape[0], page_size),
                     _pool_array(k_format, k_arrays, d), _pool_array(v_format, v_arrays, d))
    rows = t * hq // kvh
    part = lambda i: Partial(acc[i].reshape(b, kvh, ROWS, d)[:, :, :rows],
                             m[i].reshape(b, kvh, ROWS)[:, :, :rows],
                             l[i].reshape(b, kvh, ROWS)[:, :, :rows])
    out = part(0)
    for i in range(1, splits):
        out = merge(out, part(i))
    return out


def paged_attention_mgpu(q, q_pos, k_pages, v_pages, pos_pages, block_tables, num_pages,
                         **kwargs) -> jax.Array:
    """`paged_attention` on the Mosaic GPU kernel: [B, T, H, D] float32."""
    return finish(paged_attention_mgpu_partial(q, q_pos, k_pages, v_pages, pos_pages,
                                               block_tables, num_pages, **kwargs), q.shape)


# ----------------------------------------------------------------------------- interpret support


def interpret_transposed_wgmma():
    """Teach jax 0.10.2's GPU interpreter to read wgmma operands through `transpose_ref`.

    Its wgmma callback turns every operand transform into an index range
    (`interpret.utils.to_range`), and a `TransposeTransform` has none
    (AttributeError). This wraps the callback: trailing transposes are taken
    off an operand's transforms, the operand is read through the rest, and
    transposed in numpy before the same `acc + a @ b`. Operands without a
    transpose go to jax's callback unchanged. Idempotent; returns an undo
    function. (Hardware wgmma reads transposed bf16 tiles natively.)
    """
    import numpy as np
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    from jax._src.state.types import TransposeTransform

    original = cb.wgmma
    if getattr(original, "kvjax_transposes", False):
        return lambda: None

    def split(transforms):
        transforms, perm = tuple(cb._remove_noop_transforms(tuple(transforms))), None
        while transforms and isinstance(transforms[-1], TransposeTransform):
            p = tuple(transforms[-1].permutation)
            perm = p if perm is None else tuple(perm[i] for i in p)
            transforms = transforms[:-1]
        return jax.tree.map(int, transforms), perm

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array,
              acc_transforms, acc_dtype, a_allocation_key_as_array, a_transforms,
              b_allocation_key_as_array, b_transforms, source_info=None):
        (a_tr, a_perm), (b_tr, b_perm) = split(a_transforms), split(b_transforms)
        if a_perm is None and b_perm is None:
            return original(token=token, device_id=device_id,
                            grid_point_coords=grid_point_coords, thread_id=thread_id,
                            acc_allocation_key_as_array=acc_allocation_key_as_array,
                            acc_transforms=acc_transforms, acc_dtype=acc_dtype,
                            a_allocation_key_as_array=a_allocation_key_as_array,
                            a_transforms=a_transforms,
                            b_allocation_key_as_array=b_allocation_key_as_array,
                            b_transforms=b_transforms, source_info=source_info)
        device_id, thread_id = int(device_id), int(thread_id)
        memory = cb._get_shared_memory()
        gid = memory.get_global_thread_id(device_id, thread_id)
        info = interpret_utils.GPULoggingInfo(
            device_id=device_id, grid_point_coords=tuple(int(x) for x in grid_point_coords),
            thread_id=thread_id, source_info=source_info)

        def read(key, transforms, perm):
            x, _, _ = memory.get_buffer_content(
                cb.HostAllocationKey.from_array(key), interpret_utils.to_range(transforms), gid,
                logging_info=info)
            return x if perm is None else np.transpose(x, perm)

        a = read(a_allocation_key_as_array, a_tr, a_perm)
        b = read(b_allocation_key_as_array, b_tr, b_perm)
        acc_key = cb.HostAllocationKey.from_array(acc_allocation_key_as_array)
        acc_range = interpret_utils.to_range(
            jax.tree.map(int, cb._remove_noop_transforms(acc_transforms)))
        acc, _, _ = memory.get_buffer_content(acc_key, acc_range, gid, logging_info=info)
        memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype),
                                    gid, logging_info=info)
        return token

    wgmma.kvjax_transposes = True
    cb.wgmma = wgmma

    def undo():
        cb.wgmma = original
    return undo
