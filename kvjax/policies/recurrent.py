"""Recurrent-state layers: a fixed-size state per (sequence, KV head) in the cache protocol.

Linear attention keeps, instead of keys and values, the state

    S = sum_j g_j psi(k_j) v_j^T   [F, D]      z = sum_j g_j psi(k_j)   [F]

(`psi` the key feature map, `g_j = gamma^(t - p_j)` an optional per-head decay
of a token at position `p_j` seen from position `t`, GLA / Mamba-2 style) and
answers a query with `phi(q)^T S / phi(q)^T z`. Bytes per sequence do not grow
with context (`F*D + F + 1` floats per KV head).

Two layer types, both pytrees that `kvjax.write`, `kvjax.attend`,
`kvjax.nbytes`, `kvjax.shard_cache`, `kvjax.shrink`, `jax.export` and the
sampler handle like a `TokenCache` (both implement `kvjax.core.layer.CacheLayer`):

- `LinearLayer` (pure linear attention, `linear_state`): the state plus the
  tokens of the latest write (a staging window of `W` slots). A write first
  folds the staged tokens into the state, then stages the new ones; attention
  reads the state (everything before this write) and the staged tokens
  causally. A write of `T` tokens is one chunk of the *chunked parallel form*
  (state between chunks, quadratic within); `T = 1` writes are the
  *recurrent form*. `tests/test_recurrent_state.py` proves both equal a
  plain quadratic masked linear attention.
- `FoldedLayer` (LESS-style hybrid, `fold`): a token cache of kept tokens
  plus the state of the tokens an eviction policy removed. Attention is one
  softmax-shaped ratio over both (see `hybrid_attend`).

Example:
    >>> import kvjax
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=8)
    >>> k = v = jnp.ones((1, 1, 6, 4))                                 # [B, KVH, T, D]
    >>> cache = tuple(kvjax.write(c, k, v, jnp.arange(6)[None]) for c in cache)
    >>> t = linear_state("prf", layers=(0,), features=32)   # layer 0 becomes linear
    >>> cache, _ = t.update(cache, t.init(cache), None)
    >>> [type(layer).__name__ for layer in cache]
    ['LinearLayer', 'TokenCache']
    >>> t = fold_evicted(kvjax.snapkv(ratio=0.75), "prf")   # LESS: evicted tokens folded
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import EMPTY, TokenCache, check_sizes, view
from kvjax.core.layer import is_plain, kind_of, register_layer, unknown_counters
from kvjax.policies.feature_maps import FeatureMap, check_map_name, resolve
from kvjax.core.transforms import CacheTransform

NEG_INF = -1e30
UNBOUNDED = 2 ** 31 - 1  # `capacity` of a linear layer: any number of tokens fits


# ----------------------------------------------------------------------------- the state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """`S` and `z` of every (sequence, KV head) row, decayed to position `at`."""

    s: jax.Array  # [R, F, D] float32 sum of g * psi(k) v^T, R = B*KVH (row b*KVH + h)
    z: jax.Array  # [R, F] float32 sum of g * psi(k)
    at: jax.Array  # [R] int32 position the decay is measured from (latest folded); EMPTY: none

    def replace(self, **changes: Any) -> "RecurrentState":
        return dataclasses.replace(self, **changes)


def init_state(rows: int, features: int, head_dim: int) -> RecurrentState:
    """An empty state (zeros, `at = EMPTY`)."""
    return RecurrentState(s=jnp.zeros((rows, features, head_dim), jnp.float32),
                          z=jnp.zeros((rows, features), jnp.float32),
                          at=jnp.full((rows,), EMPTY, jnp.int32))


def log_decay(decay: tuple[float, ...], rows: int) -> jax.Array:
    """[R] float32 log gamma per row from one gamma or one per KV head (row r: head r % KVH)."""
    g = np.log(np.asarray(decay, np.float64)).astype(np.float32)
    return jnp.asarray(np.tile(g, rows // len(g)))


def fold_tokens(state: RecurrentState, phi_k: jax.Array, v: jax.Array, pos: jax.Array,
                log_g: jax.Array) -> RecurrentState:
    """Fold tokens into the state: the recurrence `S <- gamma^dt S + sum gamma^(t-p) psi(k) v^T`.

    Args:
      phi_k: [R, N, F] key features; v: [R, N, D] values; pos: [R, N] int32
        positions (EMPTY or negative: not a token, ignored).
      log_g: [R] log of the per-step decay (0: no decay).
    """
    valid = pos >= 0
    new_at = jnp.maximum(state.at, jnp.max(jnp.where(valid, pos, EMPTY), axis=-1))  # [R]
    keep_old = jnp.where(state.at >= 0, jnp.exp(log_g * (new_at - state.at)), 0.0)  # [R]
    w = jnp.where(valid, jnp.exp(log_g[:, None] * (new_at[:, None] - pos)), 0.0)  # [R, N]
    wk = phi_k * w[..., None]  # [R, N, F]
    s = keep_old[:, None, None] * state.s + jnp.einsum("rnf,rnd->rfd", wk, v.astype(jnp.float32))
    z = keep_old[:, None] * state.z + wk.sum(axis=1)
    return RecurrentState(s=s, z=z, at=new_at.astype(jnp.int32))


def read_state(phi_q: jax.Array, q_pos: jax.Array, state: RecurrentState,
               log_g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """phi(q)^T S and phi(q)^T z, decayed to each query: [R, Q, D], [R, Q] (0 for padding)."""
    dt = jnp.maximum(q_pos - state.at[:, None], 0)  # [R, Q]
    g = jnp.where((q_pos >= 0) & (state.at[:, None] >= 0), jnp.exp(log_g[:, None] * dt), 0.0)
    num = jnp.einsum("rqf,rfd->rqd", phi_q, state.s) * g[..., None]
    den = jnp.einsum("rqf,rf->rq", phi_q, state.z) * g
    return num, den


def read_tokens(phi_q: jax.Array, q_pos: jax.Array, phi_k: jax.Array, v: jax.Array,
                k_pos: jax.Array, log_g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal linear attention of queries over tokens: [R, Q, D] numerator, [R, Q] denominator.

    Weight of token n for query q: `phi(q).psi(k_n) * gamma^(t_q - p_n)` when
    `0 <= p_n <= t_q`, else 0.
    """
    visible = (k_pos[:, None, :] >= 0) & (q_pos[:, :, None] >= 0) & \
        (k_pos[:, None, :] <= q_pos[:, :, None])  # [R, Q, N]
    dt = jnp.maximum(q_pos[:, :, None] - k_pos[:, None, :], 0)
    a = jnp.einsum("rqf,rnf->rqn", phi_q, phi_k)
    a = jnp.where(visible, a * jnp.exp(log_g[:, None, None] * dt), 0.0)
    return jnp.einsum("rqn,rnd->rqd", a, v.astype(jnp.float32)), a.sum(axis=-1)


