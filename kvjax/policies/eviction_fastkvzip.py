"""Fast KVzip (kvpress FastKVzipPress; Kim, Han, Yun 2026, https://arxiv.org/abs/2601.17668):
a small gate per layer predicts each token's KVzip score from its attention input, and
KVzip's rule evicts by the predictions.

KVzip (`kvzip`) scores a context by running the model over it a second time. Fast KVzip
learns that score once per model: per layer and KV head a "sink attention" gate reads the
token's attention input `h` (after the input norm), makes from it `G` queries and one key of
width `dim` (linear maps, then an RMSNorm each), and scores the token by how much its own key
wins against `sink` learned keys:

    logit_g = <k, q_g> / sqrt(dim) + b_g,   base_{s,g} = <k_base_s, q_g> / sqrt(dim)
    score   = mean_g  1 / (1 + sum_s exp(base_{s,g} - logit_g))            (in (0, 1))

The model evaluates the gates as tokens enter (`StatsSpec(token_scores=...)`, as KVzap's
surrogate), so the scores cost two small matmuls per token and no second pass. After
prefill, the first `n_sink` tokens and the newest `max(1, floor(T * window_ratio))` (T below
32,000; `window_size` from there) score 1, and the lowest-scored `floor(L * KVH * T * ratio)`
tokens of all layers and KV heads together go (`layerwise`: per layer), exactly KVzip's
selection (`eviction_kvzip.kvzip_keep`), so budgets differ by layer and head (pooled rows).

The gates score decode tokens as they enter too, which is the paper's point (its decoding
benchmarks, `math/method/compression/fastkvzip.py`): with `compress_every` every later
update evicts the lowest-scored tokens of every layer and KV head until the row is back at
the total the prompt's compression left (newest window and sinks kept), so the cache stays
at its budget while it decodes. kvpress compresses the prompt only.

The gates are a `FastKVzipGates`, saved and read with orbax. kvpress downloads the paper's
(`Jang-Hyun/Fast-KVzip`, for a few large models); `kvjax calibrate --fastkvzip --out DIR`
trains them for any model kvjax loads, as the paper does: KVzip's scores of real text as
targets, binary cross-entropy, SGD with momentum (optax).

Example:
    >>> g = FastKVzipGates.initial(num_layers=2, hidden_size=8, kv_heads=1, groups=2, dim=4,
    ...                            sink=3)
    >>> params = g.layer_params(0)
    >>> s = g.apply(params, jnp.zeros((1, 5, 8)))   # [B, T, KVH]; a zero input has a zero key:
    >>> [round(x, 4) for x in s[0, :, 0].tolist()]   # every logit 0, so 1 / (1 + 3 sinks)
    [0.25, 0.25, 0.25, 0.25, 0.25]
    >>> fastkvzip(ratio=0.5, gates=g).stats.token_scores is g
    True
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import EMPTY, Cache
from kvjax.core.layer import is_plain
from kvjax.core.layout import compact, map_layers
from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import _check_bool, check_int, check_real
from kvjax.policies.eviction_kvzap import LayerScorer, check_training_shapes, restore_arrays
from kvjax.policies.eviction_kvzip import _evict, drop_lowest, stacked_slot_scores

FIELDS = ("q_proj", "q_bias", "k_proj", "q_norm", "k_norm", "k_base", "bias")
LONG_CONTEXT = 32_000  # from this many tokens on, the protected window is `window_size`


@dataclasses.dataclass(frozen=True, eq=False)
class FastKVzipGates(LayerScorer):
    """Per-layer gate weights stacked over layers (float32; kvpress `FastKVzipGate`'s, with
    torch's Linear weights transposed). Hashed by content: it keys compilation through
    `StatsSpec.token_scores`."""

    q_proj: np.ndarray  # [L, hidden, KVH*G*dim]
    q_bias: np.ndarray  # [L, KVH*G*dim]
    k_proj: np.ndarray  # [L, hidden, KVH*dim]
    q_norm: np.ndarray  # [L, dim] RMSNorm weights
    k_norm: np.ndarray  # [L, dim]
    k_base: np.ndarray  # [L, KVH, sink, dim] the learned sink keys
    bias: np.ndarray  # [L, KVH, G]
    eps: float = 1e-6  # the RMSNorms' (Qwen3RMSNorm's default)

    METHOD = "fastkvzip"
    ARTIFACT = "gates"

    def __post_init__(self):
        for name in FIELDS:
            a = getattr(self, name)
            if not (isinstance(a, np.ndarray) and a.dtype == np.float32):
                raise ValueError(f"FastKVzipGates: {name} must be a float32 numpy array, got "
                                 f"{type(a).__name__} {getattr(a, 'dtype', '')}")
        if self.k_base.ndim != 4 or self.bias.ndim != 3 or 0 in self.k_base.shape:
            raise ValueError(f"FastKVzipGates: k_base [L, KVH, sink, dim] and bias [L, KVH, G] "
                             f"expected, got {self.k_base.shape} and {self.bias.shape}")
        layers, kvh, _, dim = self.k_base.shape
        g, hidden = self.bias.shape[-1], self.q_proj.shape[1] if self.q_proj.ndim == 3 else 0
        want = {"q_proj": (layers, hidden, kvh * g * dim), "q_bias": (layers, kvh * g * dim),
                "k_proj": (layers, hidden, kvh * dim), "q_norm": (layers, dim),
                "k_norm": (layers, dim), "bias": (layers, kvh, g)}
        for name, shape in want.items():
            if getattr(self, name).shape != shape or 0 in shape:
                raise ValueError(f"FastKVzipGates: {name} has shape {getattr(self, name).shape}, "
                                 f"expected {shape} (k_base [L, KVH, sink, dim], bias "
                                 f"[L, KVH, G] and q_proj [L, hidden, .] set the sizes)")
        for name in FIELDS:
            if not np.isfinite(getattr(self, name)).all():
                raise ValueError(f"FastKVzipGates: {name} is not all finite")
        check_real("FastKVzipGates", "eps", self.eps, 0.0)

    @classmethod
    def initial(cls, num_layers: int, hidden_size: int, kv_heads: int, groups: int,
                dim: int = 16, sink: int = 16, seed: int = 0) -> "FastKVzipGates":
        """Untrained gates as the paper initialises them: torch Linear's uniform projections,
        unit norms, zero sink keys and biases."""
        rng = np.random.default_rng(seed)
        bound = 1 / math.sqrt(hidden_size)
        uniform = lambda *shape: rng.uniform(-bound, bound, shape).astype(np.float32)
        zeros = lambda *shape: np.zeros(shape, np.float32)
        return cls(q_proj=uniform(num_layers, hidden_size, kv_heads * groups * dim),
                   q_bias=uniform(num_layers, kv_heads * groups * dim),
                   k_proj=uniform(num_layers, hidden_size, kv_heads * dim),
                   q_norm=np.ones((num_layers, dim), np.float32),
                   k_norm=np.ones((num_layers, dim), np.float32),
                   k_base=zeros(num_layers, kv_heads, sink, dim),
                   bias=zeros(num_layers, kv_heads, groups))

    @property
    def num_layers(self) -> int:
        return self.k_base.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.q_proj.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k_base.shape[1]

    def layer_params(self, index: int) -> dict[str, jax.Array]:
        """Layer `index`'s weights (they ride in `LayerStats.scorer`)."""
        return {n: jnp.asarray(getattr(self, n)[index]) for n in FIELDS}

    def apply(self, params: dict[str, jax.Array], inputs: jax.Array) -> jax.Array:
        """[..., hidden] attention inputs -> [..., KVH] float32 gate scores in (0, 1)."""
        return gate_scores(params, inputs, self.eps)

    def save(self, path: str | os.PathLike) -> None:
        """Write the gates as an orbax checkpoint at `path` (a new directory)."""
        self.save_arrays(path, {n: getattr(self, n) for n in FIELDS} |
                         {"eps": np.float64(self.eps)})


def gate_scores(params: dict[str, jax.Array], inputs: jax.Array, eps: float) -> jax.Array:
    """The gate of one layer (kvpress `FastKVzipGate.forward`): [..., hidden] -> [..., KVH]."""
    hi = jax.lax.Precision.HIGHEST
    kvh, _, dim = params["k_base"].shape
    g = params["bias"].shape[-1]
    x = inputs.astype(jnp.float32)
    rms = lambda v, w: v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + eps) * w
    q = jnp.matmul(x, params["q_proj"], precision=hi) + params["q_bias"]
    q = rms(q.reshape(*x.shape[:-1], kvh, g, dim), params["q_norm"])  # [..., KVH, G, dim]
    k = jnp.matmul(x, params["k_proj"], precision=hi)
    k = rms(k.reshape(*x.shape[:-1], kvh, 1, dim), params["k_norm"])  # [..., KVH, 1, dim]
    scale = 1 / math.sqrt(dim)
    logit = jnp.sum(k * q, -1) * scale + params["bias"]  # [..., KVH, G]
    base = jnp.einsum("...hgd,hsd->...hsg", q, params["k_base"], precision=hi) * scale
    score = 1 / (1 + jnp.sum(jnp.exp(base - logit[..., None, :]), -2))  # [..., KVH, G]
    return score.mean(-1)


