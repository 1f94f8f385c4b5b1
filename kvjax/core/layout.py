"""Cache-layout operations: move, pool, cut and grow the slots of a cache.

Shared by the eviction policies (`kvjax.policies.eviction` compacts what a policy
keeps), the codecs (a KIVI layer compacts its body and exact part) and the
sampler (`shrink` after compression). None of them decides *which* tokens
stay; they only rearrange slots:

* `compact(layer, keep)`: the kept slots of every row to the front, in slot
  order (jit-able; capacity is static).
* `pool_heads(layer)`: the per-head `[B*KVH, C, D]` layout as the pooled
  `[B, KVH*C, D]` one (Ada-KV head-wise budgets).
* `resize(layer, capacity)` / `shrink(cache, room)`: host side, cut or grow
  the slot axis so `nbytes` follows what is kept.

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=8, head_dim=4)
    >>> k = jax.random.normal(jax.random.key(0), (1, 1, 6, 4))
    >>> layer = kvjax.write(layer, k, k, jnp.arange(6)[None])
    >>> keep = jnp.array([[[True, False, True, False, False, True, False, False]]])
    >>> small = compact(layer, keep)
    >>> small.pos[0, 0].tolist(), int(small.length)     # kept positions first, then EMPTY
    ([0, 2, 5, -1, -1, -1, -1, -1], 3)
    >>> resize(small, 4).pos.shape                      # host side: cut to 4 slots
    (1, 1, 4)
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, Cache, Layer, TokenCache, resize_plan
from kvjax.core.stores import count_true, fold_rows, take


def _signature(tree) -> tuple:
    """What a traced program over `tree` depends on: structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)