# ----------------------------------------------------------------------------- query layout


def group_queries(q: jax.Array, q_pos: jax.Array, kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """q [B, T, H, D], q_pos [B, T] -> rows [B*KVH, G*T, D] and their positions [B*KVH, G*T]."""
    b, t, h, d = q.shape
    g = h // kv_heads
    qg = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b * kv_heads, g * t, d)
    pos = jnp.broadcast_to(q_pos[:, None, None, :], (b, kv_heads, g, t)).reshape(b * kv_heads, -1)
    return qg.astype(jnp.float32), pos


def ungroup(out: jax.Array, q_shape: tuple[int, ...], kv_heads: int) -> jax.Array:
    """[B*KVH, G*T, D] -> [B, T, H, D]."""
    b, t, h, d = q_shape
    return out.reshape(b, kv_heads, h // kv_heads, t, d).transpose(0, 3, 1, 2, 4).reshape(
        b, t, h, d)


def _check_queries(name: str, q, q_pos, batch: int, kv_heads: int, head_dim: int,
                   window, softcap) -> None:
    b, t, h, d = q.shape
    if h % kv_heads or (b, d) != (batch, head_dim):
        raise ValueError(f"{name}: queries {q.shape} do not fit a layer of batch {batch}, "
                         f"{kv_heads} KV heads of head_dim {head_dim}")
    if q_pos.shape != (b, t):
        raise ValueError(f"{name}: q_pos has shape {q_pos.shape}, expected {(b, t)}")
    if window is not None or softcap is not None:
        raise ValueError(f"{name}: a recurrent-state layer supports neither window nor softcap")