def load_fastkvzip(path: str | os.PathLike) -> FastKVzipGates:
    """The `FastKVzipGates` saved at `path` (`FastKVzipGates.save`, `kvjax calibrate
    --fastkvzip`); a ValueError naming the path when it is not such a checkpoint."""
    restored = restore_arrays(path, "fastkvzip", "gates")
    if set(restored) != set(FIELDS) | {"eps"}:
        raise ValueError(f"fastkvzip: gates={str(path)!r} holds {sorted(restored)}, not "
                         f"{', '.join(FIELDS)} and eps")
    return FastKVzipGates(**{k: np.asarray(restored[k], np.float32) for k in FIELDS},
                          eps=float(restored["eps"]))


def protect_window(scores: jax.Array, pos: jax.Array, window_size: int,
                   window_ratio: float) -> jax.Array:
    """`scores` [L, B, KVH, C] with each row's newest `max(1, floor(T * window_ratio))`
    positions (T: the row's tokens so far, its largest position + 1; from 32,000 tokens on,
    `window_size`) set to 1, the gate's largest score (kvpress `FastKVzipPress._score_fast`).

    Example:
        >>> pos = jnp.arange(6).reshape(1, 1, 1, 6)
        >>> protect_window(jnp.zeros((1, 1, 1, 6)), pos, 4096, 0.34)[0, 0, 0].tolist()
        [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    """
    tokens = jnp.max(pos, axis=(0, 2, 3)) + 1  # [B]
    short = jnp.maximum(1, jnp.floor(tokens * window_ratio).astype(jnp.int32))
    window = jnp.where(tokens < LONG_CONTEXT, short, window_size)
    newest = pos >= (tokens - window)[None, :, None, None]
    return jnp.where(newest & (pos != EMPTY), 1.0, scores)


