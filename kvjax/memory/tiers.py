"""Memory tiers for the paged pool: cold pages in host memory, prefetched before they are read.

A `TieredLayer` is a `PagedLayer` whose page ids split in two tiers:

- ids `[0, device_pages)` keep their keys/values in device memory (`k`, `v`), as before;
- ids `[device_pages, P)` keep them in host memory (`host_k`, `host_v`, page `id -
  device_pages`), placed with jax memory kinds: `pinned_host` where the backend lists it
  (GPU, TPU, and CPU in jax 0.10), else `unpinned_host`, else (no host memory kind) device
  memory as a plain fallback that keeps the bookkeeping and the results identical.

So **the block table says where each page lives**: an entry below `device_pages` is on the
device, one at or above it on the host. Slot positions (`pos`, 4 bytes a slot) stay on the
device for every page, so masks and audits never touch the host. One `PagePool` counts
references for both tiers, so `fork`, `release`, `evict_pages` and `check_pool` work
unchanged: a spilled page is still a page of its rows, shared or not.

- `spill(pool, layers, pages)` moves device pages to free host pages (a whole-page copy, the
  table entries of every row listing the page renamed); `restore` moves host pages back.
  With `shared_tables` a page moves, and is staged, with its sequence's aligned group of
  KV heads, so the kernel reads one `[B, NP]` table per tier.
  Pages a row writes next (each row's last written page, reserved pages) never spill, and
  `reserve` allocates device pages only, so writes always land on the device.
- `coldest_pages(layer, scores, n)` is the spill policy: the `n` in-use device pages whose
  best slot scores lowest (`recency_scores`: older is colder; or any per-slot score such as
  accumulated attention).
- `prefetch(layers, pages)` stages copies of host pages in a per-layer device buffer
  (`stage_k`, `stage_v`, tagged `stage_ids`). Called eagerly it returns at once (jax's
  asynchronous dispatch): the copies run while the device finishes earlier work, and a step
  that reads them waits for them (jax orders a buffer's reads after its definition).
  Attention reads a host page from the stage when its id is tagged there; a host page the
  step reads that is not staged is a *prefetch miss*: it is fetched inside the step
  (synchronously, under a `lax.cond` that skips the transfer when there is none) and counted
  in `misses` [B, KVH]. A staged copy of a page that a pool operation frees is dropped, so a
  stage never serves a page id reused by another sequence.

Attention over a partly offloaded sequence reads the same values in the same slot order as
over an all-device pool, so its result is identical (tests/test_offload.py).

Example:
    >>> import jax.numpy as jnp
    >>> from kvjax.memory.paging import reserve, check_pool
    >>> pool, layers = init_tiered_cache(device_pages=6, host_pages=4, page_size=4, batch=1,
    ...                                  kv_heads=1, max_pages=8, head_dim=2, num_layers=1)
    >>> pool, layers = reserve(pool, layers, jnp.array([10]))         # 3 device pages
    >>> k = jnp.arange(20.).reshape(1, 1, 10, 2)
    >>> layers = [l.write(k, -k, jnp.arange(10)[None]) for l in layers]
    >>> pool, layers = spill(pool, layers, coldest_pages(layers[0], recency_scores(layers[0]), 1))
    >>> layers[0].tables[0, 0, :3].tolist(), tier_counts(pool, layers[0])   # page 1 -> host page 6
    ([6, 2, 3], {'allocated': 3, 'device': 2, 'host': 1})
    >>> layers = prefetch(layers, host_pages_in_use(layers[0]))   # stage what the next step reads
    >>> layers[0].stage_ids.tolist()
    [6, -1, -1, -1]
    >>> view = tiered_view(layers[0])                                    # the tokens, both tiers
    >>> bool((view.k[0, :10] == k[0, 0]).all()), view.pos[0, 0, :10].tolist() == list(range(10))
    (True, True)
    >>> check_pool(pool, layers)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from kvjax.core.branches import rare_cond
from kvjax.core.cache import EMPTY, TokenCache
from kvjax.core.layer import register_layer
from kvjax.memory.paging import (NULL_PAGE, PagedLayer, PagePool, _concrete, _finish,
                                 _first_error, _held, _in_use, _last_page, init_paged_cache)
from kvjax.core.stores import is_dense, map_slot_leaves, read

NO_PAGE = -1
"""A stage slot that holds no page."""


def host_memory_kind(device: Any = None) -> str | None:
    """The host memory kind to place cold pages in on `device` (default: the first device):
    'pinned_host', else 'unpinned_host', else None (no host memory: the fallback)."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    return None


