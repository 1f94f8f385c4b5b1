"""`attend(impl="pallas")`: the cache layers as page pools for the Pallas kernel.

Every layer kind the kernel reads is a pool of pages plus block tables:

- `PagedLayer`: as it is.
- `TokenCache` (per-head layout): each row's `C` slots are `C/S` pages of
  `S` slots; its KV heads share one block table per sequence (`[B, C/S]`,
  head h at page offset `h * C/S`: KVH times less SMEM than per-head
  tables); only the pages below the write cursor are read.
  `S` is the largest power of two <= 256 that divides `C` (at least 8); a
  capacity whose pages would be smaller than `TILE_SLOTS` is padded per call to
  a multiple of it (`padded_to_tile`: a copy, new slots EMPTY); caches shrunk
  for the kernel are aligned already (`kvjax.shrink(align=kvjax.tile_slots(impl))`).
  On TPU with `S` a multiple of 128, dense and `PackedTokens` stores go to
  the kernel as *row pools* (`row_pages`): the kernel DMAs each page out of
  the cache's own `[R, D, C]` / `[R, C, D]` rows (packed: the code words
  `[R, W, C]`; only the float16 parameters are repacked, as Mosaic takes no
  float16 arguments), so no page pool is built per call. KIVI keys
  (`PackedChannels`) go the same way (`channel_rows`: their code words in
  place, plus each slot's row in its page's table window and the table as
  uint32 rows, `pf.PackedChannelRows`). Other layouts are converted to a page
  pool each call (a copy of the cache).
- `ResidualCache` (KIVI): the encoded body and the exact recent part are two
  kernel calls whose softmax states are merged. A paged KIVI layer
  (`PagedKivi`) the same way, its body's pages read as the pool keeps them
  (keys `pf.PackedChannelPages`: one group per page; TPU only).
- `TieredLayer` (pages in host memory, staged copies on the device): two kernel calls,
  merged, over its device pages and over its stage, each with a block table that lists the
  row's pages in that pool (`tier_views`). A host page read unstaged (a prefetch miss) sends
  the step through XLA's view of both tiers instead, which fetches it (`rare_cond`).

- A low-rank layer (`Latent` stores; ThinK's kept-channel keys are one) is read over its
  latent coordinates (`latent_view`): the queries are projected on each KV head's key basis,
  `(P^T q) . z = q . (P z)`, the kernel weights the value coordinates (their rank its
  `value_dim` when it differs from the keys'), and the accumulator is lifted by the value
  basis after (linear, so it commutes with the softmax's sums and merges).

- A pooled `TokenCache` (head-wise budgets: a sequence's KV heads share one row of slots, each
  slot owned by one head) is one KV row per sequence holding all H query heads (`pooled_view`):
  its positions carry their owner head (`own_positions`, built per call: 4 bytes a slot) and
  each query row sees its own KV head's slots (the kernel's `slot_owners`). Every page is read
  once per sequence, for all its heads. Positions must stay below 2**28 (8 KV heads).

Dense (float32/bf16/fp8), `PackedTokens` and `PackedChannels` stores are
decoded inside the kernel. A residual layer with a pooled and a per-head part (no method
makes one) is not read: `kernel_refusal` says why and `attend` uses the XLA path for it.

Example:
    >>> import kvjax
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 12, 8))   # [B, KVH, T, D]
    >>> cache = kvjax.write(kvjax.init_cache(1, 1, 16, 8), k, v, jnp.arange(12)[None])
    >>> q, q_pos = jax.random.normal(jax.random.key(1), (1, 1, 2, 8)), jnp.array([[11]])
    >>> out = attend_pallas(q, q_pos, cache, backend="tpu", interpret=True)  # on CPU
    >>> ref = kvjax.attend(q, q_pos, cache, impl="reference")
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
    ((1, 1, 2, 8), True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import (NEG_INF, Partial, finish, merge, own_positions,
                                            paged_attention_partial)
from kvjax.core.branches import rare_cond
from kvjax.core.attention import blockwise_state
from kvjax.core.cache import EMPTY, ResidualCache, TokenCache
from kvjax.memory.paged_kivi import ChannelPages, PagedKivi
from kvjax.memory.paging import PagedLayer, TokenPages, kept_first
from kvjax.memory.tiers import TieredLayer, stage_misses, tiered_view
from kvjax.core.stores import (Latent, PackedChannels, PackedTokens, is_dense,
                               map_slot_leaves, param_values)

KERNEL_LAYOUTS = {TokenCache: "rows", ResidualCache: "parts", PagedKivi: "parts",
                  PagedLayer: "pages", TieredLayer: "tiers"}
"""The layer kinds the kernel reads, by exact type (a subclass attends itself): a per-head
`TokenCache`'s rows cut in pages, a residual layer (or a paged KIVI layer: its body's pages,
then its exact part) part by part, pages, and a tiered layer's device pages and stage."""