class FastKVzipState(NamedTuple):
    """`fastkvzip`'s state: the ratio, and the budget the first update left."""

    ratio: jax.Array  # [] float32 fraction of the prompt's tokens evicted
    kept: jax.Array  # [L, B] int32 tokens of layer l, row b (all KV heads) after the first
    #                  update; -1 before it


def slot_scores_of(cache: Cache, stats) -> tuple[jax.Array, jax.Array]:
    """(positions, gate scores) [L, B, KVH, C] of every slot, per-head or pooled rows (C the
    widest layer's slots, the others' padded with EMPTY); a ValueError when the statistics
    hold no gate scores or a layer is not a plain token cache."""
    if stats is None or any(s is None or s.scorer is None for s in stats):
        raise ValueError("fastkvzip scores tokens as the model runs them (its gates, "
                         "StatsSpec.token_scores): these statistics have no such scores; "
                         "run it through the sampler (models.sampler)")
    for i, layer in enumerate(cache):
        if not is_plain(layer):
            raise ValueError(f"fastkvzip: layer {i} is not a plain token cache (a codec's before "
                             f"it in the chain); fastkvzip ranks the tokens themselves")
    return stacked_slot_scores(cache, stats)


@dataclasses.dataclass(frozen=True)
class FastKVzipUpdate:
    """`fastkvzip`'s update: the gates' scores, the window protected, ranked as KVzip's.

    First update (after prefill): the lowest `floor(N * ratio)` of the N tokens of every layer
    and KV head go (kvpress's rule). Every later one (`compress_every`, the paper's decoding
    rule): the tokens written since are scored by the gates as they entered, and the lowest go
    until the row holds the first update's total again, over every layer and KV head
    together (`layerwise`: each layer back to its own total)."""

    n_sink: int = 4
    layerwise: bool = False
    window_size: int = 4096
    window_ratio: float = 0.02

    def __call__(self, cache: Cache, state: FastKVzipState, stats=None):
        pos, scores = slot_scores_of(cache, stats)
        scores = protect_window(scores, pos, self.window_size, self.window_ratio)
        scores = jnp.where(pos < self.n_sink, jnp.inf, scores)
        valid = pos != EMPTY
        held = jnp.sum(valid, axis=(2, 3))  # [L, B]
        first = state.kept < 0  # [L, B]: no update yet
        if not self.layerwise:
            held, first, kept = held.sum(0), first[0], state.kept.sum(0)  # [B]
        else:
            kept = state.kept
        by_ratio = jnp.floor(held.astype(jnp.float32) * state.ratio).astype(jnp.int32)
        keep = drop_lowest(scores, valid, jnp.where(first, by_ratio,
                                                    jnp.maximum(held - kept, 0)))
        evict = lambda layer, k: compact(layer, k) if layer.pooled else _evict(layer, k)
        keep = tuple(k[..., :layer.pos.shape[-1]] for k, layer in zip(keep, cache))
        out = map_layers(evict, tuple(cache), keep)
        now = jnp.stack([jnp.sum(k, axis=(1, 2)) for k in keep]).astype(jnp.int32)  # [L, B]
        return out, state._replace(kept=jnp.where(state.kept < 0, now, state.kept))


