"""A paged key/value pool: pages allocated on demand, shared copy-on-write, freed whole.

The pool is `P` pages of `page_size` slots. A page belongs to one
(sequence, KV head) *row*; a row lists its pages in slot order in its block
table. Everything is a pure, jit-compiled function of explicit state:

- `PagePool` is the allocator: a reference count per page and a sticky
  `overflow` flag.
- `PagedLayer` is one layer's storage: key/value/position pages plus the
  block tables and per-row lengths it reads and writes. Every layer of a
  model holds identical tables; the functions below update them together.

**The null page.** Page `NULL_PAGE` (index 0) is reserved: it is never
allocated, its positions stay `EMPTY` and its keys/values zero. Every unused
block-table entry points to it, so a table is always a valid gather index,
and a stray read sees nothing.

**Life of a row.** `reserve(pool, layers, n)` makes room for `n` more tokens
per sequence: it allocates fresh pages (their positions reset to `EMPTY`),
and when a row's last, partly filled page is shared it copies that page
first (copy-on-write). `write` then appends tokens at each row's length.
`fork` shares one sequence's pages with another (prefix sharing: reference
counts go up, nothing is copied); `release` frees a sequence's pages;
`evict_pages` frees chosen whole pages and closes the gaps in the table.

Capacity errors cannot raise under jit: a `reserve` that does not fit
allocates nothing and sets `overflow`; writes beyond a row's reserved pages
are dropped (never written to the null page); `check_pool` raises on the
host. Callers check after a step.

Example:
    >>> pool, layers = init_paged_cache(num_pages=64, page_size=16, batch=2, kv_heads=3,
    ...                                 max_pages=8, head_dim=64, num_layers=30)
    >>> pool, layers = reserve(pool, layers, jnp.array([20, 5]))   # room for the prompts
    >>> layers = [layer.write(k, v, pos) for layer in layers]       # the model does this
    >>> check_pool(pool)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import EMPTY, TokenCache
from kvjax.stores import PackedTokens, encode_dense, is_dense, map_slot_leaves, read

NULL_PAGE = 0
"""Reserved page: never allocated, always empty; unused block-table entries point to it."""

_static = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePool:
    """Allocator state shared by the layers of a paged cache."""

    refcount: jax.Array  # [P] int32 rows whose tables list the page (NULL_PAGE: always 0)
    overflow: jax.Array  # [] bool a reserve or fork did not fit (sticky)
    page_size: int = dataclasses.field(metadata=_static)

    @property
    def num_pages(self) -> int:
        return self.refcount.shape[0]

    def replace(self, **changes: Any) -> "PagePool":
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayer:
    """One layer's pages and the block tables that map rows to them.

    `k`/`v` are dense `[P, S, D]` arrays or a `PackedTokens` store over
    pages (rows = pages, capacity = S). Row `(b, h)`'s slot `i` lives in
    page `tables[b, h, i // S]` at offset `i % S`.
    """

    k: Any  # [P, S, D] or PackedTokens
    v: Any  # [P, S, D] or PackedTokens
    pos: jax.Array  # [P, 1, S] int32 absolute position per slot, EMPTY when free
    tables: jax.Array  # [B, KVH, NP] int32 pages per row in slot order, NULL_PAGE past the end
    lengths: jax.Array  # [B, KVH] int32 slots written per row

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
        """[B, KVH] pages each row has written into."""
        return -(-self.lengths // self.page_size)

    def replace(self, **changes: Any) -> "PagedLayer":
        return dataclasses.replace(self, **changes)

    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "PagedLayer":
        """Append T tokens per row at its length (`kvjax.write` calls this).

        k_new, v_new: [B, KVH, T, D]; pos_new: [B, T] int32 (negative =
        padding: the slot is taken but stays EMPTY). Slots beyond a row's
        reserved pages are dropped; `reserve` first.
        """
        b, h, t, d = k_new.shape
        if (b, h, d) != (self.batch, self.kv_heads, self.head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"PagedLayer.write: keys {k_new.shape} / values {v_new.shape} do "
                             f"not fit [batch={self.batch}, kv_heads={self.kv_heads}, T, "
                             f"head_dim={self.head_dim}]")
        if pos_new.shape != (b, t):
            raise ValueError(f"PagedLayer.write: positions {pos_new.shape}, expected {(b, t)}")
        slot = self.lengths[..., None] + jnp.arange(t)  # [B, KVH, T]
        index = jnp.minimum(slot // self.page_size, self.tables.shape[-1] - 1)
        page = jnp.take_along_axis(self.tables, index, axis=-1)
        fits = (slot < self.capacity) & (page != NULL_PAGE)
        page = jnp.where(fits, page, self.pos.shape[0]).reshape(-1)  # out of range: dropped
        offset = (slot % self.page_size).reshape(-1)
        pos = jnp.broadcast_to(jnp.where(pos_new < 0, EMPTY, pos_new)[:, None], (b, h, t))
        return self.replace(
            k=_scatter(self.k, page, offset, k_new.reshape(-1, d)),
            v=_scatter(self.v, page, offset, v_new.reshape(-1, d)),
            pos=self.pos.at[page, 0, offset].set(pos.reshape(-1).astype(jnp.int32), mode="drop"),
            lengths=self.lengths + t)


def _scatter(store: Any, page: jax.Array, offset: jax.Array, x: jax.Array) -> Any:
    """Write tokens x [N, D] at (page, offset) of a page store; out-of-range pages are dropped."""
    if is_dense(store):
        return store.at[page, offset].set(encode_dense(x, store.dtype), mode="drop")
    piece = store.encode(x[:, None])  # each token quantized on its own: [N, 1, ...]
    return store.replace(**{f: getattr(store, f).at[page, offset].set(getattr(piece, f)[:, 0],
                                                                     mode="drop")
                            for f in store.slot_fields if getattr(store, f) is not None})


def init_paged_cache(num_pages: int, page_size: int, batch: int, kv_heads: int, max_pages: int,
                     head_dim: int, num_layers: int, dtype=jnp.float32, bits: int | None = None,
                     group: int = 32) -> tuple[PagePool, tuple[PagedLayer, ...]]:
    """An empty pool of `num_pages` pages (one of them the null page) and its layers.

    `max_pages` is the block-table length: one row holds at most
    `max_pages * page_size` tokens. `bits` stores keys and values as
    per-token `bits`-bit codes in groups of `group` channels (kernels read
    them packed); otherwise pages are dense `dtype`.
    """
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("batch", batch),
                        ("kv_heads", kv_heads), ("max_pages", max_pages),
                        ("head_dim", head_dim), ("num_layers", num_layers)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"init_paged_cache: {name} must be a positive int, got {value!r}")
    if num_pages < 2:
        raise ValueError("init_paged_cache: the pool needs the null page and at least one more")
    if bits is None:
        kv = jnp.zeros((num_pages, page_size, head_dim), dtype)
    else:
        kv = PackedTokens.empty(num_pages, page_size, head_dim, bits, group)
    layer = PagedLayer(k=kv, v=kv, pos=jnp.full((num_pages, 1, page_size), EMPTY, jnp.int32),
                       tables=jnp.full((batch, kv_heads, max_pages), NULL_PAGE, jnp.int32),
                       lengths=jnp.zeros((batch, kv_heads), jnp.int32))
    pool = PagePool(refcount=jnp.zeros((num_pages,), jnp.int32),
                    overflow=jnp.zeros((), bool), page_size=page_size)
    return pool, (layer,) * num_layers


def _with_tables(layers: Sequence[PagedLayer], tables, lengths, fn=None) -> tuple:
    """Every layer with the new tables/lengths, and `fn` applied to its pages."""
    out = []
    for layer in layers:
        layer = layer.replace(tables=tables, lengths=lengths)
        out.append(layer if fn is None else fn(layer))
    return tuple(out)


def _count_refs(tables: jax.Array, used: jax.Array, num_pages: int) -> jax.Array:
    """[P] how many in-use table entries list each page."""
    return jnp.zeros((num_pages,), jnp.int32).at[tables.reshape(-1)].add(
        used.reshape(-1).astype(jnp.int32))


def _in_use(layer: PagedLayer) -> jax.Array:
    """[B, KVH, NP] bool: table entries that hold written pages."""
    return jnp.arange(layer.tables.shape[-1]) < layer.num_pages_used[..., None]


def _last_page(layer: PagedLayer) -> jax.Array:
    """[B, KVH, NP] bool: each row's last written page (it takes the next writes)."""
    return jnp.arange(layer.tables.shape[-1]) == (layer.num_pages_used - 1)[..., None]