def kernel_layout(layer: Any) -> str | None:
    """How the kernel reads `layer` (`KERNEL_LAYOUTS`), or None: the layer attends itself."""
    return KERNEL_LAYOUTS.get(type(layer))

MAX_PAGE = 256
MIN_PAGE = 8
# Query rows (query tokens x query heads per KV head) one kernel call holds on chip. Measured
# on an H200 (jax 0.11.2): a 256-token prefill chunk of SmolLM2 (768 rows) asked Triton for
# 834 KiB of shared memory (232 KiB there); a 508-token chunk (1524 rows) failed to compile
# for a v5e, out of VMEM (deviceless). Longer query blocks are split along T into calls of at
# most this many rows.
MAX_QUERY_ROWS = {"gpu": 64, "tpu": 256}
ONE_SPLIT = 1 << 30  # pages_per_split that keeps a whole block table in one split
TILE_SLOTS = {"tpu": 128, "gpu": 64}  # smaller pages are padded to this (`padded_to_tile`)


def pallas_backend() -> str | None:
    """The kernel backend of the default device: "tpu", "gpu", or None (CPU: no compiled Pallas)."""
    platform = jax.default_backend()
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform)


def page_size_for(capacity: int) -> int | None:
    """Largest power of two <= MAX_PAGE dividing `capacity`, or None below MIN_PAGE."""
    if capacity < MIN_PAGE:
        return None
    size = MAX_PAGE
    while size >= MIN_PAGE:
        if capacity % size == 0:
            return size
        size //= 2
    return None


def kernel_table(store: PackedChannels) -> jax.Array:
    """A KIVI key store's lane-flat table as the TPU kernel's uint32 words `[R, NG * L]`
    (`pf.PackedChannelRows.pack_table`): the store's own array, or its free bitcast (float32);
    only 16-bit symmetric scales, kept in their own dtype, are widened per call."""
    table = store.table
    if table.dtype == jnp.uint32:
        return table
    if table.dtype == jnp.float32:
        return jax.lax.bitcast_convert_type(table, jnp.uint32)
    return jax.lax.bitcast_convert_type(table, jnp.uint16).astype(jnp.uint32)


def _store_pages(store: Any, page: int, valid: jax.Array, wide: bool = False,
                 backend: str = "tpu"):
    """(format, arrays) of a store whose slot leaves are [R, C, ...], as pages of `page` slots.

    valid [R*C/page, page] bool marks the slots that hold tokens (KIVI's
    table windows are placed by them). `wide`: KIVI windows span the whole
    table (always exact; the fallback when a page's groups spread wider).
    """
    if isinstance(store, TokenPages):  # a page pool's per-token pages: the kernel's layout
        return store.format, (store.pages,)
    as_pages = lambda x: x.reshape(-1, page, *x.shape[2:])
    if is_dense(store):
        if backend == "tpu" and store.shape[-1] % 128:  # D < 128 lanes: XLA keeps it page-minor
            return pf.DENSE_T, (jnp.swapaxes(as_pages(store), 1, 2),)
        return pf.DENSE, (as_pages(store),)
    if isinstance(store, PackedTokens) and backend == "tpu":
        # the store's words as [P, W, S]: free for a page pool (XLA:TPU keeps [P, S, W]
        # slot-minor), a transpose for a TokenCache's [R, C, W] rows cut in pages
        fmt = pf.PackedTokenRows(store.bits, store.group, symmetric=store.offset is None,
                                 param_dtype=store.param_dtype)
        offset = None if store.offset is None else as_pages(store.offset)
        return fmt, fmt.from_store(as_pages(store.words), as_pages(store.scale), offset)
    if isinstance(store, PackedTokens):
        fmt = pf.PackedTokens(store.bits, store.group, symmetric=store.offset is None,
                              param_dtype=store.param_dtype)
        offset = None if store.offset is None else as_pages(param_values(store.offset))
        return fmt, fmt.from_store(as_pages(store.words), as_pages(param_values(store.scale)),
                                   offset)
    if isinstance(store, ChannelPages) and backend == "tpu":  # paged KIVI keys, as they are
        return store.format, (store.words, store.params)
    if isinstance(store, PackedChannels):
        fmt = channel_format(store, page, wide, backend)
        words, ids = as_pages(store.words), as_pages(store.group_id)
        page_row = jnp.arange(words.shape[0], dtype=jnp.int32) // (store.words.shape[1] // page)
        return fmt, fmt.from_store(words, ids, valid, store.scale, store.offset, page_row)
    return None


