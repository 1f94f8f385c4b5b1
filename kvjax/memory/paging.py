"""A paged key/value pool: pages allocated on demand, shared copy-on-write, freed whole.

The pool is `P` pages of `page_size` slots. A page belongs to one
(sequence, KV head) *row*; a row lists its pages in slot order in its block
table. Everything is a pure, jit-compiled function of explicit state:

- `PagePool` is the allocator: a reference count per page, a sticky
  `overflow` flag and a sticky `error` record (the first bad argument).
- `PagedLayer` is one layer's storage: key/value/position pages plus the
  block tables and per-row lengths it reads and writes. Every layer of a
  model holds identical tables; the functions below update them together.

**The null page.** Page `NULL_PAGE` (index 0) is reserved: it is never
allocated or counted, its positions stay `EMPTY` and its keys/values zero.
Every unused block-table entry points to it, so a table is always a valid
gather index, and a stray read sees nothing.

**Life of a row.** A row *holds* the pages its table lists (a prefix of the
table); the first `ceil(length / page_size)` of them are *in use* (written,
read by attention), the rest are reserved for the next writes.
`reserve(pool, layers, n)` makes room for `n` more tokens per sequence: it
takes free pages, and when a row's last, partly filled page is shared it
copies that page first (copy-on-write). `write` appends tokens at each
row's length. `fork` shares one sequence's in-use pages with another
(prefix sharing: reference counts go up, nothing is copied); `release`
frees every page a sequence holds; `evict_pages` frees chosen whole pages
and closes the gaps in the table.

**Isolation.** A sequence reads only what it wrote or inherited by fork:
- a page is scrubbed (keys/values zero, positions `EMPTY`) by the write that
  starts it, so nothing a previous owner left (NaN and Inf included: attention
  multiplies masked slots by 0) is ever readable, and padding tokens are not
  stored at all (their slots stay `EMPTY` and zero);
- `write` never writes into a page shared by `fork` (it cannot allocate the
  copy: it sees one layer, and the allocator lives in the pool): such a token
  is dropped and the layer's `error` set; `reserve` first;
- the null page is never counted, so reference counts cannot go negative.

**Errors.** Bad argument *values* raise `ValueError` at once when the call
is eager (concrete values), and under jit set `pool.error` (all or nothing:
the call changes nothing). Capacity shortfalls set `pool.overflow`. A write
that drops a real token sets `layer.error`; the next pool operation copies
it into `pool.error`. `check_pool(pool)` raises on the flags on the host;
`check_pool(pool, layers)` also audits every invariant. Callers check after
a step (or a few).

Example:
    >>> pool, layers = init_paged_cache(num_pages=8, page_size=4, batch=2, kv_heads=1,
    ...                                 max_pages=4, head_dim=4, num_layers=2)
    >>> pool, layers = reserve(pool, layers, jnp.array([6, 3]))    # room for the prompts
    >>> k = v = jnp.ones((2, 1, 6, 4))                               # [B, KVH, T, D]
    >>> pos = jnp.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]])  # -1: padding
    >>> layers = [layer.write(k, v, pos) for layer in layers]       # the model does this
    >>> check_pool(pool, layers)
    >>> pool.refcount.tolist()   # page 0 is the null page; 6 tokens take 2 pages, 3 take 1
    [0, 1, 1, 1, 0, 0, 0, 0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import page_formats as pf
from kvjax.core.branches import rare_cond
from kvjax.core.cache import EMPTY, TokenCache, check_sizes
from kvjax.core.layer import register_layer
from kvjax.core.quant import PARAM_DTYPES
from kvjax.core.stores import (PackedTokens, Store, encode_dense, is_dense, map_slot_leaves,
                               param_values, read, register_export)

NULL_PAGE = 0
"""Reserved page: never allocated or counted, always empty; unused table entries point to it."""

_static = dict(static=True)

# Error records are [4] int32: (code, a, b, c), the first error sticky; 0 = no error.
# The messages say what a, b and c are.
_ERRORS = {
    1: "reserve: new_tokens[{0}] = {1} is negative; counts must be in [0, {2}]",
    2: "reserve: new_tokens[{0}] = {1} exceeds what a block table holds; counts must be in "
       "[0, {2}]",
    3: "fork: source[{0}] = {1} is not a sequence; sources must be in [-1, {2}) (-1: no fork)",
    4: "fork: target sequence {0} is not empty ({1} slots written, {2} pages held); release it "
       "before forking into it",
    5: "write: sequence {0}, KV head {1}: slot {2} falls in a page shared by fork, so the "
       "token was dropped; call reserve before writing (it copies the shared page)",
    6: "write: sequence {0}, KV head {1}: slot {2} has no reserved page, so the token was "
       "dropped; call reserve before writing",
    7: "release/evict_pages: page {0} would have reference count {1} < 0; the layers do not "
       "belong to this pool",
    8: "write: sequence {0}, KV head {1}: slot {2} falls in a page spilled to host memory, so "
       "the token was dropped; restore the page first (kvjax.memory.tiers.restore)",
    9: "spill: pages[{0}] = {1} is out of range, so nothing moved for it: the device pages "
       "are [1, {2}) (NO_PAGE = -1 entries are skipped)",
    10: "restore: pages[{0}] = {1} is out of range, so nothing moved for it: the host pages "
        "end at {2} and start at the layers' device_pages (NO_PAGE = -1 entries are skipped)",
    11: "prefetch: pages[{0}] = {1} is out of range, so its stage slot stays empty: the pool's "
        "pages are [0, {2}) (NO_PAGE = -1 entries are skipped)",
}
NO_ERROR = (0, 0, 0, 0)


class PoolError(ValueError):
    """A paged pool's flags are set or one of its invariants is broken (`check_pool`)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenPages(Store):
    """Per-token codes over pages, each page *lane-flat*: the kernel's layout, held as it is.

    `pages[p, 0]` is page p's `W` rows of code words (W = D*bits/32) then its `NW` rows of
    packed scales (and offsets), each row `S` lanes long, side by side:
    `kernels_pallas.page_formats.PackedTokens`. The codes and parameters are those of
    `kvjax.core.stores.PackedTokens` (same quantizer, same bits); only the layout differs.
    XLA:TPU keeps a `[P, 1, L]` array row-major and dense at any page size, so the kernel
    DMAs each page as one contiguous row with no relayout of the pool per call, where a
    `[P, S, W]` pool of pages below 128 slots is laid out page-minor (docs/DECISIONS.md,
    "Page pools held lane-flat").

    Example:
        >>> s = TokenPages.empty(pages=3, page_size=64, dim=128, bits=4, group=32)
        >>> s.pages.shape, s.shape   # 16 code rows + 4 rows of float16 scale/offset pairs
        ((3, 1, 1280), (3, 64, 128))
        >>> x = jnp.ones((2, 128))
        >>> s = s.put_slots(jnp.array([1, 2]), jnp.array([0, 63]), x)
        >>> s.read()[jnp.array([1, 2]), jnp.array([0, 63])].tolist() == x.tolist()
        True
    """

    pages: jax.Array  # [P, 1, (W + NW) * S] uint32
    bits: int = dataclasses.field(metadata=_static)
    group: int = dataclasses.field(metadata=_static)
    dim: int = dataclasses.field(metadata=_static)
    symmetric: bool = dataclasses.field(metadata=_static)
    param_dtype: str = dataclasses.field(metadata=_static)

    slot_fields = ("pages",)
    codec_kind = "tokens"

    @classmethod
    def empty(cls, pages: int, page_size: int, dim: int, bits: int, group: int,
              symmetric: bool = False, param_dtype=jnp.float16) -> "TokenPages":
        PackedTokens.empty(0, 0, dim, bits, group)  # checks bits, group and dim
        name = _dtype_name(param_dtype)
        rows = pf.PackedTokens(bits, group, bool(symmetric), name).rows(dim)  # checks the dtype
        return cls(pages=jnp.zeros((pages, 1, rows * page_size), jnp.uint32), bits=bits,
                   group=group, dim=dim, symmetric=bool(symmetric), param_dtype=name)

    @property
    def format(self) -> pf.PackedTokens:
        """The kernel's format of these pages (`kernels_pallas.page_formats`)."""
        return pf.PackedTokens(self.bits, self.group, self.symmetric, self.param_dtype)

    @property
    def rows(self) -> int:
        """Lane rows of S slots a page holds: code words, then packed parameters."""
        return self.format.rows(self.dim)

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical `[P, S, D]`."""
        return (self.pages.shape[0], self.pages.shape[-1] // self.rows, self.dim)

    def encode_pages(self, x: jax.Array) -> jax.Array:
        """x [N, S', D] -> [N, 1, rows * S'] uint32: each slot quantized on its own, as
        `kvjax.core.stores.PackedTokens` does (bit for bit), laid out as pages of S' slots."""
        like = PackedTokens.empty(0, 0, self.dim, self.bits, self.group, self.symmetric,
                                  jnp.dtype(self.param_dtype))
        piece = like.encode(x)
        offset = None if piece.offset is None else param_values(piece.offset)
        return self.format.from_store(piece.words, param_values(piece.scale), offset)[0]

    def put_slots(self, page: jax.Array, offset: jax.Array, x: jax.Array) -> "TokenPages":
        """Tokens x [N, D] written at slot `offset` [N] of page `page` [N] (out of range:
        dropped): one lane in each of the page's rows."""
        s = self.shape[1]
        words = self.encode_pages(x[:, None])[:, 0]  # [N, rows]: one lane per row
        lanes = jnp.arange(self.rows) * s + offset[:, None]  # [N, rows]
        return self.replace(pages=self.pages.at[page[:, None], 0, lanes].set(words, mode="drop"))

    def to_packed(self) -> PackedTokens:
        """The same pages as a `kvjax.core.stores.PackedTokens` of `[P, S, ...]` slot leaves
        (exact bits: the inverse of `encode_pages`' layout)."""
        p, s, _ = self.shape
        w, n = self.dim * self.bits // 32, self.format.n_params(self.dim)
        rows = self.pages.reshape(p, self.rows, s)
        slots_last = lambda x: jnp.swapaxes(x, 1, 2)
        packed = rows[:, w:]  # [P, NW, S]
        if self.param_dtype == "float32":
            params = jax.lax.bitcast_convert_type(packed, jnp.float32)
        else:  # 16-bit pairs: row i holds logical rows i (low half) and i + NW (high half)
            halves = jnp.concatenate([packed & 0xFFFF, packed >> 16], axis=1)[:, :n]
            params = halves.astype(jnp.uint16)  # float16 is stored as its bits
            if self.param_dtype == "bfloat16":
                params = jax.lax.bitcast_convert_type(params, jnp.bfloat16)
        params = slots_last(params)  # [P, S, n]
        ng = self.dim // self.group
        return PackedTokens(words=slots_last(rows[:, :w]), scale=params[..., :ng],
                            offset=None if self.symmetric else params[..., ng:],
                            bits=self.bits, group=self.group, dim=self.dim)

    def read(self) -> jax.Array:
        """[P, S, D] float32: what `kvjax.core.stores.PackedTokens` of the same codes reads."""
        return self.to_packed().read()


