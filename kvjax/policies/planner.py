"""`auto`: a method whose target is a memory budget; it plans eviction and codec per layer
and KV head so that the compressed cache fits the budget, measured with `kvjax.nbytes`.

`auto(budget=F)`: F is a fraction of the bytes of the *bfloat16* uncompressed cache of the
same tokens (keys, values, an int32 position per slot and head, a cursor per layer: what
`kvjax.nbytes` counts for `init_model_cache(..., dtype=bfloat16)`). `auto(bytes=N)`: N bytes
per sequence. A batch's budget is B times one sequence's, for its longest row (the rows of a
batch share one slot axis). The budget holds for what the cache *holds*: the compressed
layers cut to their written slots (`kvjax.shrink(cache, room=0)`).

How it decides (`docs/DECISIONS.md`, "auto: the budget planner"):

1. **Per layer, static** (one compiled program per budget and shape): a codec (int8, int4 or
   int2 per-token codes, group 32, fp16 scale and offset) and a share of the context's
   tokens, chosen by a multiple-choice knapsack over `CONFIGS` that minimises the summed
   predicted damage under the budget. The damage table is the shipped calibration
   (`planner_calibration.json`: each layer's attention-output error per config, measured
   on calibration text by `experiments/eval/calibrate_planner.py`) when it matches the
   model's layer count, else an analytic prior (`prior_damage`). `plan_source()` says which.
2. **Per layer, traced**: the token budget from the bytes. With `fixed_l + slot_l x T_l`
   bytes for a layer of `T_l` pooled slots (measured once from shapes with `nbytes`),
   `T_l = floor(share_l x X)` with the largest X that fits; floors make `nbytes <= budget`.
3. **Per KV head, traced, from the prompt**: the layer's `T_l` slots go to the (head, token)
   pairs with the most attention from the last `window` queries, each head's attention
   normalised to sum to 1 (so the split maximises the attention mass kept, summed over
   heads: a head whose attention is concentrated needs, and gets, fewer tokens than a
   diffuse one); every head keeps at least `alpha x T_l / KVH`; the first `sinks` and the
   last `recent` tokens of every head outrank the rest. The layer then uses the pooled
   (head-wise) layout, as Ada-KV does in kvjax, so per-head counts really save memory.

Every later `update` (`--compress-every`) re-plans for the context grown so far: budgets
grow with it, the codecs stay (a token is never requantized).

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> from kvjax.core.stats import StatsSpec
    >>> t = auto(budget=0.25)
    >>> t.stats == StatsSpec(window=32)
    True
    >>> auto(budget=0.0)
    Traceback (most recent call last):
    ...
    ValueError: auto: budget=0.0 is outside [0.00586, 1]: a fraction of the bfloat16 full cache's bytes; the smallest plan keeps 1/32 of the tokens as int2 codes (3 of bf16's 16 bits per element)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import EMPTY, Cache, TokenCache, init_cache, nbytes, view
from kvjax.core.layout import compact, map_layers, pool_heads
from kvjax.core.selection import rank
from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies import codecs
from kvjax.policies.eviction import window_attention

BITS = (8, 4, 2)
KEEPS = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)
CONFIGS: tuple[tuple[float, int], ...] = tuple((k, b) for b in BITS for k in KEEPS)
"""Candidate (share of the context's tokens kept per head, bits) of one layer."""

MIN_FRACTION = KEEPS[-1] * 3 / 16
"""The smallest budget `auto` takes: 1/32 of the tokens as int2 codes plus an fp16 scale and
offset per 32 channels (2 + 32/32 = 3 bits against bf16's 16)."""

TABLES = ("auto", "learned", "table", "prior")

CALIBRATION = Path(__file__).with_name("planner_calibration.json")
"""Per-layer damage tables measured on calibration text (absent: the analytic prior)."""


# ----------------------------------------------------------------------------- damage tables


def prior_damage(num_layers: int) -> np.ndarray:
    """[L, len(CONFIGS)] predicted damage without calibration: the same for every layer.

    Eviction costs `0.012 (1/keep - 1)`, codes cost 0.001 / 0.06 / 0.3 for 8 / 4 / 2 bits,
    added: the shape of the relative perplexity increases in docs/RESULTS.md
    (SnapKV-0.5 +1%, -0.75 +4.5%, int8 +0%, int4 +6%, KIVI-2 +23%), not fitted to any text.

    Example:
        >>> d = prior_damage(2)
        >>> d.shape, bool(d[0, CONFIGS.index((1.0, 8))] < d[0, CONFIGS.index((0.5, 4))])
        ((2, 18), True)
    """
    quant = {8: 0.001, 4: 0.06, 2: 0.3}
    row = np.array([0.012 * (1 / k - 1) + quant[b] for k, b in CONFIGS])
    return np.tile(row, (num_layers, 1))


@functools.lru_cache(maxsize=None)
def _calibration(path: str) -> dict | None:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


def damage_table(num_layers: int, source: str = "auto") -> tuple[np.ndarray, str]:
    """([L, len(CONFIGS)] damage, where it came from), for `source`:

    * "auto": the learned controller's predictions from the shipped calibration signals when
      both exist for `num_layers` layers, else the measured calibration table, else the prior;
    * "learned" / "table": only that one (else the prior); "prior": the prior.
    """
    if source not in TABLES:
        raise ValueError(f"auto: table must be one of {TABLES}, got {source!r}")
    cal = _calibration(str(CALIBRATION)) if source != "prior" else None
    fits = cal is not None and len(cal["damage"]) == num_layers and \
        [tuple(c) for c in cal["configs"]] == list(CONFIGS)
    params = load_controller(str(CONTROLLER)) if source in ("auto", "learned") else None
    if fits and params is not None and "signals" in cal:
        with jax.ensure_compile_time_eval():  # a constant even when planning under jit
            predicted = np.exp(np.asarray(controller_apply(params, jnp.asarray(cal["signals"]))))
        return predicted.astype(np.float64), \
            f"learned controller on signals of {cal['source']}"
    if fits and source != "learned":
        return np.asarray(cal["damage"], np.float64), f"calibrated table ({cal['source']})"
    return prior_damage(num_layers), "prior (no calibration for this layer count)"


def plan_source(num_layers: int, table: str = "auto") -> str:
    """Which damage table `auto` plans with for a model of `num_layers` layers."""
    return damage_table(num_layers, table)[1]


# ----------------------------------------------------------------------------- bytes


@functools.lru_cache(maxsize=None)
def layer_bytes(batch: int, kv_heads: int, head_dim: int, dtype: str, bits: int) -> tuple[int, int]:
    """(fixed, per pooled slot) bytes of one layer as `auto` stores it: pooled and coded
    with `bits`-bit per-token codes; `nbytes = fixed + per_slot x slots`. Measured with
    `nbytes` on shapes (nothing is allocated).

    Example:
        >>> layer_bytes(1, 3, 64, "float32", 8)   # 64 + 64 code bytes + 4 fp16 params x 2, 3 positions
        (4, 156)
    """
    def coded(slots_per_head):
        layer = pool_heads(init_cache(batch, kv_heads, slots_per_head, head_dim, dtype))
        return _encode(layer, bits)
    one, two = (nbytes(jax.eval_shape(functools.partial(coded, c))) for c in (1, 2))
    per_slot, rem = divmod(two - one, kv_heads)
    if rem:
        raise AssertionError(f"layer bytes not linear in slots: {one}, {two}")
    return one - per_slot * kv_heads, per_slot // batch


def bf16_full_bytes(num_layers: int, batch: int, kv_heads: int, head_dim: int, tokens):
    """`nbytes` of an uncompressed bfloat16 cache of `tokens` per row (works traced).

    Example:
        >>> import kvjax, jax.numpy as jnp
        >>> c = kvjax.init_model_cache(kvjax.CacheSpec(2, 3, 64), 2, 10, jnp.bfloat16)
        >>> bf16_full_bytes(2, 2, 3, 64, 10) == kvjax.nbytes(c)
        True
    """
    return num_layers * (batch * kv_heads * tokens * (4 * head_dim + 4) + 4)


def _group(head_dim: int) -> int:
    return math.gcd(32, head_dim)


def _encode(layer, bits: int):
    t = codecs.quantize(bits=bits, group=_group(layer.head_dim))
    return t.update((layer,), (), None)[0][0]


# ----------------------------------------------------------------------------- the static plan


class LayerChoice(NamedTuple):
    keep: float  # share of the context's tokens per head (before filling the budget)
    bits: int


def knapsack(damage: np.ndarray, cost: np.ndarray, capacity: float) -> tuple[int, ...]:
    """One config per layer (row of `damage` [L, K]) minimising the summed damage with summed
    `cost` [K] <= `capacity`: greedy along each layer's lower convex hull (the Lagrangian
    solution of the multiple-choice knapsack). Starts from the cheapest config.

    Example:
        >>> knapsack(np.array([[1.0, 0.0], [1.0, 0.5]]), np.array([1.0, 2.0]), 3.0)
        (1, 0)
    """
    num_layers, _ = damage.shape
    cheapest = int(np.argmin(cost))
    choice = [cheapest] * num_layers
    used = cost[cheapest] * num_layers
    moves = []  # (damage saved per cost, layer, from, to) along each layer's hull
    for layer in range(num_layers):
        hull = _lower_hull(cost, damage[layer])
        for a, b in zip(hull, hull[1:]):
            slope = (damage[layer, a] - damage[layer, b]) / (cost[b] - cost[a])
            moves.append((-slope, layer, a, b))
    for _, layer, a, b in sorted(moves):
        if choice[layer] != a:
            continue
        if used + cost[b] - cost[a] <= capacity + 1e-12:
            used += cost[b] - cost[a]
            choice[layer] = b
    return tuple(choice)


def _lower_hull(cost: np.ndarray, damage: np.ndarray) -> list[int]:
    """Config indices on the lower-left convex hull of (cost, damage), by rising cost."""
    order = sorted(range(len(cost)), key=lambda i: (cost[i], damage[i]))
    hull: list[int] = []
    for i in order:
        if hull and damage[i] >= damage[hull[-1]]:
            continue  # costs more, does no better
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            cross = (cost[b] - cost[a]) * (damage[i] - damage[a]) - \
                (damage[b] - damage[a]) * (cost[i] - cost[a])
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


@functools.lru_cache(maxsize=None)
def static_plan(fraction: float, num_layers: int, kv_heads: int, head_dim: int,
                table: str = "auto") -> tuple[LayerChoice, ...]:
    """The per-layer (keep share, bits) for a budget of `fraction` of the bf16 full cache.

    Example:
        >>> plan = static_plan(0.25, 4, 3, 64, "prior")
        >>> len(plan), all(c.bits in BITS for c in plan)
        (4, True)
    """
    damage, _ = damage_table(num_layers, table)
    per_token = 4 * head_dim + 4  # a bf16 head-token: k, v and its position
    slot = {b: layer_bytes(1, kv_heads, head_dim, "float32", b)[1] for b in BITS}
    cost = np.array([k * slot[b] / per_token for k, b in CONFIGS])
    picks = knapsack(damage, cost, fraction * num_layers)
    return tuple(LayerChoice(*CONFIGS[i]) for i in picks)


# ----------------------------------------------------------------------------- the transform


class AutoState(NamedTuple):
    """What the last plan decided (for `kvjax inspect` and the eval rows)."""

    layer_slots: jax.Array  # [L] int32 pooled slots per row allowed in each layer
    head_kept: jax.Array  # [L, B, KVH] int32 tokens each head kept
    head_entropy: jax.Array  # [L, B, KVH] float32 entropy (nats) of its window attention
    budget_bytes: jax.Array  # [] float32 the batch's budget at the last update


def _init_state(cache: Cache) -> AutoState:
    b, kvh = cache[0].batch, cache[0].kv_heads
    n = len(cache)
    return AutoState(jnp.zeros((n,), jnp.int32), jnp.zeros((n, b, kvh), jnp.int32),
                     jnp.zeros((n, b, kvh), jnp.float32), jnp.zeros((), jnp.float32))


def head_signals(layer: TokenCache, stats, window: int) -> tuple[jax.Array, jax.Array]:
    """(scores [B, KVH, C], entropy [B, KVH]) of a pooled, dense view of a layer: each head's
    window attention (mean over its query heads and the window), normalised to sum to 1 over
    its own tokens, and that distribution's entropy."""
    attn = window_attention(layer, stats, window).mean(axis=2)  # [B, KVH, C]
    valid = layer.pos != EMPTY
    attn = jnp.where(valid, attn, 0.0)
    total = attn.sum(axis=-1, keepdims=True)
    p = attn / jnp.maximum(total, 1e-30)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-30)), 0.0), axis=-1)
    return p, entropy


