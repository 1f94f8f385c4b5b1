"""A cache monitor: what every transform did, per layer and KV head, as a pytree.

`monitored(transform)` wraps a `CacheTransform`: its state becomes a `MonitoredState(inner,
monitor)`, so the monitor is returned alongside the cache by whatever runs the transform
(`models.sampler.generate` included), under jit, with no Python state. A `Monitor` is one
`LayerMonitor` per layer; each field is `[B, KVH]`:

- `tokens`: tokens held (slots with a position);
- `slots_used` / `capacity`: slots up to the write cursor (holes left by eviction included)
  / slots a row can hold;
- `evicted`: tokens the transform's updates removed so far (cumulative);
- `mass_retained`: the share of attention the kept tokens received, where the update saw
  attention: the queries of the statistics window (SnapKV, TOVA, ...) or the accumulated
  attention of the cache (H2O); NaN where it saw none (the last update that saw some wins);
- `k_error` / `v_error`: relative error `||stored - exact|| / ||exact||` of the kept keys and
  values, measured where the update encoded them (a codec: quantize, KIVI, fp8, low rank),
  0 for tokens kept exact;
- `pages_device` / `pages_host` / `prefetch_misses`: for a paged layer, pages each row lists
  on the device and in host memory (`kvjax.memory.tiers`), and host pages read unstaged.

`refresh(monitor, cache)` re-reads the counters a decode loop changes (tokens, slots,
pages, misses) from a later cache; `summary(monitor)` reduces it to plain numbers.

Example:
    >>> import jax, kvjax
    >>> from kvjax.core.stats import LayerStats
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 8), batch=1, capacity=16)
    >>> k = jax.random.normal(jax.random.key(0), (1, 1, 16, 8))
    >>> cache = (kvjax.write(cache[0], k, k, jnp.arange(16)[None]),)
    >>> t = monitored(kvjax.chain(kvjax.streaming_llm(sinks=2, window=6), kvjax.quantize(bits=4, group=8)))
    >>> cache, state = t.update(cache, t.init(cache), None)
    >>> s = summary(state.monitor)
    >>> s["tokens"], s["evicted"], 0.01 < s["k_error"] < 0.2    # 8 kept, 8 evicted, 4-bit error
    (8, 8, True)
"""

from __future__ import annotations


from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.attention import attention_mass
from kvjax.core.cache import EMPTY, ResidualCache, TokenCache, flush_span
from kvjax.core.layer import has_exact_part
from kvjax.core.stores import map_slot_leaves, read
from kvjax.core.transforms import CacheTransform


class LayerMonitor(NamedTuple):
    """One layer's counters, each [B, KVH]."""

    tokens: jax.Array  # int32 tokens held
    slots_used: jax.Array  # int32 slots up to the write cursor
    capacity: jax.Array  # int32 slots a row can hold
    evicted: jax.Array  # int32 tokens removed by updates so far
    mass_retained: jax.Array  # float32 attention share kept (NaN: no attention seen)
    k_error: jax.Array  # float32 relative error of stored keys (kept tokens)
    v_error: jax.Array  # float32 relative error of stored values
    pages_device: jax.Array  # int32 pages listed on the device (paged layers)
    pages_host: jax.Array  # int32 pages listed in host memory (tiered layers)
    prefetch_misses: jax.Array  # int32 host pages read without a staged copy
    k_err_sq: jax.Array | None = None  # float32 sum |stored - exact|^2 of the held keys
    k_ref_sq: jax.Array | None = None  # float32 sum |exact|^2 of the held keys
    v_err_sq: jax.Array | None = None  # the same for values
    v_ref_sq: jax.Array | None = None


Monitor = tuple  # tuple[LayerMonitor, ...], one per layer


def dense(layer: Any) -> TokenCache:
    """Any layer as a dense `TokenCache` (`CacheLayer.view`: stores decoded, parts joined,
    pages gathered from every tier); a ValueError for a layer that holds no tokens."""
    return layer.view()


def _by_head(x: jax.Array, batch: int, kv_heads: int) -> jax.Array:
    """[B, 1 or KVH, ...] -> [B, KVH, ...] (a pooled layout's shared rows broadcast)."""
    return jnp.broadcast_to(x, (batch, kv_heads, *x.shape[2:]))


def _supported(layer: Any) -> bool:
    try:
        dense(layer)
    except ValueError:
        return False
    return True