def fastkvzip(ratio: float | None = None,
              gates: str | os.PathLike | FastKVzipGates | None = None, n_sink: int = 4,
              layerwise: bool = False, window_size: int = 4096,
              window_ratio: float = 0.02) -> CacheTransform:
    """Fast KVzip: evict the tokens whose gate-predicted KVzip scores are lowest, over every
    layer and KV head together (`layerwise`: per layer); kvpress
    `FastKVzipPress(compression_ratio=ratio, layerwise, n_sink, window_size, window_ratio)`.

    `gates`: a `FastKVzipGates` or the orbax directory `kvjax calibrate --fastkvzip --out DIR`
    writes (made for the model it runs with: checked when the statistics are made). With
    `compress_every` it also compresses while decoding, as the paper's decoding rule does
    (kvpress compresses the prompt only): each new token is scored by the gates as it enters,
    and every update evicts the lowest-scored tokens of all layers and KV heads until the
    cache holds what the prompt's compression left (`FastKVzipUpdate`).
    """
    check_real("fastkvzip", "ratio", ratio, 0.0, 1.0, high_open=True)
    check_int("fastkvzip", "n_sink", n_sink, 0)
    check_int("fastkvzip", "window_size", window_size)
    check_real("fastkvzip", "window_ratio", window_ratio, 0.0, 1.0)
    _check_bool("fastkvzip", "layerwise", layerwise)
    if gates is None:
        raise ValueError("fastkvzip: needs gates=DIR, the gates that `kvjax calibrate "
                         "--fastkvzip --out DIR` trains for the model")
    gates = gates if isinstance(gates, FastKVzipGates) else load_fastkvzip(gates)
    init = lambda cache: FastKVzipState(jnp.float32(ratio),
                                        jnp.full((len(cache), cache[0].batch), -1, jnp.int32))
    return CacheTransform(init, FastKVzipUpdate(n_sink, layerwise, window_size, window_ratio),
                          StatsSpec(token_scores=gates))