def headwise_keep(scores: jax.Array, valid: jax.Array, protect: jax.Array, slots: jax.Array,
                  alpha: float) -> jax.Array:
    """[B, KVH, C] keep mask: at most `slots` (traced scalar) per batch row over all heads:
    protected slots first, then each head's `floor(alpha x slots / KVH)` best, then the best
    scores across heads.

    Example:
        >>> s = jnp.array([[[0.9, 0.05, 0.05, 0.0], [0.3, 0.3, 0.2, 0.2]]])  # peaked, flat
        >>> v = jnp.ones(s.shape, bool)
        >>> headwise_keep(s, v, ~v, jnp.int32(4), 0.0).sum(-1).tolist()
        [[1, 3]]
    """
    b, kvh, c = scores.shape
    big = jnp.finfo(jnp.float32).max
    s = jnp.where(protect, jnp.inf, jnp.minimum(scores.astype(jnp.float32), big))
    safe = jnp.floor(alpha * slots / kvh).astype(jnp.int32)
    s = jnp.where(rank(s, valid) < safe, jnp.inf, s)
    flat = rank(s.reshape(b, kvh * c), valid.reshape(b, kvh * c)).reshape(b, kvh, c)
    return (flat < slots) & valid


@dataclasses.dataclass(frozen=True)
class AutoUpdate:
    """`auto`'s update; equal fields = one compilation."""

    fraction: float | None  # of the bf16 full cache, or None with `per_sequence`
    per_sequence: int | None  # bytes per sequence
    context: int = 1024  # with `per_sequence`: the context the codecs are planned for
    window: int = 32
    sinks: int = 4
    recent: int = 8
    alpha: float = 0.2
    table: str = "auto"

    def plan_fraction(self, num_layers: int, kv_heads: int, head_dim: int) -> float:
        """The fraction the static (codec) plan is made for: F, or N over the bf16 bytes
        of `context` tokens."""
        if self.fraction is not None:
            return self.fraction
        full = bf16_full_bytes(num_layers, 1, kv_heads, head_dim, self.context)
        return min(1.0, max(MIN_FRACTION, self.per_sequence / full))

    def plan(self, cache: Cache) -> tuple[LayerChoice, ...]:
        first = cache[0]
        fraction = self.plan_fraction(len(cache), first.kv_heads, first.head_dim)
        return static_plan(fraction, len(cache), first.kv_heads, first.head_dim, self.table)

    def __call__(self, cache: Cache, state: AutoState, stats=None):
        first = cache[0]
        num_layers, b, kvh, d = len(cache), first.batch, first.kv_heads, first.head_dim
        dtype = str(view(first).k.dtype)
        plan = self.plan(cache)
        fixed, slot = zip(*(layer_bytes(b, kvh, d, dtype, c.bits) for c in plan))
        n_ctx = (jnp.max(first.pos) + 1).astype(jnp.float32)  # [] the longest row's context
        if self.per_sequence is not None:
            budget = jnp.float32(self.per_sequence * b)
        else:
            budget = self.fraction * bf16_full_bytes(num_layers, b, kvh, d, n_ctx)
        if self.per_sequence is not None and self.per_sequence * b < sum(fixed):
            raise ValueError(f"auto: bytes={self.per_sequence} is below the cache's fixed "
                             f"{sum(fixed) / b:.0f} bytes per sequence (cursors) for this model")
        shares = np.array([c.keep * kvh for c in plan])  # slots per context token
        per_x = b * float(np.dot(shares, slot))  # bytes per unit of X
        x = (budget - sum(fixed)) / per_x * (1 - 2 ** -20)  # margin for float32 rounding
        x = jnp.maximum(x, 0.0)
        slots = [jnp.clip(jnp.floor(s * x), 0, kvh * n_ctx).astype(jnp.int32) for s in shares]
        stats = stats if stats is not None else (None,) * num_layers
        out = [None] * num_layers
        for bits in sorted({c.bits for c in plan}):  # one compiled layer body per codec
            members = [i for i, c in enumerate(plan) if c.bits == bits]
            done = map_layers(functools.partial(self._layer, choice=LayerChoice(1.0, bits)),
                              *([xs[i] for i in members] for xs in (cache, stats, slots)))
            for i, result in zip(members, done):
                out[i] = result
        layers, kept, entropy = zip(*out)
        return tuple(layers), AutoState(jnp.stack(slots), jnp.stack(kept), jnp.stack(entropy),
                                        jnp.asarray(budget, jnp.float32))

    def _layer(self, layer, stats, slots, choice: LayerChoice):
        layer = pool_heads(layer)
        seen = view(layer)
        scores, entropy = head_signals(seen, stats, self.window)
        valid = seen.pos != EMPTY
        order = rank(seen.pos.astype(jnp.float32), valid)  # 0 = the latest token
        first = rank(-seen.pos.astype(jnp.float32), valid)  # 0 = the earliest
        protect = valid & ((order < self.recent) | (first < self.sinks))
        keep = headwise_keep(scores, valid, protect, slots, self.alpha)
        layer = _encode(compact(layer, keep), choice.bits)
        return layer, keep.sum(axis=-1).astype(jnp.int32), entropy


