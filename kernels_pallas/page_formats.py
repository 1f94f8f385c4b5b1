"""How one page of keys or values is laid out for the kernel, and how the kernel decodes it.

A *page* holds `page_size` (S) consecutive slots of one (sequence, KV head).
A format names the arrays that hold a pool of P pages and decodes one page
to float32 inside the kernel. The same decode runs in the plain-jnp
reference, so a kernel and its reference read identical numbers.

Kernel layout (docs/DECISIONS.md, "Paged pool"): every array is indexed by page
first. Packed pages keep the **slot axis last** (on TPU lanes) and are
**lane-flat**: a page's logical `[rows, S]` words lie side by side in one
`[1, rows * S]` row (row r at lanes `r*S ...`). TPU tiles the two minor dims
of an array (8 sublanes x 128 lanes for 32 bits); a `[P, rows, S]` array with
rows not a multiple of 8 would be padded or stored page-minor by XLA and
copied to row-major before every kernel call, while `[P, 1, L]` is tiled
(1, 128): no padding, no copy, one contiguous DMA per page.

| format | arrays (P pages of S slots) | decode |
|---|---|---|
| `Dense(slots_last)` | `[P, S, D]` (or `[P, D, S]`) float32/bf16/fp8 | cast |
| `PackedTokens(bits, group, symmetric, param_dtype)` | `[P, 1, (W + NW) * S]` uint32: W = D*bits/32 rows of code words, then NW rows of packed scale (and offset) | per token, groups of G channels; `[D, S]` |
| `PackedChannels(bits, window, symmetric, param_dtype)` | `[P, 1, (W + 1) * S]` uint32 (codes, then each slot's row in the page's table window) and `[P, 1, TW * D]` uint32 table window | per channel; `[D, S]` |

Parameters in 16-bit dtypes (float16, bfloat16) travel as pairs in uint32
words (`pack_rows`: row i holds logical rows i and i + ceil(n/2)) and are
widened to float32 in the kernel by bit operations: exact, 2 bytes each.
float32 parameters travel as their bits. Mosaic does not load float16
vectors, and a `[S, D/G]` parameter array would be padded to 128 lanes in
TPU memory; this layout avoids both.

`from_store` converts `kvjax.core.stores`' layout (`[P, S, ...]`, slot axis
second) to this one; KIVI's per-row tables become per-page windows of
`window` table rows (the groups a page's slots use), so the work per page
is constant and attention is linear in context.

Example:
    >>> from kvjax.core import stores
    >>> x = jax.random.normal(jax.random.key(0), (2, 16, 64))          # 2 pages of S = 16
    >>> s = stores.put(stores.PackedTokens.empty(2, 16, 64, bits=4, group=32), x, jnp.int32(0))
    >>> fmt = PackedTokens(bits=4, group=32)
    >>> (pages,) = fmt.from_store(s.words, s.scale, s.offset)
    >>> pages.shape                           # [P, 1, (8 + 2) * S] for D = 64
    (2, 1, 160)
    >>> fmt.check((pages,), head_dim=64)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PARAM_DTYPES = ("float16", "bfloat16", "float32")


# ----------------------------------------------------------------------------- bit helpers


def unpack_planes(words: jax.Array, bits: int) -> jax.Array:
    """[W, S] uint32 -> [W * 32/bits, S] float32 codes (strided planes: channel j*W + w)."""
    mask = jnp.uint32((1 << bits) - 1)
    planes = [((words >> jnp.uint32(j * bits)) & mask).astype(jnp.int32)
              for j in range(32 // bits)]
    return jnp.concatenate(planes, axis=0).astype(jnp.float32)


def half_to_f32(h: jax.Array, dtype: str) -> jax.Array:
    """int32 holding 16 bits of a float16/bfloat16 -> float32, exactly, by bit operations."""
    if dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(h << 16, jnp.float32)
    sign, exp, man = (h >> 15) & 1, (h >> 10) & 31, h & 1023
    normal = (sign << 31) | ((exp + 112) << 23) | (man << 13)
    special = (sign << 31) | (255 << 23) | (man << 13)  # inf / nan
    bits = jnp.where(exp == 31, special, normal)
    tiny = man.astype(jnp.float32) * (2.0 ** -24)  # zero and subnormals
    tiny = jnp.where(sign == 1, -tiny, tiny)
    return jnp.where(exp == 0, tiny, jax.lax.bitcast_convert_type(bits, jnp.float32))


def param_rows(n: int, dtype: str) -> int:
    """uint32 rows that hold n logical parameter rows of `dtype`."""
    return n if dtype == "float32" else -(-n // 2)


def pack_rows(x: jax.Array, dtype: str) -> jax.Array:
    """[..., n, L] parameters -> [..., param_rows(n), L] uint32 (16-bit: rows i and i+ceil(n/2))."""
    if dtype == "float32":
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    n = x.shape[-2]
    half = -(-n // 2)
    bits = jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32)
    pad = [(0, 0)] * (x.ndim - 2) + [(0, 2 * half - n), (0, 0)]
    bits = jnp.pad(bits, pad)
    lo, hi = bits[..., :half, :], bits[..., half:, :]
    return lo | (hi << 16)


def unpack_rows(words: jax.Array, n: int, dtype: str) -> jax.Array:
    """Inverse of `pack_rows`: [m, L] uint32 -> [n, L] float32."""
    if dtype == "float32":
        return jax.lax.bitcast_convert_type(words, jnp.float32)[:n]
    w = jax.lax.bitcast_convert_type(words, jnp.int32)
    lo = half_to_f32(w & 0xFFFF, dtype)
    hi = half_to_f32((w >> 16) & 0xFFFF, dtype)
    return jnp.concatenate([lo, hi], axis=0)[:n]


def pack_pairs(x: jax.Array) -> jax.Array:
    """[n] int in [0, 2**16) -> [ceil(n/2)] int32: x[i] in bits 16 (i % 2) of word i // 2
    (two page numbers per SMEM word)."""
    x = jnp.pad(x.astype(jnp.int32), (0, x.shape[0] % 2)).reshape(-1, 2)
    return x[:, 0] | (x[:, 1] << 16)


def row_tile(rows: int) -> int:
    """Rows a 32-bit `[R, N]` array keeps in one TPU tile (8 sublanes), so that its view
    `[R / n, n, N]` is free and the kernel copies row r as the one-sublane slice
    `[r // n, r % n]`: 8 when it divides R, else 1 (`[R, 1, N]`, which XLA:TPU lays out a row
    a tile: one copy of the array, as every call made before).

    Example:
        >>> row_tile(512), row_tile(3)
        (8, 1)
    """
    return 8 if rows % 8 == 0 else 1


def unpack_pairs(words: jax.Array, n: int) -> jax.Array:
    """Inverse of `pack_pairs`: [ceil(n/2)] int32 -> [n] int32."""
    both = jnp.stack([words & 0xFFFF, jax.lax.shift_right_logical(words, 16) & 0xFFFF], axis=1)
    return both.reshape(-1)[:n]


def expand_groups(params: jax.Array, group: int) -> jax.Array:
    """[NG, S] per-group rows -> [NG*group, S]: each row repeated over its group's channels."""
    ng, s = params.shape
    return jnp.concatenate([jnp.broadcast_to(params[g:g + 1], (group, s)) for g in range(ng)],
                           axis=0)


