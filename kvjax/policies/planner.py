"""`auto`: a method whose target is a memory budget; it plans eviction and codec per layer
and KV head so that the compressed cache fits the budget, measured with `kvjax.nbytes`.

`auto(budget=F)`: F is a fraction of the bytes of the *bfloat16* uncompressed cache of the
same tokens (keys, values, an int32 position per slot and head, a cursor per layer: what
`kvjax.nbytes` counts for `init_model_cache(..., dtype=bfloat16)`). `auto(bytes=N)`: N bytes
per sequence. A batch's budget is B times one sequence's, for its longest row (the rows of a
batch share one slot axis). The budget holds for what the cache *holds*: the compressed
layers cut to their written slots (`kvjax.shrink(cache, room=0)`).

How it decides (`docs/DECISIONS.md`, "auto: the budget planner"):

1. **Per layer, static** (one compiled program per budget and shape): a share of the
   context's tokens, the bits (8, 4 or 2; group 32, fp16 scale and offset) and the key
   coding: per-token (keys like values) or per-channel (KIVI's keys: each channel over
   groups of 32 tokens). A multiple-choice knapsack over `CONFIGS` minimises the summed
   predicted damage under the budget, from calibration tables measured on calibration text
   by `experiments/eval/calibrate_planner.py`: the shipped ones (`planner_calibration.json`,
   SmolLM2-135M's) for a model of their shape, or the user's own model's (`calibration=`):
   each layer's damage end to end (the KL of the model's next-token distributions with that
   layer alone stored so), else its attention-output error, else a learned controller's
   prediction from the calibration's signals; without tables, an analytic prior
   (`prior_damage`). `plan_source()` says which.
2. **Per layer, traced**: the head-slots from the bytes. With `fixed_l + slot_l x T_l` bytes
   for `T_l` coded head-slots (measured once from shapes with `nbytes`),
   `T_l = floor(share_l x X)` with the largest X that fits; floors make `nbytes <= budget`.
3. **Per KV head, traced, from the prompt**: tokens ranked by `score` (default the mean of
   the attention future queries are expected to pay, ExpectedAttention's, and the attention
   the last `window` queries paid, SnapKV's; or either alone), each head's scores
   normalised to sum to 1; the first `sinks` and last `recent` tokens of
   every head outrank the rest. A per-token layer is pooled (head-wise, as Ada-KV in kvjax)
   and its `T_l` slots go to the best (head, token) pairs, every head keeping at least
   `alpha x T_l / KVH`: a head whose attention is concentrated gets fewer. A per-channel
   layer keeps per-head rows, the same count per head, coded in whole groups of 32 tokens;
   the bytes a group would not fill buy a few more tokens kept exact (`channel_keep`).

Every later `update` (`--compress-every`) re-plans for the context grown so far: budgets
grow with it, the codecs stay (a token is never requantized; a per-channel layer's coded
groups stay and its new tokens are kept exact while the bytes last, coded as groups fill).

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> from kvjax.core.stats import StatsSpec
    >>> t = auto(budget=0.25)
    >>> t.stats == StatsSpec(window=32, query_moments=True, moments_skip=4)
    True
    >>> auto(budget=0.0)
    Traceback (most recent call last):
    ...
    ValueError: auto: budget=0.0 is outside [0.00586, 1]: a fraction of the bfloat16 full cache's bytes; the smallest plan keeps 1/32 of the tokens as int2 codes (3 of bf16's 16 bits per element)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import EMPTY, Cache, TokenCache, init_cache, nbytes, view
from kvjax.core.layer import has_exact_part
from kvjax.core.layout import compact, map_layers, pool_heads
from kvjax.core.selection import rank
from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies import codecs
from kvjax.policies.eviction import ExpectedAttentionScorer, window_attention

BITS = (8, 4, 2)
KEEPS = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)
KEYS = ("token", "channel")
"""How a layer's keys are coded: "token" (each token's channels in groups, as its values;
the layer pooled so its heads share the slots unevenly) or "channel" (KIVI's: each channel
over groups of tokens, values per token; per-head rows, every head keeping the same count)."""
CONFIGS: tuple[tuple[float, int, str], ...] = tuple(
    (k, b, a) for a in KEYS for b in BITS for k in KEEPS)
"""Candidate (share of the context's tokens kept per head, bits, keys) of one layer."""

MIN_FRACTION = KEEPS[-1] * 3 / 16
"""The smallest budget `auto` takes: 1/32 of the tokens as int2 codes plus an fp16 scale and
offset per 32 channels (2 + 32/32 = 3 bits against bf16's 16)."""

TABLES = ("auto", "kl", "table", "learned", "prior")

CALIBRATION = Path(__file__).with_name("planner_calibration.json")
"""Per-layer damage tables measured on calibration text (absent: the analytic prior)."""


# ----------------------------------------------------------------------------- damage tables


def prior_damage(num_layers: int) -> np.ndarray:
    """[L, len(CONFIGS)] predicted damage without calibration: the same for every layer.

    Eviction costs `0.012 (1/keep - 1)`, per-token codes cost 0.001 / 0.06 / 0.3 for 8 / 4 / 2
    bits and per-channel keys 0.001 / 0.03 / 0.2, added: the shape of the relative perplexity
    increases in docs/RESULTS.md (SnapKV-0.5 +1%, -0.75 +4.5%, int8 +0%, int4 +6%,
    per-channel int4 +3-5%, KIVI-2 +23%), not fitted to any text.

    Example:
        >>> d = prior_damage(2)
        >>> d.shape, bool(d[0, CONFIGS.index((1.0, 8, "token"))] < d[0, CONFIGS.index((0.5, 4, "token"))])
        ((2, 36), True)
    """
    quant = {"token": {8: 0.001, 4: 0.06, 2: 0.3}, "channel": {8: 0.001, 4: 0.03, 2: 0.2}}
    row = np.array([0.012 * (1 / k - 1) + quant[a][b] for k, b, a in CONFIGS])
    return np.tile(row, (num_layers, 1))


def read_calibration(path: str | Path) -> dict | None:
    """The calibration file at `path` (None when there is none), read again when it changes.

    ValueError, naming the file, when it is not a calibration of `CONFIGS`: JSON with
    `configs` and a `kl` table or an attention-output `damage` table; `shape` (layers, KV
    heads, head dim of the model it was measured on) is optional in files older than it."""
    path, digest = _file_version(path)
    return None if digest is None else _read_calibration(path, digest)


@functools.lru_cache(maxsize=8)
def _read_calibration(path: str, digest: str) -> dict:
    try:
        cal = json.loads(Path(path).read_text())
        configs = [tuple(c) for c in cal["configs"]]
        tables = _tables(cal)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"auto: {path} is not a planner calibration (JSON with `configs` and a "
                         f"`kl` or `damage` table, written by experiments/eval/"
                         f"calibrate_planner.py): {type(e).__name__}: {e}") from None
    if configs != list(CONFIGS):
        raise ValueError(f"auto: {path} was measured for other configs ({len(configs)} of "
                         f"them, not this kvjax's {len(CONFIGS)}): run calibrate_planner.py again")
    if not tables or any(np.shape(t)[1:] != (len(CONFIGS),) for t in tables):
        raise ValueError(f"auto: {path} holds no [layers, {len(CONFIGS)}] damage table")
    return cal