# ----------------------------------------------------------------------------- calibration


@functools.partial(jax.jit, static_argnames=("keep", "bits", "window"))
def config_damage(layer: TokenCache, select_stats, eval_q: jax.Array, eval_pos: jax.Array,
                  keep: float, bits: int, window: int = 32) -> jax.Array:
    """[] relative squared error of a layer's attention output when `auto` stores it with
    (`keep` share of its tokens, `bits`), for queries the selection never saw.

    `layer`: a dense layer (the prefix); `select_stats`: its statistics with the last
    `window` queries of the prefix (what `auto` selects with); `eval_q` [B, T, H, D],
    `eval_pos` [B, T]: later queries (the continuation's), which score the damage:
    `|o_auto - o_full|^2 / |o_full|^2` summed over them. What
    `experiments/eval/calibrate_planner.py` measures per layer and config on calibration text.
    """
    from kvjax.core.attention import attend_reference
    n = jnp.max(jnp.sum(layer.pos != EMPTY, axis=-1))
    slots = jnp.floor(keep * layer.kv_heads * n).astype(jnp.int32)
    update = AutoUpdate(1.0, None, window=window)
    small, _, _ = update._layer(layer, select_stats, slots, LayerChoice(keep, bits))
    full_out = attend_reference(eval_q, eval_pos, layer)
    out = attend_reference(eval_q, eval_pos, small)
    return jnp.sum((out - full_out) ** 2) / jnp.maximum(jnp.sum(full_out ** 2), 1e-30)