def _onehot_expand(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table [NW, D] f32, ids [1, S] int32 in [0, NW) -> [D, S]: column s is table row ids[s].

    A one-hot matmul (a TPU has no vector gather): exact at HIGHEST precision.
    """
    hot = (ids == jax.lax.broadcasted_iota(jnp.int32, (table.shape[0], ids.shape[1]), 0))
    return jax.lax.dot_general(table, hot.astype(jnp.float32), (((0,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- backends


class Ops(NamedTuple):
    """How a backend reads a lane-flat block `[1, rows * width]`: `rows(block, start, n, width)`.

    Every packed array keeps one page as one lane-dense row (see module
    docstring); `rows` cuts logical rows `[start, start + n)` of `width`
    lanes out of it -> [n, width]. A format's `decode` only calls this, so
    one decode serves the TPU kernel (blocks are VMEM refs), the GPU kernel
    (blocks are several pages of HBM refs, `PageRef`) and the reference
    (blocks are arrays). `load(block, slots_last)` reads a dense block.
    GPU only (Triton has no n-way concatenate; loads are gathers):
    `take(block, rows, width)` gathers logical rows `rows` [N] int32 of
    every page of the block -> [N, L] (L = the block's slots, pages side by
    side); `take_cols(block, rows, width)` gathers, for each column j, lanes
    `rows[0, j] * width + [0, width)` of column j's page -> [width, L] (KIVI
    table rows named per slot, without a one-hot matmul).
    """

    load: Callable
    rows: Callable
    take: Callable | None = None
    take_cols: Callable | None = None


class PageRef(NamedTuple):
    """Several pages of a whole-pool HBM ref, side by side (GPU: every load is a gather).

    `page[0, j]` is the page of block column j: column j is slot j % S of
    that page, so a block of n pages of S slots has L = n * S columns.
    """

    ref: Any  # [P, ...]
    page: jax.Array  # [1, L] int32


def _lanes(block) -> int:
    return (block.ref if isinstance(block, PageRef) else block).shape[-1]


def _tpu_rows(ref, start: int, n: int, width: int):
    pieces = [ref[:, pl.ds((start + i) * width, width)] for i in range(n)]  # [1, width] each
    return pieces[0] if n == 1 else jnp.concatenate(pieces, axis=0)


def _reference_rows(x, start: int, n: int, width: int):
    return x.reshape(-1, width)[start:start + n]


def _page_cols(block: PageRef, width: int) -> int:
    """L, the block's columns: one page of `width` slots when its page is a scalar."""
    return block.page.shape[-1] if jnp.ndim(block.page) else width


def _gpu_take(block: PageRef, rows: jax.Array, width: int) -> jax.Array:
    """Logical rows `rows` [N] (each `width` lanes) of every page of the block -> [N, L]."""
    slot = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (1, _page_cols(block, width)), 1),
                       width)
    return block.ref[block.page, 0, rows[:, None] * width + slot]


def _gpu_rows(block: PageRef, start: int, n: int, width: int):
    return _gpu_take(block, start + jax.lax.iota(jnp.int32, n), width)