register_export(TokenPages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePool:
    """Allocator state shared by the layers of a paged cache."""

    refcount: jax.Array  # [P] int32 table entries listing the page (NULL_PAGE: always 0)
    overflow: jax.Array  # [] bool a reserve or fork did not fit (sticky)
    page_size: int = dataclasses.field(metadata=_static)
    error: jax.Array  # [4] int32 first bad argument or dropped write (code, a, b, c); 0 = none

    @property
    def num_pages(self) -> int:
        return self.refcount.shape[0]

    def replace(self, **changes: Any) -> "PagePool":
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayer:
    """One layer's pages and the block tables that map rows to them.

    `k`/`v` are dense `[P, S, D]` arrays or a `TokenPages` store (per-token codes, each
    page lane-flat as the kernel reads it). Row `(b, h)`'s slot `i` lives in
    page `tables[b, h, i // S]` at offset `i % S`. `shared` mirrors the
    pool's `refcount > 1` (the pool functions keep it), so `write` can refuse
    shared pages without the pool. With `shared_tables` the pool hands out
    pages in aligned groups of KVH ids, one group per (sequence, block):
    `tables[b, h, i] == tables[b, 0, i] + h` with `tables[b, 0, i] % KVH == 0`,
    so `tables[:, 0]` is a `[B, NP]` table the heads share (the kernel reads
    head h's page at `+ h`, `head_stride=1`).
    """

    k: Any  # [P, S, D] or TokenPages
    v: Any  # [P, S, D] or TokenPages
    pos: jax.Array  # [P, 1, S] int32 absolute position per slot, EMPTY when free
    tables: jax.Array  # [B, KVH, NP] int32 pages per row in slot order, NULL_PAGE past the end
    lengths: jax.Array  # [B, KVH] int32 slots written per row
    shared: jax.Array  # [P] bool pages listed by more than one table entry (read-only)
    error: jax.Array  # [4] int32 first dropped write (code, a, b, c); 0 = none
    # True: a sequence's KV heads share one page id per block (`init_paged_cache`)
    shared_tables: bool = dataclasses.field(default=False, metadata=_static, kw_only=True)

    @property
    def batch(self) -> int:
        return self.tables.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.tables.shape[1]

    @property
    def page_size(self) -> int:
        return self.pos.shape[-1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]  # a store's logical shape ends in D too

    @property
    def mass(self) -> None:
        """Paged layers track no accumulated attention (H2O-style policies need a TokenCache)."""
        return None

    @property
    def capacity(self) -> int:
        """Slots one row can hold: table length x page size."""
        return self.tables.shape[-1] * self.page_size

    @property
    def num_pages_used(self) -> jax.Array:
        """[B, KVH] pages each row has written into (attention reads these)."""
        return -(-self.lengths // self.page_size)

    @property
    def num_pages_held(self) -> jax.Array:
        """[B, KVH] pages each row's table lists (in use, then reserved)."""
        return jnp.sum(self.tables != NULL_PAGE, axis=-1, dtype=jnp.int32)

    @property
    def device_pages(self) -> int:
        """Pages whose keys/values live in `k`/`v` (ids below it); a plain layer: all of them.
        A tiered layer (`kvjax.memory.tiers.TieredLayer`) keeps the others in host memory."""
        return self.pos.shape[0]

    def all_pages(self) -> tuple[jax.Array, jax.Array]:
        """([P, S, D], [P, S, D]) float keys and values of every page id, decoded, on device
        (a tiered layer brings its host pages over: a reference and audit path)."""
        return read(self.k), read(self.v)

    def pages_freed(self, refcount: jax.Array) -> "PagedLayer":
        """Called by every pool operation with the new reference counts [P]; a plain layer keeps
        nothing per page beyond its pages (a tiered layer drops staged copies of freed ones)."""
        return self

    def replace(self, **changes: Any) -> "PagedLayer":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------ CacheLayer (kvjax.core.layer)
    def attend(self, q, q_pos, *, impl: str = "xla", window=None, softcap=None):
        """The XLA attention of `kvjax.attend` over the dense view (the Pallas kernel reads the
        pages in place: `kvjax.backends.pallas`)."""
        from kvjax.core.attention import attend_blockwise, attend_reference
        fn = attend_reference if impl == "reference" else attend_blockwise
        return fn(q, q_pos, self.view(), window=window, softcap=softcap)

    def view(self, keep_latent: bool = False) -> TokenCache:
        return dense_view(self)

    def counters(self) -> dict[str, jax.Array]:
        """Slots written per row, pages listed on the device and (a tiered layer) host."""
        used = jnp.arange(self.tables.shape[-1]) < self.num_pages_used[..., None]
        host = used & (self.tables >= self.device_pages)
        return dict(tokens=jnp.sum(self.view().pos != EMPTY, -1, dtype=jnp.int32),
                    slots_used=self.lengths,
                    capacity=jnp.full(self.lengths.shape, self.capacity, jnp.int32),
                    pages_device=jnp.sum(used & ~host, -1, dtype=jnp.int32),
                    pages_host=jnp.sum(host, -1, dtype=jnp.int32),
                    prefetch_misses=self.misses_so_far())

    def misses_so_far(self) -> jax.Array:
        """[B, KVH] int32 host pages read without a staged copy: none for a device-only layer."""
        return jnp.zeros(self.lengths.shape, jnp.int32)

    def count_misses(self) -> "PagedLayer":
        """The layer after counting this step's prefetch misses (a tiered layer's)."""
        return self

    def free_tokens(self) -> int:
        """Host side: slots left in the fullest row's block table (reserve pages first)."""
        return self.capacity - int(jnp.max(self.lengths))

    def check(self, index: int, spec: Any, batch: int) -> None:
        check_sizes(index, self, spec, batch, "paged")

    def shardings(self, mesh, batch_axis, kv_axis) -> "PagedLayer":
        """Every leaf replicated: the pool's pages are shared by all rows."""
        from jax.sharding import NamedSharding, PartitionSpec as P
        return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), self)

    def parts(self) -> tuple:
        return ()  # pages, not dense slots (`view` gathers them)

    def shrink_usage(self) -> None:
        return None

    def shrink_plan(self, usage: None, room: int, max_write: int, align: int = 1) -> None:
        """Nothing to cut: pages are freed whole by the pool (`release`, `evict_pages`)."""
        return None

    def resized(self, plan: None) -> "PagedLayer":
        return self

    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "PagedLayer":
        """Append T tokens per row at its length (`kvjax.write` calls this).

        k_new, v_new: [B, KVH, T, D]; pos_new: [B, T] int32 (negative =
        padding: the slot is taken, EMPTY, with zero key and value). Every slot
        of a page this write starts is written (tokens, then zeros and EMPTY past
        the last one), so nothing a previous owner left is readable. A token
        (position >= 0) whose slot has no reserved page, or falls in a page
        shared by `fork`, is dropped and sets `error` (`reserve` first);
        lengths never pass the reserved pages.
        """
        b, h, t, d = k_new.shape
        if (b, h, d) != (self.batch, self.kv_heads, self.head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"PagedLayer.write: keys {k_new.shape} / values {v_new.shape} do "
                             f"not fit [batch={self.batch}, kv_heads={self.kv_heads}, T, "
                             f"head_dim={self.head_dim}]")
        if pos_new.shape != (b, t):
            raise ValueError(f"PagedLayer.write: positions {pos_new.shape}, expected {(b, t)}")
        if t == 0:
            return self
        s, n_table, n_pages = self.page_size, self.tables.shape[-1], self.pos.shape[0]
        slot = self.lengths[..., None] + jnp.arange(t)  # [B, KVH, T]
        page = jnp.take_along_axis(self.tables, jnp.minimum(slot // s, n_table - 1), axis=-1)
        held = (slot < self.capacity) & (page != NULL_PAGE)
        shared = held & self.shared[page]
        on_host = held & (page >= self.device_pages)  # a tiered layer's spilled page
        real = jnp.broadcast_to((pos_new >= 0)[:, None], (b, h, t))
        error = _first_error(self.error,
                             _error_at(real & shared, 5, slot),
                             _error_at(real & ~held, 6, slot),
                             _error_at(real & on_host & ~shared, 8, slot))
        layer = self._scrub_last_page(t)
        page = jnp.where(held & ~shared & ~on_host, page, n_pages).reshape(-1)  # dropped
        offset = (slot % s).reshape(-1)
        keep = real.reshape(-1, 1)
        pos = jnp.where(real, jnp.broadcast_to(pos_new[:, None], (b, h, t)), EMPTY)
        return layer.replace(
            k=_scatter(layer.k, page, offset, jnp.where(keep, k_new.reshape(-1, d), 0)),
            v=_scatter(layer.v, page, offset, jnp.where(keep, v_new.reshape(-1, d), 0)),
            pos=layer.pos.at[page, 0, offset].set(pos.reshape(-1).astype(jnp.int32),
                                                  mode="drop"),
            lengths=jnp.minimum(self.lengths + t, self.num_pages_held * s),
            error=error)

    def _scrub_last_page(self, t: int) -> "PagedLayer":
        """Zero the keys/values and EMPTY the positions of each row's page that a write of `t`
        tokens starts but does not fill (pages it fills are overwritten whole anyway).

        At most one page per row; skipped (`lax.cond`) when no row starts one, as in most
        decode steps."""
        s, n_table, n_pages = self.page_size, self.tables.shape[-1], self.pos.shape[0]
        end = self.lengths + t  # [B, KVH] one past the last slot written
        index = (end - 1) // s
        page = jnp.take_along_axis(self.tables, jnp.minimum(index, n_table - 1)[..., None],
                                   axis=-1)[..., 0]
        start = ((index < n_table) & (index * s >= self.lengths) & (end % s != 0)
                 & (page != NULL_PAGE) & ~self.shared[page] & (page < self.device_pages))
        page = jnp.where(start, page, n_pages).reshape(-1)
        zero = lambda x: x.at[page].set(0, mode="drop")

        def scrub(kvp):
            k, v, pos = kvp
            return (map_slot_leaves(k, zero), map_slot_leaves(v, zero),
                    pos.at[page].set(EMPTY, mode="drop"))

        k, v, pos = rare_cond(jnp.any(start), scrub, lambda kvp: kvp,
                              (self.k, self.v, self.pos))
        return self.replace(k=k, v=v, pos=pos)


register_layer(PagedLayer)


def _scatter(store: Any, page: jax.Array, offset: jax.Array, x: jax.Array) -> Any:
    """Write tokens x [N, D] at (page, offset) of a page store; out-of-range pages are dropped."""
    if is_dense(store):
        return store.at[page, offset].set(encode_dense(x, store.dtype), mode="drop")
    if isinstance(store, TokenPages):
        return store.put_slots(page, offset, x)
    piece = store.encode(x[:, None])  # each token quantized on its own: [N, 1, ...]
    return store.replace(**{f: getattr(store, f).at[page, offset].set(getattr(piece, f)[:, 0],
                                                                     mode="drop")
                            for f in store.slot_fields if getattr(store, f) is not None})


def _error_at(bad: jax.Array, code: int, value: jax.Array) -> jax.Array:
    """[4] int32 (code, b, h, value[b, h, t]) at the first True of bad [B, KVH, T], else zeros."""
    flat = jnp.argmax(bad.reshape(-1))
    b, h, _ = jnp.unravel_index(flat, bad.shape)
    record = jnp.stack([jnp.int32(code), b.astype(jnp.int32), h.astype(jnp.int32),
                        value.reshape(-1)[flat].astype(jnp.int32)])
    return jnp.where(jnp.any(bad), record, 0)


def _first_error(*records: jax.Array) -> jax.Array:
    """The first record with a nonzero code (sticky: pass the current record first)."""
    out = records[-1]
    for record in reversed(records[:-1]):
        out = jnp.where(record[0] != 0, record, out)
    return out


def _dtype_name(dtype) -> str:
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        return repr(dtype)


def init_paged_cache(num_pages: int, page_size: int, batch: int, kv_heads: int, max_pages: int,
                     head_dim: int, num_layers: int, dtype=jnp.float32, bits: int | None = None,
                     group: int = 32, shared_tables: bool = False, param_dtype=jnp.float16
                     ) -> tuple[PagePool, tuple[PagedLayer, ...]]:
    """An empty pool of `num_pages` pages (one of them the null page) and its layers.

    `max_pages` is the block-table length: one row holds at most
    `max_pages * page_size` tokens. `bits` stores keys and values as
    per-token `bits`-bit codes in groups of `group` channels (kernels read
    them packed), with scales and offsets in `param_dtype` (float16, bfloat16 or float32;
    the TPU kernel reads bfloat16 and float32 ones in place, float16 ones as a copy of
    their bits: Mosaic takes no float16 arguments); otherwise pages are dense `dtype`.
    `shared_tables`: pages
    are allocated `kv_heads` at a time, one aligned group of ids per
    (sequence, block) (group 0 holds the null page and is never used, nor
    are the `num_pages % kv_heads` last ids), so the kernel reads a `[B, NP]`
    table shared by the heads; `evict_pages` then drops a page for all heads
    of a sequence or none.
    """
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("batch", batch),
                        ("kv_heads", kv_heads), ("max_pages", max_pages),
                        ("head_dim", head_dim), ("num_layers", num_layers)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"init_paged_cache: {name} must be a positive int, got {value!r}")
    if num_pages < 2:
        raise ValueError("init_paged_cache: the pool needs the null page and at least one more")
    if shared_tables and num_pages // kv_heads < 2:
        raise ValueError(f"init_paged_cache: shared_tables needs num_pages >= 2 * kv_heads "
                         f"(= {2 * kv_heads}; page group 0 holds the null page), got {num_pages}")
    if bits is not None and _dtype_name(param_dtype) not in PARAM_DTYPES:
        raise ValueError(f"init_paged_cache: param_dtype must be float16, bfloat16 or float32, "
                         f"got {_dtype_name(param_dtype)}")
    if max_pages * page_size >= 2 ** 30:
        raise ValueError(f"init_paged_cache: max_pages * page_size = {max_pages * page_size} "
                         f"slots per row; must be below 2**30 (int32 lengths)")

    def pages():
        if bits is None:
            return jnp.zeros((num_pages, page_size, head_dim), dtype)
        return TokenPages.empty(num_pages, page_size, head_dim, bits, group,
                                param_dtype=param_dtype)

    def layer():  # every array its own buffer, so a jitted step may donate the cache
        return PagedLayer(k=pages(), v=pages(),
                          pos=jnp.full((num_pages, 1, page_size), EMPTY, jnp.int32),
                          tables=jnp.full((batch, kv_heads, max_pages), NULL_PAGE, jnp.int32),
                          lengths=jnp.zeros((batch, kv_heads), jnp.int32),
                          shared=jnp.zeros((num_pages,), bool), error=jnp.zeros((4,), jnp.int32),
                          shared_tables=bool(shared_tables))

    pool = PagePool(refcount=jnp.zeros((num_pages,), jnp.int32),
                    overflow=jnp.zeros((), bool), page_size=page_size,
                    error=jnp.zeros((4,), jnp.int32))
    return pool, tuple(layer() for _ in range(num_layers))


def _count_refs(tables: jax.Array, counted: jax.Array, num_pages: int) -> jax.Array:
    """[P] how many `counted` table entries list each page (the null page is never counted)."""
    counted = counted & (tables != NULL_PAGE)
    return jnp.zeros((num_pages,), jnp.int32).at[tables.reshape(-1)].add(
        counted.reshape(-1).astype(jnp.int32))


def _in_use(layer: PagedLayer) -> jax.Array:
    """[B, KVH, NP] bool: table entries that hold written pages."""
    return jnp.arange(layer.tables.shape[-1]) < layer.num_pages_used[..., None]


def _held(layer: PagedLayer) -> jax.Array:
    """[B, KVH, NP] bool: table entries that list a page (in use or reserved)."""
    return layer.tables != NULL_PAGE


def _last_page(layer: PagedLayer) -> jax.Array:
    """[B, KVH, NP] bool: each row's last written page (it takes the next writes)."""
    return jnp.arange(layer.tables.shape[-1]) == (layer.num_pages_used - 1)[..., None]


def _finish(pool: PagePool, layers: Sequence[PagedLayer], refcount, tables, lengths, error,
            overflow=None, fn=None) -> tuple[PagePool, tuple[PagedLayer, ...]]:
    """New pool and layers: reference counts kept non-negative (an underflow is an error),
    every layer's tables, lengths and `shared` updated (and `fn` applied to its pages), and
    the layers' write errors copied into the pool's record."""
    negative = refcount < 0
    page = jnp.argmax(negative)
    error = _first_error(error, *(l.error for l in layers),
                         jnp.where(jnp.any(negative),
                                   jnp.stack([jnp.int32(7), page.astype(jnp.int32),
                                              refcount[page], jnp.int32(0)]), 0))
    refcount = jnp.maximum(refcount, 0)
    out = []
    for layer in layers:
        layer = layer.replace(tables=tables, lengths=lengths, shared=refcount > 1)
        layer = layer.pages_freed(refcount)  # a tiered layer forgets staged copies of them
        out.append(layer if fn is None else fn(layer))
    pool = pool.replace(refcount=refcount, error=error,
                        overflow=pool.overflow if overflow is None else overflow)
    return pool, tuple(out)


def _concrete(x: Any) -> np.ndarray | None:
    """x as a numpy array, or None when it is traced (inside jit)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_vector(fn: str, name: str, x: Any, length: int, kind: str) -> None:
    """Static checks of a [B] argument: shape and dtype kind ('int' or 'bool')."""
    arr = x if hasattr(x, "dtype") else np.asarray(x)
    shape, dtype = tuple(arr.shape), arr.dtype
    want = jnp.issubdtype(dtype, jnp.integer) if kind == "int" else dtype == jnp.bool_
    if not want:
        noun = "integers" if kind == "int" else "a bool mask"
        raise ValueError(f"{fn}: {name} must be {noun}, got dtype {dtype}")
    if shape != (length,):
        raise ValueError(f"{fn}: {name} must have shape [{length}] (one per sequence), got "
                         f"{list(shape)}")


def reserve(pool: PagePool, layers: Sequence[PagedLayer], new_tokens: Any):
    """Allocate pages so every row of sequence b can take `new_tokens[b]` more slots.

    `new_tokens`: [B] integers in [0, max_pages * page_size]; a bad count
    raises `ValueError` at once when concrete, and under jit sets
    `pool.error` and changes nothing. A row whose last page is partly filled
    and shared is given a private copy of it first (copy-on-write), so writes
    never touch a shared page. Pages a row already holds beyond its length
    count toward the room. All or nothing: if the free pages or a table run
    out, nothing is allocated and `overflow` is set.
    """
    layers = tuple(layers)
    _check_vector("reserve", "new_tokens", new_tokens, layers[0].batch, "int")
    n = _concrete(new_tokens)
    if n is not None:
        cap = layers[0].capacity
        for b, value in enumerate(n.tolist()):
            if not 0 <= value <= cap:
                raise ValueError(_ERRORS[1 if value < 0 else 2].format(b, value, cap))
    return _reserve(pool, layers, jnp.asarray(new_tokens, jnp.int32))


@jax.jit
def _reserve(pool: PagePool, layers: Sequence[PagedLayer], new_tokens: jax.Array):
    layer = layers[0]
    s, n_table, n_pages = pool.page_size, layer.tables.shape[-1], pool.num_pages
    bad = (new_tokens < 0) | (new_tokens > layer.capacity)
    first = jnp.argmax(bad)
    error = jnp.where(jnp.any(bad), jnp.stack([jnp.where(new_tokens[first] < 0, 1, 2),
                                               first.astype(jnp.int32), new_tokens[first],
                                               jnp.int32(layer.capacity)]), 0)
    n = jnp.broadcast_to(jnp.where(bad, 0, new_tokens)[:, None], layer.lengths.shape)
    held, have = layer.num_pages_held, layer.num_pages_used  # [B, KVH]
    need = -(-(layer.lengths + n) // s)
    last = jnp.take_along_axis(layer.tables, jnp.maximum(have - 1, 0)[..., None], -1)[..., 0]
    cow = (layer.lengths % s != 0) & (n > 0) & (pool.refcount[last] > 1)
    grow = jnp.maximum(need - held, 0)
    fresh = grow + cow  # pages to take from the free list
    free = ((pool.refcount == 0) & (jnp.arange(n_pages) != NULL_PAGE)
            & (jnp.arange(n_pages) < layer.device_pages))  # new pages are written: on device
    if layer.shared_tables:
        # allocate in aligned groups of KVH ids, one per (sequence, block): the heads of a
        # sequence hold equal lengths and tables up to `+ h`, so head 0 decides for all
        kvh = layer.kv_heads
        unit = n_pages // kvh  # groups; group 0 holds the null page, so it is never free
        free = free[:unit * kvh].reshape(unit, kvh).all(-1)  # [G]
        fits = (fresh[:, 0].sum() <= free.sum()) & jnp.all(need <= n_table)
    else:
        unit = n_pages
        fits = (fresh.sum() <= free.sum()) & jnp.all(need <= n_table)
    ok = fits & ~jnp.any(bad)
    fresh, grow, cow = jnp.where(ok, fresh, 0), jnp.where(ok, grow, 0), cow & ok
    free_list = jnp.nonzero(free, size=unit, fill_value=NULL_PAGE)[0]  # free pages or groups
    if layer.shared_tables:
        first = jnp.cumsum(fresh[:, 0]) - fresh[:, 0]  # [B] first group each sequence takes
        first = jnp.broadcast_to(first[:, None], fresh.shape)
        to_page = lambda idx, h: free_list[idx] * kvh + h  # group -> head h's page
        heads = jnp.arange(kvh, dtype=jnp.int32)
    else:
        first = (jnp.cumsum(fresh.reshape(-1)) - fresh.reshape(-1)).reshape(fresh.shape)
        to_page = lambda idx, h: free_list[idx]
        heads = jnp.zeros((layer.kv_heads,), jnp.int32)
    j = jnp.arange(n_table)
    take = (j >= held[..., None]) & (j < (held + grow)[..., None])  # [B, KVH, NP] new pages
    picked = to_page(jnp.clip((first + cow)[..., None] + j - held[..., None], 0, unit - 1),
                     heads[None, :, None])
    copy_to = to_page(jnp.clip(first, 0, unit - 1), heads[None, :])  # [B, KVH] copy of a shared page
    tables = jnp.where(take, picked, layer.tables)
    tables = jnp.where(cow[..., None] & (j == (have - 1)[..., None]), copy_to[..., None], tables)
    refcount = (pool.refcount + _count_refs(picked, take, n_pages)
                + _count_refs(copy_to, cow, n_pages) - _count_refs(last, cow, n_pages))
    src = jnp.where(cow, last, n_pages).reshape(-1)
    dst = jnp.where(cow, copy_to, n_pages).reshape(-1)

    def copy_pages(l: PagedLayer) -> PagedLayer:
        copy = lambda x: x.at[dst].set(x[jnp.minimum(src, n_pages - 1)], mode="drop")
        return l.replace(k=map_slot_leaves(l.k, copy), v=map_slot_leaves(l.v, copy),
                         pos=copy(l.pos))

    return _finish(pool, layers, refcount, tables, layer.lengths,
                   _first_error(pool.error, error), pool.overflow | (~fits & ~jnp.any(bad)),
                   copy_pages)


def release(pool: PagePool, layers: Sequence[PagedLayer], rows: Any):
    """Free every page (in use or reserved) of the sequences where `rows` [B] is True; their
    rows become empty. A row that holds no pages (e.g. padding only) frees nothing."""
    layers = tuple(layers)
    _check_vector("release", "rows", rows, layers[0].batch, "bool")
    return _release(pool, layers, jnp.asarray(rows))


@jax.jit
def _release(pool: PagePool, layers: Sequence[PagedLayer], rows: jax.Array):
    layer = layers[0]
    gone = rows[:, None, None] & _held(layer)
    refcount = pool.refcount - _count_refs(layer.tables, gone, pool.num_pages)
    tables = jnp.where(rows[:, None, None], NULL_PAGE, layer.tables)
    lengths = jnp.where(rows[:, None], 0, layer.lengths)
    return _finish(pool, layers, refcount, tables, lengths, pool.error)


def fork(pool: PagePool, layers: Sequence[PagedLayer], source: Any):
    """Sequence b shares sequence `source[b]`'s written pages (prefix sharing); -1 leaves b alone.

    `source`: [B] integers in [-1, B); a bad one raises `ValueError` at once
    when concrete, and under jit sets `pool.error` and changes nothing.
    Nothing is copied: the pages' reference counts go up, and the `reserve`
    before the first write into a shared, partly filled page copies it. The
    source's reserved (unwritten) pages stay its own. A target must be empty
    (released); otherwise nothing happens and `overflow` and `error` are set.
    """
    layers = tuple(layers)
    return _fork(pool, layers, checked_source(source, layers[0].batch))


def checked_source(source: Any, batch: int) -> jax.Array:
    """`fork`'s `source` as int32 [B]; ValueError for a wrong shape or dtype, and (when
    concrete) for a value outside [-1, B)."""
    _check_vector("fork", "source", source, batch, "int")
    src = _concrete(source)
    if src is not None:
        for b, value in enumerate(src.tolist()):
            if not -1 <= value < len(src):
                raise ValueError(_ERRORS[3].format(b, value, len(src)))
    return jnp.asarray(source, jnp.int32)


@jax.jit
def _fork(pool: PagePool, layers: Sequence[PagedLayer], source: jax.Array):
    layer = layers[0]
    batch = layer.batch
    bad = (source < -1) | (source >= batch)
    first_bad = jnp.argmax(bad)
    share = (source >= 0) & ~bad
    written, held = layer.lengths.max(axis=1), layer.num_pages_held.max(axis=1)  # [B]
    busy = share & ((written > 0) | (held > 0))
    first_busy = jnp.argmax(busy)
    error = _first_error(
        pool.error,
        jnp.where(jnp.any(bad), jnp.stack([jnp.int32(3), first_bad.astype(jnp.int32),
                                           source[first_bad], jnp.int32(batch)]), 0),
        jnp.where(jnp.any(busy), jnp.stack([jnp.int32(4), first_busy.astype(jnp.int32),
                                            written[first_busy], held[first_busy]]), 0))
    ok = ~jnp.any(bad) & ~jnp.any(busy)
    share = share & ok
    src = jnp.clip(source, 0, batch - 1)
    inherited = jnp.where(_in_use(layer)[src], layer.tables[src], NULL_PAGE)  # in-use pages only
    tables = jnp.where(share[:, None, None], inherited, layer.tables)
    lengths = jnp.where(share[:, None], layer.lengths[src], layer.lengths)
    refcount = pool.refcount + _count_refs(inherited, share[:, None, None], pool.num_pages)
    return _finish(pool, layers, refcount, tables, lengths, error,
                   pool.overflow | jnp.any(busy))


def evict_pages(pool: PagePool, layers: Sequence[PagedLayer], drop: Any):
    """Free the in-use pages where `drop` [B, KVH, NP] (bool) is True and close the gaps.

    Kept pages keep their order (and their tokens their positions). A row's
    last written page is never dropped, since it takes the next writes, nor
    are reserved pages; only whole pages are freed, so nothing is copied.
    """
    layers = tuple(layers)
    want = tuple(layers[0].tables.shape)
    arr = drop if hasattr(drop, "dtype") else np.asarray(drop)
    if arr.dtype != jnp.bool_ or tuple(arr.shape) != want:
        raise ValueError(f"evict_pages: drop must be a bool mask of shape {list(want)} "
                         f"[batch, kv_heads, max_pages], got {arr.dtype} {list(arr.shape)}")
    concrete = _concrete(drop)
    if layers[0].shared_tables and concrete is not None and \
            np.any(concrete != concrete[:, :1]):
        b, h, i = (int(x[0]) for x in np.nonzero(concrete != concrete[:, :1]))
        raise ValueError(f"evict_pages: with shared_tables a page is dropped for all KV heads of "
                         f"a sequence or none; drop[{b}, {h}, {i}] = {bool(concrete[b, h, i])} "
                         f"differs from head 0's")
    return _evict_pages(pool, layers, jnp.asarray(drop))


@jax.jit
def _evict_pages(pool: PagePool, layers: Sequence[PagedLayer], drop: jax.Array):
    layer = layers[0]
    if layer.shared_tables:  # under jit a mixed mask drops only what every head drops
        drop = jnp.broadcast_to(jnp.all(drop, axis=1, keepdims=True), drop.shape)
    drop = drop & _in_use(layer) & _held(layer) & ~_last_page(layer)
    refcount = pool.refcount - _count_refs(layer.tables, drop, pool.num_pages)
    tables = kept_first(_held(layer) & ~drop, layer.tables)
    lengths = layer.lengths - drop.sum(-1, dtype=jnp.int32) * pool.page_size
    return _finish(pool, layers, refcount, tables, lengths, pool.error)


def kept_first(keep: jax.Array, tables: jax.Array) -> jax.Array:
    """[..., NP] block tables with the entries `keep` marks first, in their order, then
    NULL_PAGE (a row's pages compacted: `evict_pages`, a tiered layer's pools).

    Example:
        >>> kept_first(jnp.array([False, True, True]), jnp.array([4, 7, 9])).tolist()
        [7, 9, 0]
    """
    order = jnp.argsort(~keep, axis=-1, stable=True)
    return jnp.where(jnp.take_along_axis(keep, order, -1),
                     jnp.take_along_axis(tables, order, -1), NULL_PAGE)


def page_scores(layer: PagedLayer, slot_scores: jax.Array) -> jax.Array:
    """[B, KVH, NP] the highest score of each page's tokens (empty slots: -inf).

    A page scores low only if *all* its tokens do, so dropping the lowest
    pages drops no token that scored well. `slot_scores` is [P, S]
    (per slot of the pool, e.g. key norms or accumulated attention).
    """
    valid = layer.pos[:, 0] != EMPTY
    best = jnp.where(valid, slot_scores, -jnp.inf).max(axis=-1)  # [P]
    return jnp.where(_in_use(layer), best[layer.tables], -jnp.inf)


def drop_lowest_pages(layer: PagedLayer, scores: jax.Array, keep: int) -> jax.Array:
    """[B, KVH, NP] bool: the in-use pages to drop so each row keeps its last page and
    the `keep` best-scoring others (`scores` from `page_scores`)."""
    candidate = _in_use(layer) & ~_last_page(layer)
    rank = jnp.argsort(jnp.argsort(-jnp.where(candidate, scores, -jnp.inf), -1), -1)
    return candidate & (rank >= keep)


# ---------------------------------------------------------------------------------------------
# The audit: every invariant of a pool and its layers, counted on device.

def _describe_error(record) -> str | None:
    code, a, b, c = (int(x) for x in np.asarray(record))
    return None if code == 0 else _ERRORS.get(code, f"unknown error code {code}").format(a, b, c)


@jax.jit
def _audit(pool: PagePool, layers: Sequence[PagedLayer]):
    """[K] counts of violations of each invariant of `_AUDIT_MESSAGES`, [K] an example index
    for each (page or row, where one helps), and the layers' first write error [4]."""
    layer = layers[0]
    n_pages, s = pool.num_pages, pool.page_size
    kvh = layer.kv_heads
    held, in_use = _held(layer), _in_use(layer)
    refs = _count_refs(layer.tables, held, n_pages)  # [P]
    out = {}
    mismatch = pool.refcount != refs
    out["refcount"] = (mismatch.sum(), jnp.argmax(mismatch))
    out["negative"] = ((pool.refcount < 0).sum(), jnp.argmax(pool.refcount < 0))
    free_listed = (pool.refcount == 0) & (refs > 0)
    out["free_listed"] = (free_listed.sum(), jnp.argmax(free_listed))
    out["null_counted"] = ((pool.refcount[NULL_PAGE] != 0).astype(jnp.int32), 0)
    # null page: never written
    dirty = jnp.int32(0)
    for l in layers:
        dirty += jnp.sum(l.pos[NULL_PAGE] != EMPTY)
        for store in (l.k, l.v):
            for leaf in jax.tree.leaves(map_slot_leaves(store, lambda x: x[NULL_PAGE])):
                dirty += jnp.sum(leaf != 0)
    out["null_dirty"] = (dirty, 0)
    # held pages form a prefix of each table; lengths fit the held pages
    after_hole = jnp.cumsum(~held, axis=-1) > 0
    holes = (held & after_hole).sum()
    out["prefix"] = (holes, 0)
    bad_len = (layer.lengths < 0) | (layer.lengths > layer.num_pages_held * s)
    out["lengths"] = (bad_len.sum(), jnp.argmax(bad_len.reshape(-1)))
    # sharing: only in-use pages of rows of the same KV head, each row listing a page once
    heads = jnp.broadcast_to(jnp.arange(kvh)[None, :, None], layer.tables.shape)
    flat, ok = layer.tables.reshape(-1), held.reshape(-1)
    hi = jnp.full((n_pages,), -1, jnp.int32).at[flat].max(jnp.where(ok, heads.reshape(-1), -1))
    lo = jnp.full((n_pages,), kvh, jnp.int32).at[flat].min(jnp.where(ok, heads.reshape(-1), kvh))
    used_refs = _count_refs(layer.tables, in_use, n_pages)
    ordered = jnp.sort(jnp.where(held, layer.tables, -1 - jnp.arange(layer.tables.shape[-1])),
                       axis=-1)
    twice_in_row = jnp.sum(ordered[..., 1:] == ordered[..., :-1])
    illegal = (refs > 1) & ((hi != lo) | (used_refs != refs))
    out["mapped_twice"] = (illegal.sum() + twice_in_row,
                           jnp.where(illegal.any(), jnp.argmax(illegal), -1))
    # shared tables: head h lists head 0's page + h, head 0 a multiple of KVH, lengths equal
    if layer.shared_tables:
        base = layer.tables[:, :1]
        off = held & ((layer.tables != base + heads) | (base % kvh != 0))
        off = off.sum() + jnp.sum(layer.lengths != layer.lengths[:, :1])
    else:
        off = jnp.int32(0)
    out["head_aligned"] = (off, 0)
    # the layers agree, and `shared` mirrors the reference counts
    disagree = jnp.int32(0)
    stale_shared = jnp.int32(0)
    for l in layers:
        disagree += jnp.sum(l.tables != layer.tables) + jnp.sum(l.lengths != layer.lengths)
        stale_shared += jnp.sum(l.shared != (pool.refcount > 1))
    out["layers_disagree"] = (disagree, 0)
    out["shared_flag"] = (stale_shared, 0)
    # readable slots: past a row's length its last page is EMPTY; EMPTY slots hold zeros
    past = jnp.int32(0)
    empty_dirty = jnp.int32(0)
    readable = used_refs > 0  # [P] pages some row reads (never the null page)
    last = jnp.take_along_axis(layer.tables, jnp.maximum(layer.num_pages_used - 1, 0)[..., None],
                               -1)[..., 0]
    fill = layer.lengths % s  # [B, KVH] slots used in the last page (0: full or none)
    for l in layers:
        tail = (jnp.arange(s) >= fill[..., None]) & (fill > 0)[..., None]  # [B, KVH, S]
        past += jnp.sum(tail & (l.pos[last, 0] != EMPTY))
        empty = (l.pos[:, 0] == EMPTY) & readable[:, None]  # [P, S]
        for x in l.all_pages():  # both tiers of a tiered layer
            empty_dirty += jnp.sum(empty & jnp.any(x != 0, axis=-1))
    out["past_length"] = (past, 0)
    on_host = (last >= layer.device_pages) & (layer.num_pages_used > 0)  # [B, KVH]
    out["last_on_host"] = (on_host.sum(), jnp.argmax(on_host.reshape(-1)))
    out["empty_dirty"] = (empty_dirty, 0)
    layer_error = _first_error(*(l.error for l in layers))
    counts = jnp.stack([jnp.asarray(out[name][0], jnp.int32) for name in _AUDIT_MESSAGES])
    examples = jnp.stack([jnp.asarray(out[name][1], jnp.int32) for name in _AUDIT_MESSAGES])
    return counts, examples, layer_error