SIGNALS = ("keep", "bits/8", "attention mass lost", "entropy / log n",
           "key error", "value error")
"""What the learned controller reads per (layer, config), all measured on the prompt."""


@functools.partial(jax.jit, static_argnames=("keep", "bits", "window"))
def config_signals(layer: TokenCache, select_stats, keep: float, bits: int,
                   window: int = 32) -> jax.Array:
    """[len(SIGNALS)] float32 signals of storing a dense `layer` with (`keep`, `bits`): the
    share of window attention the kept tokens would lose (mean over heads), the heads' mean
    attention entropy over log n, and the relative squared error of the keys and of the
    values under `bits`-bit per-token codes."""
    scores, entropy = head_signals(layer, select_stats, window)  # [B, KVH, C]
    valid = layer.pos != EMPTY
    n = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)  # [B, KVH, 1]
    top = rank(scores, valid) < jnp.floor(keep * n)
    lost = 1 - jnp.sum(jnp.where(top, scores, 0.0), axis=-1)  # [B, KVH]
    coded = view(_encode(layer, bits))
    rel = lambda x, y: jnp.sum((x - y) ** 2) / jnp.maximum(jnp.sum(y ** 2), 1e-30)
    return jnp.stack([jnp.float32(keep), jnp.float32(bits / 8), lost.mean(),
                      (entropy / jnp.log(jnp.maximum(n[..., 0], 2))).mean(),
                      rel(coded.k, layer.k), rel(coded.v, layer.v)]).astype(jnp.float32)