def _to_host(x: jax.Array) -> jax.Array:
    """x placed in host memory (inside or outside jit); the fallback leaves it where it is."""
    return x if host_memory_kind() is None else jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: jax.Array) -> jax.Array:
    return x if host_memory_kind() is None else jax.device_put(x, jax.memory.Space.Device)


def _on_host(fn, *args):
    """fn(*args) computed in host memory (`compute_on("device_host")`, inside jit), so pages
    are gathered or scattered where they live and only the pages moved cross the bus."""
    if host_memory_kind() is None:
        return fn(*args)
    with compute_on("device_host"):
        return fn(*args)


def _host_take(store: Any, ids: jax.Array) -> Any:
    """Pages `ids` [N] of a host store, gathered on the host and brought to the device."""
    ids = _to_host(ids)
    return map_slot_leaves(store, lambda x: _to_device(_on_host(lambda a, i: a[i], x, ids)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TieredLayer(PagedLayer):
    """A `PagedLayer` whose pages at ids >= `device_pages` live in host memory.

    `k`/`v` hold the device pages `[Pd, S, D]`; `host_k`/`host_v` the host pages `[Ph, S, D]`
    (page id `Pd + i` is host page `i`); `pos` covers all `Pd + Ph` ids. The stage holds
    prefetched copies of host pages; `misses` counts host pages a step read unstaged.
    """

    host_k: Any  # [Ph, S, D] or TokenPages, in host memory
    host_v: Any  # [Ph, S, D] or TokenPages, in host memory
    stage_ids: jax.Array  # [M] int32 page id each stage slot holds a copy of, NO_PAGE if none
    stage_k: Any  # [M, S, D] or TokenPages, device
    stage_v: Any  # [M, S, D] or TokenPages, device
    misses: jax.Array  # [B, KVH] int32 host pages read without a staged copy (cumulative)

    @property
    def device_pages(self) -> int:
        return self.pos.shape[0] - _rows(self.host_k)

    def all_pages(self) -> tuple[jax.Array, jax.Array]:
        host = lambda s: _to_device(read(map_slot_leaves(s, _to_device)))
        return (jnp.concatenate([read(self.k), host(self.host_k)]),
                jnp.concatenate([read(self.v), host(self.host_v)]))

    def pages_freed(self, refcount: jax.Array) -> "TieredLayer":
        live = refcount[jnp.maximum(self.stage_ids, 0)] > 0
        return self.replace(stage_ids=jnp.where(live & (self.stage_ids >= 0), self.stage_ids,
                                                NO_PAGE))

    def write(self, k_new, v_new, pos_new) -> "TieredLayer":
        """`PagedLayer.write`, then count this step's prefetch misses: in-use host pages of
        each row that the stage does not hold (the attention that follows fetches them)."""
        return PagedLayer.write(self, k_new, v_new, pos_new).count_misses()

    def count_misses(self) -> "TieredLayer":
        return self.replace(misses=self.misses + stage_misses(self).sum(-1, dtype=jnp.int32))

    def misses_so_far(self) -> jax.Array:
        return self.misses

    def view(self, keep_latent: bool = False) -> TokenCache:
        """Both tiers: device pages read in place, host pages from the stage or (misses)
        fetched now (`tiered_view`); `attend` reads this view."""
        return tiered_view(self)


register_layer(TieredLayer)


def _rows(store: Any) -> int:
    return (store if is_dense(store) else getattr(store, store.slot_fields[0])).shape[0]


def stage_misses(layer: TieredLayer) -> jax.Array:
    """[B, KVH, NP] bool: in-use table entries on the host that no stage slot holds."""
    on_host = _in_use(layer) & (layer.tables >= layer.device_pages)
    staged = jnp.any(layer.tables[..., None] == layer.stage_ids, axis=-1)
    return on_host & ~staged


def tiered_view(layer: TieredLayer) -> TokenCache:
    """The layer as a dense `TokenCache` (as `kvjax.memory.paging.dense_view`), reading host pages
    from the stage where staged and fetching the rest (misses) from host memory."""
    pd, n_table = layer.device_pages, layer.tables.shape[-1]
    ids = jnp.where(_in_use(layer), layer.tables, NULL_PAGE).reshape(-1, n_table)  # [R, NP]
    on_host = ids >= pd
    match = ids[..., None] == layer.stage_ids  # [R, NP, M]
    hit, slot = jnp.any(match, -1), jnp.argmax(match, -1)
    miss = on_host & ~hit

    def gather(dev, host, stage):
        x = read(dev)[jnp.where(on_host, NULL_PAGE, ids)]  # [R, NP, S, D]
        x = jnp.where((on_host & hit)[..., None, None], read(stage)[slot], x)
        wanted = jnp.where(miss, ids - pd, 0).reshape(-1)
        fetched = rare_cond(jnp.any(miss),
                            lambda: read(_host_take(host, wanted)).reshape(x.shape),
                            lambda: jnp.zeros_like(x))
        x = jnp.where(miss[..., None, None], fetched, x)
        return x.reshape(x.shape[0], -1, x.shape[-1])  # [R, NP*S, D]

    k = gather(layer.k, layer.host_k, layer.stage_k)
    v = gather(layer.v, layer.host_v, layer.stage_v)
    in_use = jnp.arange(layer.capacity) < layer.lengths.reshape(-1, 1)
    pos = jnp.where(in_use, layer.pos[ids.reshape(-1), 0].reshape(ids.shape[0], -1), EMPTY)
    return TokenCache(k=k, v=v, pos=pos.reshape(layer.batch, layer.kv_heads, -1),
                      length=jnp.max(layer.lengths))


def init_tiered_cache(device_pages: int, host_pages: int, page_size: int, batch: int,
                      kv_heads: int, max_pages: int, head_dim: int, num_layers: int,
                      stage_pages: int | None = None, dtype=jnp.float32, bits: int | None = None,
                      group: int = 32, param_dtype=jnp.float16, shared_tables: bool = False
                      ) -> tuple[PagePool, tuple[TieredLayer, ...]]:
    """An empty pool of `device_pages` device pages (the null page among them) and
    `host_pages` host pages, and its layers; `stage_pages` (default: `host_pages`) is the
    size of each layer's prefetch stage. Other arguments as `init_paged_cache`.

    `shared_tables`: pages are allocated, spilled, restored and staged in aligned groups of
    `kv_heads` ids (a sequence's heads), so the kernel reads one `[B, NP]` table per tier;
    `device_pages`, `host_pages` and `stage_pages` must then be multiples of `kv_heads`, and
    `spill`/`restore` of a page move its whole group."""
    for name, value in (("host_pages", host_pages), ("stage_pages", stage_pages)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"init_tiered_cache: {name} must be a positive int, got {value!r}")
    if not isinstance(device_pages, (int, np.integer)) or device_pages < 2:
        raise ValueError(f"init_tiered_cache: device_pages must be an int >= 2 (the null page "
                         f"and one more), got {device_pages!r}")
    stage_pages = host_pages if stage_pages is None else stage_pages
    if shared_tables:
        for name, value in (("device_pages", device_pages), ("host_pages", host_pages),
                            ("stage_pages", stage_pages)):
            if value % kv_heads:
                raise ValueError(f"init_tiered_cache: with shared_tables, {name} must be a "
                                 f"multiple of kv_heads = {kv_heads} (pages move in groups of "
                                 f"a sequence's heads), got {value}")
    total = device_pages + host_pages
    pool, plain = init_paged_cache(total, page_size, batch, kv_heads, max_pages, head_dim,
                                   num_layers, dtype, bits, group, param_dtype=param_dtype,
                                   shared_tables=shared_tables)
    _, small = init_paged_cache(max(host_pages, stage_pages), page_size, 1, 1, 1, head_dim, 1,
                                dtype, bits, group, param_dtype=param_dtype)
    take = lambda store, n: map_slot_leaves(store, lambda x: x[:n])
    layers = []
    for layer in plain:
        fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(PagedLayer)}
        fields.update(
            k=take(layer.k, device_pages), v=take(layer.v, device_pages),
            host_k=map_slot_leaves(take(small[0].k, host_pages), lambda x: _to_host(jnp.copy(x))),
            host_v=map_slot_leaves(take(small[0].v, host_pages), lambda x: _to_host(jnp.copy(x))),
            stage_ids=jnp.full((stage_pages,), NO_PAGE, jnp.int32),
            stage_k=take(small[0].k, stage_pages), stage_v=take(small[0].v, stage_pages),
            misses=jnp.zeros((batch, kv_heads), jnp.int32))
        # committed to the device like a jitted step's outputs: an uncommitted leaf would make
        # the first `reserve`/step compile once more than the next ones (same shapes)
        dev = jax.devices()[0]
        static = {f.name for f in dataclasses.fields(TieredLayer) if f.metadata.get("static")}
        fields.update({f: jax.device_put(x, dev) for f, x in fields.items()
                       if f not in static | {"host_k", "host_v"}})
        layers.append(TieredLayer(**fields))
    return jax.device_put(pool, jax.devices()[0]), tuple(layers)


def recency_scores(layer: PagedLayer) -> jax.Array:
    """[P, S] per-slot score for `coldest_pages`: the slot's position (older = colder)."""
    return layer.pos[:, 0].astype(jnp.float32)


def _spillable(layer: PagedLayer) -> jax.Array:
    """[P] bool: device pages in use by some row and not any row's last written page."""
    n = layer.pos.shape[0]
    count = lambda mask: jnp.zeros((n,), jnp.int32).at[layer.tables.reshape(-1)].add(
        mask.reshape(-1).astype(jnp.int32))
    used = count(_in_use(layer)) > 0
    last = count(_last_page(layer) & _held(layer)) > 0
    ids = jnp.arange(n)
    return used & ~last & (ids != NULL_PAGE) & (ids < layer.device_pages)


def coldest_pages(layer: PagedLayer, slot_scores: jax.Array, n: int) -> jax.Array:
    """[n] int32 the spillable device pages whose best slot scores lowest (NO_PAGE where
    fewer exist): the spill policy. `slot_scores` [P, S], e.g. `recency_scores(layer)`."""
    valid = layer.pos[:, 0] != EMPTY
    best = jnp.where(valid, slot_scores, -jnp.inf).max(-1)
    ok = _spillable(layer)
    order = jnp.argsort(jnp.where(ok, best, jnp.inf), stable=True)[:n]
    return jnp.where(ok[order], order, NO_PAGE).astype(jnp.int32)


def keep_on_host(pool: PagePool, layers: Sequence[TieredLayer], fraction: Any):
    """Spill the coldest device pages (`recency_scores`) until `fraction` of the allocated
    pages are on the host, as far as spillable pages and free host pages allow.

    One jitted call (the decision and the copies), `fraction` a traced scalar: a decode loop
    calling it every step compiles it once, with no host sync."""
    f = _concrete(fraction)
    if f is not None and not (f.shape == () and 0 <= float(f) <= 1):
        raise ValueError(f"keep_on_host: fraction must be a scalar in [0, 1], got {fraction!r}")
    return _keep_on_host(pool, tuple(layers), jnp.asarray(fraction, jnp.float32))


@jax.jit
def _keep_on_host(pool: PagePool, layers: tuple[TieredLayer, ...], fraction: jax.Array):
    layer = layers[0]
    n = pool.num_pages
    live = pool.refcount > 0
    host = jnp.sum(live & (jnp.arange(n) >= layer.device_pages), dtype=jnp.int32)
    want = jnp.ceil(fraction * jnp.sum(live, dtype=jnp.int32)).astype(jnp.int32) - host
    order = coldest_pages(layer, recency_scores(layer), n)  # [P] coldest first
    return _move(pool, layers, jnp.where(jnp.arange(n) < want, order, NO_PAGE), to_host=True)


def spill(pool: PagePool, layers: Sequence[TieredLayer], pages: Any):
    """Move device pages `pages` [K] (NO_PAGE entries ignored) to free host pages.

    Only spillable pages move (in use, not a row's last written page); the rest, and pages
    beyond the free host pages, stay. Every table entry listing a moved page is renamed.
    A page id outside the device pages [1, device_pages) (other than NO_PAGE) is a
    ValueError (checked when `pages` is concrete)."""
    layers = tuple(layers)
    pages = _checked_pages("spill", pages, 1, layers[0].device_pages, "device pages")
    return _move(pool, layers, pages, to_host=True)


def restore(pool: PagePool, layers: Sequence[TieredLayer], pages: Any):
    """Move host pages `pages` [K] (NO_PAGE entries ignored) back to free device pages.
    A page id outside the host pages [device_pages, num_pages) (other than NO_PAGE) is a
    ValueError (checked when `pages` is concrete)."""
    layers = tuple(layers)
    pages = _checked_pages("restore", pages, layers[0].device_pages, pool.num_pages,
                           "host pages")
    return _move(pool, layers, pages, to_host=False)


def _checked_pages(what: str, pages: Any, low: int, high: int, kind: str) -> jax.Array:
    """`pages` as int32 [K]; ValueError for a float, a wrong rank or (when concrete) an id
    outside [low, high) other than NO_PAGE -- it would otherwise be skipped silently."""
    if isinstance(pages, jax.core.Tracer):
        return pages.astype(jnp.int32)
    array = np.asarray(pages)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{what}: pages must be a 1-D array of integer page ids, got "
                         f"{array.dtype} of shape {list(array.shape)}")
    bad = sorted({int(p) for p in array if p != NO_PAGE and not low <= p < high})
    if bad:
        raise ValueError(f"{what}: pages {bad[:8]} are out of range: the {kind} are "
                         f"[{low}, {high}) (NO_PAGE = {NO_PAGE} entries are skipped)")
    return jnp.asarray(array, jnp.int32)


