"""A paged KIVI layer: the quantized body in pool pages, the exact residual on the device.

`PagedKivi` is the paged form of a KIVI `ResidualCache` (`kvjax.policies.codecs.kivi`): one page holds
one KIVI group of `G` tokens (page size = group), so

- keys are quantized per channel over the page's `G` tokens (`ChannelPages`: codes and one
  scale/offset row per page, lane-flat as the kernel reads them, so a page carries its own
  parameters), and
- values per token in groups of channels (`TokenPages`, as a 4-bit `PagedLayer`),

and the body is a `PagedLayer` or a `kvjax.memory.tiers.TieredLayer`: `reserve`, `spill`,
`restore`, `prefetch`, `evict_pages` and `check_pool` take the *bodies* (`bodies(layers)`)
and move KIVI pages exactly as dense pages. The exact part (`recent`, a dense `TokenCache`)
stays on the device: it takes every write, so a sequence's `release` and `fork` are this
module's (they empty or copy its exact part too; `paging.release` on the bodies alone would
leave the released sequence's newest tokens readable).

A write flushes like the unpaged layer (`kvjax.core.cache.flush_residual`): the oldest whole groups of
`recent` beyond `residual` are quantized (the same `kvjax.core.quant.quantize` call on the same
slots, so the codes and parameters are bit-identical to the unpaged layer's:
tests/test_paged_kivi.py::test_flushed_pages_bit_identical_to_unpaged_kivi) and written into
each row's next reserved pages, then the new tokens are appended to `recent`. A flush needs its
pages reserved first: `flush_tokens(layers)` says how many tokens the next write flushes per
sequence (`reserve(pool, bodies(layers), flush_tokens(layers))`); a group without a reserved,
unshared device page is dropped and sets the body's `error`, as `PagedLayer.write` does.

`from_residual` loads an unpaged KIVI cache (e.g. after `snapkv:...+kivi:...` compressed a
prompt) into pages by copying codes and parameters (exact). Eviction *after* KIVI compacts the
body across groups, which a page cannot hold: `from_residual` refuses such a body.

Example:
    >>> import kvjax
    >>> from kvjax.memory.paging import check_pool, reserve
    >>> k = jax.random.normal(jax.random.key(0), (1, 1, 24, 64))     # [B, KVH, T, D]
    >>> cache = (kvjax.write(kvjax.init_cache(1, 1, 32, 64), k, k, jnp.arange(24)[None]),)
    >>> t = kvjax.kivi(bits=4, group=8, residual=8)
    >>> unpaged, _ = t.update(cache, t.init(cache), None)             # 16 quantized, 8 exact
    >>> pool, layers = from_residual(unpaged, max_pages=4, device_pages=4, host_pages=2)
    >>> pool, b = reserve(pool, bodies(layers), flush_tokens(layers))  # pages for the next flush
    >>> layers = with_bodies(layers, b)
    >>> layers[0].body.lengths.tolist(), int(layers[0].recent.length)   # 2 pages, 8 exact
    ([[16]], 8)
    >>> check_pool(pool, bodies(layers))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.branches import rare_cond
from kvjax.core.cache import EMPTY, ResidualCache, TokenCache, check_sizes, write as cache_write
from kvjax.core.layer import has_exact_part, register_layer
from kvjax.memory import paging
from kvjax.memory.paging import NULL_PAGE, PagedLayer, TokenPages, _error_at, _first_error
from kvjax.memory.paging import init_paged_cache
from kvjax.core.quant import pack, quantize, unpack
from kernels_pallas import page_formats as pf
from kvjax.core.stores import (PackedChannels, PackedTokens, Store, pack_params, param_values,
                               refuse_old_layout, register_export, unpack_params)

_static = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChannelPages(Store):
    """KIVI keys in pages: each page's `S` tokens quantized per channel as one group, held as
    the TPU kernel reads them (`kernels_pallas.page_formats.PackedChannelPages`).

    `words[p, 0]` are page p's code words lane-flat: word w of slot s at lane `w * S + s`
    (XLA:TPU keeps a `[P, 1, L]` array dense at any page size, where `[P, S, W]` below 128
    slots is laid out page-minor: docs/DECISIONS.md, "Page pools held lane-flat").
    `params[p, 0]` is the page's per-channel scale and offset as uint32 words (a 16-bit pair
    per word, K = 1; float32: the D scales then the D offsets, K = 2: a KIVI table row's
    `kvjax.core.stores.pack_params`); `page_params` reads them back. `live[p, s]` marks
    slots that hold a token (an EMPTY slot reads 0, so a page never shows codes its row did
    not write). Every leaf has the page axis first, so a page moves between tiers as a whole.

    Example:
        >>> s = ChannelPages.empty(pages=2, page_size=32, dim=128, bits=4)
        >>> s.words.shape, s.params.shape, s.shape   # 16 words x 32 slots; 128 pairs
        ((2, 1, 512), (2, 1, 128), (2, 32, 128))
    """

    words: jax.Array  # [P, 1, W * S] uint32 (W = D*bits/32)
    params: jax.Array  # [P, 1, K * D] uint32
    live: jax.Array  # [P, S] bool
    bits: int = dataclasses.field(metadata=_static)
    dim: int = dataclasses.field(metadata=_static)
    param_dtype: str = dataclasses.field(metadata=_static)

    slot_fields = ("words", "params", "live")
    codec_kind = "channels"

    @classmethod
    def empty(cls, pages: int, page_size: int, dim: int, bits: int,
              param_dtype=jnp.float16) -> "ChannelPages":
        name = jnp.dtype(param_dtype).name
        k = pf.PackedChannelPages(bits, param_dtype=name).group_words()
        return cls(words=jnp.zeros((pages, 1, dim * bits // 32 * page_size), jnp.uint32),
                   params=jnp.zeros((pages, 1, k * dim), jnp.uint32),
                   live=jnp.zeros((pages, page_size), bool), bits=bits, dim=dim,
                   param_dtype=name)

    @property
    def format(self) -> pf.PackedChannelPages:
        """The kernel's format of these pages."""
        return pf.PackedChannelPages(self.bits, param_dtype=self.param_dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical `[P, S, D]`."""
        return (*self.live.shape, self.dim)

    @property
    def group(self) -> int:
        """Tokens one scale/offset row covers: the page."""
        return self.live.shape[1]

    def page_leaves(self, words: jax.Array, scale: jax.Array, offset: jax.Array,
                    live: jax.Array) -> dict[str, jax.Array]:
        """Whole pages as this store's leaves: words [N, S, W] uint32, scale/offset [N, 1, D]
        (any float dtype; kept in `param_dtype`), live [N, S] bool."""
        params = pack_params(scale, offset, self.param_dtype)  # a KIVI table row's words
        return dict(words=pf.lane_flat(jnp.swapaxes(words, 1, 2)),
                    params=jax.lax.bitcast_convert_type(params, jnp.uint32), live=live)

    def page_params(self) -> tuple[jax.Array, jax.Array]:
        """(scale, offset) [P, 1, D] float32 (exact: widened from `param_dtype`)."""
        rows = self.params
        if self.param_dtype == "float32":
            rows = jax.lax.bitcast_convert_type(rows, jnp.float32)
        return unpack_params(rows, self.dim, self.param_dtype, symmetric=False)

    def slot_words(self) -> jax.Array:
        """[P, S, W] uint32: the code words per slot (`kvjax.core.quant.pack` along D)."""
        p, s, _ = self.shape
        return jnp.swapaxes(self.words.reshape(p, -1, s), 1, 2)

    def read(self) -> jax.Array:
        """[P, S, D] float32: codes * scale + offset (as `PackedChannels`), 0 where not live."""
        codes = unpack(self.slot_words(), self.bits, self.dim).astype(jnp.float32)
        scale, offset = self.page_params()
        x = codes * scale + offset
        return jnp.where(self.live[..., None], x, 0.0)


# version 2: lane-flat words and kernel-packed parameters in place of [P, S, W] words and
# [P, 1, D] scale / offset arrays; an artifact or checkpoint of the first layout is refused
register_export(ChannelPages, "kvjax.ChannelPages.v2")
refuse_old_layout("kvjax.ChannelPages", "a paged KIVI (ChannelPages) key store",
                  "the layout kvjax used before 2026-12-07 ([P, S, W] words, [P, 1, D] scale "
                  "and offset arrays)", "its pages lane-flat, as the TPU kernel reads them")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKivi:
    """One layer of a paged KIVI cache: `body` pages (one KIVI group each) + exact `recent`."""

    body: PagedLayer  # page size = group; k: ChannelPages, v: TokenPages (or TieredLayer)
    recent: TokenCache  # dense exact part [B*KVH, Cr, D], on the device
    residual: int = dataclasses.field(metadata=_static)

    batch = property(lambda self: self.recent.batch)
    kv_heads = property(lambda self: self.recent.kv_heads)
    head_dim = property(lambda self: self.recent.head_dim)
    pooled = property(lambda self: False)
    slots_per_token = property(lambda self: 1)
    mass = property(lambda self: None)  # no accumulated attention (a TokenCache policy's)

    @property
    def block(self) -> int:
        """Tokens one flush moves at a time: the KIVI group, one page."""
        return self.body.page_size

    def replace(self, **changes: Any) -> "PagedKivi":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------ CacheLayer (kvjax.core.layer)
    def check(self, i: int, spec: Any, batch: int) -> None:
        check_sizes(i, self, spec, batch, "a paged KIVI layer")

    def view(self, keep_latent: bool = False) -> TokenCache:
        return as_residual(self).view()

    def counters(self) -> dict[str, jax.Array]:
        """The body's pages, then slots written and held by both parts."""
        pages = self.body.counters()
        both = self.body.capacity + self.recent.capacity
        return dict(pages, tokens=jnp.sum(self.view().pos != EMPTY, -1, dtype=jnp.int32),
                    slots_used=self.body.lengths + self.recent.length,
                    capacity=jnp.full(self.body.lengths.shape, both, jnp.int32))

    def free_tokens(self) -> int:
        """Host side: tokens the exact part takes before a flush must find reserved pages."""
        return self.recent.free_tokens()

    def shardings(self, mesh, batch_axis, kv_axis) -> "PagedKivi":
        return self.replace(body=self.body.shardings(mesh, batch_axis, kv_axis),
                            recent=self.recent.shardings(mesh, batch_axis, kv_axis))

    def parts(self) -> tuple:
        return ()  # a body in pages (`view` gathers it)

    def shrink_usage(self) -> None:
        return None

    def shrink_plan(self, usage: None, room: int, max_write: int, align: int = 1) -> None:
        """Nothing to cut: pages are the pool's, and the exact part keeps its room to flush."""
        return None

    def resized(self, plan: None) -> "PagedKivi":
        return self

    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "PagedKivi":
        """Flush whole groups beyond `residual` into the reserved pages, then append T tokens
        [B, KVH, T, D] to the exact part (as the unpaged layer's `kvjax.write`)."""
        held = self.residual + self.block - 1 if _span(self) else 0
        if not held and not isinstance(self.recent.length, jax.core.Tracer):
            held = int(self.recent.length)  # a layer that cannot flush: the exact cursor
        if held + k_new.shape[2] > self.recent.capacity:
            raise ValueError(f"PagedKivi.write: {k_new.shape[2]} new tokens do not fit the exact "
                             f"part ({self.recent.capacity} slots, up to {held} hold the "
                             f"residual)")
        layer = flush_residual(self)
        body = layer.body.count_misses()  # a tiered body: the host pages this step reads
        return layer.replace(body=body, recent=cache_write(layer.recent, k_new, v_new, pos_new))

    def attend(self, q, q_pos, *, impl: str = "xla", window=None, softcap=None):
        """Attention over the body's pages (both tiers: staged or fetched host pages) and the
        exact part, one running softmax (`attend_blockwise` over a residual layer's parts)."""
        from kvjax.core.attention import attend_blockwise, attend_reference
        fn = attend_reference if impl == "reference" else attend_blockwise
        return fn(q, q_pos, as_residual(self), window=window, softcap=softcap)


register_export(PagedKivi)
register_layer(PagedKivi)


def as_residual(layer: PagedKivi) -> ResidualCache:
    """The layer as an unpaged `ResidualCache` whose body is the decoded pages in table order
    (host pages read from the stage or fetched): a reference and attention path."""
    return ResidualCache(body=layer.body.view(), recent=layer.recent, residual=layer.residual,
                         block=layer.block)


def bodies(layers: Sequence[PagedKivi]) -> tuple[PagedLayer, ...]:
    """The page layers of a paged KIVI cache: what the pool and tier functions take."""
    return tuple(l.body for l in layers)


def with_bodies(layers: Sequence[PagedKivi], new: Sequence[PagedLayer]) -> tuple[PagedKivi, ...]:
    """`layers` with their page layers replaced (after `reserve`, `spill`, `prefetch`, ...)."""
    return tuple(l.replace(body=b) for l, b in zip(layers, new))


def release(pool: Any, layers: Sequence[PagedKivi], rows: Any):
    """`kvjax.memory.paging.release` for a paged KIVI cache: the sequences where `rows` [B]
    is True free their pages and their exact part is emptied (its slots stay behind the
    shared cursor as padding). -> (pool, layers)."""
    layers = tuple(layers)
    pool, new = paging.release(pool, bodies(layers), rows)
    return pool, _clear_rows(with_bodies(layers, new), jnp.asarray(rows))


@jax.jit
def _clear_rows(layers: tuple[PagedKivi, ...], rows: jax.Array) -> tuple[PagedKivi, ...]:
    def clear(recent: TokenCache) -> TokenCache:
        b, h = recent.batch, recent.kv_heads
        slots = jnp.repeat(rows, h)[:, None, None]  # [B*KVH, 1, 1]
        return recent.replace(k=jnp.where(slots, 0, recent.k), v=jnp.where(slots, 0, recent.v),
                              pos=jnp.where(rows[:, None, None], EMPTY, recent.pos))
    return tuple(l.replace(recent=clear(l.recent)) for l in layers)


def fork(pool: Any, layers: Sequence[PagedKivi], source: Any):
    """`kvjax.memory.paging.fork` for a paged KIVI cache: sequence b shares sequence
    `source[b]`'s pages and gets a copy of its exact part (-1 leaves b alone).

    A target must be empty (released): no pages and no exact token; otherwise nothing
    happens and the pool's `error` (code 4) and `overflow` are set, as `paging.fork`. A bad
    `source` raises when concrete, and under jit sets `error` (code 3). -> (pool, layers)."""
    layers = tuple(layers)
    return _fork(pool, layers, paging.checked_source(source, layers[0].batch))


@jax.jit
def _fork(pool: Any, layers: tuple[PagedKivi, ...], source: jax.Array):
    layer = layers[0]
    batch, heads = layer.batch, layer.kv_heads
    bad = jnp.any((source < -1) | (source >= batch))
    exact = jnp.sum(layer.recent.pos != EMPTY, axis=(1, 2), dtype=jnp.int32)  # [B]
    written = layer.body.lengths.max(axis=1) + exact
    held = layer.body.num_pages_held.max(axis=1)
    busy = (source >= 0) & ((written > 0) | (held > 0))
    refused = ~bad & jnp.any(busy)
    first = jnp.argmax(busy)
    # the whole fork is refused here, so the pages' fork never sees a busy target
    pool, new = paging._fork(pool, bodies(layers), jnp.where(refused, -1, source))
    record = jnp.where(refused, jnp.stack([jnp.int32(4), first.astype(jnp.int32),
                                           written[first], held[first]]), 0)
    pool = pool.replace(error=_first_error(pool.error, record),
                        overflow=pool.overflow | refused)
    share = (source >= 0) & ~bad & ~refused  # [B]
    src = jnp.where(share, source, jnp.arange(batch))

    def copy(recent: TokenCache) -> TokenCache:
        rows = (src[:, None] * heads + jnp.arange(heads)).reshape(-1)  # [B*KVH]
        return recent.replace(k=recent.k[rows], v=recent.v[rows], pos=recent.pos[src])
    return pool, tuple(l.replace(recent=copy(l.recent)) for l in with_bodies(layers, new))


def _span(layer: PagedKivi) -> int:
    return max(0, layer.recent.capacity - layer.residual) // layer.block * layer.block


def flush_tokens(layers: Sequence[PagedKivi]) -> jax.Array:
    """[B] int32 tokens the next write flushes into each sequence's pages (host side): reserve
    them (`reserve(pool, bodies(layers), flush_tokens(layers))`) before the step."""
    layer = layers[0]
    g, n = layer.block, int(layer.recent.length)
    moved = 0 if _span(layer) == 0 else max(0, (n - layer.residual) // g) * g
    return jnp.full((layer.batch,), moved, jnp.int32)


def _encode_groups(body: PagedLayer, k: jax.Array, v: jax.Array, valid: jax.Array):
    """Quantize n whole groups k, v [R, n*G, D] (valid [R, n*G]) as the unpaged KIVI layer
    does (`PackedChannels.put_groups`, `PackedTokens.encode`): the page leaves
    ([R, n, G, ...]) of keys, values and liveness."""
    r, t, d = k.shape
    g, n = body.page_size, t // body.page_size
    ks, vs = body.k, body.v
    q = quantize(k, ks.bits, g, axis=1, symmetric=False, param_dtype=jnp.dtype(ks.param_dtype),
                 valid=jnp.broadcast_to(valid[..., None], k.shape))
    words = jnp.where(valid[..., None], pack(q.codes, ks.bits), 0)
    pages = lambda x: x.reshape(r * n, -1, *x.shape[2:])  # [R, n*G or n, ...] -> [R*n, ...]
    keys = ks.page_leaves(pages(words), pages(q.scale), pages(q.offset), pages(valid))
    values = dict(pages=vs.encode_pages(pages(jnp.where(valid[..., None], v, 0.0))))
    by_row = lambda leaves: {f: x.reshape(r, n, *x.shape[1:]) for f, x in leaves.items()}
    return by_row(keys), by_row(values)  # an EMPTY slot's value: 0


def _write_groups(body: PagedLayer, keys: dict, values: dict, pos: jax.Array,
                  count: jax.Array) -> PagedLayer:
    """Write the first `count` (multiple of G, shared by the rows) of n groups per row
    (leaves [R, n, G, ...], pos [R, n, G]) into each row's next pages. A group whose page is
    not reserved, shared or in host memory is dropped, and sets `error` (codes 6, 5, 8) when
    it holds a token (a group of padding only is dropped silently, as `PagedLayer.write`)."""
    g, n_table = body.page_size, body.tables.shape[-1]
    b, h = body.batch, body.kv_heads
    n = pos.shape[1]
    j = jnp.arange(n)
    index = (body.lengths // g)[..., None] + j  # [B, KVH, n] table entries
    page = jnp.take_along_axis(body.tables, jnp.minimum(index, n_table - 1), axis=-1)
    want = jnp.broadcast_to(j * g < count, (b, h, n))
    real = want & keys["live"].reshape(b, h, n, g).any(-1)  # groups that hold a token
    held = (index < n_table) & (page != NULL_PAGE)
    shared = held & body.shared[page]
    on_host = held & (page >= body.device_pages)
    slot = index * g
    error = _first_error(body.error, _error_at(real & shared, 5, slot),
                         _error_at(real & ~held, 6, slot),
                         _error_at(real & on_host & ~shared, 8, slot))
    ok = want & held & ~shared & ~on_host
    dst = jnp.where(ok, page, body.pos.shape[0]).reshape(-1)  # out of range: dropped
    flat = lambda x: x.reshape(b * h * n, *x.shape[2:])  # [R, n, G, ...] -> [R*n, G, ...]
    put = lambda store, leaves: store.replace(**{
        f: getattr(store, f).at[dst].set(flat(x).astype(getattr(store, f).dtype), mode="drop")
        for f, x in leaves.items()})
    return body.replace(
        k=put(body.k, keys), v=put(body.v, values),
        pos=body.pos.at[dst, 0].set(flat(pos), mode="drop"),
        lengths=jnp.minimum(body.lengths + count, body.num_pages_held * g), error=error)


def flush_residual(layer: PagedKivi) -> PagedKivi:
    """`kvjax.core.cache.flush_residual` into pages: the oldest whole groups of `recent` beyond `residual`."""
    recent, g, span = layer.recent, layer.block, _span(layer)
    if span == 0:
        return layer
    moved = jnp.maximum(0, (recent.length - layer.residual) // g) * g

    def move(layer):
        r = recent.k.shape[0]
        first = lambda x, axis: jax.lax.slice_in_dim(x, 0, span, axis=axis)
        pos = first(recent.pos, 2).reshape(r, span)
        keys, values = _encode_groups(layer.body, first(recent.k, 1), first(recent.v, 1),
                                      pos != EMPTY)
        body = _write_groups(layer.body, keys, values, pos.reshape(r, span // g, g), moved)
        gone = jnp.arange(recent.capacity) >= recent.length - moved
        roll = lambda x, axis: jnp.roll(x, -moved, axis=axis)
        new_recent = recent.replace(k=roll(recent.k, 1), v=roll(recent.v, 1),
                                    pos=jnp.where(gone, EMPTY, roll(recent.pos, 2)),
                                    length=recent.length - moved)
        return layer.replace(body=body, recent=new_recent)

    return rare_cond(moved > 0, move, lambda layer: layer, layer)


def _check_unpaged(cache: Sequence[Any]) -> None:
    for i, layer in enumerate(cache):
        ok = (has_exact_part(layer) and isinstance(layer.body.k, PackedChannels)
              and isinstance(layer.body.v, PackedTokens) and not layer.body.k.symmetric
              and layer.block == layer.body.k.group and not layer.pooled
              and layer.recent.mass is None)
        if not ok:
            raise ValueError(f"from_residual: cache layer {i} is a {type(layer).__name__}, not "
                             f"an unpaged KIVI layer (ResidualCache with per-channel keys in "
                             f"groups of its block, per-token values, per-head rows, no mass)")
        body = layer.body
        n = int(body.length)
        ids = np.asarray(body.k.group_id)[:, :n].astype(np.int64)
        valid = np.asarray(body.pos).reshape(ids.shape[0], -1)[:, :n] != EMPTY
        order = np.arange(n) // layer.block
        if n % layer.block or int(body.k.groups) != n // layer.block or \
                (valid & (ids != order)).any():
            raise ValueError(
                f"from_residual: cache layer {i}'s KIVI body is not whole groups in write "
                f"order ({n} slots, {int(body.k.groups)} groups of {layer.block}): eviction "
                f"after KIVI compacts codes across groups, which one-group pages cannot hold; "
                f"put the eviction before kivi in the chain")


def from_residual(cache: Sequence[ResidualCache], *, max_pages: int, device_pages: int,
                  host_pages: int = 0, stage_pages: int | None = None,
                  shared_tables: bool = False):
    """(pool, layers): a paged KIVI cache holding exactly the tokens of an unpaged KIVI cache.

    Codes and parameters are copied (bit for bit); the exact part is kept as it is.
    `max_pages` is the block-table length (body tokens per row / group, with room to grow);
    `device_pages` (null page included) and `host_pages` size the pool: `host_pages=0` gives
    plain `PagedLayer` bodies, else `kvjax.memory.tiers.TieredLayer` bodies with a stage of
    `stage_pages` (default `host_pages`). `shared_tables` allocates (and, tiered, spills and
    stages) a sequence's pages for all its KV heads at once (`init_paged_cache`,
    `init_tiered_cache`), so the TPU kernel reads one `[B, NP]` table: pages are one group,
    32 tokens by default, and at 64 x 32k x 8 KV heads per-head tables would need 2 MiB of
    SMEM."""
    from kvjax.memory.paging import reserve  # the pool functions take the bodies
    _check_unpaged(cache)
    first = cache[0]
    g, ks, vs = first.block, first.body.k, first.body.v
    b, kvh, d = first.batch, first.kv_heads, first.head_dim
    args = (g, b, kvh, max_pages, d, len(cache))
    if host_pages:
        from kvjax.memory.tiers import init_tiered_cache
        pool, plain = init_tiered_cache(device_pages, host_pages, *args, stage_pages=stage_pages,
                                        shared_tables=shared_tables)
    else:
        pool, plain = init_paged_cache(device_pages, *args, shared_tables=shared_tables)
    key = lambda n: ChannelPages.empty(n, g, d, ks.bits, jnp.dtype(ks.param_dtype))
    value = lambda n: TokenPages.empty(n, g, d, vs.bits, vs.group, vs.offset is None,
                                       jnp.dtype(vs.param_dtype))
    stores = {"k": key, "v": value, "host_k": key, "host_v": value, "stage_k": key,
              "stage_v": value}
    if host_pages:
        from kvjax.memory.tiers import _to_host
        on_host = lambda s: s.map_slots(lambda x: _to_host(jnp.copy(x)))
    body_layers = []
    for layer in plain:
        fields = {}
        names = {f.name for f in dataclasses.fields(layer)}
        for name, make in stores.items():
            if name in names:
                rows = jax.tree.leaves(getattr(layer, name))[0].shape[0]
                fields[name] = make(rows)
                if name.startswith("host_"):
                    fields[name] = on_host(fields[name])
        body_layers.append(layer.replace(**fields))
    n = int(first.body.length)
    pool, body_layers = reserve(pool, body_layers, jnp.full((b,), n, jnp.int32))
    layers = tuple(_load(bl, l) for bl, l in zip(body_layers, cache))
    return pool, layers


@jax.jit
def _load(body: PagedLayer, layer: ResidualCache) -> PagedKivi:
    """The body's groups copied into the reserved pages (exact bits), the exact part kept."""
    src = layer.body
    r, g = src.k.words.shape[0], layer.block
    nb = src.capacity // g  # whole groups the body has room for
    cut = lambda x: jax.lax.slice_in_dim(x, 0, nb * g, axis=1)
    split = lambda x: cut(x).reshape(r, nb, g, *x.shape[2:])
    pos = split(src.pos.reshape(r, -1))
    valid = pos != EMPTY
    table = lambda t: jax.lax.slice_in_dim(jnp.pad(t, ((0, 0), (0, max(0, nb - t.shape[1])),
                                                       (0, 0))), 0, nb, axis=1)[:, :, None]
    live = lambda x: jnp.where(valid[..., None], split(x), 0).reshape(r * nb, g, -1)
    pages = lambda x: x.reshape(r * nb, *x.shape[2:])  # [R, NB, ...] -> [R * NB, ...]
    keys = body.k.page_leaves(live(src.k.words), pages(table(src.k.scale)),
                              pages(table(src.k.offset)), pages(valid))
    offset = None if src.v.offset is None else param_values(live(src.v.offset))
    values = dict(pages=body.v.format.from_store(live(src.v.words),
                                                 param_values(live(src.v.scale)), offset)[0])
    by_row = lambda leaves: {f: x.reshape(r, nb, *x.shape[1:]) for f, x in leaves.items()}
    keys, values = by_row(keys), by_row(values)
    body = body.replace(lengths=jnp.zeros_like(body.lengths))
    body = _write_groups(body, keys, values, pos, src.length)
    return PagedKivi(body=body, recent=layer.recent, residual=layer.residual)


def unpaged_groups(layer: PagedKivi) -> dict[str, jax.Array]:
    """The body's pages gathered in table order per row, as an unpaged KIVI body lays them
    out: key `words` [R, NP*G, W], key `scale`/`offset` [R, NP, D], value leaves [R, NP*G, ...]
    and `pos` [R, NP*G] (reads host pages too; a test and audit path)."""
    body = layer.body
    tables = body.tables.reshape(-1, body.tables.shape[-1])  # [R, NP]
    pick = lambda store, host, f: _all_rows(getattr(store, f), None if host is None
                                            else getattr(host, f))[tables]
    host_k, host_v = getattr(body, "host_k", None), getattr(body, "host_v", None)
    r, n = tables.shape
    gathered = lambda store, host: store.replace(**{  # the rows' pages in table order
        f: pick(store, host, f).reshape(r * n, *getattr(store, f).shape[1:])
        for f in store.slot_fields})
    keys = gathered(body.k, host_k)  # [R * NP, ...]
    words, (scale, offset) = keys.slot_words(), keys.page_params()
    out = {"k_words": words.reshape(r, -1, words.shape[-1]),
           "k_scale": scale.reshape(r, n, -1), "k_offset": offset.reshape(r, n, -1),
           "k_live": keys.live.reshape(r, -1), "pos": body.pos[tables, 0].reshape(r, -1)}
    values = gathered(body.v, host_v).to_packed()  # [R * NP, G, ...]
    for f in values.slot_fields:
        if getattr(values, f) is not None:
            x = getattr(values, f)
            out["v_" + f] = x.reshape(r, -1, *x.shape[2:])
    return out


def _all_rows(dev: jax.Array, host: jax.Array | None) -> jax.Array:
    if host is None:
        return dev
    from kvjax.memory.tiers import _to_device
    return jnp.concatenate([dev, _to_device(host)])