@jax.jit
def reserve(pool: PagePool, layers: Sequence[PagedLayer], new_tokens: jax.Array):
    """Allocate pages so every row of sequence b can take `new_tokens[b]` more slots.

    A row whose last page is partly filled and shared is given a private
    copy of it first (copy-on-write), so writes never touch a shared page.
    New pages have all positions EMPTY. All or nothing: if the free pages or
    a table run out, nothing is allocated and `overflow` is set.
    """
    layer = layers[0]
    s, n_table, n_pages = pool.page_size, layer.tables.shape[-1], pool.num_pages
    n = jnp.broadcast_to(jnp.asarray(new_tokens, jnp.int32)[:, None], layer.lengths.shape)
    have = layer.num_pages_used  # [B, KVH]
    need = -(-(layer.lengths + n) // s)
    last = jnp.take_along_axis(layer.tables, jnp.maximum(have - 1, 0)[..., None], -1)[..., 0]
    cow = (layer.lengths % s != 0) & (n > 0) & (pool.refcount[last] > 1)
    fresh = need - have + cow  # pages to take from the free list
    free = (pool.refcount == 0) & (jnp.arange(n_pages) != NULL_PAGE)
    ok = (fresh.sum() <= free.sum()) & jnp.all(need <= n_table)
    fresh, cow = jnp.where(ok, fresh, 0), cow & ok
    free_list = jnp.nonzero(free, size=n_pages, fill_value=NULL_PAGE)[0]
    first = (jnp.cumsum(fresh.reshape(-1)) - fresh.reshape(-1)).reshape(fresh.shape)
    start = have - cow  # table index of the first new page
    j = jnp.arange(n_table)
    take = (j >= start[..., None]) & (j < (start + fresh)[..., None])  # [B, KVH, NP]
    picked = free_list[jnp.clip(first[..., None] + j - start[..., None], 0, n_pages - 1)]
    tables = jnp.where(take, picked, layer.tables)
    refcount = pool.refcount + _count_refs(picked, take, n_pages)
    refcount = refcount.at[last.reshape(-1)].add(-cow.reshape(-1).astype(jnp.int32))
    # copies: (source page, new page) of every cow row; fresh pages get EMPTY positions
    src = jnp.where(cow, last, n_pages).reshape(-1)
    dst = jnp.where(cow, jnp.take_along_axis(tables, start[..., None], -1)[..., 0],
                    n_pages).reshape(-1)
    fresh_pages = jnp.where(take & ~(cow[..., None] & (j == start[..., None])), tables, n_pages)

    def update(l: PagedLayer) -> PagedLayer:
        copy = lambda x: x.at[dst].set(x[jnp.minimum(src, n_pages - 1)], mode="drop")
        pos = l.pos.at[fresh_pages.reshape(-1)].set(EMPTY, mode="drop")
        return l.replace(k=map_slot_leaves(l.k, copy), v=map_slot_leaves(l.v, copy),
                         pos=copy(pos))

    pool = pool.replace(refcount=refcount, overflow=pool.overflow | ~ok)
    return pool, _with_tables(layers, tables, layer.lengths, update)


@jax.jit
def release(pool: PagePool, layers: Sequence[PagedLayer], rows: jax.Array):
    """Free every page of the sequences where `rows` [B] is True; their rows become empty."""
    layer = layers[0]
    gone = rows[:, None, None] & _in_use(layer)
    refcount = pool.refcount - _count_refs(layer.tables, gone, pool.num_pages)
    tables = jnp.where(rows[:, None, None], NULL_PAGE, layer.tables)
    lengths = jnp.where(rows[:, None], 0, layer.lengths)
    return pool.replace(refcount=refcount), _with_tables(layers, tables, lengths)


@jax.jit
def fork(pool: PagePool, layers: Sequence[PagedLayer], source: jax.Array):
    """Sequence b shares sequence `source[b]`'s pages (prefix sharing); -1 leaves b alone.

    Nothing is copied: the pages' reference counts go up, and the first
    write into a shared, partly filled page copies it (`reserve`). A target
    must be empty (released); otherwise nothing happens and `overflow` is set.
    """
    layer = layers[0]
    share = source >= 0
    src = jnp.maximum(source, 0)
    ok = ~jnp.any(share & (layer.lengths.max(axis=1) > 0))
    share = share & ok
    tables = jnp.where(share[:, None, None], layer.tables[src], layer.tables)
    lengths = jnp.where(share[:, None], layer.lengths[src], layer.lengths)
    used = share[:, None, None] & _in_use(layer.replace(tables=tables, lengths=lengths))
    refcount = pool.refcount + _count_refs(tables, used, pool.num_pages)
    return (pool.replace(refcount=refcount, overflow=pool.overflow | ~ok),
            _with_tables(layers, tables, lengths))


@jax.jit
def evict_pages(pool: PagePool, layers: Sequence[PagedLayer], drop: jax.Array):
    """Free the in-use pages where `drop` [B, KVH, NP] is True and close the gaps.

    Kept pages keep their order (and their tokens their positions). A row's
    last page is never dropped, since it takes the next writes; only whole
    pages are freed, so nothing is copied.
    """
    layer = layers[0]
    used = _in_use(layer)
    drop = drop & used & ~_last_page(layer)
    refcount = pool.refcount - _count_refs(layer.tables, drop, pool.num_pages)
    keep = used & ~drop
    order = jnp.argsort(~keep, axis=-1, stable=True)  # kept pages first, in order
    tables = jnp.where(jnp.take_along_axis(keep, order, -1),
                       jnp.take_along_axis(layer.tables, order, -1), NULL_PAGE)
    lengths = layer.lengths - drop.sum(-1) * pool.page_size
    return pool.replace(refcount=refcount), _with_tables(layers, tables, lengths)


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


def check_pool(pool: PagePool) -> None:
    """Raise (host side) if a reserve or fork could not be met."""
    if bool(pool.overflow):
        free = int(jnp.sum(pool.refcount == 0)) - 1
        raise ValueError(f"paged cache overflow: a reserve or fork did not fit ({free} free "
                         f"pages of {pool.num_pages}); add pages, lengthen the block tables, "
                         f"or release sequences")


def dense_view(layer: PagedLayer):
    """The layer as a `TokenCache` of `NP * S` slots per row (gathered; for reference paths)."""
    rows = layer.tables.reshape(-1, layer.tables.shape[-1])  # [R, NP]
    gather = lambda x: x[rows].reshape(rows.shape[0], -1, *x.shape[2:])
    k, v = gather(read(layer.k)), gather(read(layer.v))
    in_use = jnp.arange(layer.capacity) < layer.lengths.reshape(-1, 1)
    pos = jnp.where(in_use, gather(layer.pos[:, 0]), EMPTY).reshape(layer.batch, layer.kv_heads, -1)
    return TokenCache(k=k, v=v, pos=pos, length=jnp.max(layer.lengths))