_AUDIT_MESSAGES = {
    "refcount": "{n} pages' reference counts differ from the number of table entries listing "
                "them (e.g. page {i})",
    "negative": "{n} pages have a negative reference count (e.g. page {i})",
    "free_listed": "{n} pages are listed in a block table but free (reference count 0; e.g. "
                   "page {i}), so the allocator may hand them to another sequence",
    "null_counted": "the null page has a nonzero reference count",
    "null_dirty": "the null page holds {n} written values or positions",
    "prefix": "{n} table entries list a page after an unused (null page) entry",
    "lengths": "{n} rows' lengths are negative or exceed the pages they hold",
    "mapped_twice": "{n} pages are mapped twice other than by fork sharing (same KV head, "
                    "written pages only, once per row; e.g. page {i})",
    "head_aligned": "{n} entries of shared_tables layers break head alignment (head h must "
                    "list head 0's page + h, head 0 a multiple of KV heads, equal lengths)",
    "layers_disagree": "the layers disagree on block tables or lengths ({n} entries)",
    "shared_flag": "the layers' shared-page flags disagree with the reference counts ({n} "
                   "entries)",
    "past_length": "{n} slots past a row's length in its last page hold positions, so the "
                   "row could read them",
    "empty_dirty": "{n} EMPTY slots of readable pages hold nonzero keys or values (attention "
                   "multiplies them by 0: a NaN or Inf there poisons the output)",
    "last_on_host": "{n} rows' last written page is in host memory, where writes cannot go "
                    "(e.g. row {i})",
}


