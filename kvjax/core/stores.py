"""Encoded key/value stores: what a `TokenCache` holds in place of a dense array.

A store holds one tensor (keys or values) of a layer, logically
`[R, C, D]` (R = rows, batch x KV heads; C = slots; D = head_dim), in
compressed form. Every store is a pytree; its *slot leaves* have the slot
axis at position 1 and move with their slot when a policy compacts the
cache, so an evicted-then-compacted token keeps its exact bits. A store
encodes new tokens itself (`put`), so the model writes into it unchanged.

| store | bytes per token and row | encodes |
|---|---|---|
| dense array (float32/bf16/fp8) | D x itemsize | as is (fp8 saturates) |
| `PackedTokens` | D x bits/8 + (D/G) x param bytes (x2 asymmetric) | per token, groups of G channels |
| `PackedChannels` | D x bits/8 + 2 (group id) + table | per channel, groups of G tokens |
| `Latent` | r x itemsize (+ one [KVH, D, r] basis per layer) | projection on a basis |

`PackedChannels` (KIVI's keys) keeps one scale/offset per (group of G
tokens, channel) in a table, and each slot records its group: compaction
moves codes and group ids, the table stays, so nothing is requantized.
`resize` (host side) drops table rows no slot uses.

Example:
    >>> s = PackedTokens.empty(rows=6, capacity=128, dim=64, bits=4, group=32)
    >>> x = jax.random.normal(jax.random.key(0), (6, 10, 64))  # [R, T, D]: 10 new tokens
    >>> s = put(s, x, at=jnp.int32(0))
    >>> s.words.shape, read(s).shape, read(s).dtype   # 64 4-bit codes = 8 words per token
    ((6, 128, 8), (6, 128, 64), dtype('float32'))
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import jax
import jax.numpy as jnp

from jax.experimental.layout import Layout, with_layout_constraint

from kvjax.core import cpu_kernel
from kvjax.core.quant import BITS, FP8, Quantized, dequantize, pack, quantize, to_fp8, unpack

_static = dict(static=True)


def _slot_slice(x: jax.Array, start, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _put_rows(x: jax.Array, new: jax.Array, at, count, codes: bool = False) -> jax.Array:
    """Write `new` [R, T, ...] into slots [at, at+T) of `x`; with `count`, only the first `count`.

    Without `count` this is one `dynamic_update_slice` (in place under jit).
    With it, slots past `count` or past the capacity are dropped, by one
    read-modify-write of a T-slot span that lies inside the store: also an
    in-place `dynamic_update_slice`, where a scatter was (docs/DECISIONS.md,
    "Store layouts in the decode loop"). `codes`: `x` is an encoded store's
    per-slot array, kept slot-minor on TPU (`slot_minor_on_tpu`).
    """
    new = new.astype(x.dtype)
    keep = slot_minor_on_tpu if codes else (lambda y: y)
    if count is None:
        return keep(jax.lax.dynamic_update_slice_in_dim(x, new, at, axis=1))
    t, c = new.shape[1], x.shape[1]
    if t > c:  # a span longer than the store: only a scatter can drop the tail
        idx = jnp.where(jnp.arange(t) < count, at + jnp.arange(t), c)  # C = dropped
        return x.at[:, idx].set(new, mode="drop")
    start = jnp.clip(at, 0, c - t)  # the span moved inside the store; new slot i lands at at + i
    shift = at - start
    old = jax.lax.dynamic_slice_in_dim(x, start, t, axis=1)
    shifted = jax.lax.dynamic_slice_in_dim(jnp.concatenate([jnp.zeros_like(new), new], axis=1),
                                           t - jnp.minimum(shift, t), t, axis=1)
    i = jnp.arange(t) - shift  # the new slot each span slot would take
    write = ((i >= 0) & (i < count)).reshape((1, t) + (1,) * (x.ndim - 2))
    return keep(jax.lax.dynamic_update_slice_in_dim(x, jnp.where(write, shifted, old), start,
                                                    axis=1))


_hints = threading.local()


def without_layout_hints():
    """Trace without `slot_minor_on_tpu`'s layout constraints inside this block: a `jax.export`
    artifact may hold no `LayoutConstraint` custom call (it has no serialization compatibility
    guarantee), so an exported decoder's TPU program keeps XLA's own layouts."""
    return cpu_kernel.switched_off(_hints)


def slot_minor_on_tpu(x: jax.Array) -> jax.Array:
    """An encoded store's written per-slot array [R, C, X] (X < 128: code words, per-token
    parameters) held slot-minor when compiled for TPU: the layout XLA:TPU gives such a cache
    argument (measured: u32[512, 32640, 16] and f16[192, 4224, 2] arguments are {1,2,0}), which
    makes the Pallas kernel's slot-last view [R, X, C] free.

    Inside a decode loop XLA:TPU chose row-minor for the carried stores instead (the layout a
    few new slots are written in best) and copied each whole store into and out of the loop,
    and before every kernel call: 1.3x the cache in temporaries and extra passes over it per
    step (docs/DECISIONS.md, "Store layouts in the decode loop"). Other platforms, and other
    arrays (tables, dense stores, whose argument layouts XLA:TPU picks per shape), are left as
    they are.
    """
    if x.ndim != 3 or x.shape[-1] >= 128 or getattr(_hints, "off", False):
        return x
    keep = lambda y: with_layout_constraint(y, Layout(major_to_minor=(0, 2, 1)))
    return jax.lax.platform_dependent(x, tpu=keep, default=lambda y: y)


def _take_rows(x: jax.Array, order: jax.Array, kept: jax.Array) -> jax.Array:
    """Gather slots `order` [R, C'] of x [R, C, ...]; slots not `kept` become zero."""
    idx = order.reshape(order.shape + (1,) * (x.ndim - 2))
    out = jnp.take_along_axis(x, idx, axis=1)
    return jnp.where(kept.reshape(idx.shape), out, 0).astype(x.dtype)


def resize_rows(x: jax.Array, capacity: int) -> jax.Array:
    c = x.shape[1]
    if capacity <= c:
        return jax.lax.slice_in_dim(x, 0, capacity, axis=1)
    return jnp.pad(x, [(0, capacity - c if a == 1 else 0) for a in range(x.ndim)])


def _check_group(dim: int, group: int, bits: int) -> None:
    if bits not in BITS or bits == 1:
        raise ValueError(f"bits must be one of {BITS[1:]}, got {bits}")
    if group < 1 or dim % group:
        raise ValueError(f"group size {group} must divide head_dim {dim}")
    if dim % (32 // bits):
        raise ValueError(f"head_dim {dim} must be a multiple of {32 // bits} to pack "
                         f"{bits}-bit codes into 32-bit words")


class Store:
    """Base class of encoded stores. `slot_fields` name the leaves indexed by slot."""

    slot_fields: tuple[str, ...] = ()
    codec_kind: str | None = None  # the `kvjax.policies.codecs` encoding it holds, if any

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical `[R, C, D]` shape of the tensor the store encodes."""
        first = getattr(self, self.slot_fields[0])
        return (first.shape[0], first.shape[1], self.dim)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)  # what `read` returns

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    def map_slots(self, fn) -> "Store":
        """Apply `fn` to every slot leaf (leaves without data, e.g. None, are kept)."""
        return self.replace(**{f: fn(getattr(self, f)) for f in self.slot_fields
                               if getattr(self, f) is not None})


def _quantize_packed(x: jax.Array, bits: int, group: int, axis: int, symmetric: bool,
                     param_dtype, valid: jax.Array | None = None):
    """(words, scale, offset or None) of x quantized along `axis` and packed: one CPU kernel
    call where it serves (`kvjax.core.cpu_kernel.quantize_packed`), `quantize` + `pack` elsewhere;
    `valid` [R, T] masks tokens out of per-channel (axis 1) groups."""
    def plain(x, valid=None):
        mask = None if valid is None else jnp.broadcast_to(valid[..., None], x.shape)
        q = quantize(x, bits, group, axis=axis, symmetric=symmetric, param_dtype=param_dtype,
                     valid=mask)
        return pack(q.codes, bits), q.scale, None if symmetric else q.offset

    return cpu_kernel.quantize_packed(x, bits, group, axis, symmetric, param_dtype, plain,
                                      valid=valid)


def stored_params(x: jax.Array, like) -> jax.Array:
    """Parameters `x` in the dtype `like` of the array that stores them: uint16 holds float16
    as its bits. XLA:TPU compiles the uint16 view of a float16 array (Mosaic takes no float16
    arguments) as a copy on every kernel call; a uint16 store is read in place (docs/
    DECISIONS.md, "Float16 parameters stored as their bits")."""
    if jnp.dtype(like) == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
    return x.astype(like)


def param_values(x: jax.Array) -> jax.Array:
    """Stored parameters as floats of their dtype (uint16: float16 bits; others as they are)."""
    return jax.lax.bitcast_convert_type(x, jnp.float16) if x.dtype == jnp.uint16 else x


def storage_dtype(param_dtype) -> jnp.dtype:
    """The dtype an array of `param_dtype` parameters is stored in (`stored_params`)."""
    dtype = jnp.dtype(param_dtype)
    return jnp.dtype(jnp.uint16) if dtype == jnp.float16 else dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedTokens(Store):
    """Per-token uniform quantization: each token's D channels in groups of `group`.

    `codes[r, s, e]` are `bits`-bit, bit-packed along D into uint32 words
    (`kvjax.core.quant.pack`). `x ~ code * scale + offset` per group; a symmetric
    store keeps no offset (it is `-2**(bits-1) * scale`).
    """

    words: jax.Array  # [R, C, D*bits/32] uint32
    scale: jax.Array  # [R, C, D/G] `stored_params` (float16, the default, as uint16 bits)
    offset: jax.Array | None  # [R, C, D/G] or None (symmetric)
    bits: int = dataclasses.field(metadata=_static)
    group: int = dataclasses.field(metadata=_static)
    dim: int = dataclasses.field(metadata=_static)

    slot_fields = ("words", "scale", "offset")
    codec_kind = "tokens"
    kernel_format = 1  # the CPU attention kernel's name for this layout (kvjax.core.cpu_kernel)

    @classmethod
    def empty(cls, rows: int, capacity: int, dim: int, bits: int, group: int,
              symmetric: bool = False, param_dtype=jnp.float16) -> "PackedTokens":
        _check_group(dim, group, bits)
        params = jnp.zeros((rows, capacity, dim // group), storage_dtype(param_dtype))
        return cls(words=jnp.zeros((rows, capacity, dim * bits // 32), jnp.uint32),
                   scale=params, offset=None if symmetric else params, bits=bits, group=group,
                   dim=dim)

    @property
    def param_dtype(self) -> str:
        """The parameters' float dtype ("float16" for a uint16 store of their bits)."""
        dtype = jnp.dtype(self.scale.dtype)
        return "float16" if dtype == jnp.uint16 else dtype.name

    def encode(self, x: jax.Array) -> "PackedTokens":
        words, scale, offset = _quantize_packed(x, self.bits, self.group, -1,
                                                self.offset is None,
                                                jnp.dtype(self.param_dtype))
        keep = lambda p: None if p is None else stored_params(p, self.scale.dtype)
        return self.replace(words=words, scale=keep(scale), offset=keep(offset))

    def read(self) -> jax.Array:
        codes = unpack(self.words, self.bits, self.dim)
        scale = param_values(self.scale).astype(jnp.float32)
        offset = (-(2 ** (self.bits - 1)) * scale if self.offset is None
                  else param_values(self.offset).astype(jnp.float32))
        return dequantize(Quantized(codes, scale, offset), self.group, axis=-1)


def table_lanes(dim: int, param_dtype, symmetric: bool) -> int:
    """Entries of one `PackedChannels` table row: `2 * dim` for float32 scales and offsets,
    `dim` otherwise (a 16-bit scale and offset share a uint32 word; symmetric: scales only)."""
    return 2 * dim if jnp.dtype(param_dtype) == jnp.float32 and not symmetric else dim


def table_dtype(param_dtype, symmetric: bool) -> jnp.dtype:
    """The dtype of a `PackedChannels` table (`pack_params`): uint32 for 16-bit scales and
    offsets (a pair a word), the parameters' own dtype for float32 or symmetric scales."""
    dtype = jnp.dtype(param_dtype)
    return jnp.dtype(jnp.uint32) if not symmetric and dtype.itemsize == 2 else dtype


def pack_params(scale: jax.Array, offset: jax.Array | None, param_dtype) -> jax.Array:
    """Per-channel parameters [..., D] -> table rows [..., L] (`table_lanes`) as stored.

    16-bit asymmetric: uint32 words, the scale's bits low, the offset's high;
    float32 asymmetric: the D scales then the D offsets; symmetric: the scales.
    """
    dtype = jnp.dtype(param_dtype)
    if offset is None:
        return scale.astype(dtype)
    if dtype == jnp.float32:
        return jnp.concatenate([scale, offset], axis=-1).astype(dtype)
    bits16 = lambda x: jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32)
    return bits16(scale) | (bits16(offset) << 16)


def unpack_params(rows: jax.Array, dim: int, param_dtype, symmetric: bool):
    """Table rows [..., L] -> (scale, offset) [..., D] float32 (offset None if symmetric)."""
    dtype = jnp.dtype(param_dtype)
    if symmetric:
        return rows.astype(jnp.float32), None
    if dtype == jnp.float32:
        return rows[..., :dim], rows[..., dim:]
    half = lambda w: jax.lax.bitcast_convert_type(w.astype(jnp.uint16), dtype).astype(jnp.float32)
    return half(rows & 0xFFFF), half(rows >> 16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedChannels(Store):
    """Per-channel uniform quantization in groups of `group` consecutive tokens (KIVI keys).

    A group's scale/offset per channel lives in a table row; `group_id`
    maps every slot to its row, so compaction moves only codes and ids.
    New groups are appended at the table cursor `groups`.

    The table is lane-flat, `[R, NG * L]`, group g's row at entries
    `[g * L, (g + 1) * L)` (`pack_params`): the layout the TPU kernel reads
    in place, in windows of whole rows. A 3-D `[R, NG, D]` table was laid out
    by shape on TPU (table rows major-most) and repacked on every attention
    call, 1.5 GiB a step at 64 x 32k for the 8B shape (docs/DECISIONS.md,
    "KIVI's table in the kernel's layout"). `scale` and `offset` give it as
    `[R, NG, D]` arrays.
    """

    words: jax.Array  # [R, C, D*bits/32] uint32
    group_id: jax.Array  # [R, C] int16 table row of each slot's group
    table: jax.Array  # [R, NG * L] (`pack_params`): uint32, or float32 / the scales' dtype
    groups: jax.Array  # [] int32 table rows used
    bits: int = dataclasses.field(metadata=_static)
    group: int = dataclasses.field(metadata=_static)
    dim: int = dataclasses.field(metadata=_static)
    param_dtype: str = dataclasses.field(default="float16", metadata=_static)
    symmetric: bool = dataclasses.field(default=False, metadata=_static)

    slot_fields = ("words", "group_id")
    codec_kind = "channels"
    kernel_format = 2  # the CPU attention kernel's name for this layout (kvjax.core.cpu_kernel)

    @classmethod
    def empty(cls, rows: int, capacity: int, dim: int, bits: int, group: int,
              symmetric: bool = False, param_dtype=jnp.float16) -> "PackedChannels":
        _check_group(dim, 1, bits)
        table_rows = -(-capacity // group)
        if table_rows >= 2 ** 15:  # the ids are int16, as the kernels' page windows read them
            raise ValueError(f"capacity {capacity}: a per-channel (KIVI) store of groups of "
                             f"{group} tokens holds at most {(2 ** 15 - 1) * group} slots "
                             f"({2 ** 15 - 1} groups), it needs {table_rows}")
        name = jnp.dtype(param_dtype).name
        table = (rows, table_rows * table_lanes(dim, name, symmetric))
        return cls(words=jnp.zeros((rows, capacity, dim * bits // 32), jnp.uint32),
                   group_id=jnp.zeros((rows, capacity), jnp.int16),
                   table=jnp.zeros(table, table_dtype(name, symmetric)),
                   groups=jnp.zeros((), jnp.int32), bits=bits, group=group, dim=dim,
                   param_dtype=name, symmetric=symmetric)

    @property
    def lanes(self) -> int:
        """Entries of one table row (`table_lanes`)."""
        return table_lanes(self.dim, self.param_dtype, self.symmetric)

    @property
    def table_rows(self) -> int:
        return self.table.shape[1] // self.lanes

    def table_by_group(self) -> jax.Array:
        """The table as `[R, NG, L]`, one row per group."""
        return self.table.reshape(self.table.shape[0], self.table_rows, self.lanes)

    def _params(self, which: int) -> jax.Array | None:
        rows = unpack_params(self.table_by_group(), self.dim, self.param_dtype, self.symmetric)
        return None if rows[which] is None else rows[which].astype(self.param_dtype)

    @property
    def scale(self) -> jax.Array:
        """[R, NG, D] each group's per-channel scales, in `param_dtype`."""
        return self._params(0)

    @property
    def offset(self) -> jax.Array | None:
        """[R, NG, D] each group's per-channel offsets, or None (symmetric)."""
        return self._params(1)

    def table_rows_of_slots(self, table: jax.Array) -> jax.Array:
        """[R, NG, L] table -> [R, C, L]: each slot's row, gathered as whole rows of L.

        One gather index per slot (slice `[1, L]`), not one per element: on
        XLA:CPU an element-wise `take_along_axis` of the table cost ~50 ns per
        element, 60x a row gather (docs/DECISIONS.md). Batched over R (vmap), not
        a take from the flattened [R*NG, L] table: a row-sharded cache then gathers
        on its own device, where the flat index made XLA all-gather the table
        (tests/test_sharding.py); same speed on XLA:CPU.
        """
        take = lambda t, i: jnp.take(t, i, axis=0, mode="clip")  # [NG, L], [C] -> [C, L]
        return jax.vmap(take)(table, self.group_id.astype(jnp.int32))  # [R, C, L]

    def read(self) -> jax.Array:
        return self._dequantize(self.words, self.table_rows_of_slots)

    def _dequantize(self, words: jax.Array, rows_of) -> jax.Array:
        """codes * scale + offset, float32 [R, S, D]; `rows_of(table)` gives each slot's row
        of the `[R, NG, L]` table."""
        codes = unpack(words, self.bits, self.dim).astype(jnp.float32)  # [R, S, D]
        scale, offset = unpack_params(rows_of(self.table_by_group()), self.dim,
                                      self.param_dtype, self.symmetric)
        if offset is None:
            return codes * scale - (2 ** (self.bits - 1)) * scale
        return codes * scale + offset

    def read_slots(self, start, size: int, length=None) -> jax.Array:
        """`read()[:, start:start + size]` decoding only those slots (traced `start`).

        When the slots hold their groups in write order (slot `s` in table row
        `s // group`: a layer quantized and never compacted since), each
        table row is broadcast over its `group` slots; otherwise the rows are
        gathered per slot. Both give the same floats (`lax.cond`). Slots at or
        after `length` (unwritten) do not count against the order.
        """
        piece = self.map_slots(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1))
        g, ng = self.group, self.table_rows
        n = size // g + 2  # table rows that can touch `size` consecutive slots
        slots = start + jnp.arange(size, dtype=jnp.int32)
        in_order = piece.group_id.astype(jnp.int32) == (slots // g)[None]
        if length is not None:
            in_order |= (slots >= length)[None]
        in_order = jnp.all(in_order)

        def by_group(table):  # [R, NG, L] -> [R, size, L], rows start//g ... repeated g times
            if ng < n:
                table = jnp.pad(table, ((0, 0), (0, n - ng), (0, 0)))
            first = jnp.minimum(start // g, table.shape[1] - n)
            rows = jax.lax.dynamic_slice_in_dim(table, first, n, axis=1)
            return jax.lax.dynamic_slice_in_dim(jnp.repeat(rows, g, axis=1), start - first * g,
                                                size, axis=1)

        return jax.lax.cond(in_order, lambda p: p._dequantize(p.words, by_group),
                            lambda p: p.read(), piece)

    def put_groups(self, x: jax.Array, valid: jax.Array, at, count) -> "PackedChannels":
        """Quantize x [R, T, D] (T a multiple of `group`) as T/G new groups at slot `at`.

        Only the first `count` slots (a multiple of the group) are written;
        `valid` [R, T] leaves empty slots out of each group's range.
        """
        r, t, d = x.shape
        if t % self.group:
            raise ValueError(f"channel groups take {self.group} tokens at a time, got {t}")
        words, scale, offset = _quantize_packed(x, self.bits, self.group, 1, self.symmetric,
                                                jnp.dtype(self.param_dtype),
                                                jnp.broadcast_to(valid, (r, t)).astype(bool))
        ids = (self.groups + jnp.arange(t) // self.group).astype(jnp.int16)
        rows = pack_params(scale, offset, self.param_dtype).reshape(r, -1)  # [R, T/G * L]
        n_lanes = None if count is None else count // self.group * self.lanes
        return self.replace(
            words=_put_rows(self.words, words, at, count, codes=True),
            group_id=_put_rows(self.group_id, jnp.broadcast_to(ids, (r, t)), at, count),
            table=_put_rows(self.table, rows, self.groups * self.lanes, n_lanes),
            groups=self.groups + (t if count is None else count) // self.group)

    def used_groups(self, valid: jax.Array) -> jax.Array:
        """[R, NG] bool: table rows that some valid slot (`valid` [R, C]) refers to."""
        ids = jnp.where(valid, self.group_id.astype(jnp.int32), self.table_rows)
        used = jnp.zeros((ids.shape[0], self.table_rows + 1), bool)
        return used.at[jnp.arange(ids.shape[0])[:, None], ids].set(True)[:, :-1]

    def collect(self, valid: jax.Array, table_rows: int | None = None) -> "PackedChannels":
        """Drop the table rows no valid slot uses, keep the rest in order (exact).

        Jit-traceable; the table keeps `table_rows` rows (default: unchanged)
        and the cursor moves to the most rows any store row still uses.
        """
        used = self.used_groups(valid)  # [R, NG]
        n = self.table_rows if table_rows is None else table_rows
        order = jnp.argsort(~used, axis=1, stable=True)  # used rows first, in order
        new_id = jnp.zeros(used.shape, jnp.int32).at[
            jnp.arange(used.shape[0])[:, None], order].set(jnp.arange(used.shape[1]))
        if n > used.shape[1]:
            order = jnp.pad(order, ((0, 0), (0, n - used.shape[1])))
        order = order[:, :n]
        table = jnp.take_along_axis(self.table_by_group(), order[..., None], axis=1)
        ids = jnp.take_along_axis(new_id, self.group_id.astype(jnp.int32), axis=1)
        return self.replace(group_id=jnp.where(valid, ids, 0).astype(jnp.int16),
                            table=table.reshape(table.shape[0], -1),
                            groups=jnp.max(count_true(used, 1)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Latent(Store):
    """Low-rank storage: `x ~ z @ basis[h].T`, z the token's coordinates on r basis vectors.

    `basis` [KVH, D, r] has orthonormal columns per KV head (from
    `kvjax.policies.low_rank.calibrate`); row `n` of the store uses head `n % KVH`.
    Attention scores need no reconstruction: `q . (P z) = (P^T q) . z`.
    """

    z: jax.Array  # [R, C, r] latent coordinates
    basis: jax.Array  # [KVH, D, r] per-head orthonormal basis

    slot_fields = ("z",)
    codec_kind = "latent"

    @property
    def dim(self) -> int:
        return self.basis.shape[1]

    @classmethod
    def empty(cls, rows: int, capacity: int, basis: jax.Array, dtype=jnp.float32) -> "Latent":
        return cls(z=jnp.zeros((rows, capacity, basis.shape[-1]), dtype), basis=basis)

    def _by_head(self, x: jax.Array) -> jax.Array:
        kvh = self.basis.shape[0]
        return x.reshape(-1, kvh, *x.shape[1:])  # [B, KVH, ...]

    def project(self, x: jax.Array) -> jax.Array:
        """x [R, T, D] -> [R, T, r] coordinates on each row's basis."""
        z = jnp.einsum("bhtd,hdr->bhtr", self._by_head(x.astype(jnp.float32)),
                       self.basis.astype(jnp.float32))
        return z.reshape(*x.shape[:-1], -1)

    def lift(self, z: jax.Array) -> jax.Array:
        """z [R, T, r] -> [R, T, D] float32."""
        x = jnp.einsum("bhtr,hdr->bhtd", self._by_head(z.astype(jnp.float32)),
                       self.basis.astype(jnp.float32))
        return x.reshape(*z.shape[:-1], -1)

    def encode(self, x: jax.Array) -> "Latent":
        return self.replace(z=self.project(x).astype(self.z.dtype))

    def read(self) -> jax.Array:
        return self.lift(self.z)


def register_export(cls: type, name: str | None = None) -> type:
    """Let `jax.export` serialize a dataclass pytree whose static fields are JSON values
    (ints, strings, bools), under `name` (default `kvjax.<class name>`)."""
    jax.export.register_pytree_node_serialization(
        cls, serialized_name=name or f"kvjax.{cls.__name__}",
        serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
        deserialize_auxdata=lambda data: tuple(json.loads(data)))
    return cls


for _cls in (PackedTokens, Latent):
    register_export(_cls)
# version 2: the lane-flat table (`table`, `param_dtype`, `symmetric`) in place of [R, NG, D]
# `scale` / `offset` arrays; an artifact or checkpoint of the first layout is refused by name
register_export(PackedChannels, "kvjax.PackedChannels.v2")


class StoreFormatError(ValueError):
    """A serialized store (an exported artifact's or a checkpoint's pytree) in a layout this
    kvjax no longer reads."""


def refuse_old_layout(name: str, what: str, old: str, new: str) -> None:
    """Make the serialized name `name` of a store's earlier layout raise `StoreFormatError`
    when an artifact or checkpoint holding it is read, naming `what` the store is, its `old`
    layout, the `new` one and what to do."""
    @jax.tree_util.register_static
    class _OldLayout:
        pass

    def refuse(_data: bytes):
        raise StoreFormatError(f"this artifact or checkpoint holds {what} in {old}; this "
                               f"kvjax stores {new}. Export or save it again with this "
                               f"version.")

    jax.export.register_pytree_node_serialization(
        _OldLayout, serialized_name=name, serialize_auxdata=lambda aux: b"",
        deserialize_auxdata=refuse)


refuse_old_layout("kvjax.PackedChannels", "a KIVI (PackedChannels) key store",
                  "the layout kvjax used before 2026-12-06 ([R, NG, D] scale and offset "
                  "tables)", "the table lane-flat")


# ----------------------------------------------------------------------------- store ops


def is_dense(store: Any) -> bool:
    """True for a plain array (any float dtype, FP8 included), False for an encoded store."""
    return not isinstance(store, Store)


def is_encoded(store: Any) -> bool:
    """True when attention cannot read `store` as it is: an encoded store or an FP8 array."""
    return not is_dense(store) or jnp.dtype(store.dtype).itemsize == 1


def read(store: Any) -> jax.Array:
    """The [R, C, D] tensor a store holds: float32 if encoded (or FP8), else the array itself."""
    if is_dense(store):
        return store.astype(jnp.float32) if is_encoded(store) else store
    return store.read()


def encode_dense(x: jax.Array, dtype) -> jax.Array:
    """x in a dense cache dtype; FP8 saturates instead of overflowing to Inf/NaN."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        fmt = {jnp.dtype(d): name for name, d in FP8.items()}
        if dtype not in fmt:
            raise ValueError(f"unsupported FP8 cache dtype {dtype}")
        return to_fp8(x, fmt[dtype])
    return x.astype(dtype)


def put(store: Any, x: jax.Array, at, count=None, valid: jax.Array | None = None) -> Any:
    """Encode x [R, T, D] into slots [at, at + T) (only the first `count` if given)."""
    if is_dense(store):
        return _put_rows(store, encode_dense(x, store.dtype), at, count)
    if isinstance(store, PackedChannels):
        valid = jnp.ones(x.shape[:2], bool) if valid is None else valid
        return store.put_groups(x, valid, at, count)
    piece = store.encode(x)
    return store.replace(**{f: _put_rows(getattr(store, f), getattr(piece, f), at, count,
                                         codes=True)
                            for f in store.slot_fields if getattr(store, f) is not None})


def take(store: Any, order: jax.Array, kept: jax.Array) -> Any:
    """Gather slots `order` [R, C'] (a compaction); slots not `kept` are zeroed. Exact bits.

    A `PackedChannels` store then frees the table rows no kept slot uses.
    """
    if is_dense(store):
        return _take_rows(store, order, kept)
    out = store.map_slots(lambda x: _take_rows(x, order, kept))
    return out.collect(kept) if isinstance(out, PackedChannels) else out


def count_true(mask: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """int32 number of True entries of `mask` along `axis`.

    Summed in float32 (exact: every partial sum is an integer below 2**24, which the axis length
    guarantees; longer axes sum in int32). XLA:CPU rewrites an integer or boolean reduction over
    a long axis into three kernels (two reduce-windows of 32 and a reduce), each compiled on its
    own; a float reduction stays one loop fused with its producer (DECISIONS "Compile: integer
    reductions as float counts").

    Example:
        >>> count_true(jnp.array([[True, False, True], [False, False, False]])).tolist()
        [2, 0]
    """
    if mask.shape[axis] >= 2 ** 24:
        return jnp.sum(mask, axis=axis, keepdims=keepdims, dtype=jnp.int32)
    return jnp.sum(mask, axis=axis, keepdims=keepdims, dtype=jnp.float32).astype(jnp.int32)


def table_usage(store: Any, valid: jax.Array) -> jax.Array | None:
    """The most table rows any store row of a `PackedChannels` uses (`valid` [R, C] marks the
    slots in use; jit-able), None for other stores. `table_rows` turns it into a row count."""
    return jnp.max(count_true(store.used_groups(valid), 1)) if isinstance(store, PackedChannels) \
        else None


def table_rows(store: Any, capacity: int, used: int | None, in_use: int) -> int | None:
    """Rows a `PackedChannels` table keeps at `capacity` slots (host side; None for other
    stores), from its `table_usage` and the most slots in use in a row: the rows in use plus
    one per `group` free slots (and one for a partial group), room for every later flush.
    With no free slot the table keeps only the rows in use."""
    if not isinstance(store, PackedChannels):
        return None
    free = max(capacity - in_use, 0)
    return int(used) + (-(-free // store.group) + 1 if free else 0)  # +1: a partial group


def resize_store(store: Any, capacity: int, valid: jax.Array, rows: int | None = None) -> Any:
    """Cut or extend the slot axis; `valid` [R, C] marks the slots in use, `rows` is a
    `PackedChannels` table's `table_rows` (jit-able with `capacity` and `rows` static)."""
    if is_dense(store):
        return resize_rows(store, capacity)
    if isinstance(store, PackedChannels):
        store = store.collect(valid, rows)
    return store.map_slots(lambda x: resize_rows(x, capacity))


def fold_rows(store: Any, rows: int) -> Any:
    """Reshape `[R, C, ...]` slot leaves to `[rows, R*C/rows, ...]` (the pooled layout)."""
    if isinstance(store, (PackedChannels, Latent)):
        raise ValueError(f"head-wise budgets (pooled layout) do not support a "
                         f"{type(store).__name__} store: its parameters belong to one KV head")
    # explicit slot count: a store with no slots (C = 0) cannot infer a -1 axis
    return map_slot_leaves(store, lambda x: x.reshape(rows, x.shape[0] * x.shape[1] // rows,
                                                      *x.shape[2:]))


def map_slot_leaves(store: Any, fn) -> Any:
    """`fn` applied to a dense array, or to every slot leaf of an encoded store."""
    return fn(store) if is_dense(store) else store.map_slots(fn)