def _rows(x: jax.Array) -> jax.Array:
    """[B, KVH, ...] -> [B*KVH, ...]."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _row_sharding(mesh, batch_axis, kv_axis, ndim: int):
    from jax.sharding import NamedSharding, PartitionSpec as P
    axes = tuple(a for a in (batch_axis, kv_axis) if a is not None)
    return NamedSharding(mesh, P(axes or None, *[None] * (ndim - 1)))


def _state_sharding(state: RecurrentState, mesh, batch_axis, kv_axis) -> RecurrentState:
    by_row = lambda x: _row_sharding(mesh, batch_axis, kv_axis, x.ndim)
    return RecurrentState(s=by_row(state.s), z=by_row(state.z), at=by_row(state.at))


# ----------------------------------------------------------------------------- pure linear layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearLayer:
    """A layer of pure linear attention: the state, and the latest write's tokens (W slots).

    The staged tokens are raw keys (after RoPE) and values; the next write
    folds them into `state` with `feature_map.key`.
    """

    state: RecurrentState
    k: jax.Array  # [B*KVH, W, D] keys of the latest write
    v: jax.Array  # [B*KVH, W, D] values of the latest write
    pos: jax.Array  # [B, KVH, W] int32 their positions, EMPTY for a free slot
    feature_map: FeatureMap = dataclasses.field(metadata=dict(static=True))
    decay: tuple = dataclasses.field(default=(1.0,), metadata=dict(static=True))

    batch = property(lambda self: self.pos.shape[0])
    kv_heads = property(lambda self: self.pos.shape[1])
    head_dim = property(lambda self: self.k.shape[-1])
    window = property(lambda self: self.pos.shape[2])
    capacity = property(lambda self: UNBOUNDED)  # tokens never run out (`free_tokens`)
    length = property(lambda self: np.int32(0))
    slots_per_token = property(lambda self: 1)
    pooled = property(lambda self: False)
    mass = property(lambda self: None)

    def replace(self, **changes: Any) -> "LinearLayer":
        return dataclasses.replace(self, **changes)

    def _log_g(self) -> jax.Array:
        return log_decay(self.decay, self.k.shape[0])

    def folded(self) -> RecurrentState:
        """The state with the staged tokens folded in (everything this layer has seen)."""
        phi_k = self.feature_map.key(self.k, self.kv_heads)
        return fold_tokens(self.state, phi_k, self.v, _rows(self.pos), self._log_g())

    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "LinearLayer":
        """Fold the staged tokens into the state, then stage the new [B, KVH, T, D] ones."""
        b, h, t, d = k_new.shape
        if (b, h, d) != (self.batch, self.kv_heads, self.head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"LinearLayer.write: keys {k_new.shape} / values {v_new.shape} do "
                             f"not fit [batch={self.batch}, kv_heads={self.kv_heads}, T, "
                             f"head_dim={self.head_dim}]")
        if t > self.window:
            raise ValueError(f"LinearLayer.write: {t} tokens in one write exceed the layer's "
                             f"staging window of {self.window}; make it with window >= {t} "
                             f"(or shrink(cache, room, max_write={t}))")
        if pos_new.shape != (b, t):
            raise ValueError(f"LinearLayer.write: positions {pos_new.shape}, expected {(b, t)}")
        pad = self.window - t
        pos = jnp.where(pos_new < 0, EMPTY, pos_new).astype(jnp.int32)
        pos = jnp.broadcast_to(pos[:, None, :], (b, h, t))
        widen = lambda x: jnp.pad(x.reshape(b * h, t, d).astype(self.k.dtype),
                                  ((0, 0), (0, pad), (0, 0)))
        return self.replace(state=self.folded(), k=widen(k_new), v=widen(v_new),
                            pos=jnp.pad(pos, ((0, 0), (0, 0), (0, pad)), constant_values=EMPTY))

    def attend(self, q: jax.Array, q_pos: jax.Array, *, impl: str = "xla",
               window: int | None = None, softcap: float | None = None) -> jax.Array:
        """phi(q)^T S + causal linear attention over the staged tokens, normalised. [B, T, H, D]."""
        _check_queries("LinearLayer.attend", q, q_pos, self.batch, self.kv_heads,
                       self.head_dim, window, softcap)
        qg, qp = group_queries(q, q_pos, self.kv_heads)
        fm, log_g = self.feature_map, self._log_g()
        phi_q = fm.query(qg, self.kv_heads)
        num_s, den_s = read_state(phi_q, qp, self.state, log_g)
        num_t, den_t = read_tokens(phi_q, qp, fm.key(self.k, self.kv_heads), self.v,
                                   _rows(self.pos), log_g)
        num, den = num_s + num_t, den_s + den_t
        out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
        return ungroup(out, q.shape, self.kv_heads)

    # ------------------------------------------------ CacheLayer (kvjax.core.layer)
    def check(self, i: int, spec, batch: int) -> None:
        """ValueError unless the layer fits a model of `spec` and `batch` (`kvjax.check_cache`)."""
        check_sizes(i, self, spec, batch, "a linear layer")

    def view(self, keep_latent: bool = False) -> TokenCache:
        raise ValueError("a linear layer holds a recurrent state, no tokens to view")

    def counters(self) -> dict[str, jax.Array]:
        return unknown_counters(self.batch, self.kv_heads)

    def free_tokens(self) -> int:
        return UNBOUNDED  # the state takes any number of tokens

    def shardings(self, mesh, batch_axis, kv_axis) -> "LinearLayer":
        """Shardings of every leaf: rows over (batch, kv), `pos` over each (`kvjax.shard_cache`)."""
        from jax.sharding import NamedSharding, PartitionSpec as P
        by_row = lambda x: _row_sharding(mesh, batch_axis, kv_axis, x.ndim)
        return self.replace(state=_state_sharding(self.state, mesh, batch_axis, kv_axis),
                            k=by_row(self.k), v=by_row(self.v),
                            pos=NamedSharding(mesh, P(batch_axis, kv_axis, None)))

    def parts(self) -> tuple:
        return ()  # a state and a staging window, not dense slots

    def shrink_usage(self) -> None:
        return None

    def shrink_plan(self, usage: None, room: int, max_write: int, align: int = 1) -> int:
        """`kvjax.shrink`: fold the staged tokens; stage up to `max_write` next."""
        return max(1, max_write)

    def resized(self, plan: int) -> "LinearLayer":
        return resize_window(self, plan)


def resize_window(layer: LinearLayer, window: int) -> LinearLayer:
    """The same layer with its staged tokens folded and an empty staging window of `window`."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"resize_window: window must be an int >= 1, got {window!r}")
    rows, d = layer.k.shape[0], layer.head_dim
    return layer.replace(state=layer.folded(), k=jnp.zeros((rows, window, d), layer.k.dtype),
                         v=jnp.zeros((rows, window, d), layer.v.dtype),
                         pos=jnp.full((layer.batch, layer.kv_heads, window), EMPTY, jnp.int32))