def _equal_groups(items) -> tuple[tuple[int, ...], ...]:
    """The indices of `items` grouped by equal `_signature`, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(_signature(item), []).append(i)
    return tuple(tuple(m) for m in groups.values())


def map_layers(fn, *per_layer):
    """`tuple(fn(*items) for items in zip(*per_layer))`, compiling `fn` once per group of equal
    layers.

    Under jit, the layers whose arguments have equal structure, shapes and dtypes run as one
    `lax.map` (a loop in the compiled program), each step picking its layer's arguments with a
    `lax.switch` -- so a 30-layer compression compiles one layer body, not 30, and never stacks
    the whole cache (one layer is copied at a time). An argument that is an earlier
    `map_layers` result over the same group (a chain's second stage) is read from that loop's
    stacked output instead. A group of one and eager calls run `fn` directly. `fn` must not
    depend on the layer's index except through its arguments, and its outputs must have equal
    shapes across a group (a compression's static capacity).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> xs = (jnp.ones(3), 2 * jnp.ones(3), jnp.ones(4))
        >>> f = jax.jit(lambda xs: map_layers(lambda x, w: w * x.sum(), xs, (1.0, 2.0, 3.0)))
        >>> [float(y) for y in f(xs)]     # layers 0 and 1: one loop; layer 2 alone
        [3.0, 12.0, 12.0]
    """
    items = list(zip(*per_layer))
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(items)):
        return tuple(fn(*item) for item in items)
    out = [None] * len(items)
    for members in _equal_groups(items):
        if len(members) == 1:
            out[members[0]] = fn(*items[members[0]])
            continue
        sources = [_stacked_source([items[i][a] for i in members]) for a in range(len(per_layer))]
        picked = [a for a, src in enumerate(sources) if src is None]
        branches = [lambda i=i: tuple(items[i][a] for a in picked) for i in members]

        def step(j_and_stacked):
            j, stacked_args = j_and_stacked
            args = list(stacked_args)
            for a, x in zip(picked, jax.lax.switch(j, branches)):
                args[a] = x
            return fn(*args)

        stacked = jax.lax.map(step, (jnp.arange(len(members)), sources))
        for n, i in enumerate(members):
            out[i] = jax.tree.map(lambda x: x[n], stacked)
            for leaf, whole in zip(jax.tree.leaves(out[i]), jax.tree.leaves(stacked)):
                _remember_slice(leaf, whole, n)
    return tuple(out)


_slices: dict[int, tuple] = {}
"""Under jit: id of a `map_layers` output leaf -> (a weak reference to it, its group's stacked
output leaf, its index there), while the leaf's tracer lives."""


def _remember_slice(leaf, whole, n: int) -> None:
    key = id(leaf)
    _slices[key] = (weakref.ref(leaf, lambda _: _slices.pop(key, None)), whole, n)


def _stacked_source(trees: list):
    """The stacked tree whose slices 0, 1, ... `trees` are (one `map_layers` group's output in
    order), or None."""
    leaves = [jax.tree.leaves(t) for t in trees]
    if not leaves[0]:
        return None
    whole = []
    for position in range(len(leaves[0])):
        seen = [_slices.get(id(layer[position])) for layer in leaves]
        if any(s is None or s[0]() is not layer[position] or s[2] != n or s[1] is not seen[0][1]
               for n, (s, layer) in enumerate(zip(seen, leaves))):
            return None
        if seen[0][1].shape[0] != len(trees):
            return None
        whole.append(seen[0][1])
    return jax.tree.unflatten(jax.tree.structure(trees[0]), whole)


@jax.tree_util.register_pytree_node_class
class StackedLayers:
    """Per-layer trees stacked by group of equal structure, shapes and dtypes (`stack_layers`).

    What a compiled program returns instead of one array per layer and leaf: on XLA:CPU every
    such output is its own copy kernel (~95 ms of compile per cache layer of ~14 leaves),
    while a group's stacked leaves are the `lax.map` results `map_layers` already holds.
    `unstack_layers` takes them apart outside, with one compiled take per group.
    """

    def __init__(self, groups: tuple, members: tuple[tuple[int, ...], ...]):
        self.groups = groups  # per group: its layers' tree, leaves stacked [G, ...] if G > 1
        self.members = members  # static: each group's layer indices, in stacking order

    def tree_flatten(self):
        return (self.groups,), self.members

    @classmethod
    def tree_unflatten(cls, members, children):
        return cls(children[0], members)


def stack_layers(per_layer) -> StackedLayers:
    """Per-layer trees (e.g. a cache) stacked by group of equal layers; see `StackedLayers`.

    Inside jit, stacking the slices of a `map_layers` result folds back into that result (no
    copy, no per-layer kernel)."""
    members = _equal_groups(per_layer)
    stack = lambda m: per_layer[m[0]] if len(m) == 1 else \
        jax.tree.map(lambda *xs: jnp.stack(xs), *[per_layer[i] for i in m])  # a group of one stays
    return StackedLayers(tuple(stack(m) for m in members), members)


def unstack_layers(stacked: StackedLayers) -> tuple:
    """The per-layer trees of `stack_layers`, in layer order (eager: one compiled take per
    group layout, called once per layer).

    Example:
        >>> import jax.numpy as jnp
        >>> s = jax.jit(stack_layers)((jnp.ones(2), jnp.zeros(3), 2 * jnp.ones(2)))
        >>> s.members                                 # layers 0 and 2 have equal shapes
        ((0, 2), (1,))
        >>> [x.tolist() for x in unstack_layers(s)]
        [[1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 2.0]]
    """
    out = [None] * sum(map(len, stacked.members))
    for group, members in zip(stacked.groups, stacked.members):
        for n, i in enumerate(members):
            out[i] = group if len(members) == 1 else _take_resized(group, n, None)
    return tuple(out)


def compact(cache: Layer, keep: jax.Array, capacity: int | None = None) -> Layer:
    """Move the kept slots of every row to the front, in slot order.

    Encoded stores move their codes and parameters bit for bit. A
    `ResidualCache` compacts its body and its exact part separately
    (`keep` covers the body's slots, then the recent ones).

    Args:
      cache: the layer cache (per-head or pooled layout).
      keep: [B, KVH, C] bool; each row may keep at most `capacity` slots
        (extra slots beyond `capacity` in a row are dropped, latest last).
        In the pooled layout a slot stays when its owner head keeps it.
      capacity: slots of the returned cache (default: unchanged). Smaller
        means less memory; larger leaves room for new tokens.
    Returns:
      A cache whose rows hold their kept slots at `[0, n_row)` and EMPTY after,
      with the write cursor at the largest `n_row`.
    """
    if len(cache.parts()) > 1:  # a residual layer: each part compacts its own slots
        if capacity is not None:
            raise ValueError("compact: a residual layer keeps its capacity; use shrink to cut it")
        if keep.shape != cache.pos.shape:
            raise ValueError(f"compact: keep mask {keep.shape} does not match slots "
                             f"{cache.pos.shape}")
        return cache.map_parts(compact, keep)
    b, kvh, c = cache.pos.shape
    capacity = c if capacity is None else capacity
    if keep.shape != (b, kvh, c):
        raise ValueError(f"compact: keep mask {keep.shape} does not match slots {(b, kvh, c)}")
    if c == 0 and capacity == 0:  # no slots, nothing to move (the empty body of a short prompt)
        return cache
    if capacity < 1:
        raise ValueError(f"compact: capacity must be positive, got {capacity}")
    keep = keep & (cache.pos != EMPTY)
    rows = cache.k.shape[0]
    keep_rows = keep.any(axis=1) if cache.pooled else keep.reshape(rows, c)  # [R, C]
    slot = jnp.arange(c, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(keep_rows, slot, c + slot), axis=-1)  # kept first, in order
    if capacity <= c:
        order = order[..., :capacity]
    else:  # grow: pad with an index that is never kept (masked below)
        order = jnp.pad(order, ((0, 0), (0, capacity - c)), constant_values=c - 1)
    kept = jnp.take_along_axis(keep_rows, order, axis=-1)
    kept &= jnp.arange(capacity) < count_true(keep_rows, keepdims=True)  # [R, C']
    by_head = lambda x: jnp.broadcast_to(x.reshape(b, -1, capacity), (b, kvh, capacity))
    order_h, kept_h = by_head(order), by_head(kept)
    kept_h &= jnp.take_along_axis(keep, order_h, axis=-1)  # pooled: only the owner head
    pos = jnp.where(kept_h, jnp.take_along_axis(cache.pos, order_h, axis=-1), EMPTY)
    mass = cache.mass
    if mass is not None:
        mass = jnp.where(kept_h, jnp.take_along_axis(mass, order_h, axis=-1), 0.0)
    return TokenCache(k=take(cache.k, order, kept), v=take(cache.v, order, kept), pos=pos,
                      length=jnp.max(count_true(kept)), mass=mass)


def _pool(x: jax.Array, fill) -> jax.Array:
    """[B, KVH, C] per-head slot data -> [B, KVH, KVH*C]: head h owns slots [h*C, (h+1)*C)."""
    b, kvh, c = x.shape
    own = jnp.eye(kvh, dtype=bool)[None, :, :, None]  # [1, head, owner, 1]
    return jnp.where(own, x[:, :, None, :], fill).reshape(b, kvh, kvh * c)


def pool_heads(cache: Layer) -> Layer:
    """The same tokens in the pooled layout: `[B*KVH, C, D]` rows become `[B, KVH*C, D]`.

    Same bytes for keys and values (a reshape); each head's slots are marked
    in `pos` by head. Compact afterwards to let heads share the freed slots.
    """
    if cache.pooled:
        return cache
    if len(cache.parts()) > 1:  # a residual layer: each part pooled
        return cache.map_parts(pool_heads)
    b, kvh, c = cache.pos.shape
    return TokenCache(k=fold_rows(cache.k, b), v=fold_rows(cache.v, b), pos=_pool(cache.pos, EMPTY),
                      length=jnp.int32(kvh * c),
                      mass=None if cache.mass is None else _pool(cache.mass, 0.0))


def resize(cache: TokenCache, capacity: int) -> TokenCache:
    """Cut or extend the slot axis to `capacity`; slots past the cursor must be free.

    Host-side (capacity is a shape); raises if a written slot would be lost.
    """
    usage = jax.device_get(_usage(cache, False))
    return _take_resized(cache, None, resize_plan(cache, usage, capacity))


@functools.partial(jax.jit, static_argnames=("stacked",))
def _usage(group, stacked: bool):
    """`CacheLayer.shrink_usage` of one layer, or of every layer of a stacked group (leaves
    [G, ...]): one compiled program per layout, one call per group."""
    usage = lambda layer: layer.shrink_usage()
    return jax.vmap(usage)(group) if stacked else usage(group)


@functools.partial(jax.jit, static_argnames=("plan",))
def _take_resized(group, n, plan):
    """Layer `n` of a stacked group (`n=None`: `group` is the layer) cut by `plan` (its
    `CacheLayer.shrink_plan`, or None: as it is): one compiled program per layout and plan,
    called once per layer."""
    layer = group if n is None else jax.tree.map(lambda x: x[n], group)
    return layer if plan is None else layer.resized(plan)


def shrink(cache: Cache | StackedLayers, room: int = 0, max_write: int | None = None,
           align: int = 1) -> Cache:
    """Cut every layer to its written slots plus room for `room` more tokens (host side).

    After a policy compacted the cache, `nbytes(shrink(cache))` is the kept
    tokens' bytes: budget x (2 x head_dim x itemsize) per KV head, plus the
    int32 position per slot and head and the 4-byte cursor.
    A `ResidualCache` keeps `residual + block - 1 + max_write` exact slots
    (default `max_write = room`: one write of all the room) and gives the
    body room for every token that can flush into it; with `room=0` both
    parts are cut to the tokens they hold. `align` rounds every slot capacity up
    to a multiple of it: the attention kernel's tile (`kvjax.tile_slots`),
    so the TPU/GPU kernel reads the cache in place instead of padding a copy of it
    on every call; the samplers pass it for `impl="pallas"`.

    `cache` may also be the `StackedLayers` a compiled compression returns
    (`stack_layers`): its layers come back apart, each taken and cut by one
    compiled program per layout and size, after one host read of all layers'
    cursors and table usage.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=64)
        >>> cache = shrink(cache, room=8)   # nothing written yet: room for 8 tokens
        >>> cache[0].k.shape, cache[0].pos.shape
        ((1, 8, 4), (1, 1, 8))
        >>> shrink(cache, room=8, align=128)[0].capacity   # the TPU kernel's tile
        128
    """
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"shrink: align must be a positive int (slots), got {align!r}")
    max_write = room if max_write is None else max_write
    if not isinstance(cache, StackedLayers):
        cache = StackedLayers(tuple(cache), tuple((i,) for i in range(len(cache))))
    usages = jax.device_get([_usage(group, len(m) > 1)
                             for group, m in zip(cache.groups, cache.members)])  # one host read
    out = [None] * sum(map(len, cache.members))
    for group, members, usage in zip(cache.groups, cache.members, usages):
        stacked = len(members) > 1
        shapes = _one_layer(group) if stacked else group  # what a plan reads of a layer
        for n, i in enumerate(members):
            own = jax.tree.map(lambda x: x[n], usage) if stacked else usage
            plan = shapes.shrink_plan(own, room, max_write, align)
            out[i] = _take_resized(group, n if stacked else None, plan)
    return tuple(out)


def _one_layer(group):
    """One layer of a stacked group, abstract (shapes and dtypes): what a plan reads."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), group)