# ----------------------------------------------------------------------------- training


def fit_gates(inputs: np.ndarray, targets: np.ndarray, groups: int, dim: int = 16,
              sink: int = 16, steps: int = 500, lr: float = 0.2, batch: int = 1000,
              seed: int = 0) -> FastKVzipGates:
    """Gates trained on KVzip's scores as the paper's `optim.py` does: binary cross-entropy
    between the gate's score and the target score (in [0, 1]), averaged over tokens and summed
    over KV heads and layers, SGD with momentum 0.9 (optax), the learning rate warmed up over
    the first 1% of `steps`, halved at 50% and again at 75%; shuffled batches.

    `inputs` [N, L, hidden] attention inputs, `targets` [N, L, KVH] KVzip scores; `groups`:
    queries per KV head (the paper: the model's query heads per KV head). The paper runs 5,000
    steps over millions of tokens; the default 500 suit `kvjax calibrate --fastkvzip`'s ~10^4
    (about 70 passes over them)."""
    import optax

    check_training_shapes("fit_gates", inputs, targets)
    if not (np.isfinite(inputs).all() and ((targets >= 0) & (targets <= 1)).all()):
        raise ValueError("fit_gates: inputs must be finite and targets KVzip scores in [0, 1]")
    for arg, value in (("groups", groups), ("dim", dim), ("sink", sink), ("steps", steps),
                       ("batch", batch)):
        check_int("fit_gates", arg, value)
    check_real("fit_gates", "lr", lr, 1e-12)
    n, layers, hidden = inputs.shape
    start = FastKVzipGates.initial(layers, hidden, targets.shape[-1], groups, dim, sink, seed)
    params = {k: jnp.asarray(getattr(start, k)) for k in FIELDS}
    warmup = max(steps // 100, 1)
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr),
         optax.constant_schedule(lr / 2), optax.constant_schedule(lr / 4)],
        [warmup, steps // 2, 3 * steps // 4])
    opt = optax.sgd(schedule, momentum=0.9)
    state = opt.init(params)
    per_layer = jax.vmap(lambda p, x: gate_scores(p, x, start.eps), in_axes=(0, 1), out_axes=1)

    def loss_fn(p, x, y):  # [B, L, KVH] scores: binary cross-entropy, torch's log clamp
        s = per_layer(p, x)
        log = lambda v: jnp.maximum(jnp.log(v), -100.0)
        bce = -(y * log(s) + (1 - y) * log(1 - s))
        return bce.mean(0).sum()

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    x_all, y_all = jnp.asarray(inputs, jnp.float32), jnp.asarray(targets, jnp.float32)
    rng = np.random.default_rng(seed)
    batch = min(batch, n)
    order = rng.permutation(n)
    for i in range(steps):
        split = i % (n // batch)
        if split == 0 and i:
            order = rng.permutation(n)
        take = order[split * batch:(split + 1) * batch]
        params, state, _ = step(params, state, x_all[take], y_all[take])
    return FastKVzipGates(**{k: np.asarray(v, np.float32) for k, v in params.items()},
                          eps=start.eps)