def _check_decay(decay) -> tuple[float, ...]:
    values = tuple(decay) if isinstance(decay, (tuple, list)) else (decay,)
    if not values or any(isinstance(g, bool) or not isinstance(g, (int, float))
                         or not 0 < g <= 1 for g in values):
        raise ValueError(f"decay must be a number in (0, 1] or one per KV head, got {decay!r}")
    return tuple(float(g) for g in values)


def init_linear_layer(batch: int, kv_heads: int, head_dim: int, feature_map: FeatureMap,
                      window: int = 1, decay: float | Sequence[float] = 1.0,
                      dtype: Any = jnp.float32) -> LinearLayer:
    """An empty linear layer; `window` = the most tokens one write may add (a prefill chunk)."""
    for name, value in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("window", window)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"init_linear_layer: {name} must be a positive int, got {value!r}")
    if not isinstance(feature_map, FeatureMap) or feature_map.head_dim != head_dim:
        raise ValueError(f"init_linear_layer: feature_map must be a FeatureMap of head_dim "
                         f"{head_dim}, got {feature_map!r}")
    decay = _check_decay(decay)
    if len(decay) not in (1, kv_heads):
        raise ValueError(f"init_linear_layer: decay has {len(decay)} values; give 1 or one per "
                         f"KV head ({kv_heads})")
    rows = batch * kv_heads
    return LinearLayer(state=init_state(rows, feature_map.features, head_dim),
                       k=jnp.zeros((rows, window, head_dim), dtype),
                       v=jnp.zeros((rows, window, head_dim), dtype),
                       pos=jnp.full((batch, kv_heads, window), EMPTY, jnp.int32),
                       feature_map=feature_map, decay=decay)