CONTROLLER = Path(__file__).with_name("planner_controller")
"""The learned controller's parameters (an orbax checkpoint; absent: no controller)."""


def controller_apply(params: dict, signals: jax.Array) -> jax.Array:
    """Predicted log-damage [...] from signals [..., len(SIGNALS)]: a two-layer tanh MLP.

    Example:
        >>> p = {"w1": jnp.zeros((6, 4)), "b1": jnp.zeros(4), "w2": jnp.zeros((4, 1)),
        ...      "b2": jnp.ones(1), "mean": jnp.zeros(6), "scale": jnp.ones(6)}
        >>> controller_apply(p, jnp.ones((3, 6))).tolist()
        [1.0, 1.0, 1.0]
    """
    x = (signals - params["mean"]) / params["scale"]
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"])[..., 0]


@functools.lru_cache(maxsize=None)
def load_controller(path: str) -> dict | None:
    """The controller's parameters saved by `experiments/eval/train_planner.py` (orbax), or
    None when there are none."""
    if not Path(path).is_dir():
        return None
    import orbax.checkpoint as ocp
    restored = ocp.StandardCheckpointer().restore(Path(path).absolute())
    return {k: np.asarray(v) for k, v in restored.items()}


def auto(budget: float | None = None, bytes: int | None = None, context: int = 1024,
         window: int = 32, sinks: int = 4, recent: int = 8, alpha: float = 0.2,
         table: str = "auto") -> CacheTransform:
    """A cache that fits a memory budget: eviction and codes planned per layer and KV head.

    Args:
      budget: F in (0, 1]: the fraction of the bf16 full cache's bytes for the same tokens.
      bytes: N, a budget in bytes per sequence instead (exactly one of the two).
      context: with `bytes`, the context length the per-layer codecs are planned for
        (the token counts always follow the real context).
      window: the last `window` queries score the tokens (their attention).
      sinks, recent: the first and the last tokens of every head, kept before the rest.
      alpha: each head keeps at least `alpha` of an equal share of its layer's slots.
      table: where per-layer damage comes from (`damage_table`): "auto" (the learned
        controller, else the calibration table, else the prior), "learned", "table", "prior".

    Example:
        >>> auto(bytes=0)
        Traceback (most recent call last):
        ...
        ValueError: auto: bytes=0 must be a positive int (bytes per sequence)
    """
    if (budget is None) == (bytes is None):
        raise ValueError(f"auto: give exactly one of budget=F (a fraction of the bf16 full "
                         f"cache, in [{MIN_FRACTION:.3g}, 1]) or bytes=N (bytes per sequence); "
                         f"got budget={budget}, bytes={bytes}")
    if budget is not None:
        ok = isinstance(budget, (int, float)) and not isinstance(budget, bool) and \
            math.isfinite(budget)
        if not ok or not MIN_FRACTION <= budget <= 1:
            raise ValueError(f"auto: budget={budget!r} is outside [{MIN_FRACTION:.3g}, 1]: a "
                             f"fraction of the bfloat16 full cache's bytes; the smallest plan "
                             f"keeps 1/32 of the tokens as int2 codes (3 of bf16's 16 bits "
                             f"per element)")
    if bytes is not None and (isinstance(bytes, bool) or not isinstance(bytes, int)
                              or bytes < 1):
        raise ValueError(f"auto: bytes={bytes!r} must be a positive int (bytes per sequence)")
    for name, value, low in (("context", context, 1), ("window", window, 1),
                             ("sinks", sinks, 0), ("recent", recent, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"auto: {name}={value!r} must be an int >= {low}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"auto: alpha={alpha!r} must be a number in [0, 1]")
    if table not in TABLES:
        raise ValueError(f"auto: table={table!r} must be one of {', '.join(TABLES)}")
    update = AutoUpdate(None if budget is None else float(budget), bytes, context,
                        window, sinks, recent, float(alpha), table)
    return CacheTransform(_init_state, update, StatsSpec(window=window))