def _snapshot(layer: Any) -> dict[str, jax.Array]:
    """The counters read off one layer (`CacheLayer.counters`): tokens, slots, capacity,
    pages, misses ([B, KVH]). A layer that holds no tokens to read (a pure recurrent state)
    reports -1 for the token counts and 0 for the pages."""
    return layer.counters()


def init_monitor(cache: Any) -> Monitor:
    """A monitor of `cache` before any update: its counters, nothing evicted, no error."""
    out = []
    for layer in cache:
        snap = _snapshot(layer)
        shape = snap["tokens"].shape
        out.append(LayerMonitor(evicted=jnp.zeros(shape, jnp.int32),
                                mass_retained=jnp.full(shape, jnp.nan, jnp.float32),
                                k_error=jnp.zeros(shape, jnp.float32),
                                v_error=jnp.zeros(shape, jnp.float32),
                                k_err_sq=jnp.zeros(shape, jnp.float32),
                                k_ref_sq=jnp.zeros(shape, jnp.float32),
                                v_err_sq=jnp.zeros(shape, jnp.float32),
                                v_ref_sq=jnp.zeros(shape, jnp.float32), **snap))
    return tuple(out)


def refresh(monitor: Monitor, cache: Any) -> Monitor:
    """The monitor with the counters a decode loop changes re-read from `cache`."""
    return tuple(m._replace(**_snapshot(layer)) for m, layer in zip(monitor, cache))