# ----------------------------------------------------------------------------- hybrid layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FoldedLayer:
    """Kept tokens (a `TokenCache`, attended exactly) and the state of the evicted ones."""

    tokens: TokenCache
    state: RecurrentState  # sum over evicted tokens, no decay
    feature_map: FeatureMap = dataclasses.field(metadata=dict(static=True))

    batch = property(lambda self: self.tokens.batch)
    kv_heads = property(lambda self: self.tokens.kv_heads)
    head_dim = property(lambda self: self.tokens.head_dim)
    capacity = property(lambda self: self.tokens.capacity)
    length = property(lambda self: self.tokens.length)
    slots_per_token = property(lambda self: self.tokens.slots_per_token)
    pooled = property(lambda self: self.tokens.pooled)
    pos = property(lambda self: self.tokens.pos)
    # accumulated attention is not tracked beside a state: an H2O policy chained before
    # `fold` scores with the mass gathered up to the first compression
    mass = property(lambda self: None)

    def replace(self, **changes: Any) -> "FoldedLayer":
        return dataclasses.replace(self, **changes)

    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "FoldedLayer":
        from kvjax.core.cache import write
        return self.replace(tokens=write(self.tokens, k_new, v_new, pos_new))

    def attend(self, q: jax.Array, q_pos: jax.Array, *, impl: str = "xla",
               window: int | None = None, softcap: float | None = None) -> jax.Array:
        _check_queries("FoldedLayer.attend", q, q_pos, self.batch, self.kv_heads,
                       self.head_dim, window, softcap)
        return hybrid_attend(q, q_pos, view(self.tokens), self.state, self.feature_map)

    # ------------------------------------------------ CacheLayer (kvjax.core.layer)
    def check(self, i: int, spec, batch: int) -> None:
        self.tokens.check(i, spec, batch)

    def view(self, keep_latent: bool = False) -> TokenCache:
        """The kept tokens (the state of the evicted ones is no tokens)."""
        return self.tokens.view(keep_latent=keep_latent)

    def counters(self) -> dict[str, jax.Array]:
        return self.tokens.counters()

    def free_tokens(self) -> int:
        return self.tokens.free_tokens()

    def shardings(self, mesh, batch_axis, kv_axis) -> "FoldedLayer":
        return self.replace(tokens=self.tokens.shardings(mesh, batch_axis, kv_axis),
                            state=_state_sharding(self.state, mesh, batch_axis, kv_axis))

    def parts(self) -> tuple:
        return ()  # tokens beside a state: the fold transforms rewrite `tokens` themselves

    def shrink_usage(self) -> Any:
        return self.tokens.shrink_usage()

    def shrink_plan(self, usage: Any, room: int, max_write: int, align: int = 1) -> Any:
        return self.tokens.shrink_plan(usage, room, max_write, align)

    def resized(self, plan: Any) -> "FoldedLayer":
        return self.replace(tokens=self.tokens.resized(plan))