@functools.partial(jax.jit, static_argnames=("to_host",))
def _move(pool: PagePool, layers: tuple[TieredLayer, ...], pages: jax.Array, to_host: bool):
    layer = layers[0]
    n, pd = pool.num_pages, layer.device_pages
    ids = jnp.arange(n)
    if to_host:
        movable = _spillable(layer)
        free = (pool.refcount == 0) & (ids >= pd)
    else:
        movable = (pool.refcount > 0) & (ids >= pd)
        free = (pool.refcount == 0) & (ids < pd) & (ids != NULL_PAGE)
    low, high = (1, pd) if to_host else (pd, n)
    error = _first_error(pool.error, _id_error(pages, low, high, 9 if to_host else 10))
    # pages move in units: one page, or with shared tables its aligned group of KVH ids (a
    # sequence's heads), which moves whole so that head h's page stays head 0's + h
    u = layer.kv_heads if layer.shared_tables else 1
    units = n // u
    whole = lambda mask: mask[:units * u].reshape(units, u).all(-1)  # [units]
    movable, free = whole(movable), whole(free)
    listed = (pages >= 0) & (pages < units * u)
    unit = jnp.where(listed, pages // u, 0)
    ok = listed & movable[unit]
    ok = ok & (jnp.cumsum(ok) <= free.sum())  # as many as there are free units
    ok = ok & ~jnp.any(jnp.tril(unit[:, None] == unit[None, :], -1) & ok[None, :], -1)  # once
    free_list = jnp.nonzero(free, size=pages.shape[0], fill_value=NULL_PAGE)[0]
    dst = free_list[jnp.clip(jnp.cumsum(ok) - 1, 0, pages.shape[0] - 1)]
    head = jnp.arange(u)  # each unit's pages; n: dropped by the scatters
    src = jnp.where(ok[:, None], unit[:, None] * u + head, n).reshape(-1)
    dst = jnp.where(ok[:, None], dst[:, None] * u + head, n).reshape(-1)
    rename = jnp.arange(n + 1).at[src].set(dst, mode="drop")[:n]  # [P] old id -> new id
    tables = rename[layer.tables]
    refcount = pool.refcount.at[dst].set(pool.refcount[jnp.minimum(src, n - 1)],
                                         mode="drop").at[src].set(0, mode="drop")

    def copy(l: TieredLayer) -> TieredLayer:
        s_, d_ = src, dst
        if to_host:
            hd = jnp.where(d_ < n, d_ - pd, n)
            put = lambda h, x: _on_host(lambda a, i, y: a.at[i].set(y, mode="drop"), h,
                                        _to_host(hd), _to_host(x[jnp.minimum(s_, pd - 1)]))
            host_k = _tree_map2(put, l.host_k, l.k)
            host_v = _tree_map2(put, l.host_v, l.v)
            k, v = l.k, l.v
        else:
            hs = jnp.where(s_ < n, s_ - pd, 0)
            put = lambda x, h: x.at[d_].set(_to_device(_on_host(lambda a, i: a[i], h,
                                                                 _to_host(hs))), mode="drop")
            k, v = _tree_map2(put, l.k, l.host_k), _tree_map2(put, l.v, l.host_v)
            host_k, host_v = l.host_k, l.host_v
        pos = l.pos.at[d_].set(l.pos[jnp.minimum(s_, n - 1)], mode="drop")
        pos = pos.at[s_].set(EMPTY, mode="drop")
        return l.replace(k=k, v=v, host_k=host_k, host_v=host_v, pos=pos)

    return _finish(pool, layers, refcount, tables, layer.lengths, error, fn=copy)


def _id_error(pages: jax.Array, low: int, high: int, code: int) -> jax.Array:
    """[4] int32 (code, index, id, high) of the first id in pages [K] outside [low, high)
    other than NO_PAGE, else zeros: the under-jit form of `_checked_pages`' ValueError."""
    bad = (pages != NO_PAGE) & ((pages < low) | (pages >= high))
    i = jnp.argmax(bad)
    return jnp.where(jnp.any(bad), jnp.stack([jnp.int32(code), i.astype(jnp.int32),
                                              pages[i], jnp.int32(high)]), 0)


def _tree_map2(fn, a: Any, b: Any) -> Any:
    """fn over the slot leaves of two stores of one kind (dense arrays or encoded stores)."""
    if is_dense(a):
        return fn(a, b)
    return a.replace(**{f: fn(getattr(a, f), getattr(b, f)) for f in a.slot_fields
                        if getattr(a, f) is not None})


def host_pages_in_use(layer: TieredLayer) -> jax.Array:
    """[M] int32 the host page ids some row reads (NO_PAGE padded, size = stage size): what
    the next step needs staged."""
    n = layer.pos.shape[0]
    used = jnp.zeros((n,), bool).at[layer.tables.reshape(-1)].max(_in_use(layer).reshape(-1))
    used = used & (jnp.arange(n) >= layer.device_pages)
    return jnp.nonzero(used, size=layer.stage_ids.shape[0], fill_value=NO_PAGE)[0].astype(
        jnp.int32)


def prefetch(layers: Sequence[TieredLayer], pages: Any) -> tuple[TieredLayer, ...]:
    """Stage copies of host pages `pages` [M] (NO_PAGE: an empty stage slot; M = the stage
    size) in every layer. Eager calls return before the copies finish (asynchronous
    dispatch); whatever reads the stage waits for them. A device page listed is not staged."""
    layers = tuple(layers)
    m = layers[0].stage_ids.shape[0]
    if not isinstance(pages, jax.Array) and np.shape(pages) == (m,):
        # host values only: reading a device array's ids would wait for it, and an eager
        # prefetch must return before its copies finish (ids from host_pages_in_use are valid)
        pages = _checked_pages("prefetch", pages, 0, layers[0].pos.shape[0],
                               "pool's pages (a device page is not staged)")
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != (m,):
        raise ValueError(f"prefetch: pages must have shape [{m}] (the stage size), got "
                         f"{list(pages.shape)}")
    return _prefetch(layers, pages)


def whole_groups(pages: jax.Array, group: int) -> jax.Array:
    """[M] page ids -> [M]: the aligned groups of `group` ids the listed pages belong to, each
    once, in the order first listed, group j at entries `j * group + h` (NO_PAGE after). How a
    stage of shared-table layers holds pages: head h's copy at head 0's slot + h.

    Example:
        >>> whole_groups(jnp.array([9, 4, 8, -1, -1, -1]), 2).tolist()   # groups 4 and 2
        [8, 9, 4, 5, -1, -1]
    """
    m = pages.shape[0]
    g = jnp.where(pages >= 0, pages // group, NO_PAGE)
    first = (g >= 0) & ~jnp.any(jnp.tril(g[:, None] == g[None, :], -1), -1)
    order = jnp.argsort(~first, stable=True)[:m // group]
    groups = jnp.where(first[order], g[order], NO_PAGE)  # [M / group]
    ids = jnp.where(groups[:, None] >= 0, groups[:, None] * group + jnp.arange(group), NO_PAGE)
    return jnp.pad(ids.reshape(-1), (0, m - ids.size), constant_values=NO_PAGE)


@jax.jit
def _prefetch(layers: tuple[TieredLayer, ...], pages: jax.Array) -> tuple[TieredLayer, ...]:
    out = []
    for l in layers:
        pd = l.device_pages
        error = _first_error(l.error, _id_error(pages, 0, l.pos.shape[0], 11))
        wanted = whole_groups(pages, l.kv_heads) if l.shared_tables else pages
        ok = (wanted >= pd) & (wanted < l.pos.shape[0])
        hid = jnp.where(ok, wanted - pd, 0)
        stage_k = _host_take(l.host_k, hid)
        stage_v = _host_take(l.host_v, hid)
        out.append(l.replace(stage_ids=jnp.where(ok, wanted, NO_PAGE), stage_k=stage_k,
                             stage_v=stage_v, error=error))
    return tuple(out)


def tier_counts(pool: PagePool, layer: PagedLayer) -> dict[str, int]:
    """Host-side page counts: allocated (reference count > 0), on device, on host."""
    live = np.asarray(pool.refcount) > 0
    device = live[:layer.device_pages].sum()
    return {"allocated": int(live.sum()), "device": int(device),
            "host": int(live.sum() - device)}