def _tables(cal: dict) -> list:
    """The damage tables a calibration holds: its end-to-end one, its attention-output one."""
    return [cal["kl"]["damage"] if k == "kl" else cal[k] for k in ("kl", "damage") if k in cal]


def _checked_calibration(calibration, table: str) -> str | None:
    """`auto`'s `calibration` argument as an absolute path (None stays None), or ValueError:
    it must name a file and go with a table the file can hold (not the prior)."""
    if calibration is None:
        return None
    if table == "prior":
        raise ValueError("auto: calibration= needs table=auto, kl, table or learned, not prior")
    if not isinstance(calibration, (str, Path)) or not Path(calibration).is_file():
        raise ValueError(f"auto: calibration={calibration!r} is not a file (one "
                         f"experiments/eval/calibrate_planner.py --out wrote)")
    return str(Path(calibration).absolute())


def _shape_mismatch(cal: dict, num_layers: int, kv_heads: int | None,
                    head_dim: int | None) -> str | None:
    """Why `cal` does not describe this cache's model (None when it does). A file without
    `shape` is matched on its layer count alone."""
    shape = cal.get("shape", {})
    want = {"layers": len(_tables(cal)[0]), "kv_heads": shape.get("kv_heads"),
            "head_dim": shape.get("head_dim")}
    have = {"layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim}
    if any(w is not None and h is not None and w != h for w, h in zip(want.values(),
                                                                      have.values())):
        return (f"measured on {want['layers']} layers x {want['kv_heads']} KV heads x head dim "
                f"{want['head_dim']}, this cache has {num_layers} x {kv_heads} x {head_dim}")
    return None


def damage_table(num_layers: int, source: str = "auto", kv_heads: int | None = None,
                 head_dim: int | None = None, calibration: str | None = None
                 ) -> tuple[np.ndarray, str]:
    """([L, len(CONFIGS)] damage, where it came from), for `source`:

    * "auto": the end-to-end table ("kl") when it exists for this model, else the
      attention-output table ("table"), else the learned controller's predictions, else the
      prior (on the calibration text's held-out windows the KL table planned better than the
      attention table at 1/16-1/4 and worse below, the attention table better than the
      controller: docs/DECISIONS.md);
    * "kl": each layer's damage as the KL divergence of the model's next-token
      distributions when that layer alone is stored so (`calibrate_planner.py --target kl`);
    * "table": each layer's attention-output error (`calibrate_planner.py --target
      attention`); "learned": the controller's predictions from that calibration's signals;
      each only itself (else the prior); "prior": the prior.

    The tables come from `calibration` (a file `calibrate_planner.py --out` wrote for the
    user's model: ValueError if it was measured on another shape or lacks the asked table),
    else from the shipped `CALIBRATION` when it was measured on a model of this shape
    (`num_layers`, and `kv_heads` and `head_dim` when given), else the prior.
    """
    if source not in TABLES:
        raise ValueError(f"auto: table must be one of {TABLES}, got {source!r}")
    calibration = _checked_calibration(calibration, source)
    cal = read_calibration(calibration or CALIBRATION) if source != "prior" else None
    mismatch = None if cal is None else _shape_mismatch(cal, num_layers, kv_heads, head_dim)
    if calibration is not None and mismatch:
        raise ValueError(f"auto: calibration={calibration!r} was {mismatch}")
    fits = cal is not None and mismatch is None
    kl = cal.get("kl") if fits else None
    if kl is not None and source in ("auto", "kl"):
        return np.asarray(kl["damage"], np.float64), f"end-to-end table ({kl['source']})"
    if fits and "damage" in cal and source in ("auto", "table"):
        return np.asarray(cal["damage"], np.float64), f"calibrated table ({cal['source']})"
    params = load_controller(str(CONTROLLER)) if source in ("auto", "learned") else None
    if fits and params is not None and "signals" in cal:
        with jax.ensure_compile_time_eval():  # a constant even when planning under jit
            predicted = np.exp(np.asarray(controller_apply(params, jnp.asarray(cal["signals"]))))
        return predicted.astype(np.float64), \
            f"learned controller on signals of {cal['source']}"
    if calibration is not None:
        raise ValueError(f"auto: calibration={calibration!r} has no table for table={source}")
    return prior_damage(num_layers), "prior (no calibration for this model's shape)"


def _file_version(path: str | Path) -> tuple:
    """(absolute path, SHA-256 of its bytes) of a calibration file: what its parsed contents
    and `static_plan`'s plans are cached on, so a rewritten file is read anew, even one
    rewritten at the same size within the file system's timestamp resolution."""
    path = Path(path)
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return (str(path), None)
    return (str(path.absolute()), digest)


def plan_source(num_layers: int, table: str = "auto", kv_heads: int | None = None,
                head_dim: int | None = None, calibration: str | None = None) -> str:
    """Which damage table `auto` plans with for a model of this shape."""
    return damage_table(num_layers, table, kv_heads, head_dim, calibration)[1]


# ----------------------------------------------------------------------------- bytes


@functools.lru_cache(maxsize=None)
def layer_bytes(batch: int, kv_heads: int, head_dim: int, dtype: str, bits: int,
                keys: str = "token") -> tuple[int, int]:
    """(fixed, per head-slot) bytes of one layer as `auto` stores it with `bits`-bit codes and
    `keys` coding: `nbytes = fixed + per_slot x head-slots` (for "channel", of its coded whole
    groups; its exact tokens cost `exact_slot_bytes`). Measured with `nbytes` on the coded
    layer's shapes (nothing written by hand).

    Example:
        >>> layer_bytes(1, 3, 64, "float32", 8)   # 64 + 64 code bytes + 4 fp16 params x 2, 3 positions
        (4, 156)
        >>> layer_bytes(1, 3, 64, "float32", 4, "channel")  # + a group id, 1 position per slot
        (12, 86)
    """
    unit = 1 if keys == "token" else _group(head_dim)  # head-slots come in units of `unit`

    def coded(units):
        layer = init_cache(batch, kv_heads, units * unit, head_dim, dtype)
        layer = layer.replace(pos=jnp.broadcast_to(jnp.arange(units * unit, dtype=jnp.int32),
                                                   layer.pos.shape), length=jnp.int32(units * unit))
        layer = pool_heads(layer) if keys == "token" else layer
        return _written(_encode(layer, bits, keys))
    one, two = (nbytes(jax.eval_shape(functools.partial(coded, c))) for c in (1, 2))
    per_unit, rem = divmod(two - one, kv_heads * batch)
    per_slot, rem2 = divmod(per_unit, unit)
    if rem or rem2:
        raise AssertionError(f"layer bytes not linear in slots: {one}, {two}")
    return one - per_unit * kv_heads * batch, per_slot


def _written(layer):
    """A coded layer as `kvjax.shrink(..., room=0)` holds it when every slot of its body is
    written and its exact part is empty (shapes only: the exact part cut to no slots)."""
    if not has_exact_part(layer):
        return layer
    recent = layer.recent
    none = lambda x, axis: jax.lax.slice_in_dim(x, 0, 0, axis=axis)
    return layer.replace(recent=recent.replace(
        k=none(recent.k, 1), v=none(recent.v, 1), pos=none(recent.pos, 2),
        mass=None if recent.mass is None else none(recent.mass, 2)))


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


def _encode(layer, bits: int, keys: str = "token"):
    """A layer coded as `auto` stores it: `bits`-bit per-token codes for keys and values
    ("token"; a pooled layer stays pooled), or KIVI's coding with no exact window
    ("channel": keys per channel over groups of tokens, values per token; whole groups are
    coded, a last partial group stays exact until it fills)."""
    group = _group(layer.head_dim)
    if keys == "token":
        t = codecs.quantize(bits=bits, group=group)
    else:
        t = codecs.kivi(bits=bits, group=group, residual=0)
    return t.update((layer,), (), None)[0][0]


@functools.lru_cache(maxsize=None)
def exact_slot_bytes(batch: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one uncoded head-slot (key, value, position) of a per-head `dtype` layer, per
    batch row: what a token of a per-channel layer's exact part costs.

    Example:
        >>> exact_slot_bytes(1, 3, 64, "bfloat16")
        260
    """
    one, two = (nbytes(jax.eval_shape(lambda c=c: init_cache(batch, kv_heads, c, head_dim, dtype)))
                for c in (1, 2))
    return (two - one) // (kv_heads * batch)


# ----------------------------------------------------------------------------- the static plan


class LayerChoice(NamedTuple):
    keep: float  # share of the context's tokens per head (before filling the budget)
    bits: int
    keys: str = "token"  # one of KEYS


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
                table: str = "auto", keys: str = "auto", calibration: str | None = None,
                _version: tuple | None = None) -> tuple[LayerChoice, ...]:
    """The per-layer (keep share, bits, keys) for a budget of `fraction` of the bf16 full
    cache. `keys`: "auto" lets each layer choose its key coding, else only that one. A
    coding whose fixed bytes (cursors) do not fit the budget of a one-token context is left
    out when another fits, so the budget holds from the first token. `calibration`: a file
    of the user's model (`damage_table`); `_version` keys this cache on the file's version
    (`_file_version`).

    Example:
        >>> plan = static_plan(0.25, 4, 3, 64, "prior")
        >>> len(plan), all(c.bits in BITS and c.keys in KEYS for c in plan)
        (4, True)
        >>> {c.keys for c in static_plan(0.25, 4, 3, 64, "prior", keys="token")}
        {'token'}
    """
    damage, _ = damage_table(num_layers, table, kv_heads, head_dim, calibration)
    per_token = 4 * head_dim + 4  # a bf16 head-token: k, v and its position
    one_token = fraction * bf16_full_bytes(1, 1, kv_heads, head_dim, 1)
    sizes = [layer_bytes(1, kv_heads, head_dim, "float32", b, a) for _, b, a in CONFIGS]
    asked = np.array([keys in ("auto", a) for _, _, a in CONFIGS])
    fits = np.array([fixed <= one_token for fixed, _ in sizes])
    allowed = asked & fits if (asked & fits).any() else asked
    cost = np.array([k * slot / per_token for (k, _, _), (_, slot) in zip(CONFIGS, sizes)])
    index = np.flatnonzero(allowed)
    picks = knapsack(damage[:, index], cost[index], fraction * num_layers)
    return tuple(LayerChoice(*CONFIGS[index[i]]) for i in picks)


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


SCORES = ("mixed", "expected_attention", "attention")
"""What ranks a layer's tokens: the attention expected of future queries (ExpectedAttention's,
from the prompt's query moments), the last `window` queries' attention (SnapKV's), or the mean
of the two distributions ("mixed", the default: docs/DECISIONS.md, "auto ranks tokens by
expected and observed attention together")."""


def head_signals(layer: TokenCache, stats, window: int,
                 score: str = "attention") -> tuple[jax.Array, jax.Array]:
    """(scores [B, KVH, C], entropy [B, KVH]) of a dense view of a layer (pooled or per
    head): each head's `score` (window attention, expected attention, or the mean of the two
    after normalising each; mean over its query heads), normalised to sum to 1 over its own
    tokens, and that distribution's entropy."""
    valid = layer.pos != EMPTY

    def normalised(attn):
        attn = jnp.where(valid, attn, 0.0)
        return attn / jnp.maximum(attn.sum(axis=-1, keepdims=True), 1e-30)

    def expected():
        sinks = min(ExpectedAttentionScorer.sinks, layer.pos.shape[-1])  # a prompt may be shorter
        return normalised(ExpectedAttentionScorer(sinks=sinks)(layer, stats, None, None)[0])

    def observed():
        return normalised(window_attention(layer, stats, window).mean(axis=2))  # [B, KVH, C]

    if score == "expected_attention":
        p = expected()
    elif score == "mixed":
        p = 0.5 * (expected() + observed())
    else:
        p = observed()
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
    keys: str = "auto"
    score: str = "mixed"
    calibration: str | None = None  # a calibration file for the user's model

    def plan_fraction(self, num_layers: int, kv_heads: int, head_dim: int) -> float:
        """The fraction the static (codec) plan is made for: F, or N over the bf16 bytes
        of `context` tokens."""
        if self.fraction is not None:
            return self.fraction
        full = bf16_full_bytes(num_layers, 1, kv_heads, head_dim, self.context)
        return min(1.0, max(MIN_FRACTION, self.per_sequence / full))

    def plan(self, cache: Cache) -> tuple[LayerChoice, ...]:
        return self.plan_for(len(cache), cache[0].kv_heads, cache[0].head_dim)

    def plan_for(self, num_layers: int, kv_heads: int, head_dim: int) -> tuple[LayerChoice, ...]:
        """The static plan for a model of this shape (what `plan` makes for its cache)."""
        fraction = self.plan_fraction(num_layers, kv_heads, head_dim)
        return static_plan(fraction, num_layers, kv_heads, head_dim, self.table, self.keys,
                           self.calibration, _file_version(self.calibration or CALIBRATION))

    def source(self, num_layers: int, kv_heads: int, head_dim: int) -> str:
        """Where the plan's damage table comes from (`plan_source`)."""
        return plan_source(num_layers, self.table, kv_heads, head_dim, self.calibration)

    def __call__(self, cache: Cache, state: AutoState, stats=None):
        first = cache[0]
        num_layers, b, kvh, d = len(cache), first.batch, first.kv_heads, first.head_dim
        dtype = str(view(first).k.dtype)
        plan = self.plan(cache)
        fixed, slot = zip(*(layer_bytes(b, kvh, d, dtype, c.bits, c.keys) for c in plan))
        n_ctx = (jnp.max(first.pos) + 1).astype(jnp.float32)  # [] the longest row's context
        if self.per_sequence is not None:
            budget = jnp.float32(self.per_sequence * b)
        else:
            budget = self.fraction * bf16_full_bytes(num_layers, b, kvh, d, n_ctx)
        if self.per_sequence is not None and self.per_sequence * b < sum(fixed):
            raise ValueError(f"auto: bytes={self.per_sequence} is below the cache's fixed "
                             f"{sum(fixed) / b:.0f} bytes per sequence (cursors) for this model")
        shares = np.array([c.keep * kvh for c in plan])  # head-slots per context token
        per_x = b * float(np.dot(shares, slot))  # bytes per unit of X
        x = (budget - sum(fixed)) / per_x * (1 - 2 ** -20)  # margin for float32 rounding
        x = jnp.maximum(x, 0.0)
        slots = [jnp.clip(jnp.floor(s * x), 0, kvh * n_ctx).astype(jnp.int32) for s in shares]
        stats = stats if stats is not None else (None,) * num_layers
        out = [None] * num_layers
        for coding in sorted({c[1:] for c in plan}):  # one compiled layer body per codec
            members = [i for i, c in enumerate(plan) if c[1:] == coding]
            done = map_layers(functools.partial(self._layer, choice=LayerChoice(1.0, *coding)),
                              *([xs[i] for i in members] for xs in (cache, stats, slots)))
            for i, result in zip(members, done):
                out[i] = result
        layers, kept, entropy = zip(*out)
        return tuple(layers), AutoState(jnp.stack(slots), jnp.stack(kept), jnp.stack(entropy),
                                        jnp.asarray(budget, jnp.float32))

    def _layer(self, layer, stats, slots, choice: LayerChoice):
        """One layer cut to `slots` head-slots' bytes (traced) and coded: pooled and split over
        heads by attention for per-token keys; for per-channel keys `channel_keep`."""
        pooled = choice.keys == "token"
        layer = pool_heads(layer) if pooled else layer
        seen = view(layer)
        scores, entropy = head_signals(seen, stats, self.window, self.score)
        valid = seen.pos != EMPTY
        order = rank(seen.pos.astype(jnp.float32), valid)  # 0 = the latest token
        first = rank(-seen.pos.astype(jnp.float32), valid)  # 0 = the earliest
        protect = valid & ((order < self.recent) | (first < self.sinks))
        if pooled:
            keep = headwise_keep(scores, valid, protect, slots, self.alpha)
        else:
            b, kvh, d = seen.batch, seen.kv_heads, seen.head_dim
            dtype = str(seen.k.dtype)
            ratio = layer_bytes(b, kvh, d, dtype, choice.bits, "channel")[1] / \
                exact_slot_bytes(b, kvh, d, dtype)
            coded = None
            if has_exact_part(layer):  # coded before: its body's slots come first
                body = layer.parts()[0]
                coded = valid & (jnp.arange(valid.shape[-1]) < body.capacity)
            keep = channel_keep(jnp.where(protect, jnp.inf, scores), valid, slots // kvh,
                                ratio, _group(d), coded)
        layer = _encode(compact(layer, keep), choice.bits, choice.keys)
        return layer, keep.sum(axis=-1).astype(jnp.int32), entropy


def channel_keep(scores: jax.Array, valid: jax.Array, allowed: jax.Array, ratio: float,
                 group: int, coded: jax.Array | None = None) -> jax.Array:
    """[B, KVH, C] keep mask of a per-channel layer allowed `allowed` coded head-slots per
    head (traced): the best whole `group`s of tokens per head, or, for a layer coded before,
    every token it holds coded (`coded` [B, KVH, C]: codes are never re-selected, so each
    group keeps one parameter row); then, while the bytes last, the best further tokens kept
    exact (`ratio` = coded / exact bytes of a slot). A shorter row's coded and exact tokens
    fit within the longest row's, so the bytes are the longest row's.

    Example:
        >>> s = jnp.arange(40.0).reshape(1, 1, 40)   # later tokens score higher
        >>> keep = channel_keep(s, jnp.ones(s.shape, bool), jnp.int32(36), 0.5, group=32)
        >>> int(keep.sum()), bool(keep[0, 0, -34:].all())   # 32 coded + (36 - 32) x 0.5 exact
        (34, True)
    """
    if coded is None:
        best = jnp.minimum(valid.sum(-1), allowed) // group * group  # [B, KVH] whole groups
        coded = (rank(scores, valid) < best[..., None]) & valid
    coded_slots = jnp.max(coded.sum(-1))  # [] the longest row's, what `shrink` keeps
    extra = jnp.floor(jnp.maximum(allowed - coded_slots, 0) * ratio).astype(jnp.int32)
    rest = valid & ~coded
    return coded | (rest & (rank(scores, rest) < extra))


# ----------------------------------------------------------------------------- calibration


@functools.partial(jax.jit, static_argnames=("bits", "keys", "window", "score"))
def config_damage(layer: TokenCache, select_stats, eval_q: jax.Array, eval_pos: jax.Array,
                  keep: float, bits: int, keys: str = "token", window: int = 32,
                  score: str = "attention") -> jax.Array:
    """[] relative squared error of a layer's attention output when `auto` stores it with
    (`keep` share of its tokens, `bits`, `keys`), tokens ranked by `score`, for queries the
    selection never saw.

    `layer`: a dense layer (the prefix); `select_stats`: its statistics with the last
    `window` queries of the prefix (what `auto` selects with; with the prefix's query moments
    for the scores that read them); `eval_q` [B, T, H, D],
    `eval_pos` [B, T]: later queries (the continuation's), which score the damage:
    `|o_auto - o_full|^2 / |o_full|^2` summed over them. What
    `experiments/eval/calibrate_planner.py` measures per layer and config on calibration text.
    """
    from kvjax.core.attention import attend_reference
    small = _stored(layer, select_stats, LayerChoice(keep, bits, keys), window, score)
    full_out = attend_reference(eval_q, eval_pos, layer)
    out = attend_reference(eval_q, eval_pos, small)
    return jnp.sum((out - full_out) ** 2) / jnp.maximum(jnp.sum(full_out ** 2), 1e-30)


def _stored(layer: TokenCache, select_stats, choice: LayerChoice, window: int, score: str):
    """A dense `layer` as `auto` stores it with `choice`: `choice.keep` of its written
    head-slots, ranked by `score` from `select_stats`."""
    n = jnp.max(jnp.sum(layer.pos != EMPTY, axis=-1))
    slots = jnp.floor(choice.keep * layer.kv_heads * n).astype(jnp.int32)
    update = AutoUpdate(1.0, None, window=window, score=score)
    return update._layer(layer, select_stats, slots, choice)[0]


@functools.partial(jax.jit, static_argnames=("bits", "keys", "window", "score"))
def stored_in_place(layer: TokenCache, select_stats, keep: float, bits: int,
                    keys: str = "token", window: int = 32, score: str = "mixed") -> TokenCache:
    """The dense `layer` [B, KVH, C] holding only what `auto` would store with (`keep`,
    `bits`, `keys`): each kept token's decoded key and value in its own slot, every other
    slot EMPTY. Same shapes and cursor as `layer`, so a whole-model program compiled once
    runs any layer stored any way (what `calibrate_planner.py --target kl` measures).
    """
    small = view(_stored(layer, select_stats, LayerChoice(keep, bits, keys), window, score))
    b, kvh, c = layer.pos.shape
    s, d = small.pos.shape[-1], layer.head_dim
    rows = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]
    # slot_of[b, h, p]: the slot of `layer` holding position p (c: none; a dense prefill
    # holds positions < c)
    slot_of = jnp.full((b, kvh, c), c, jnp.int32).at[
        (*rows, jnp.where(layer.pos >= 0, layer.pos, c))].set(
        jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, kvh, c)), mode="drop")
    target = jnp.where(small.pos >= 0, slot_of[(*rows, jnp.clip(small.pos, 0, c - 1))], c)

    def put(dense, stored):  # stored [B*R, S, D], R = KVH per head or 1 pooled
        stored = jnp.broadcast_to(stored.reshape(b, -1, s, d), (b, kvh, s, d))
        out = dense.reshape(b, kvh, c, d).at[(*rows, target)].set(
            stored.astype(dense.dtype), mode="drop")
        return out.reshape(dense.shape)

    pos = jnp.full_like(layer.pos, EMPTY).at[(*rows, target)].set(small.pos, mode="drop")
    return layer.replace(k=put(layer.k, small.k), v=put(layer.v, small.v), pos=pos)


SIGNALS = ("keep", "bits/8", "per-channel keys", "attention mass lost", "entropy / log n",
           "key error", "value error")
"""What the learned controller reads per (layer, config), all measured on the prompt."""


@functools.partial(jax.jit, static_argnames=("bits", "keys", "window"))
def config_signals(layer: TokenCache, select_stats, keep: float, bits: int,
                   keys: str = "token", window: int = 32) -> jax.Array:
    """[len(SIGNALS)] float32 signals of storing a dense `layer` with (`keep`, `bits`,
    `keys`): whether keys are coded per channel, the share of window attention the kept
    tokens would lose (mean over heads), the heads' mean attention entropy over log n, and
    the relative squared error of the keys and of the values under those codes."""
    scores, entropy = head_signals(layer, select_stats, window)  # [B, KVH, C]
    valid = layer.pos != EMPTY
    n = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)  # [B, KVH, 1]
    top = rank(scores, valid) < jnp.floor(keep * n)
    lost = 1 - jnp.sum(jnp.where(top, scores, 0.0), axis=-1)  # [B, KVH]
    coded = view(_encode(layer, bits, keys))  # its first slots are the layer's, in order
    rows = valid.reshape(-1, layer.capacity)[..., None]  # [B*KVH, C, 1]: written slots only
    rel = lambda x, y: jnp.sum(jnp.where(rows, x[:, :layer.capacity] - y, 0.0) ** 2) / \
        jnp.maximum(jnp.sum(jnp.where(rows, y, 0.0) ** 2), 1e-30)
    return jnp.stack([jnp.float32(keep), jnp.float32(bits / 8), jnp.float32(keys == "channel"),
                      lost.mean(),
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
         table: str = "auto", keys: str = "auto", score: str = "mixed",
         calibration: str | None = None) -> CacheTransform:
    """A cache that fits a memory budget: eviction and codes planned per layer and KV head.

    Args:
      budget: F in (0, 1]: the fraction of the bf16 full cache's bytes for the same tokens.
      bytes: N, a budget in bytes per sequence instead (exactly one of the two).
      context: with `bytes`, the context length the per-layer codecs are planned for
        (the token counts always follow the real context).
      window: the last `window` queries score the tokens (their attention).
      sinks, recent: the first and the last tokens of every head, kept before the rest.
      alpha: each head keeps at least `alpha` of an equal share of its layer's slots.
      table: where per-layer damage comes from (`damage_table`): "auto" (the end-to-end
        table, else the attention-output table, else the learned controller, else the
        prior), "kl", "table", "learned", "prior".
      keys: the key codings a layer may use: "auto" (each layer chooses), "token" (per-token
        codes, heads sharing the layer's slots unevenly) or "channel" (KIVI's per-channel
        keys, the same count per head).
      score: what ranks the tokens (`SCORES`): "mixed" (the mean of the two below, each
        normalised per head; chosen on calibration text, docs/results/planner/dev),
        "expected_attention" (future queries' expected attention from the prompt's query
        moments; the first 4 tokens kept) or "attention" (the last `window` queries').
      calibration: a damage-table file measured on the user's own model (`python
        experiments/eval/calibrate_planner.py --model M --out F`); its layer count, KV heads
        and head dim must be the cache's. Default: the shipped table where it was measured
        on a model of the cache's shape (SmolLM2-135M), else the prior.

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
    if keys not in ("auto",) + KEYS:
        raise ValueError(f"auto: keys={keys!r} must be one of auto, {', '.join(KEYS)}")
    if score not in SCORES:
        raise ValueError(f"auto: score={score!r} must be one of {', '.join(SCORES)}")
    calibration = _checked_calibration(calibration, table)
    if calibration is not None:
        read_calibration(calibration)  # a file of the wrong kind fails here, not at trace
    update = AutoUpdate(None if budget is None else float(budget), bytes, context,
                        window, sinks, recent, float(alpha), table, keys, score, calibration)
    stats = StatsSpec(window=window)
    if score in ("expected_attention", "mixed"):
        stats = stats.merge(StatsSpec(query_moments=True, moments_skip=ExpectedAttentionScorer.sinks))
    return CacheTransform(_init_state, update, stats)