def channel_format(store: PackedChannels, page: int, wide: bool = False,
                   backend: str = "tpu") -> pf.PackedChannels:
    """The kernel format of a KIVI key store read in pages of `page` slots.

    The window is the groups a page of consecutive slots overlaps (`wide`:
    the whole table). Both backends take any window (the GPU kernel gathers
    each slot's table row; `backend` is kept for callers).
    """
    window = (pf.window_for(store.table_rows * store.group, store.group, store.table_rows)
              if wide else pf.window_for(page, store.group, store.table_rows))
    return pf.PackedChannels(store.bits, window, symmetric=store.symmetric,
                             param_dtype=store.param_dtype)


def _windows_fit(layer: Any, page: int, backend: str) -> jax.Array | None:
    """For a KIVI key store: do all pages' groups fit the narrow window? None otherwise."""
    if kernel_layout(layer) != "rows" or not isinstance(layer.k, PackedChannels):
        return None
    if _reads_rows(layer, page, backend):
        return channel_rows(layer, page)[2]
    store = layer.k
    fmt = channel_format(store, page, backend=backend)
    valid = (layer.pos != EMPTY).reshape(-1, page)
    return fmt.window_start(store.group_id.reshape(-1, page), valid, store.table_rows)[1]


def _reads_rows(layer: Any, page: int, backend: str) -> bool:
    """True when the TPU kernel DMAs a `TokenCache`'s pages out of its own rows (`row_pages`):
    lane-aligned pages of stores it reads in place."""
    return backend == "tpu" and page % 128 == 0 and not layer.pooled and _row_stores(layer)


def _decoded_in_kernel(store: Any) -> bool:
    """A store the kernel decodes: dense, per-token or per-channel (KIVI key) codes."""
    return is_dense(store) or isinstance(store, (PackedTokens, PackedChannels))


def _row_stores(layer: Any) -> bool:
    """True when the TPU kernel can read the layer's stores as row pools (per-channel codes
    for keys only)."""
    v = layer.v
    return _decoded_in_kernel(layer.k) and (is_dense(v) or isinstance(v, PackedTokens))