def match_positions(pos_from: jax.Array, pos_to: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each slot of `pos_to` [B, KVH, C'] the slot of `pos_from` [B, KVH, C] holding the
    same position: (index [B, KVH, C'] int32, found [B, KVH, C'] bool; EMPTY never found)."""
    order = jnp.argsort(pos_from, axis=-1)
    ordered = jnp.take_along_axis(pos_from, order, -1)
    search = jnp.vectorize(lambda a, v: jnp.searchsorted(a, v), signature="(c),(d)->(d)")
    i = jnp.clip(search(ordered, pos_to), 0, pos_from.shape[-1] - 1)
    found = (jnp.take_along_axis(ordered, i, -1) == pos_to) & (pos_to != EMPTY)
    return jnp.take_along_axis(order, i, -1), found


def _error_sums(before: jax.Array, after: jax.Array, idx: jax.Array,
                found: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, KVH] sums over found slots of |after - before[idx]|^2 and |before[idx]|^2.

    One (sequence, KV head) row at a time (`lax.map`): XLA:CPU materialized the whole gathered
    `before[idx]` of every layer at once: SnapKV's monitored compression of a 0.98 GB cache
    (SmolLM2, 5 x 4k) had 1.97 GB of temporaries by `memory_analysis`, now 1.05 GB (0.08
    unmonitored; the rest is the compressed cache, which the monitor reads before it is
    stacked)."""
    b, h = idx.shape[:2]
    rows = lambda x: x.reshape(b * h, *x.shape[2:])

    def row(args):  # [C, D], [C', D], [C'], [C']
        before_row, after_row, i, w = args
        exact = jnp.take(before_row, i, axis=0)
        w = w[:, None]
        return (jnp.sum(jnp.where(w, (after_row - exact) ** 2, 0.0)),
                jnp.sum(jnp.where(w, exact ** 2, 0.0)))

    num, den = jax.lax.map(row, (rows(before), rows(after), rows(idx), rows(found)))
    return num.reshape(b, h).astype(jnp.float32), den.reshape(b, h).astype(jnp.float32)


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """sqrt(num / den), 0 where den is 0: a relative error from its sums."""
    return jnp.sqrt(num / jnp.where(den > 0, den, 1.0)).astype(jnp.float32)


def _observed_mass(layer: Any, d: TokenCache, stats: Any) -> jax.Array | None:
    """[B, KVH, C] attention each slot received as the update saw it, or None."""
    if stats is not None and getattr(stats, "queries", None) is not None \
            and stats.queries.shape[1] > 0:
        return attention_mass(stats.queries, stats.query_pos, d)
    if d.mass is not None:
        return d.mass
    return None


def observe(monitor: Monitor, before: Any, after: Any, stats: Any = None) -> Monitor:
    """The monitor after an update took `before` to `after` (`stats`: what it saw)."""
    out = []
    for i, (m, lb, la) in enumerate(zip(monitor, before, after)):
        if not (_supported(lb) and _supported(la)):  # e.g. tokens folded into a linear state
            out.append(m._replace(**_snapshot(la)))
            continue
        db, da = dense(lb), dense(la)
        b, h = db.pos.shape[:2]
        snap_b, snap = _snapshot(lb), _snapshot(la)
        idx, found = match_positions(db.pos, da.pos)  # after slot -> before slot
        kb = _by_head(db.logical_k.astype(jnp.float32), b, h)
        ka = _by_head(da.logical_k.astype(jnp.float32), b, h)
        vb = _by_head(db.logical_v.astype(jnp.float32), b, h)
        va = _by_head(da.logical_v.astype(jnp.float32), b, h)
        (k_num, k_den), (v_num, v_den) = (_error_sums(kb, ka, idx, found),
                                          _error_sums(vb, va, idx, found))
        layer_stats = None if stats is None else stats[i]
        mass = _observed_mass(lb, db, layer_stats)
        retained = m.mass_retained
        if mass is not None:
            _, kept = match_positions(da.pos, db.pos)  # before slots still held after
            total = jnp.sum(mass, -1)
            share = jnp.sum(jnp.where(kept, mass, 0.0), -1) / jnp.where(total > 0, total, 1.0)
            retained = jnp.where(total > 0, share, retained).astype(jnp.float32)
        out.append(m._replace(
            evicted=m.evicted + jnp.maximum(snap_b["tokens"] - snap["tokens"], 0),
            mass_retained=retained, k_error=_ratio(k_num, k_den), v_error=_ratio(v_num, v_den),
            k_err_sq=k_num, k_ref_sq=k_den, v_err_sq=v_num, v_ref_sq=v_den, **snap))
    return tuple(out)


def _slots(store: Any, start: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Slots [start, start + size) of a store decoded, [R, size, D] float32, and [size] bool
    marking those inside its capacity (the rest read 0). Decodes only `size` slots."""
    cap = store.shape[1]
    n = min(size, cap)
    first = jnp.minimum(start, cap - n)
    piece = read(map_slot_leaves(store, lambda x: jax.lax.dynamic_slice_in_dim(x, first, n,
                                                                               axis=1)))
    at = start - first + jnp.arange(size)
    ok = at < n
    x = jnp.take(piece.astype(jnp.float32), jnp.minimum(at, n - 1), axis=1)
    return jnp.where(ok[None, :, None], x, 0.0), ok


def _flush_sums(before: ResidualCache, after: ResidualCache):
    """([B, KVH] x 4) squared errors of the keys/values one write flushed from `before`'s
    exact part into `after`'s body, and squared norms of the tokens it wrote (exact)."""
    b, h = before.batch, before.kv_heads
    rows = lambda x: jnp.sum(x, (-1, -2)).reshape(b, h)
    zero = jnp.zeros((b, h), jnp.float32)
    errors = [zero, zero]
    span = flush_span(before)
    moved = after.body.length - before.body.length
    if span:
        flushed = (jnp.arange(span) < moved) & (before.recent.pos[..., :span] != EMPTY)
        for i, name in enumerate(("k", "v")):
            exact = getattr(before.recent, name)[:, :span].astype(jnp.float32)  # [R, span, D]
            stored, ok = _slots(getattr(after.body, name), before.body.length, span)
            w = (flushed.reshape(-1, span) & ok)[..., None]
            errors[i] = rows(jnp.where(w, (stored - exact) ** 2, 0.0))
    recent = after.recent
    written = recent.length - (before.recent.length - moved)
    slot = jnp.arange(recent.capacity)
    new = (slot >= recent.length - written) & (slot < recent.length) & (recent.pos != EMPTY)
    w = new.reshape(-1, recent.capacity)[..., None]
    norms = [rows(jnp.where(w, getattr(recent, n).astype(jnp.float32) ** 2, 0.0))
             for n in ("k", "v")]
    return errors[0], norms[0], errors[1], norms[1]


def observe_flush(monitor: Monitor, before: Any, after: Any) -> Monitor:
    """The monitor after a decode write took `before` to `after` (the model's step).

    A KIVI (residual) layer's write flushes the oldest exact tokens into its quantized body:
    their key/value errors are measured now, against the exact values they had, and added to
    the layer's sums; the tokens written add their squared norms (exact, no error). So
    `k_error` / `v_error` stay the relative error of the keys/values the cache holds, each
    token measured when it was encoded (tests/test_monitor.py::
    test_flush_error_equals_a_numpy_recomputation). Other layers are returned unchanged (a
    per-token codec encodes at write, where the exact value is not kept; eviction in decode
    is seen by `observe`)."""
    out = []
    for m, lb, la in zip(monitor, before, after):
        if not has_exact_part(lb) or m.k_err_sq is None:
            out.append(m)
            continue
        ke, kn, ve, vn = _flush_sums(lb, la)
        k_num, k_den = m.k_err_sq + ke, m.k_ref_sq + kn
        v_num, v_den = m.v_err_sq + ve, m.v_ref_sq + vn
        out.append(m._replace(k_err_sq=k_num, k_ref_sq=k_den, v_err_sq=v_num, v_ref_sq=v_den,
                              k_error=_ratio(k_num, k_den), v_error=_ratio(v_num, v_den)))
    return tuple(out)


class MonitoredState(NamedTuple):
    """A `monitored` transform's state: the wrapped transform's own and the monitor."""

    inner: Any  # the wrapped transform's state
    monitor: Monitor  # one LayerMonitor per layer


def _observe_write(state: MonitoredState, before: Any, after: Any) -> MonitoredState:
    """`monitored`'s `after_write`: the flush errors of a decode step's write."""
    return state._replace(monitor=observe_flush(state.monitor, before, after))


_MONITORED: dict[CacheTransform, CacheTransform] = {}


def monitored(transform: CacheTransform) -> CacheTransform:
    """`transform` with a `Monitor` in its state: a `MonitoredState(inner, monitor)`.

    Its updates record what they did (`observe`); its `after_write` records what each decode
    write flushed into a quantized body (`observe_flush`), so a decode loop measures it without
    knowing about monitors. The same transform gives the same wrapper (jitted code keyed on it
    compiles once)."""
    if transform not in _MONITORED:
        def init(cache):
            return MonitoredState(transform.init(cache), init_monitor(cache))

        def update(cache, state: MonitoredState, stats=None):
            new, inner = transform.update(cache, state.inner, stats)
            return new, MonitoredState(inner, observe(state.monitor, cache, new, stats))

        _MONITORED[transform] = CacheTransform(init, update, transform.stats, _observe_write)
    return _MONITORED[transform]


def summary(monitor: Monitor) -> dict[str, Any]:
    """Plain numbers over layers and heads: totals of the counts (tokens, slots, capacity,
    evicted, pages, misses; summed over layers, heads and the batch), means of the shares
    and errors (over layers and heads where defined), and the worst layer's key error."""
    stack = lambda f: np.stack([np.asarray(getattr(m, f)) for m in monitor])  # [L, B, KVH]
    out: dict[str, Any] = {}
    for f in ("tokens", "slots_used", "capacity", "evicted", "pages_device", "pages_host",
              "prefetch_misses"):
        x = stack(f)
        out[f] = int(x[x >= 0].sum())  # -1: a layer holding no tokens (a recurrent state)
    mass = stack("mass_retained")
    out["mass_retained"] = (None if np.isnan(mass).all()
                            else round(float(np.nanmean(mass)), 6))
    for f in ("k_error", "v_error"):
        out[f] = round(float(stack(f).mean()), 6)
    k = stack("k_error").mean((1, 2))
    out["worst_k_error_layer"] = int(k.argmax())
    out["layers"] = len(monitor)
    return out


def per_head(monitor: Monitor, field: str) -> np.ndarray:
    """[L, B, KVH] numpy array of one field, for plots and tables."""
    if field not in LayerMonitor._fields:
        raise ValueError(f"per_head: unknown field {field!r}; fields: {LayerMonitor._fields}")
    return np.stack([np.asarray(getattr(m, field)) for m in monitor])


def find_monitor(state: Any) -> Monitor | None:
    """The monitor inside a `monitored` transform's state (or None)."""
    return state.monitor if isinstance(state, MonitoredState) else None


__all__ = ["LayerMonitor", "Monitor", "MonitoredState", "dense", "find_monitor", "init_monitor", "match_positions",
           "monitored", "observe", "observe_flush", "per_head", "refresh", "summary"]


