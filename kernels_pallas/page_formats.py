"""How one page of keys or values is stored, and how a kernel decodes it.

A *page* holds `page_size` consecutive slots of one (sequence, KV head). A
format names the arrays that hold a pool of pages, says how a kernel's
pipeline blocks them, and decodes one page to float32 `[page_size, D]`
inside the kernel. The same decode runs in the plain-jnp reference, so a
kernel and its reference read identical numbers.

| format | arrays (P pages of S slots) | decode |
|---|---|---|
| `Dense()` | `[P, S, D]` float32/bf16/fp8 | cast |
| `PackedTokens(bits, group, symmetric)` | words `[P, S, D*bits/32]` uint32, scale `[P, S, D/G]`, offset (asymmetric) | per token, groups of G channels |
| `PackedChannels(bits, symmetric)` | words `[P, S, D*bits/32]`, group id `[P, S, 1]` int32, scale table `[R, NG, D]`, offset table | per channel, one table row per group of tokens; table row `b*KVH + h` |

The packed layouts are `kvjax.stores`' (strided bit planes, see
`kvjax.quant.pack`): a `TokenCache` of `[B*KVH, C, ...]` arrays becomes a
pool by a free reshape to `[B*KVH*C/S, S, ...]`.

Example:
    >>> fmt = PackedTokens(bits=4, group=32)
    >>> fmt.check((words, scale, offset), head_dim=64)   # eager shape checks
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PAGE = "page"  # an array indexed by page: [P, S, ...]
ROW = "row"  # an array indexed by (sequence, KV head) row: [R, ...] (per-row tables)


def unpack_planes(words: jax.Array, bits: int) -> jax.Array:
    """[S, W] uint32 -> [S, W * 32/bits] float32 codes (strided planes: element j*W + w)."""
    mask = jnp.uint32((1 << bits) - 1)
    planes = [((words >> jnp.uint32(j * bits)) & mask).astype(jnp.int32)
              for j in range(32 // bits)]
    return jnp.concatenate(planes, axis=-1).astype(jnp.float32)


class Ops(NamedTuple):
    """How a backend reads a block: `load(block)`, `unpack(words_block, bits)`, `gather(table_block, ids)`.

    A format's `decode` only calls these, so one decode serves the TPU kernel
    (blocks are VMEM refs), the GPU kernel (blocks are views of HBM refs)
    and the reference (blocks are arrays).
    """

    load: Callable
    unpack: Callable
    gather: Callable


def _take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table.astype(jnp.float32), ids[:, 0], axis=0)


def _onehot_rows(table_ref, ids: jax.Array) -> jax.Array:
    """One-hot [S, NG] @ table [NG, D]: exact at HIGHEST precision (a TPU has no row gather)."""
    table = table_ref[...]
    hot = ids == jax.lax.broadcasted_iota(jnp.int32, (ids.shape[0], table.shape[0]), 1)
    return jnp.dot(hot.astype(jnp.float32), table.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


class PageRef(NamedTuple):
    """Page `page` of a whole-pool HBM ref (GPU: one indexer per load)."""

    ref: Any  # [P, S, ...]
    page: jax.Array  # [] int32


def _gpu_unpack(block: PageRef, bits: int) -> jax.Array:
    """Element j*W + w is word w >> (j*bits): one gathered load, no lane concatenation."""
    s, w = block.ref.shape[1:]
    lane = jax.lax.broadcasted_iota(jnp.int32, (w * 32 // bits,), 0)
    rows = jax.lax.broadcasted_iota(jnp.int32, (s, 1), 0)
    words = block.ref[block.page, rows, (lane % w)[None, :]]  # [S, D]
    shift = (lane // w * bits).astype(jnp.uint32)
    return ((words >> shift[None, :]) & jnp.uint32((1 << bits) - 1)).astype(jnp.int32).astype(
        jnp.float32)


REFERENCE_OPS = Ops(load=lambda x: x, unpack=unpack_planes, gather=_take_rows)
TPU_OPS = Ops(load=lambda r: r[...], unpack=lambda r, bits: unpack_planes(r[...], bits),
              gather=_onehot_rows)
GPU_OPS = Ops(load=lambda b: b.ref[b.page] if isinstance(b, PageRef) else b[...],
              unpack=_gpu_unpack,
              gather=lambda r, ids: r[ids[:, 0]].astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Dense:
    """Plain floats, `[P, S, D]`; any float dtype (float32, bfloat16, float8)."""

    def kinds(self) -> tuple[str, ...]:
        return (PAGE,)

    def check(self, arrays, head_dim: int) -> None:
        (x,) = arrays
        if x.ndim != 3 or x.shape[-1] != head_dim:
            raise ValueError(f"dense pages must be [P, S, {head_dim}], got {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"dense pages must be a float dtype, got {x.dtype}")

    def decode(self, blocks, ops: Ops) -> jax.Array:
        """blocks: ([S, D],) -> [S, D] float32."""
        return ops.load(blocks[0]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class PackedTokens:
    """Per-token codes: each slot's D channels in groups of `group`, one scale (and offset) each."""

    bits: int
    group: int
    symmetric: bool = False

    def kinds(self) -> tuple[str, ...]:
        return (PAGE,) * (2 if self.symmetric else 3)

    def check(self, arrays, head_dim: int) -> None:
        _check_packed(arrays[0], self.bits, head_dim)
        n, s = arrays[0].shape[:2]
        for a in arrays[1:]:
            if a.shape != (n, s, head_dim // self.group):
                raise ValueError(f"per-token parameters must be {(n, s, head_dim // self.group)}, "
                                 f"got {a.shape}")

    def decode(self, blocks, ops: Ops) -> jax.Array:
        """blocks: (words [S, W], scale [S, D/G], offset?) -> [S, D] float32."""
        codes = ops.unpack(blocks[0], self.bits)
        per_channel = lambda b: jnp.repeat(ops.load(b).astype(jnp.float32), self.group, axis=-1)
        scale = per_channel(blocks[1])
        offset = (-(2 ** (self.bits - 1)) * scale if self.symmetric else per_channel(blocks[2]))
        return codes * scale + offset


@dataclasses.dataclass(frozen=True)
class PackedChannels:
    """Per-channel codes (KIVI keys): each slot names its token group's row in a per-row table."""

    bits: int
    symmetric: bool = False

    def kinds(self) -> tuple[str, ...]:
        return (PAGE, PAGE) + (ROW,) * (1 if self.symmetric else 2)

    def check(self, arrays, head_dim: int) -> None:
        _check_packed(arrays[0], self.bits, head_dim)
        n, s = arrays[0].shape[:2]
        if arrays[1].shape != (n, s, 1) or arrays[1].dtype != jnp.int32:
            raise ValueError(f"group ids must be int32 {(n, s, 1)}, got {arrays[1].dtype} "
                             f"{arrays[1].shape}")
        for t in arrays[2:]:
            if t.ndim != 3 or t.shape[-1] != head_dim:
                raise ValueError(f"per-channel tables must be [R, NG, {head_dim}], got {t.shape}")

    def decode(self, blocks, ops: Ops) -> jax.Array:
        """blocks: (words [S, W], group id [S, 1], scale table [NG, D], offset table?) -> [S, D].

        Table rows are picked by `ops.gather`: a one-hot matmul on TPU, a
        gathered load on GPU, `jnp.take` in the reference.
        """
        codes = ops.unpack(blocks[0], self.bits)
        ids = ops.load(blocks[1])
        scale = ops.gather(blocks[2], ids)
        offset = (-(2 ** (self.bits - 1)) * scale if self.symmetric
                  else ops.gather(blocks[3], ids))
        return codes * scale + offset


DENSE = Dense()
Format = Dense | PackedTokens | PackedChannels


def _check_packed(words: jax.Array, bits: int, head_dim: int) -> None:
    if bits not in (2, 4, 8):
        raise ValueError(f"packed pages hold 2, 4 or 8-bit codes, got bits={bits}")
    want = head_dim * bits // 32
    if words.ndim != 3 or words.shape[-1] != want or words.dtype != jnp.uint32:
        raise ValueError(f"packed pages must be uint32 [P, S, {want}] for {bits}-bit codes "
                         f"of head_dim {head_dim}, got {words.dtype} {words.shape}")


def block_spec(kind: str, x: jax.Array, page_index, row_index) -> pl.BlockSpec:
    """One page (or one row's table) of `x` per grid step: block `(None, *x.shape[1:])`."""
    zeros = (0,) * (x.ndim - 1)
    index = page_index if kind == PAGE else row_index
    return pl.BlockSpec((None, *x.shape[1:]), lambda *a: (index(*a), *zeros))