def check_pool(pool: PagePool, layers: Sequence[PagedLayer] | None = None) -> None:
    """Raise `PoolError` (a `ValueError`), host side, if the pool's flags are set.

    Flags: `overflow` (a reserve or fork did not fit) and `error` (a bad
    argument under jit, or a dropped write copied from the layers by a pool
    operation). With `layers`, also their write errors and every invariant:
    reference counts equal the table entries listing each page and are never
    negative; no free page is listed; the null page is uncounted and empty;
    held pages are a prefix of each table and lengths fit them; a page is
    listed twice only by fork sharing (written pages, one KV head, once per
    row); the layers agree; slots past a row's length are EMPTY and EMPTY
    slots of readable pages hold zeros. The audit runs on device and reads
    every page once: a debugging and testing check, not a per-step one.
    """
    problems = []
    if bool(pool.overflow):
        free = int(jnp.sum(pool.refcount == 0)) - 1
        problems.append(f"paged cache overflow: a reserve or fork did not fit ({free} free "
                        f"pages of {pool.num_pages}); add pages, lengthen the block tables, "
                        f"or release sequences")
    message = _describe_error(pool.error)
    if message is not None:
        problems.append(message)
    if layers is not None:
        counts, examples, layer_error = jax.device_get(_audit(pool, tuple(layers)))
        message = _describe_error(layer_error)
        if message is not None and message not in problems:
            problems.append(message)
        for name, n, i in zip(_AUDIT_MESSAGES, counts.tolist(), examples.tolist()):
            if n:
                problems.append(_AUDIT_MESSAGES[name].format(n=n, i=i))
    if problems:
        raise PoolError("paged pool: " + "; ".join(problems))


def dense_view(layer: PagedLayer):
    """The layer as a `TokenCache` of `NP * S` slots per row (gathered; for reference paths).

    Table entries past a row's written pages read the null page, so reserved pages (not yet
    scrubbed by a write) contribute zeros."""
    tables = jnp.where(_in_use(layer), layer.tables, NULL_PAGE)
    rows = tables.reshape(-1, tables.shape[-1])  # [R, NP]
    gather = lambda x: x[rows].reshape(rows.shape[0], -1, *x.shape[2:])
    k, v = (gather(x) for x in layer.all_pages())
    in_use = jnp.arange(layer.capacity) < layer.lengths.reshape(-1, 1)
    pos = jnp.where(in_use, gather(layer.pos[:, 0]), EMPTY).reshape(layer.batch, layer.kv_heads, -1)
    return TokenCache(k=k, v=v, pos=pos, length=jnp.max(layer.lengths))