def hybrid_attend(q: jax.Array, q_pos: jax.Array, tokens: TokenCache, state: RecurrentState,
                  fm: FeatureMap) -> jax.Array:
    """Softmax over the kept tokens and the state's estimate of the evicted, one normaliser.

    Full attention over all tokens is `sum_j e^{s_j} v_j / sum_j e^{s_j}`
    (`s_j = q.k_j / sqrt d`). Split the tokens into kept K and evicted E and
    estimate the evicted sums with the feature maps,
    `sum_E e^{s_j} v_j ~ phi(q)^T S` and `sum_E e^{s_j} ~ phi(q)^T z`:

        out = (sum_K e^{s_j - m} v_j + e^{-m} phi(q)^T S)
              / (sum_K e^{s_j - m}   + e^{-m} phi(q)^T z)

    Numerator and denominator estimate the same two sums of the full
    softmax, scaled by the same `e^{-m}`, so the ratio is that softmax
    exactly when the estimates are exact (no evicted token: plain softmax;
    no kept token: linear attention `phi^T S / phi^T z`). `m = max(max_K s_j,
    log phi(q)^T z)` keeps every exponent <= 0. This needs
    `phi(q).psi(k) ~ e^{q.k/sqrt d}` in absolute scale: random features are
    unbiased for it; learned maps are trained for it; elu+1 is not.
    """
    d = q.shape[-1]
    kvh = tokens.kv_heads
    if tokens.pooled:
        raise ValueError("FoldedLayer: head-wise (pooled) token layouts are not supported")
    qg, qp = group_queries(q, q_pos, kvh)  # [R, Q, D], [R, Q]
    k = tokens.k.astype(jnp.float32)
    s = jnp.einsum("rqd,rcd->rqc", qg, k) * d ** -0.5  # [R, Q, C]
    kpos = _rows(tokens.pos)  # [R, C]
    mask = (kpos[:, None, :] != EMPTY) & (qp[:, :, None] >= 0) & (kpos[:, None, :] <= qp[:, :, None])
    s = jnp.where(mask, s, NEG_INF)
    num_s, den_s = read_state(fm.query(qg, kvh), qp, state, jnp.zeros(qg.shape[0]))
    log_den = jnp.where(den_s > 0, jnp.log(jnp.where(den_s > 0, den_s, 1.0)), NEG_INF)
    m = jnp.maximum(jnp.max(s, axis=-1), log_den)  # [R, Q]
    seen = m > NEG_INF / 2
    m = jnp.where(seen, m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    scale = jnp.exp(-m)
    num = jnp.einsum("rqc,rcd->rqd", p, tokens.v.astype(jnp.float32)) + num_s * scale[..., None]
    den = p.sum(axis=-1) + den_s * scale
    out = jnp.where((seen & (den > 0))[..., None], num / jnp.where(den > 0, den, 1.0)[..., None],
                    0.0)
    return ungroup(out, q.shape, kvh)


# ----------------------------------------------------------------------------- export


def _register_export(cls, static: Sequence[str]) -> None:
    def serialize(aux) -> bytes:
        fm, *rest = aux
        head = json.dumps(list(rest)).encode()
        return len(head).to_bytes(4, "little") + head + fm.to_bytes()

    def deserialize(data: bytes):
        n = int.from_bytes(data[:4], "little")
        rest = json.loads(data[4:4 + n])
        return (FeatureMap.from_bytes(data[4 + n:]), *[tuple(x) if isinstance(x, list) else x
                                                       for x in rest])

    jax.export.register_pytree_node_serialization(
        cls, serialized_name=f"kvjax.{cls.__name__}", serialize_auxdata=serialize,
        deserialize_auxdata=deserialize)


_register_export(LinearLayer, ("feature_map", "decay"))
_register_export(FoldedLayer, ("feature_map",))
register_layer(LinearLayer)
register_layer(FoldedLayer)
jax.export.register_pytree_node_serialization(
    RecurrentState, serialized_name="kvjax.RecurrentState",
    serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
    deserialize_auxdata=lambda data: tuple(json.loads(data)))


# ----------------------------------------------------------------------------- transforms


def _dense_rows(layer, name: str) -> TokenCache:
    """A layer's tokens as a dense per-head TokenCache (ValueError for what cannot be folded)."""
    if not layer.parts():  # a state already, or pages
        raise ValueError(f"{name}: a {type(layer).__name__} cannot be folded into a state; "
                         f"use a dense token cache (TokenCache or ResidualCache)")
    dense = view(layer)
    if dense.pooled:
        raise ValueError(f"{name}: head-wise (pooled) layers are not supported; drop headwise")
    return dense


def state_of(layer: TokenCache, fm: FeatureMap, keep: jax.Array | None = None,
             decay: tuple = (1.0,)) -> RecurrentState:
    """The state of a token layer's tokens (only those where `keep` [B, KVH, C] if given)."""
    pos = layer.pos if keep is None else jnp.where(keep, layer.pos, EMPTY)
    rows = layer.k.shape[0]
    st = init_state(rows, fm.features, layer.head_dim)
    return fold_tokens(st, fm.key(layer.k, layer.kv_heads), layer.v, _rows(pos),
                       log_decay(decay, rows))


@functools.lru_cache(maxsize=None)
def _linear_update(map_name, layers, features: int, seed: int, decay: tuple):
    def update(cache, state: ConvertedLayers, stats=None):
        picked = range(len(cache)) if layers is None else layers
        if max(picked) >= len(cache):
            raise ValueError(f"linear_state: layer {max(picked)} does not exist; the cache has "
                             f"{len(cache)} layers")
        out = list(cache)
        for i in picked:
            if i in state.layers:
                continue  # already a state (a later compression): nothing to do
            dense = _dense_rows(cache[i], "linear_state")
            fm = resolve(map_name, i, dense.kv_heads, dense.head_dim, features, seed)
            if len(decay) not in (1, dense.kv_heads):
                raise ValueError(f"linear_state: decay has {len(decay)} values; give 1 or one "
                                 f"per KV head ({dense.kv_heads})")
            empty = init_linear_layer(dense.batch, dense.kv_heads, dense.head_dim, fm, 1, decay,
                                      dense.k.dtype)
            out[i] = empty.replace(state=state_of(dense, fm, decay=decay))
        return tuple(out), ConvertedLayers(tuple(sorted({*state.layers, *picked})))
    return update


def linear_state(map: str | FeatureMap = "prf", layers: Sequence[int] | None = None,
                 features: int = 128, seed: int = 0,
                 decay: float | Sequence[float] = 1.0) -> CacheTransform:
    """Replace the token cache of `layers` (default: all) by its recurrent state.

    At the first update (prompt compression) every token of those layers is
    folded into `S`, `z` with the key map; from then on they run pure linear
    attention (`LinearLayer`), holding `F*D + F + 1` floats per KV head
    whatever the context. `map`: "elu", "prf" (`features` random features
    from `seed`) or a directory of learned maps. `decay` (per-step gamma in
    (0, 1], one or one per KV head) forgets old tokens geometrically.

    Example:
        >>> from kvjax import parse_method
        >>> t = parse_method("linear_state:map=prf,features=128,layers=0-9")  # the same as
        >>> t = linear_state("prf", layers=range(10), features=128)
    """
    check_map_name(map)
    _check_count("linear_state", "features", features)
    _check_count("linear_state", "seed", seed, 0)
    decay = _check_decay(decay)
    if layers is not None:
        layers = tuple(sorted({int(i) for i in layers}))
        if not layers or layers[0] < 0:
            raise ValueError(f"linear_state: layers must be non-negative indices, got {layers}")
    return _linear_transform(map, layers, features, seed, decay)


@functools.lru_cache(maxsize=None)
def _linear_transform(map_name, layers, features, seed, decay) -> CacheTransform:
    return CacheTransform(init=_converted_layers, update=_linear_update(map_name, layers, features, seed, decay))


def _converted_layers(cache) -> "ConvertedLayers":
    return ConvertedLayers(tuple(i for i, layer in enumerate(cache)
                                 if kind_of(layer) is LinearLayer))


@functools.partial(jax.tree_util.register_dataclass, data_fields=(), meta_fields=("layers",))
@dataclasses.dataclass(frozen=True)
class ConvertedLayers:
    """`linear_state`'s state: the layers it has already replaced by a `LinearLayer` (static).

    Example:
        >>> import jax
        >>> jax.tree_util.tree_leaves(ConvertedLayers((0, 3))), ConvertedLayers((0, 3)).layers
        ([], (0, 3))
    """

    layers: tuple[int, ...] = ()


def _check_count(name: str, arg: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}: {arg} must be an int >= {low}, got {value!r}")


def evicted_mask(before: jax.Array, after: jax.Array) -> jax.Array:
    """[B, KVH, C] bool: tokens of `before` positions [B, KVH, C] missing from `after` [B, KVH, C'].

    A token is identified by its (sequence, head, position); a row's positions
    are unique. Sort-based: O(C log C) per row.
    """
    big = jnp.iinfo(jnp.int32).max
    srt = jnp.sort(jnp.where(after == EMPTY, big, after), axis=-1)  # [B, KVH, C']
    flat_s, flat_b = _rows(srt), _rows(before)
    idx = jax.vmap(jnp.searchsorted)(flat_s, flat_b)
    found = jnp.take_along_axis(flat_s, jnp.minimum(idx, flat_s.shape[-1] - 1), axis=-1) == flat_b
    return ((flat_b != EMPTY) & ~found).reshape(before.shape)


@functools.lru_cache(maxsize=None)
def _fold_update(policy_update, map_name, features: int, seed: int):
    def update(cache, fstate: FoldState, stats=None):
        tokens = _kept_tokens(cache, fstate.folded)
        kept, pstate = policy_update(tokens, fstate.inner, stats)
        out, now = [], []
        for i, (old, before, after, was) in enumerate(zip(cache, tokens, kept, fstate.folded)):
            now.append(bool(after.parts()) and (after is not before or was))
            if not now[-1]:
                out.append(after)  # a state already, or a layer the policy left alone
                continue  # (`on_layers` passes untouched layers through as they are)
            dense = _dense_rows(before, "fold")
            if not is_plain(after):
                raise ValueError("fold: the policy before fold must leave plain token layers "
                                 "(chain codecs after fold, not before)")
            fm = resolve(map_name, i, dense.kv_heads, dense.head_dim, features, seed)
            st = old.state if was else init_state(dense.k.shape[0], fm.features, dense.head_dim)
            gone = evicted_mask(dense.pos, view(after).pos)
            phi_k = fm.key(dense.k, dense.kv_heads)
            st = fold_tokens(st, phi_k, dense.v, _rows(jnp.where(gone, dense.pos, EMPTY)),
                             jnp.zeros(dense.k.shape[0]))
            out.append(FoldedLayer(tokens=after, state=st, feature_map=fm))
        return tuple(out), FoldState(pstate, tuple(now))
    return update


def _kept_tokens(cache, folded: tuple[bool, ...]) -> tuple:
    """The token layers the wrapped policy sees: a `FoldedLayer`'s kept tokens, else the layer."""
    return tuple(layer.tokens if was else layer for layer, was in zip(cache, folded))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("inner",),
                   meta_fields=("folded",))