def tiled_capacity(layer: Any, backend: str) -> int:
    """The capacity the kernel reads a `TokenCache` at: its own, or, where its pages would be
    smaller than `TILE_SLOTS[backend]` (TPU: no row pools below 128 slots; GPU: no power-of-two
    page at all), the next multiple of the tile (`padded_to_tile`). A pooled layer's is its
    `pooled_view`'s: the same slots."""
    c, tile = layer.capacity, TILE_SLOTS.get(backend, 0)
    page = page_size_for(c) or 0
    if kernel_layout(layer) != "rows" or c == 0 or not tile:
        return c
    if backend == "tpu" and (page >= tile or not _row_stores(layer)):
        return c
    if backend == "gpu" and page:
        return c
    return -(-c // tile) * tile


def padded_to_tile(layer: Any, backend: str) -> Any:
    """`layer` with its slots padded to `tiled_capacity` (a copy of it, as a page pool of a
    small page was; the new slots are empty: EMPTY positions, masked), or `layer` itself."""
    new = tiled_capacity(layer, backend)
    if new == layer.capacity:
        return layer
    grow = new - layer.capacity
    slots = lambda x: jnp.pad(x, [(0, 0), (0, grow)] + [(0, 0)] * (x.ndim - 2))
    tail = lambda x, value: jnp.pad(x, [(0, 0), (0, 0), (0, grow)], constant_values=value)
    return layer.replace(k=map_slot_leaves(layer.k, slots), v=map_slot_leaves(layer.v, slots),
                         pos=tail(layer.pos, EMPTY),
                         mass=None if layer.mass is None else tail(layer.mass, 0))


def channel_rows(layer: TokenCache, page: int):
    """A KIVI key store read in place by the TPU kernel: (format, arrays, fits, table_windows).

    The codes and the lane-flat parameter table are the store's own arrays; per call only
    each slot's row in its page's window (4 bytes a slot) is built (`pf.PackedChannelRows`).
    `fits` is False when eviction spread some page's groups wider than its window.
    """
    store = layer.k
    r = layer.pos.shape[0] * layer.pos.shape[1]
    params = dict(symmetric=store.symmetric, param_dtype=store.param_dtype)
    fmt = pf.PackedChannelRows(store.bits, pf.PackedChannelRows.window_rows(page, store.group,
                                                                            store.lanes), **params)
    arrays, windows, fits = fmt.from_store(store.words, store.group_id,
                                           (layer.pos != EMPTY).reshape(r, -1),
                                           kernel_table(store), page)
    return fmt, arrays, fits, windows


def latent_view(layer: TokenCache) -> TokenCache:
    """A low-rank layer as the kernel reads it: each `Latent` store replaced by its latent
    coordinates z `[R, C, r]` as a dense store (a view, no copy); any other layer as it is."""
    z = lambda store: store.z if isinstance(store, Latent) else store
    if not (isinstance(layer.k, Latent) or isinstance(layer.v, Latent)):
        return layer
    return layer.replace(k=z(layer.k), v=z(layer.v))


def pooled_view(layer: TokenCache) -> TokenCache:
    """A pooled layer as the kernel reads it: one KV row per sequence whose positions carry
    their owner head (`own_positions`, [B, 1, C]); any other layer as it is."""
    if not layer.pooled:
        return layer
    return layer.replace(pos=own_positions(layer.pos), mass=None)


def row_heads(layer: Any) -> int:
    """KV heads per sequence as the kernel's rows hold them: 1 for a pooled layer (its rows
    hold every head), else the layer's KV heads."""
    return 1 if kernel_layout(layer) == "rows" and layer.pooled else layer.kv_heads


def value_dim(layer: TokenCache) -> int:
    """The head dim of the values as the kernel reads them (a low-rank store's rank)."""
    return latent_view(layer).v.shape[-1]


def row_bases(store: Latent, batch: int, kv_heads: int) -> jax.Array:
    """A `Latent` store's basis per (sequence, KV head), [B, KVH, D, r] float32: its
    per-head `[KVH, D, r]` broadcast over the batch, or its per-row `[B*KVH, D, r]` (ThinK's
    kept channels) as it is."""
    basis = store.basis.astype(jnp.float32)
    return jnp.broadcast_to(basis.reshape(-1, kv_heads, *basis.shape[1:]),
                            (batch, kv_heads, *basis.shape[1:]))


def project_queries(q: jax.Array, bases: jax.Array) -> jax.Array:
    """[B, T, H, D] queries on their rows' key bases [B, KVH, D, r] (`row_bases`) ->
    [B, T, H, r], q's dtype: query head j uses the basis of its KV head j // (H / KVH), on
    which that head's keys were projected."""
    b, t, h, d = q.shape
    kvh = bases.shape[1]
    qg = q.reshape(b, t, kvh, h // kvh, d).astype(jnp.float32)
    return jnp.einsum("btkgd,bkdr->btkgr", qg, bases).reshape(b, t, h, -1).astype(q.dtype)


def _latent_partial(q, q_pos, layer: TokenCache, **kwargs) -> Partial:
    """The kernel over a low-rank layer's latent coordinates (`latent_view`): queries projected
    on the key basis (the scale stays the model's head dim's), the accumulator lifted by the
    value basis after the kernel (`acc` is linear in the values)."""
    b, kvh = layer.batch, layer.kv_heads
    if isinstance(layer.k, Latent):
        kwargs["scale"] = q.shape[-1] ** -0.5
        q = project_queries(q, row_bases(layer.k, b, kvh))
    view = latent_view(layer)
    if view.v.shape[-1] != q.shape[-1]:
        kwargs["value_dim"] = view.v.shape[-1]
    part = attend_partial(q, q_pos, view, **kwargs)
    if not isinstance(layer.v, Latent):
        return part
    bases = row_bases(layer.v, b, kvh)  # [B, KVH, D, r]
    return part._replace(acc=jnp.einsum("bkgr,bkdr->bkgd", part.acc, bases))


def kernel_inputs(layer: Any, wide: bool = False, backend: str = "tpu") -> dict | None:
    """The kernel's keyword arguments for one layer, or None if the kernel cannot read it."""
    if kernel_layout(layer) == "pages":
        # a page store's slot leaves are already [P, S, ...]: the reshape is the identity
        valid = layer.pos[:, 0] != EMPTY
        (kf, ka), (vf, va) = (_store_pages(layer.k, layer.page_size, valid, wide, backend),
                              _store_pages(layer.v, layer.page_size, valid, wide, backend))
        if layer.shared_tables:  # head h's page is head 0's + h: one [B, NP] table in SMEM
            tables = dict(block_tables=layer.tables[:, 0], head_stride=1)
        else:
            tables = dict(block_tables=layer.tables)
        return dict(k_pages=ka, v_pages=va, k_format=kf, v_format=vf, pos_pages=layer.pos,
                    num_pages=layer.num_pages_used, **tables)
    if kernel_layout(layer) != "rows" or layer.pooled:
        return None
    page = page_size_for(layer.capacity)
    if page is None:
        return None
    b, kvh, c = layer.pos.shape
    per_row = c // page
    # one table per sequence, shared by its heads: row (b, h)'s page i is (b*KVH + h)*per_row + i
    tables = (jnp.arange(b, dtype=jnp.int32)[:, None] * (kvh * per_row)
              + jnp.arange(per_row, dtype=jnp.int32))
    used = jnp.full((b, kvh), (layer.length + page - 1) // page, jnp.int32)
    shared = dict(block_tables=tables, num_pages=used, head_stride=per_row)
    if _reads_rows(layer, page, backend):
        # the kernel DMAs pages out of the cache's own rows (row_pages): no page pool is built
        windows = {}
        if isinstance(layer.k, PackedChannels):
            k_fmt, k_arrays, _, starts = channel_rows(layer, page)
            k_rows, windows = (k_fmt, k_arrays), dict(table_windows=starts)
        else:
            k_rows = row_pool(layer.k)
        v_rows = row_pool(layer.v)
        return dict(k_pages=k_rows[1], v_pages=v_rows[1], k_format=k_rows[0],
                    v_format=v_rows[0], pos_pages=layer.pos,  # [B, KVH, C], in place
                    row_pages=per_row, **shared, **windows)
    valid = (layer.pos != EMPTY).reshape(-1, page)
    k, v = (_store_pages(layer.k, page, valid, wide, backend),
            _store_pages(layer.v, page, valid, wide, backend))
    if k is None or v is None:
        return None
    return dict(k_pages=k[1], v_pages=v[1], k_format=k[0], v_format=v[0],
                pos_pages=layer.pos.reshape(-1, 1, page), **shared)


def row_pool(store: Any):
    """(format, arrays) of a store read by the TPU kernel as its own rows (`row_pages`), or None.

    Dense [R, C, D]: slot-last [R, D, C] below 128 lanes (XLA:TPU keeps such an
    array slot-minor, so the view is free), row-major [R, C, D] otherwise.
    `PackedTokens`: words as [R, W, C] (free, as for dense) and the scale and
    offset as [R, NG, C] (free: float16 is stored as its uint16 bits, which Mosaic
    takes; it takes no float16 arguments). KIVI keys:
    None here (`channel_rows` reads them, with the page size their table windows need).
    """
    if is_dense(store):
        if store.shape[-1] % 128:
            return pf.DENSE_T, (jnp.swapaxes(store, 1, 2),)
        return pf.DENSE, (store,)
    if isinstance(store, PackedTokens):
        fmt = pf.PackedTokenRows(store.bits, store.group, symmetric=store.offset is None,
                                 param_dtype=store.param_dtype)
        return fmt, fmt.from_store(store.words, store.scale, store.offset)
    return None


def supports_pallas(layer: Any, backend: str | None = None) -> bool:
    """True if `attend_pallas` reads this layer in the kernel of `backend` (default: the device's).

    The GPU (Triton) kernel also needs a power-of-two head dim >= 16 and page size; other
    layers take the XLA path there. `kernel_refusal` says why not.
    """
    return kernel_refusal(layer, backend) is None


def kernel_refusal(layer: Any, backend: str | None = None) -> str | None:
    """Why the `backend` kernel (default: the device's) does not read `layer`, or None if it
    does: what `attend(impl="pallas")` falls back to XLA for.

    Example:
        >>> import kvjax
        >>> kernel_refusal(kvjax.init_cache(1, 2, 64, 64), "tpu") is None
        True
        >>> kernel_refusal(kvjax.init_cache(1, 2, 64, 48), "gpu")
        'the GPU kernel needs a head dim >= 16 that is a power of two, got 48'

    A low-rank layer is judged by its latent coordinates (`latent_view`): the GPU kernel
    needs power-of-two ranks >= 16 there. A pooled layer by its stores and capacity, which
    its `pooled_view` shares (the owner positions are built only when it attends).
    """
    backend = backend or pallas_backend()
    name = type(layer).__name__
    if kernel_layout(layer) == "parts":  # a body of 0 slots (all tokens in the window) is skipped
        pooled = {kernel_layout(p) == "rows" and p.pooled for p in (layer.body, layer.recent)}
        if len(pooled) > 1:
            return f"a {name} with a pooled and a per-head part (their rows do not merge)"
        body = None if layer.body.capacity == 0 else kernel_refusal(layer.body, backend)
        part = body or kernel_refusal(layer.recent, backend)
        return None if part is None else f"a {name}'s part: {part}"
    if kernel_layout(layer) is None:
        return f"no kernel layout for a {name} (it attends itself)"
    if kernel_layout(layer) == "tiers":  # its pools are of one kind: as its device pages
        return kernel_refusal(_as_paged(layer), backend)
    if kernel_layout(layer) == "pages":
        if backend == "gpu" and isinstance(layer.k, ChannelPages):
            return "paged KIVI keys are read by the TPU kernel only"
        page = layer.page_size
    elif (page := page_size_for(tiled_capacity(layer := latent_view(layer), backend))) is None:
        return f"capacity {layer.capacity} has no power-of-two page of >= {MIN_PAGE} slots"
    elif not (_decoded_in_kernel(layer.k) and _decoded_in_kernel(layer.v)):
        return f"the kernel has no format for {type(layer.k).__name__} / " \
               f"{type(layer.v).__name__} stores"
    if backend == "gpu":
        pow2 = lambda n: n >= 1 and n & (n - 1) == 0
        for what, dim in (("head dim", layer.head_dim), ("value head dim", value_dim(layer))):
            if not (pow2(dim) and dim >= 16):
                return f"the GPU kernel needs a {what} >= 16 that is a power of two, got {dim}"
        if not pow2(page):
            return f"the GPU kernel needs a page size that is a power of two, got {page}"
    return None


def has_host_tier(layer: Any) -> bool:
    """True for a layer with pages in host memory (a tiered layer, or a paged KIVI layer whose
    body is one): the kernel reads it on one device, not per shard of a mesh."""
    if kernel_layout(layer) == "parts":
        return kernel_layout(layer.body) == "tiers"
    return kernel_layout(layer) == "tiers"


def _as_paged(layer: TieredLayer, **changes) -> PagedLayer:
    """The `PagedLayer` fields of a tiered layer, with `changes`, as a plain `PagedLayer`."""
    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(PagedLayer)}
    return PagedLayer(**{**fields, **changes})


def tier_views(layer: TieredLayer) -> tuple[PagedLayer, PagedLayer]:
    """A tiered layer as the two page pools the kernel reads: (its device pages, its stage).

    Each has a block table per row listing the row's in-use pages in that pool first (its
    host pages by their stage slot), then the null page, unread (`num_pages` counts the
    listed ones; `kept_first`): attention does not depend on the order of a row's pages, the mask reads their
    positions. A host page that no stage slot holds (a prefetch miss) is in neither pool
    (`stage_misses`; `attend_partial` reads the layer through XLA then).
    """
    pd, s = layer.device_pages, layer.page_size
    tables = layer.tables  # [B, KVH, NP]
    used = jnp.arange(tables.shape[-1]) < layer.num_pages_used[..., None]  # in use
    match = tables[..., None] == layer.stage_ids  # [B, KVH, NP, M]
    slot = jnp.argmax(match, axis=-1).astype(jnp.int32)
    on_device, staged = used & (tables < pd), used & (tables >= pd) & match.any(-1)
    count = lambda keep: jnp.sum(keep, axis=-1, dtype=jnp.int32)
    held = (layer.stage_ids >= 0)[:, None, None]
    stage_pos = jnp.where(held, layer.pos[jnp.maximum(layer.stage_ids, 0)], EMPTY)  # [M, 1, S]
    # shared tables stay shared in both views: a sequence's heads move and are staged as one
    # aligned group (`kvjax.memory.tiers`), so head h's entry is head 0's + h in each
    device = _as_paged(layer, pos=layer.pos[:pd], tables=kept_first(on_device, tables),
                       lengths=count(on_device) * s, shared=layer.shared[:pd])
    stage = _as_paged(layer, k=layer.stage_k, v=layer.stage_v, pos=stage_pos,
                      tables=kept_first(staged, slot), lengths=count(staged) * s,
                      shared=jnp.zeros(stage_pos.shape[0], bool))
    return device, stage


def attend_partial(q, q_pos, layer, **kwargs) -> Partial:
    """The kernel's softmax state of `q` over one layer (both parts of a residual layer,
    both tiers of a tiered one)."""
    if kernel_layout(layer) == "parts":
        if layer.body.capacity == 0:
            return attend_partial(q, q_pos, layer.recent, **kwargs)
        return merge(attend_partial(q, q_pos, layer.body, **kwargs),
                     attend_partial(q, q_pos, layer.recent, **kwargs))
    if kernel_layout(layer) == "tiers":
        device, stage = tier_views(layer)
        kernel = lambda: merge(attend_partial(q, q_pos, device, **kwargs),
                               attend_partial(q, q_pos, stage, **kwargs))
        xla = lambda: _blockwise_partial(q, q_pos, tiered_view(layer), jax.eval_shape(kernel),
                                         window=kwargs.get("window"),
                                         softcap=kwargs.get("softcap"))
        return rare_cond(jnp.any(stage_misses(layer)), xla, kernel)
    if kernel_layout(layer) == "rows" and layer.pooled:
        return attend_partial(q, q_pos, pooled_view(layer), slot_owners=layer.kv_heads, **kwargs)
    if kernel_layout(layer) == "rows" and latent_view(layer) is not layer:
        return _latent_partial(q, q_pos, layer, **kwargs)
    backend = kwargs.get("backend", "tpu")
    layer = padded_to_tile(layer, backend)
    refusal = kernel_refusal(layer, backend)
    if refusal is not None:
        raise ValueError(f"attend_pallas: the {backend} kernel does not read this layer "
                         f"({refusal}); use impl='xla'")
    kernel = lambda: paged_attention_partial(q, q_pos, **kernel_inputs(layer, False, backend),
                                             **kwargs)
    fits = _windows_fit(layer, page_size_for(layer.capacity) or 0, backend) \
        if kernel_layout(layer) == "rows" else None
    if fits is None:
        return kernel()
    # KIVI: the kernel with narrow per-page table windows, unless eviction spread some page's
    # groups wider; then XLA's block loop over the store as it is (a whole-table window per
    # page would cost ~200 GB of temporaries at 64 x 32k: docs/BENCHMARKS.md)
    xla = lambda: _blockwise_partial(q, q_pos, layer, jax.eval_shape(kernel),
                                     window=kwargs.get("window"), softcap=kwargs.get("softcap"))
    return rare_cond(~fits, xla, kernel)


def _blockwise_partial(q, q_pos, layer: TokenCache, like: Partial, *, window, softcap) -> Partial:
    """`attention.blockwise_state` of a layer in the kernel's `Partial` layout and row count
    (`like`: [B, KVH, rows, D], rows >= G*T padded with rows that saw nothing)."""
    m, l, acc = blockwise_state(q, q_pos, layer, window=window, softcap=softcap)  # [R, GT, .]
    b, kvh, rows = like.m.shape
    gt = m.shape[1]
    pad = lambda x, value: jnp.pad(x.reshape(b, kvh, gt, *x.shape[2:]),
                                   [(0, 0), (0, 0), (0, rows - gt)] + [(0, 0)] * (x.ndim - 2),
                                   constant_values=value)
    return Partial(acc=pad(acc, 0.0), m=pad(m, NEG_INF), l=pad(l, 0.0))


def query_tokens_per_call(group: int, backend: str) -> int:
    """Query tokens one kernel call takes when each has `group` query heads per KV head."""
    if backend not in MAX_QUERY_ROWS:
        raise ValueError(f"attend_pallas: backend must be one of {tuple(MAX_QUERY_ROWS)}, got "
                         f"{backend!r}")
    return max(1, MAX_QUERY_ROWS[backend] // group)


def default_pages_per_split(backend: str, batch: int, query_tokens: int) -> int:
    """Pages per flash-decoding split when the caller names none.

    GPU: 8 (splits fill the SMs when a batch's rows do not). TPU: one split per row (the
    whole block table) for a prefill block (T > 1) or a batch of >= 2 sequences, 8 pages for
    one sequence's decode. A TPU core runs the grid in order, and a megacore chip's two cores
    share its parallel axes, which a batch fills; each split adds a float32 partial output
    and its merge: at 64 x 32k on v5e, 0.6 GB of KIVI-4's 6.3 GB decode step and 0.085x the
    bytes of an int4 pool of 128-slot pages (docs/DECISIONS.md "One split per row on TPU");
    at 8 x 32k prefill for Llama-3-8B, 1.2 GB per layer.

    Example:
        >>> default_pages_per_split("tpu", batch=64, query_tokens=1) == ONE_SPLIT
        True
        >>> default_pages_per_split("gpu", batch=64, query_tokens=1)
        8
    """
    if backend == "tpu" and (query_tokens > 1 or batch > 1):
        return ONE_SPLIT
    return 8


def attend_pallas(q: jax.Array, q_pos: jax.Array, layer: Any, *, window: int | None = None,
                  softcap: float | None = None, backend: str | None = None, interpret=False,
                  pages_per_split: int | None = None) -> jax.Array:
    """Attention over a layer with the Pallas kernel; the result `attend` gives, [B, T, H, D] f32.

    `backend` defaults to the device's (`pallas_backend`); on CPU pass
    `backend="tpu"` or `"gpu"` with `interpret=True` (tests do). A block of
    more query rows than `MAX_QUERY_ROWS` (a prefill chunk) is attended in
    calls over consecutive query tokens, one kernel launch each.
    `pages_per_split` (flash-decoding splits) defaults to `default_pages_per_split`.
    """
    backend = backend or pallas_backend()
    if backend is None:
        raise ValueError("attend_pallas: no TPU or GPU; pass backend= with interpret=True")
    if (refusal := kernel_refusal(layer, backend)) is not None:
        raise ValueError(f"attend_pallas: the {backend} kernel does not read this layer "
                         f"({refusal}); use impl='xla'")
    if pages_per_split is None:
        pages_per_split = default_pages_per_split(backend, q.shape[0], q.shape[1])
    tokens = query_tokens_per_call(q.shape[2] // row_heads(layer), backend)
    if q.shape[1] > tokens:  # a prefill chunk: calls over query blocks (queries are independent)
        return jnp.concatenate([
            attend_pallas(q[:, i:i + tokens], q_pos[:, i:i + tokens], layer, window=window,
                          softcap=softcap, backend=backend, interpret=interpret,
                          pages_per_split=pages_per_split)
            for i in range(0, q.shape[1], tokens)], axis=1)
    partial = attend_partial(q, q_pos, layer, window=window, softcap=softcap, backend=backend,
                             interpret=interpret, pages_per_split=pages_per_split)
    return finish(partial, q.shape)