def _gpu_take_cols(block: PageRef, rows: jax.Array, width: int) -> jax.Array:
    """Column j: lanes rows[0, j] * width + [0, width) of page[0, j] -> [width, L]."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (width, 1), 0)
    return block.ref[block.page, 0, rows * width + lane]


def _gpu_load(block: PageRef, slots_last: bool = False) -> jax.Array:
    """A dense block: [L, D] gathered from [P, S, D] pages, or [D, L] from [P, D, S]."""
    ref, page = block.ref, block.page
    if slots_last:
        d, s = ref.shape[1:]
        col = jax.lax.broadcasted_iota(jnp.int32, (1, _page_cols(block, s)), 1)
        return ref[page, jax.lax.broadcasted_iota(jnp.int32, (d, 1), 0), jax.lax.rem(col, s)]
    s, d = ref.shape[1:]
    cols = _page_cols(block, s)
    row = jax.lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
    return ref[page.reshape(cols, 1) if jnp.ndim(page) else page, jax.lax.rem(row, s),
               jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)]


def _take_codes(ops: Ops, block, head_dim: int, bits: int, width: int) -> jax.Array:
    """Gathered unpack: channel c is word row c % W shifted by (c // W) * bits -> [D, L] f32.

    Each channel loads its own word (the 32/bits channels of a word load it
    from cache after the first), so the [D, L] codes come out in channel
    order by one shift and mask per element: no reshape, repeat or
    concatenate, whose layout changes cost more than the loads on a GPU
    (docs/DECISIONS.md, "GPU: packed pages decoded where they are loaded").
    """
    w = head_dim * bits // 32
    words = ops.take(block, jax.lax.iota(jnp.int32, head_dim) % w, width)  # [D, L]
    shift = jax.lax.broadcasted_iota(jnp.int32, (head_dim, 1), 0) // w * bits
    return exact_float((words >> shift.astype(jnp.uint32)) & jnp.uint32((1 << bits) - 1))


def exact_float(codes: jax.Array) -> jax.Array:
    """uint32 codes < 2**23 -> float32, exactly: the codes become the mantissa of 2**23 + c
    (an OR and a subtraction instead of an integer conversion)."""
    return jax.lax.bitcast_convert_type(codes | jnp.uint32(0x4B000000), jnp.float32) - 8388608.0


def _half_bits_to_f32(h: jax.Array, dtype: str) -> jax.Array:
    """GPU: int32 holding 16 bits of a float16/bfloat16 -> float32 by the native conversion."""
    if dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(h << 16, jnp.float32)
    return jax.lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _take_params(ops: Ops, block, start: int, logical: jax.Array, n: int, dtype: str,
                 width: int):
    """Gathered `unpack_rows`: logical parameter rows `logical` [N] -> [N, width] f32."""
    if dtype == "float32":
        return jax.lax.bitcast_convert_type(ops.take(block, start + logical, width), jnp.float32)
    half = -(-n // 2)
    words = jax.lax.bitcast_convert_type(ops.take(block, start + logical % half, width),
                                         jnp.int32)
    return _half_bits_to_f32((words >> ((logical // half) * 16)[:, None]) & 0xFFFF, dtype)


def _take_scale_offset(ops: Ops, block, start: int, ng: int, dtype: str, width: int,
                       groups: jax.Array):
    """Gathered asymmetric parameters of groups `groups` [N] -> (scale, offset) [N, L] f32.

    16-bit: the 2 * NG logical rows pack as word g = (scale g, offset g) (`pack_rows` with
    half = NG), so one [N, L] load gives both halves. With `groups` = each channel's group
    the parameters come out per channel, [D, L], without a repeat.
    """
    if dtype == "float32":
        load = lambda r: jax.lax.bitcast_convert_type(ops.take(block, start + r, width),
                                                      jnp.float32)
        return load(groups), load(groups + ng)
    words = jax.lax.bitcast_convert_type(ops.take(block, start + groups, width), jnp.int32)
    return (_half_bits_to_f32(words & 0xFFFF, dtype),
            _half_bits_to_f32((words >> 16) & 0xFFFF, dtype))


def _take_param_cols(ops: Ops, block, logical: jax.Array, n: int, dtype: str, width: int):
    """Column j: logical parameter row logical[0, j] of column j's page -> [width, L] f32."""
    if dtype == "float32":
        return jax.lax.bitcast_convert_type(ops.take_cols(block, logical, width), jnp.float32)
    half = -(-n // 2)
    words = jax.lax.bitcast_convert_type(ops.take_cols(block, jax.lax.rem(logical, half), width),
                                         jnp.int32)
    return _half_bits_to_f32((words >> (jax.lax.div(logical, half) * 16)) & 0xFFFF, dtype)


REFERENCE_OPS = Ops(load=lambda x, slots_last=False: x, rows=_reference_rows)
TPU_OPS = Ops(load=lambda r, slots_last=False: r[...], rows=_tpu_rows)
GPU_OPS = Ops(load=_gpu_load, rows=_gpu_rows, take=_gpu_take, take_cols=_gpu_take_cols)


def lane_flat(x: jax.Array) -> jax.Array:
    """[P, R, L] -> [P, 1, R*L]: a page's rows side by side on lanes (row r at lanes r*L...)."""
    return x.reshape(x.shape[0], 1, -1)


# ----------------------------------------------------------------------------- formats


def _check_param_dtype(dtype: str) -> None:
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {dtype!r}")


def _check_packed(pages: jax.Array, bits: int, head_dim: int, extra: int, what: str) -> None:
    if bits not in (2, 4, 8):
        raise ValueError(f"packed pages hold 2, 4 or 8-bit codes, got bits={bits}")
    want = head_dim * bits // 32 + extra
    if (pages.ndim != 3 or pages.shape[1] != 1 or pages.shape[2] % want
            or pages.dtype != jnp.uint32):
        raise ValueError(f"{what} pages must be lane-flat uint32 [P, 1, {want} * S] ({bits}-bit "
                         f"codes of head_dim {head_dim} and {extra} parameter rows), got "
                         f"{pages.dtype} {pages.shape}")


def _slots_last(x: jax.Array) -> jax.Array:
    """[P, S, L] -> [P, L, S]."""
    return jnp.swapaxes(x, 1, 2)


@dataclasses.dataclass(frozen=True)
class Dense:
    """Plain floats (float32, bfloat16, float8): `[P, S, D]`, or `[P, D, S]` with `slots_last`.

    `slots_last` suits head dims below 128 lanes on TPU: XLA keeps a
    `[.., S, 64]` cache page-minor in memory (no lane padding), so its
    `swapaxes` to `[P, D, S]` is free, while the row-major `[P, S, D]`
    Mosaic needs would be a copy of the pool before every call.
    """

    slots_last: bool = False

    def arity(self) -> int:
        return 1

    def check(self, arrays, head_dim: int) -> None:
        (x,) = arrays
        axis = 1 if self.slots_last else 2
        if x.ndim != 3 or x.shape[axis] != head_dim:
            want = f"[P, {head_dim}, S]" if self.slots_last else f"[P, S, {head_dim}]"
            raise ValueError(f"dense pages must be {want}, got {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"dense pages must be a float dtype, got {x.dtype}")

    def page_size(self, arrays, head_dim: int) -> int:
        return arrays[0].shape[2 if self.slots_last else 1]

    def shapes(self, n_pages: int, page_size: int, head_dim: int, dtype=jnp.bfloat16):
        """The pool's arrays as `jax.ShapeDtypeStruct`s."""
        shape = (n_pages, head_dim, page_size) if self.slots_last else (n_pages, page_size, head_dim)
        return (jax.ShapeDtypeStruct(shape, dtype),)

    def decode(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32) -> jax.Array:
        """blocks: ([S, D] or [D, S],) -> the same in `dtype`."""
        return ops.load(blocks[0], self.slots_last).astype(dtype)

    def decode_flops(self, head_dim: int, page_size: int) -> int:
        """Arithmetic of decoding one page (the kernel's cost estimate)."""
        return 0

    def store_bytes(self, head_dim: int, dtype) -> float:
        """Bytes per slot the format stores."""
        return head_dim * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class _PerTokenCodes:
    """What both per-token layouts share: `bits`-bit codes per channel, and per slot one scale
    (and, unless `symmetric`, one offset) per group of `group` channels."""

    bits: int
    group: int
    symmetric: bool = False
    param_dtype: str = "float16"

    slots_last = True

    def __post_init__(self):
        _check_param_dtype(self.param_dtype)

    def n_params(self, head_dim: int) -> int:
        return (head_dim // self.group) * (1 if self.symmetric else 2)

    def param_words(self, head_dim: int) -> int:
        return param_rows(self.n_params(head_dim), self.param_dtype)

    def decode_flops(self, head_dim: int, page_size: int) -> int:
        """codes * scale + offset per element."""
        return 2 * head_dim * page_size

    def store_bytes(self, head_dim: int, dtype=None) -> float:
        return head_dim * self.bits / 8 + self.n_params(head_dim) * \
            jnp.dtype(self.param_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class PackedTokens(_PerTokenCodes):
    """Per-token codes: each slot's D channels in groups of `group`, one scale (and offset) each."""

    def arity(self) -> int:
        return 1

    def check(self, arrays, head_dim: int) -> None:
        if len(arrays) != 1:
            raise ValueError(f"{self} takes one page array, got {len(arrays)}")
        if self.group < 1 or head_dim % self.group:
            raise ValueError(f"group {self.group} must divide head_dim {head_dim}")
        _check_packed(arrays[0], self.bits, head_dim, self.param_words(head_dim), "per-token")

    def rows(self, head_dim: int) -> int:
        return head_dim * self.bits // 32 + self.param_words(head_dim)

    def page_size(self, arrays, head_dim: int) -> int:
        return arrays[0].shape[2] // self.rows(head_dim)

    def shapes(self, n_pages: int, page_size: int, head_dim: int, dtype=None):
        """The pool's arrays as `jax.ShapeDtypeStruct`s."""
        return (jax.ShapeDtypeStruct((n_pages, 1, self.rows(head_dim) * page_size), jnp.uint32),)

    def from_store(self, words: jax.Array, scale: jax.Array, offset: jax.Array | None):
        """kvjax.core.stores layout -> kernel layout.

        words [P, S, W] uint32, scale/offset [P, S, D/G] -> ([P, 1, (W + NW) * S] uint32,).
        """
        params = scale if self.symmetric else jnp.concatenate([scale, offset], axis=-1)
        packed = pack_rows(_slots_last(params), self.param_dtype)  # [P, NW, S]
        return (lane_flat(jnp.concatenate([_slots_last(words), packed], axis=1)),)

    def decode(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32) -> jax.Array:
        """blocks: ([1, (W + NW) * S],) -> [D, S] in `dtype`."""
        d, n_words = head_dim, head_dim * self.bits // 32
        ng, n = d // self.group, self.n_params(d)
        s = _lanes(blocks[0]) // self.rows(d)
        if ops.take is not None:  # GPU: per-channel gathers, nothing repeated or reshaped
            codes = _take_codes(ops, blocks[0], d, self.bits, s)
            groups = jax.lax.iota(jnp.int32, d) // self.group  # [D] each channel's group
            if self.symmetric:
                scale = _take_params(ops, blocks[0], n_words, groups, n, self.param_dtype, s)
                offset = None
            else:
                scale, offset = _take_scale_offset(ops, blocks[0], n_words, ng,
                                                   self.param_dtype, s, groups)  # [D, L]
        else:
            codes = unpack_planes(ops.rows(blocks[0], 0, n_words, s), self.bits)  # [D, S]
            params = unpack_rows(ops.rows(blocks[0], n_words, self.param_words(d), s), n,
                                 self.param_dtype)  # [n, S]
            scale = expand_groups(params[:ng], self.group)
            offset = None if self.symmetric else expand_groups(params[ng:], self.group)
        if offset is None:
            offset = -(2.0 ** (self.bits - 1)) * scale
        return (codes * scale + offset).astype(dtype)

    def scales_scores(self, head_dim: int) -> bool:
        """True when a key page can be applied as codes plus a scale (and offset) per slot on
        the scores.

        One group spanning D: symmetric k_s = scale_s * (c_s - 2**(bits-1)), so
        q . k_s = scale_s * (q . (c_s - 2**(bits-1))); asymmetric k_s = scale_s * c_s +
        offset_s, so q . k_s = scale_s * (q . c_s) + offset_s * sum(q). Exact algebra; the
        codes (integers of at most 8 bits) are exact in bf16, so the dot's operands are the
        same numbers the dequantized keys would be built from.
        """
        return self.group == head_dim

    def decode_codes(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32):
        """blocks: ([1, (W + NW) * S],) -> codes [D, S] in `dtype`, scale [1, S] f32 and offset
        [1, S] f32 (None when symmetric: the codes are then centred).

        Only where `scales_scores(head_dim)`; the page decodes to codes * scale (+ offset).
        """
        if not self.scales_scores(head_dim):
            raise ValueError(f"decode_codes: {self} has more than one group per slot at "
                             f"head_dim {head_dim}; use decode")
        n_words, n = head_dim * self.bits // 32, self.n_params(head_dim)
        s = _lanes(blocks[0]) // self.rows(head_dim)
        if ops.take is not None:
            codes = _take_codes(ops, blocks[0], head_dim, self.bits, s)
            if self.symmetric:
                scale = _take_params(ops, blocks[0], n_words, jnp.zeros((1,), jnp.int32), n,
                                     self.param_dtype, s)  # [1, L]
                offset = None
            else:
                scale, offset = _take_scale_offset(ops, blocks[0], n_words, 1, self.param_dtype,
                                                   s, jnp.zeros((1,), jnp.int32))
        else:
            codes = unpack_planes(ops.rows(blocks[0], 0, n_words, s), self.bits)  # [D, S]
            params = unpack_rows(ops.rows(blocks[0], n_words, self.param_words(head_dim), s), n,
                                 self.param_dtype)  # [n, S]
            scale, offset = params[0:1], (None if self.symmetric else params[1:2])
        if self.symmetric:
            codes = codes - 2.0 ** (self.bits - 1)
        return codes.astype(dtype), scale, offset


@dataclasses.dataclass(frozen=True)
class PackedTokenRows(_PerTokenCodes):
    """Per-token codes as slot-last arrays: the layout a `kvjax.core.stores.PackedTokens` holds.

    Arrays: words `[P, W, S]` uint32 (W = D*bits/32: a store's `[R, C, W]` words
    seen as `[R, W, C]`, which is how XLA:TPU lays them out, so the view is
    free), then the scale and, unless symmetric, the offset, each `[P, NG, S]`
    (NG = D / group): a store's `[R, C, NG]` parameters seen slot-last, as they
    are for bfloat16 and float32 (free views on TPU: nothing is copied per
    call), as their bits in uint16 for float16 (Mosaic takes no float16
    arguments; the kernel widens the bits to float32 exactly, `half_to_f32`).
    A store keeps float16 parameters as those bits (`kvjax.core.stores.
    stored_params`), so they too are read in place; a float16 array's uint16
    view XLA:TPU compiles as a copy (docs/DECISIONS.md "Float16 parameters
    stored as their bits"). Decodes exactly as `PackedTokens` does.
    """

    def arity(self) -> int:
        return 2 if self.symmetric else 3

    def param_bits(self):
        """The dtype the parameters travel in: their own, uint16 (their bits) for float16."""
        return jnp.uint16 if self.param_dtype == "float16" else jnp.dtype(self.param_dtype)

    def check(self, arrays, head_dim: int) -> None:
        if len(arrays) != self.arity():
            raise ValueError(f"{self} takes words, scale{'' if self.symmetric else ' and offset'}"
                             f", got {len(arrays)} arrays")
        if self.bits not in (2, 4, 8):
            raise ValueError(f"packed pages hold 2, 4 or 8-bit codes, got bits={self.bits}")
        if self.group < 1 or head_dim % self.group:
            raise ValueError(f"group {self.group} must divide head_dim {head_dim}")
        words, *params = arrays
        w = head_dim * self.bits // 32
        if words.ndim != 3 or words.shape[1] != w or words.dtype != jnp.uint32:
            raise ValueError(f"per-token word pages must be uint32 [P, {w}, S], got "
                             f"{words.dtype} {words.shape}")
        want = (words.shape[0], head_dim // self.group, words.shape[2])
        bits = jnp.dtype(self.param_bits()).name
        for name, x in zip(("scale", "offset"), params):
            if x.shape != want or x.dtype != self.param_bits():
                raise ValueError(f"per-token {name} pages must be {bits} {want} (the "
                                 f"{self.param_dtype} parameters), got {x.dtype} {x.shape}")

    def page_size(self, arrays, head_dim: int) -> int:
        return arrays[0].shape[2]

    def shapes(self, n_pages: int, page_size: int, head_dim: int, dtype=None):
        """The pool's arrays as `jax.ShapeDtypeStruct`s."""
        param = jax.ShapeDtypeStruct((n_pages, head_dim // self.group, page_size),
                                     self.param_bits())
        words = jax.ShapeDtypeStruct((n_pages, head_dim * self.bits // 32, page_size), jnp.uint32)
        return (words, param) if self.symmetric else (words, param, param)

    def from_store(self, words: jax.Array, scale: jax.Array, offset: jax.Array | None):
        """kvjax.core.stores layout [R, C, ...] -> (words [R, W, C], scale [R, NG, C], offset
        [R, NG, C] unless symmetric): slot-last views, free on TPU where the store keeps these
        arrays slot-minor (`kvjax.core.stores.slot_minor_on_tpu`); float16 as its bits (a
        uint16 array is taken as those bits already, as the store keeps them)."""
        def carried(x):
            if x.dtype == jnp.uint16 and self.param_dtype == "float16":
                return _slots_last(x)
            x = _slots_last(x.astype(self.param_dtype))
            return (jax.lax.bitcast_convert_type(x, jnp.uint16)
                    if self.param_dtype == "float16" else x)
        params = (scale,) if self.symmetric else (scale, offset)
        return (_slots_last(words), *map(carried, params))

    def _param(self, block, ops: Ops) -> jax.Array:
        """[NG, S] float32 from a block of the parameters (float16's bits widened exactly)."""
        x = ops.load(block, True)
        if self.param_dtype == "float16":
            return half_to_f32(x.astype(jnp.int32), "float16")
        return x.astype(jnp.float32)

    def _params(self, blocks, ops: Ops, head_dim: int):
        scale = self._param(blocks[1], ops)
        return scale, (None if self.symmetric else self._param(blocks[2], ops))

    def decode(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32) -> jax.Array:
        """blocks: (words [W, S], scale [NG, S], offset [NG, S]) -> [D, S] in `dtype`."""
        codes = unpack_planes(ops.load(blocks[0], True), self.bits)  # [D, S]
        scale, offset = self._params(blocks, ops, head_dim)
        scale = expand_groups(scale, self.group)
        offset = (-(2.0 ** (self.bits - 1)) * scale if offset is None
                  else expand_groups(offset, self.group))
        return (codes * scale + offset).astype(dtype)

    def scales_scores(self, head_dim: int) -> bool:
        """True for every group size dividing D: the kernel applies the NG = D / group scales
        (and offsets) per slot on the scores, q . k_s = sum_g scale_gs (q_g . c_gs) +
        sum_g offset_gs sum(q_g), one masked dot per group (exact algebra; the codes are
        exact in bf16)."""
        return head_dim % self.group == 0

    def decode_codes(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32):
        """codes [D, S] in `dtype`, scale [NG, S] f32 and offset [NG, S] f32 (None when
        symmetric: the codes are then centred), NG = D / group; group g covers channels
        [g * group, (g + 1) * group)."""
        if not self.scales_scores(head_dim):
            raise ValueError(f"decode_codes: group {self.group} does not divide head_dim "
                             f"{head_dim}")
        codes = unpack_planes(ops.load(blocks[0], True), self.bits)
        scale, offset = self._params(blocks, ops, head_dim)
        if self.symmetric:
            codes = codes - 2.0 ** (self.bits - 1)
        return codes.astype(dtype), scale, offset


def window_for(page_size: int, group: int, table_rows: int, pow2: bool = False) -> int:
    """Table rows a page of consecutive slots can use (groups of `group` tokens it overlaps);
    `pow2` rounds up to a power of two (Triton loads power-of-two blocks)."""
    n = max(1, min(table_rows, (page_size - 1) // group + 2))
    return 1 << (n - 1).bit_length() if pow2 else n


@dataclasses.dataclass(frozen=True)
class PackedChannels:
    """Per-channel codes (KIVI keys): each slot indexes a row of its page's table window.

    Arrays: pages `[P, W + 1, S]` uint32 (codes, then each slot's row in the
    window) and table `[P, TW, D]` uint32: `window` rows of scale (and
    offset) per page, packed by `pack_rows`.
    """

    bits: int
    window: int
    symmetric: bool = False
    param_dtype: str = "float16"

    slots_last = True

    def __post_init__(self):
        _check_param_dtype(self.param_dtype)
        if self.window < 1:
            raise ValueError(f"window must be >= 1 table rows, got {self.window}")

    def arity(self) -> int:
        return 2

    def n_params(self) -> int:
        return self.window * (1 if self.symmetric else 2)

    def table_rows(self) -> int:
        return param_rows(self.n_params(), self.param_dtype)

    def check(self, arrays, head_dim: int) -> None:
        if len(arrays) != 2:
            raise ValueError(f"{self} takes pages and a table window, got {len(arrays)} arrays")
        pages, table = arrays
        _check_packed(pages, self.bits, head_dim, 1, "per-channel")
        want = (pages.shape[0], 1, self.table_rows() * head_dim)
        if table.shape != want or table.dtype != jnp.uint32:
            raise ValueError(f"per-channel table windows must be lane-flat uint32 {want}, got "
                             f"{table.dtype} {table.shape}")

    def page_size(self, arrays, head_dim: int) -> int:
        return arrays[0].shape[2] // (head_dim * self.bits // 32 + 1)

    def shapes(self, n_pages: int, page_size: int, head_dim: int, dtype=None):
        """The pool's arrays as `jax.ShapeDtypeStruct`s."""
        rows = head_dim * self.bits // 32 + 1
        return (jax.ShapeDtypeStruct((n_pages, 1, rows * page_size), jnp.uint32),
                jax.ShapeDtypeStruct((n_pages, 1, self.table_rows() * head_dim), jnp.uint32))

    def window_start(self, group_id, valid, table_rows: int):
        """Each page's first table row and whether its valid slots fit the window.

        group_id [P, S] int, valid [P, S] bool -> (first [P] int32, fits [] bool).
        A page's window starts at its smallest valid group id, moved down so
        the window stays inside the table; `fits` is False when some page's
        valid slots span more than `window` groups (eviction can spread them).
        """
        ids = group_id.astype(jnp.int32)
        first = jnp.min(jnp.where(valid, ids, jnp.iinfo(jnp.int32).max), axis=1)
        first = jnp.clip(first, 0, max(table_rows - self.window, 0))
        local = ids - first[:, None]
        fits = jnp.all(~valid | ((local >= 0) & (local < self.window)))
        return first, fits

    def from_store(self, words, group_id, valid, scale, offset, page_row):
        """kvjax.core.stores layout -> kernel layout (exact where `window_start` says it fits).

        words [P, S, W] uint32, group_id [P, S] int, valid [P, S] bool,
        scale/offset [R, NG, D] per-row tables, page_row [P] int32 (the row
        that owns each page) -> (pages [P, 1, (W + 1) * S], table [P, 1, TW * D]).
        """
        ng = scale.shape[1]
        first, _ = self.window_start(group_id, valid, ng)
        local = jnp.where(valid, group_id.astype(jnp.int32) - first[:, None], 0)
        local = jnp.clip(local, 0, self.window - 1)
        rows = jnp.minimum(first[:, None] + jnp.arange(self.window), ng - 1)  # [P, window]
        take = lambda t: t[page_row[:, None], rows]  # [P, window, D]
        params = take(scale) if self.symmetric else jnp.concatenate(
            [take(scale), take(offset)], axis=1)
        pages = jnp.concatenate([_slots_last(words), local.astype(jnp.uint32)[:, None]], axis=1)
        return lane_flat(pages), lane_flat(pack_rows(params, self.param_dtype))

    def decode(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32) -> jax.Array:
        """blocks: ([1, (W + 1) * S], table [1, TW * D]) -> [D, S] in `dtype`."""
        n_words = head_dim * self.bits // 32
        s = _lanes(blocks[0]) // (n_words + 1)
        ids = jax.lax.bitcast_convert_type(ops.rows(blocks[0], n_words, 1, s), jnp.int32)  # [1, S]
        if ops.take_cols is not None:  # GPU: each slot's table row gathered directly
            codes = _take_codes(ops, blocks[0], head_dim, self.bits, s)
            param = lambda rows: _take_param_cols(ops, blocks[1], rows, self.n_params(),
                                                  self.param_dtype, head_dim)
            scale = param(ids)  # [D, L]
            offset = (-(2.0 ** (self.bits - 1)) * scale if self.symmetric
                      else param(ids + self.window))
            return (codes * scale + offset).astype(dtype)
        else:
            codes = unpack_planes(ops.rows(blocks[0], 0, n_words, s), self.bits)  # [D, S]
            table = unpack_rows(ops.rows(blocks[1], 0, self.table_rows(), head_dim),
                                self.n_params(), self.param_dtype)
            table_scale = table[:self.window]
            table_offset = None if self.symmetric else table[self.window:]
        scale = _onehot_expand(table_scale, ids)
        offset = (-(2.0 ** (self.bits - 1)) * scale if self.symmetric
                  else _onehot_expand(table_offset, ids))
        return (codes * scale + offset).astype(dtype)

    def decode_flops(self, head_dim: int, page_size: int) -> int:
        """One-hot expansion of the window's scale (and offset) rows, then codes * scale + offset."""
        expand = 2 * self.window * head_dim * page_size * (1 if self.symmetric else 2)
        return expand + 2 * head_dim * page_size

    def store_bytes(self, head_dim: int, dtype=None, group: int = 32) -> float:
        """Bytes per slot of the store: codes, a 2-byte group id, and the table per token."""
        params = head_dim * (1 if self.symmetric else 2) * jnp.dtype(self.param_dtype).itemsize
        return head_dim * self.bits / 8 + 2 + params / group


@dataclasses.dataclass(frozen=True)
class PackedChannelRows:
    """Per-channel codes (KIVI keys) read where a `kvjax.core.stores.PackedChannels` keeps them.

    Arrays (row pools, the TPU kernel's `row_pages`; R rows of C slots):
    words `[R, W, C]` uint32 (the store's `[R, C, W]` words seen slot-last, a
    free view on TPU), ids `[R / n, n, C]` uint32 (each slot's table row minus
    its page's window start; row r at `[r // n, r % n]`, `n = row_tile(R)`, as
    the kernel reads positions) and the table `[R / n, n, NT * L]` uint32, the
    store's lane-flat table (`kvjax.core.stores.pack_params`: one row of
    `L = K * D` lanes per group, `K = group_words()`: a 16-bit scale and offset
    share a word; float32 asymmetric takes two), read in place. A page of
    S slots reads `window` table rows from its row's table, starting at its
    page's `start` (a multiple of `row_align(L)` rows, so the copy starts on a
    multiple of 128 lanes), given to the kernel as the page's first table row
    (`table_windows`, two 16-bit rows per word: `pack_pairs`). Only the ids
    (4 bytes a slot) are built per call. The page view (`rows_as_pages`, the
    reference) is words `[P, W, S]`, ids `[P, 1, S]` and each page's window
    `[P, 1, window * L]`.
    """

    bits: int
    window: int
    symmetric: bool = False
    param_dtype: str = "float16"

    slots_last = True
    # words along the slots (2); ids one sublane a row, along the slots (3); the table one
    # sublane a row, by its window start (0)
    row_axes = (2, 3, 0)

    def __post_init__(self):
        _check_param_dtype(self.param_dtype)
        if self.window < 1:
            raise ValueError(f"window must be >= 1 table rows, got {self.window}")

    @staticmethod
    def row_align(lanes: int) -> int:
        """Table rows of `lanes` lanes a window start is a multiple of: its first lane is then
        a multiple of 128 (1 for 128-lane rows, 2 for 64)."""
        return 128 // math.gcd(lanes, 128)

    @classmethod
    def window_rows(cls, page_size: int, group: int, lanes: int) -> int:
        """Rows a page reads: the groups its slots overlap, plus the rows below the first that
        an aligned start may add, rounded up to the alignment."""
        a = cls.row_align(lanes)
        groups = (page_size - 1) // group + 2
        return -(-(groups + a - 1) // a) * a

    def arity(self) -> int:
        return 3

    def group_words(self) -> int:
        return 2 if self.param_dtype == "float32" and not self.symmetric else 1

    def check(self, arrays, head_dim: int) -> None:
        if len(arrays) != 3:
            raise ValueError(f"{self} takes words, ids and a table, got {len(arrays)} arrays")
        if self.bits not in (2, 4, 8):
            raise ValueError(f"packed pages hold 2, 4 or 8-bit codes, got bits={self.bits}")
        words, ids, table = arrays
        w = head_dim * self.bits // 32
        if words.ndim != 3 or words.shape[1] != w or words.dtype != jnp.uint32:
            raise ValueError(f"per-channel word pages must be uint32 [P, {w}, S], got "
                             f"{words.dtype} {words.shape}")
        want = (words.shape[0], 1, words.shape[2])
        if ids.shape != want or ids.dtype != jnp.uint32:
            raise ValueError(f"per-channel id pages must be uint32 {want}, got {ids.dtype} "
                             f"{ids.shape}")
        want = (words.shape[0], 1, self.window * self.group_words() * head_dim)
        if table.shape != want or table.dtype != jnp.uint32:
            raise ValueError(f"per-channel table windows must be lane-flat uint32 {want}, got "
                             f"{table.dtype} {table.shape}")

    def page_size(self, arrays, head_dim: int) -> int:
        return arrays[0].shape[2]

    def window_lanes(self, words: jax.Array) -> int:
        """Lanes of one page's table window, from the words array [., W, .] (W = D*bits/32)."""
        return self.window * self.group_words() * words.shape[1] * 32 // self.bits

    def from_store(self, words, group_id, valid, table, page_size: int):
        """A store's rows -> (arrays, table_windows, fits [] bool).

        table_windows: each page's first table row, `pack_pairs`ed ([ceil(R * C/S / 2)] int32;
        rows < 2**15, as the store's int16 group ids are).

        words [R, C, W] uint32, group_id [R, C] int, valid [R, C] bool, table [R, NG * L]
        uint32 (`pack_table`, lane-flat). `fits` is False when some page's valid slots span
        more table rows than its window holds (eviction can spread a page's groups); the
        arrays are then wrong for that page and the caller must not use them.
        """
        r, c = group_id.shape
        lanes = self.group_words() * words.shape[2] * 32 // self.bits
        ng = table.shape[1] // lanes
        a = self.row_align(lanes)
        n_table = -(-max(ng, self.window) // a) * a  # padded only when ng is not aligned
        pages = lambda x: x.reshape(r, c // page_size, page_size)
        # a page's first and last table rows, reduced in the ids' own 16 bits (one pass over
        # them; the int32 form of every slot, reshaped, cost XLA:TPU three more copies)
        valid = valid.reshape(r, c)
        first = jnp.min(pages(jnp.where(valid, group_id, jnp.iinfo(group_id.dtype).max)), axis=2)
        last = jnp.max(pages(jnp.where(valid, group_id, -1)), axis=2).astype(jnp.int32)
        start = jnp.clip(first.astype(jnp.int32) // a * a, 0, n_table - self.window)  # [R, n]
        fits = jnp.all(last < start + self.window)  # a page of no valid slot: last = -1
        # each slot's row in its window; an empty slot's is never read (its position masks it)
        local = pages(group_id.astype(jnp.int32)) - start[:, :, None]
        if n_table > ng:
            table = jnp.pad(table, ((0, 0), (0, (n_table - ng) * lanes)))
        n = row_tile(r)
        arrays = (_slots_last(words), local.astype(jnp.uint32).reshape(r // n, n, c),
                  table.reshape(r // n, n, n_table * lanes))
        return arrays, pack_pairs(start.reshape(-1)), fits

    def pack_table(self, scale, offset):
        """[R, NG, D] scale (and offset) -> [R, NG, K * D] uint32 words, one row per group (a
        `PackedChannels` store's table holds them so, but for 16-bit symmetric scales, which
        it keeps in their own dtype: `kvjax.backends.pallas.kernel_table`)."""
        if self.param_dtype == "float32":
            params = scale if self.symmetric else jnp.concatenate([scale, offset], axis=-1)
            return jax.lax.bitcast_convert_type(params.astype(jnp.float32), jnp.uint32)
        bits16 = lambda x: jax.lax.bitcast_convert_type(
            x.astype(self.param_dtype), jnp.uint16).astype(jnp.uint32)
        return bits16(scale) if self.symmetric else bits16(scale) | (bits16(offset) << 16)

    def _table(self, ops: Ops, block, head_dim: int):
        """The window's (scale, offset) rows, [window, D] f32 each (offset None if symmetric)."""
        k = self.group_words()
        if k == 2:  # float32 asymmetric: group i's scale is row 2i, its offset row 2i + 1
            rows = lambda j: jnp.concatenate([ops.rows(block, 2 * i + j, 1, head_dim)
                                              for i in range(self.window)], axis=0)
            as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)
            return as_f32(rows(0)), as_f32(rows(1))
        words = ops.rows(block, 0, self.window, head_dim)  # [window, D]
        if self.param_dtype == "float32":
            return jax.lax.bitcast_convert_type(words, jnp.float32), None
        w = jax.lax.bitcast_convert_type(words, jnp.int32)
        scale = half_to_f32(w & 0xFFFF, self.param_dtype)
        return scale, (None if self.symmetric else half_to_f32((w >> 16) & 0xFFFF,
                                                               self.param_dtype))

    def decode(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32) -> jax.Array:
        """blocks: (words [W, S], ids [1, S], table [1, window * L]) -> [D, S] in `dtype`."""
        if ops.take is not None:
            raise ValueError(f"{self} is read by the TPU kernel and the reference only")
        codes = unpack_planes(ops.load(blocks[0], True), self.bits)  # [D, S]
        ids = jax.lax.bitcast_convert_type(ops.load(blocks[1], True), jnp.int32)  # [1, S]
        table_scale, table_offset = self._table(ops, blocks[2], head_dim)
        scale = _onehot_expand(table_scale, ids)
        offset = (-(2.0 ** (self.bits - 1)) * scale if table_offset is None
                  else _onehot_expand(table_offset, ids))
        return (codes * scale + offset).astype(dtype)

    def decode_flops(self, head_dim: int, page_size: int) -> int:
        """One-hot expansion of the window's scale (and offset) rows, then codes * scale + offset."""
        expand = 2 * self.window * head_dim * page_size * (1 if self.symmetric else 2)
        return expand + 2 * head_dim * page_size


@dataclasses.dataclass(frozen=True)
class PackedChannelPages:
    """Per-channel codes, one group per page: a paged KIVI layer's keys
    (`kvjax.memory.paged_kivi.ChannelPages`), read as the store keeps them.

    Arrays: words `[P, 1, W * S]` uint32, lane-flat (word w of slot s at lane `w * S + s`)
    and params `[P, 1, K * D]` uint32: the page's scale and offset as a KIVI table row holds
    them (`kvjax.core.stores.pack_params`: a 16-bit pair per word, K = 1; float32: the D
    scales then the D offsets as their bits, K = 2). Both are the
    store's own arrays, dense in TPU memory at any page size. Every slot of a page shares its
    parameters, so decoding is the one-row case of `PackedChannels` (a window of one table
    row).
    """

    bits: int
    param_dtype: str = "float16"

    slots_last = True

    def __post_init__(self):
        _check_param_dtype(self.param_dtype)

    def arity(self) -> int:
        return 2

    def group_words(self) -> int:
        return 2 if self.param_dtype == "float32" else 1

    def check(self, arrays, head_dim: int) -> None:
        if len(arrays) != 2:
            raise ValueError(f"{self} takes words and params, got {len(arrays)} arrays")
        if self.bits not in (2, 4, 8):
            raise ValueError(f"packed pages hold 2, 4 or 8-bit codes, got bits={self.bits}")
        words, params = arrays
        w = head_dim * self.bits // 32
        if (words.ndim != 3 or words.shape[1] != 1 or words.shape[2] % w
                or words.dtype != jnp.uint32):
            raise ValueError(f"per-channel word pages must be lane-flat uint32 [P, 1, {w} * S], "
                             f"got {words.dtype} {words.shape}")
        want = (words.shape[0], 1, self.group_words() * head_dim)
        if params.shape != want or params.dtype != jnp.uint32:
            raise ValueError(f"per-page parameters must be uint32 {want}, got {params.dtype} "
                             f"{params.shape}")

    def page_size(self, arrays, head_dim: int) -> int:
        return arrays[0].shape[2] // (head_dim * self.bits // 32)

    def decode(self, blocks, ops: Ops, head_dim: int, dtype=jnp.float32) -> jax.Array:
        """blocks: (words [1, W * S], params [1, K * D]) -> [D, S] in `dtype`."""
        if ops.take is not None:
            raise ValueError(f"{self} is read by the TPU kernel and the reference only")
        w = head_dim * self.bits // 32
        codes = unpack_planes(ops.rows(blocks[0], 0, w, _lanes(blocks[0]) // w), self.bits)
        rows = PackedChannelRows(self.bits, 1, False, self.param_dtype)
        scale, offset = rows._table(ops, blocks[1], head_dim)  # [1, D] each
        one_row = jnp.zeros((1, codes.shape[1]), jnp.int32)  # every slot: the page's row
        return (codes * _onehot_expand(scale, one_row)
                + _onehot_expand(offset, one_row)).astype(dtype)

    def decode_flops(self, head_dim: int, page_size: int) -> int:
        """Both parameter rows expanded over the page, then codes * scale + offset."""
        return 4 * head_dim * page_size + 2 * head_dim * page_size


DENSE = Dense()
DENSE_T = Dense(slots_last=True)
Format = (Dense | PackedTokens | PackedTokenRows | PackedChannels | PackedChannelRows
          | PackedChannelPages)


def block_spec(x: jax.Array, page_index) -> pl.BlockSpec:
    """One page of `x` per grid step: block `(None, *x.shape[1:])`."""
    zeros = (0,) * (x.ndim - 1)
    return pl.BlockSpec((None, *x.shape[1:]), lambda *a: (page_index(*a), *zeros))