@dataclasses.dataclass(frozen=True)
class FoldState:
    """`fold_evicted`'s state: the wrapped policy's state, and per layer whether `fold` has made
    it a `FoldedLayer` (static)."""

    inner: Any
    folded: tuple[bool, ...]


def _tokens_init(init):
    def init_tokens(cache):
        folded = tuple(kind_of(layer) is FoldedLayer for layer in cache)
        return FoldState(init(_kept_tokens(cache, folded)), folded)
    return init_tokens


@functools.lru_cache(maxsize=None)
def fold_evicted(policy: CacheTransform, map: str | FeatureMap = "prf", features: int = 128,
                 seed: int = 0) -> CacheTransform:
    """LESS: `policy` evicts as usual; what it evicts is folded into a per-layer state.

    Every layer becomes a `FoldedLayer` (the kept tokens plus the state);
    attention combines both under one normaliser (`hybrid_attend`). Later
    updates (`compress_every`) run the policy on the kept tokens and fold what
    it evicts then. The state costs `F*D + F + 1` floats per KV head.
    """
    check_map_name(map)
    _check_count("fold", "features", features)
    _check_count("fold", "seed", seed, 0)
    return CacheTransform(_tokens_init(policy.init),
                          _fold_update(policy.update, map, features, seed), policy.stats)


class Fold(NamedTuple):
    """A method-spec part that wraps the parts before it (`snapkv:ratio=0.75+fold:map=prf`)."""

    map: Any
    features: int
    seed: int

    def wrap(self, policy: CacheTransform) -> CacheTransform:
        return fold_evicted(policy, self.map, self.features, self.seed)


def fold(map: str = "prf", features: int = 128, seed: int = 0, layers=None) -> Fold:
    """The `fold` method part: fold what the preceding parts evict into a state (`fold_evicted`).

    `map`: "elu", "prf" (positive random features, `features` of them from
    `seed`) or the directory of learned maps (`kvjax train-state --out DIR`).
    """
    if layers is not None:
        raise ValueError("fold: takes no layers; give layers= to the eviction policy before "
                         "it (every layer's evicted tokens are folded)")
    check_map_name(map)
    _check_count("fold", "features", features)
    _check_count("fold", "seed", seed, 0)
    return Fold(map, features, seed)
