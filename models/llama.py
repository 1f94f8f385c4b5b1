"""A Llama-family decoder in Flax NNX that takes and returns its KV cache.

Covers Llama 2/3, SmolLM/SmolLM2, Mistral (with its sliding window), Qwen2,
Qwen3, Phi-3 and Gemma 3 text checkpoints: RMSNorm, RoPE (optionally with
Llama-3 or linear frequency scaling), grouped-query attention, gated MLP,
tied or untied embeddings. The families differ only in config fields
(`models.families` reads them from a Hugging Face config.json): q/k/v biases
(Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3), (1 + w) norms, norms around
attention and MLP, GELU-tanh, scaled embeddings, a query scale and logit
soft-capping (Gemma 3), and windowed layers (Mistral, Gemma 3's local layers:
their cache holds the window, `layer_windows`).

The residual stream and all normalisation run in float32; weights may be
bfloat16, in which case matmuls run as `dot(bf16, bf16) -> f32`.

Example:
    >>> cfg = LlamaConfig.tiny()
    >>> model = Llama(cfg, rngs=nnx.Rngs(0))
    >>> cache = kvjax.init_model_cache(cfg.cache_spec, batch=1, capacity=32)
    >>> tokens = jnp.array([[1, 2, 3]]); positions = jnp.arange(3)[None]
    >>> logits, cache = model(tokens, positions, cache)
    >>> logits.shape, int(cache[0].length)                # [B, T, vocab]; 3 tokens cached
    ((1, 3, 256), 3)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.core import cpu_kernel
from kvjax.core.cache import EMPTY, Cache, CacheSpec, TokenCache
from kvjax.core.layer import is_plain
from kvjax.core.stores import is_encoded
from kvjax.core.stats import NO_STATS, LayerStats, StatsSpec, accumulate_mass, init_stats, observe


ROPE_TYPES = ("llama3", "linear", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3 style (`rope_type: llama3`, the default), linear
    (`linear`: every inverse frequency divided by `factor`; Gemma 3's global layers) or
    LongRoPE (`longrope`, Phi-3/3.5's long-context models: inverse frequency i divided by
    `short_factor[i]` while a forward call's positions fit `original_max_position`, by
    `long_factor[i]` once its largest position + 1 passes it, as transformers chooses per call;
    rotated queries and keys times `attention_factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    rope_type: str = "llama3"
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {ROPE_TYPES}, "
                             f"got {self.rope_type!r}")
        if not 0 < float(self.factor) < float("inf"):
            raise ValueError(f"RopeScaling.factor must be a positive finite number, "
                             f"got {self.factor!r}")
        if not 0 < float(self.attention_factor) < float("inf"):
            raise ValueError(f"RopeScaling.attention_factor must be a positive finite number, "
                             f"got {self.attention_factor!r}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if self.rope_type == "longrope" and value is None:
                raise ValueError(f"RopeScaling.{name} is required with rope_type='longrope'")
            if value is not None:  # hashable (the config keys a cache), positive and finite
                value = tuple(float(f) for f in value)
                if not value or not all(0 < f < float("inf") for f in value):
                    raise ValueError(f"RopeScaling.{name} must be positive finite numbers, "
                                     f"got {getattr(self, name)!r}")
                object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static, hashable architecture description."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: divides inv_freq
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attention_bias: bool = False
    max_position: int = 2048
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    # --- family variations (defaults: Llama) ---
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # norms scale by (norm_offset + weight): Gemma's (1 + w)
    sandwich_norms: bool = False  # Gemma 3: norms after attention and before/after the MLP
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # a sliding layer's query sees itself + window - 1 before
    layer_types: tuple[str, ...] | None = None  # "full" / "sliding" per layer; None: all full
    local_rope_theta: float | None = None  # RoPE base of sliding layers (unscaled); None: rope_theta

    def __post_init__(self):
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(s, name)) != self.head_dim // 2:
                    raise ValueError(f"rope_scaling.{name} has {len(getattr(s, name))} entries, "
                                     f"expected head_dim/2 = {self.head_dim // 2}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim {self.head_dim} must be even for RoPE")
        for name in ("rope_theta", "rms_norm_eps", "query_scale", "attn_softcap",
                     "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is None and name not in ("rope_theta", "rms_norm_eps"):
                continue
            if isinstance(value, (str, bool)) or not 0 < float(value) < float("inf"):
                raise ValueError(f"LlamaConfig.{name} must be a positive finite number, "
                                 f"got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"LlamaConfig.activation must be one of {ACTIVATIONS}, "
                             f"got {self.activation!r}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or
                                                not isinstance(self.sliding_window, int) or
                                                self.sliding_window < 1):
            raise ValueError(f"LlamaConfig.sliding_window must be an int >= 1 or None, "
                             f"got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"LlamaConfig.layer_types has {len(self.layer_types)} entries, "
                                 f"num_layers is {self.num_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"LlamaConfig.layer_types: {bad} not in {LAYER_TYPES}")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ValueError("LlamaConfig.layer_types has sliding layers but "
                                 "sliding_window is None")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists); `LlamaConfig.from_dict` inverts it."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LlamaConfig":
        """The config `to_dict` (or a saved config.json of the converted store) describes."""
        raw = dict(raw, eos_ids=tuple(raw["eos_ids"]))
        if raw.get("layer_types") is not None:
            raw["layer_types"] = tuple(raw["layer_types"])
        if raw.get("rope_freq_factors") is not None:
            raw["rope_freq_factors"] = tuple(raw["rope_freq_factors"])
        if raw.get("rope_scaling") is not None:
            raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        return cls(**raw)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: its attention window (a sliding layer) or None (full attention)."""
        types = self.layer_types or ("full",) * self.num_layers
        return tuple(self.sliding_window if t == "sliding" else None for t in types)

    @property
    def cache_spec(self) -> CacheSpec:
        windows = self.layer_windows
        return CacheSpec(self.num_layers, self.num_kv_heads, self.head_dim,
                         windows=windows if any(w is not None for w in windows) else None)

    @classmethod
    def smollm2_135m(cls) -> "LlamaConfig":
        """SmolLM2-135M(-Instruct): 30 layers, 9 query / 3 KV heads of 64."""
        return cls(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100_000.0,
                   rms_norm_eps=1e-5, tie_embeddings=True, max_position=8192,
                   bos_id=1, eos_ids=(2,))

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """A few-kilobyte config of the same architecture, for fast tests."""
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                    max_position=512, bos_id=1, eos_ids=(2,))
        return cls(**{**base, **overrides})


@functools.lru_cache(maxsize=64)
def rope_frequencies(cfg: LlamaConfig, local: bool = False, long: bool = False) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, with the config's scaling if set.

    `local`: a sliding layer's, from `local_rope_theta` unscaled when the config has one
    (Gemma 3); otherwise the same as the full layers'. `long`: LongRoPE's long factors
    (`rotate_queries_and_keys` picks them per call); its short ones otherwise.
    """
    d = cfg.head_dim
    if local and cfg.local_rope_theta is not None:
        inv = 1.0 / (cfg.local_rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        return inv.astype(np.float32)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "linear":
        inv = inv / s.factor
    elif s is not None and s.rope_type == "longrope":
        # (LlamaConfig checked both lists hold head_dim / 2 factors)
        inv = inv / np.asarray(s.long_factor if long else s.short_factor, np.float64)
    elif s is not None:
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    if cfg.rope_freq_factors is not None:
        if len(cfg.rope_freq_factors) != d // 2:
            raise ValueError(f"rope_freq_factors has {len(cfg.rope_freq_factors)} entries, "
                             f"expected head_dim/2 = {d // 2}")
        inv = inv / np.asarray(cfg.rope_freq_factors, np.float64)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate `x` [B, T, N, D] by `positions` [B, T] (the rotate-half convention)."""
    return cpu_kernel.rope(x, positions, inv_freq)


def rotate_queries_and_keys(cfg: LlamaConfig, q: jax.Array, k: jax.Array,
                            positions: jax.Array, local: bool = False):
    """q [B, T, H, D] and k [B, T, KVH, D] turned by RoPE at `positions` [B, T].

    LongRoPE: both factor sets are applied and the long ones kept where the call's largest
    position + 1 passes `original_max_position` (transformers' rule per forward call: a cached
    key keeps the rotation it was written with), then times `attention_factor`.
    """
    inv = rope_frequencies(cfg, local)
    s = cfg.rope_scaling
    if s is None or s.rope_type != "longrope" or (local and cfg.local_rope_theta is not None):
        return apply_rope(q, positions, inv), apply_rope(k, positions, inv)
    long_inv = rope_frequencies(cfg, local, long=True)
    use_long = jnp.max(positions) + 1 > s.original_max_position
    turn = lambda x: np.float32(s.attention_factor) * jnp.where(
        use_long, apply_rope(x, positions, long_inv), apply_rope(x, positions, inv))
    return turn(q), turn(k)


def fixed_rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """The inverse frequencies every key was rotated with, for the policies that undo or
    redo RoPE (`kvjax.core.stats.LayerStats.inv_freq`); [0] when there is no one set
    (LongRoPE's change with the context), which those policies refuse by name."""
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "longrope":
        return np.zeros((0,), np.float32)
    return rope_frequencies(cfg)


FEW_ROWS = 32  # most rows for which `Llama.logits` multiply-reduces instead of a dot (XLA:CPU)


class Dense(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out]."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), dtype)
                                * (d_in ** -0.5))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return dense_together(x, (self,))[0]


def dense_together(x: jax.Array, layers: tuple[Dense, ...]) -> tuple[jax.Array, ...]:
    """Each of `layers` applied to x, their products in one few-row kernel call on the CPU
    (`kvjax.core.cpu_kernel.matmuls`: a layer's q, k and v share one round of the thread pool)."""
    ys = cpu_kernel.matmuls(x, [layer.kernel[...] for layer in layers])
    return tuple(y if layer.bias is None else y + layer.bias[...].astype(jnp.float32)
                 for layer, y in zip(layers, ys))


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x**2) + eps) * (offset + weight): `offset` 1 is Gemma's (1 + w) norm,
    whose weights are stored as the difference from 1 (zeros at init)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:  # x: [..., dim] float32
        w = self.weight[...]
        if self.offset:
            w = self.offset + w.astype(jnp.float32)
        return cpu_kernel.rms_norm(x, w, self.eps)


def _norm(cfg: LlamaConfig, dim: int, dtype) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, dtype, cfg.norm_offset)


JOIN_ALIGN = 64  # a sliding layer's joined cache has a multiple of this many slots: pages the
# Pallas kernel reads (kvjax.backends.pallas.page_size_for), where window + 1 would be none


def window_attend(q: jax.Array, positions: jax.Array, cache: TokenCache, k: jax.Array,
                  v: jax.Array, window: int, impl: str, softcap: float | None = None):
    """A sliding layer's write and attention: its cache keeps the newest `capacity` slots.

    The new keys and values (`k`, `v` [B, KVH, T, D]) are written after the cache's slots in
    a joined layer of `capacity + T` slots (rounded up to a multiple of `JOIN_ALIGN`, free
    slots masked); the queries `q` [B, T, H, D] attend over it with
    the window mask (each sees itself and the `window - 1` tokens before it), and the cache
    keeps the newest `capacity` written slots: a `window`-slot cache loses nothing the next
    queries can see. Returns (output [B, T, H, D], the joined layer: `keep_newest` cuts it back).
    """
    if not is_plain(cache) or is_encoded(cache.k) or cache.pooled:
        raise ValueError(f"a sliding-window layer keeps a plain TokenCache (its window is its "
                         f"policy); got a {type(cache).__name__}"
                         f"{' with encoded stores' if is_plain(cache) else ''}: "
                         f"apply compression to the full-attention layers only")
    c = cache.capacity
    room = -(-(c + k.shape[2]) // JOIN_ALIGN) * JOIN_ALIGN - c  # >= T, c + room aligned
    pad = lambda x, fill, axis: jnp.concatenate(  # `room` empty slots after the cache's c
        [x, jnp.full(x.shape[:axis] + (room,) + x.shape[axis + 1:], fill, x.dtype)], axis=axis)
    joined = cache.replace(k=pad(cache.k, 0, 1), v=pad(cache.v, 0, 1),  # [B*KVH, c + room, D]
                           pos=pad(cache.pos, EMPTY, 2),  # [B, KVH, c + room]
                           mass=None if cache.mass is None else pad(cache.mass, 0, 2))
    joined = kvjax.write(joined, k, v, positions)
    out = kvjax.attend(q, positions, joined, impl=impl, window=window, softcap=softcap)
    return out, joined


def keep_newest(joined: TokenCache, capacity: int) -> TokenCache:
    """The newest `capacity` written slots of `joined` (slots [length - capacity, length))."""
    start = jnp.maximum(joined.length - capacity, 0)
    take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, capacity, axis)
    return joined.replace(k=take(joined.k, 1), v=take(joined.v, 1), pos=take(joined.pos, 2),
                          mass=None if joined.mass is None else take(joined.mass, 2),
                          length=joined.length - start)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, window: int | None = None):
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Dense(cfg.hidden_size, h * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Dense(cfg.hidden_size, kvh * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Dense(cfg.hidden_size, kvh * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Dense(h * d, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.q_norm = _norm(cfg, d, dtype) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, d, dtype) if cfg.qk_norm else None
        self.shape = (h, kvh, d)
        self.config = cfg
        self.window = window  # a sliding layer's window, None for full attention

    def __call__(self, x: jax.Array, positions: jax.Array, cache: TokenCache, impl: str,
                 stats: LayerStats | None = None, spec: StatsSpec = NO_STATS):
        """x [B*T, hidden] float32, positions [B, T] -> (output [B*T, hidden], cache, stats)."""
        b, t = positions.shape
        h, _, d = self.shape
        cfg = self.config
        q_pre, q, k, v = self.project(x, positions)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KVH, T, D]
        if self.window is None:
            cache = kvjax.write(cache, k, v, positions)
            out = kvjax.attend(q, positions, cache, impl=impl, softcap=cfg.attn_softcap)
            cache = accumulate_mass(cache, q, positions)
        else:
            out, joined = window_attend(q, positions, cache, k, v, self.window, impl,
                                        cfg.attn_softcap)
            cache = keep_newest(accumulate_mass(joined, q, positions), cache.capacity)
        if stats is not None:
            stats = observe(spec, stats, q_pre, q, positions, x.reshape(b, t, -1))
        return self.o_proj(out.reshape(b * t, h * d)), cache, stats

    def project(self, x: jax.Array, positions: jax.Array):
        """x [B*T, hidden] float32, positions [B, T] -> (pre-RoPE queries q_pre [B, T, H, D],
        queries q [B, T, H, D] and keys k [B, T, KVH, D] turned by RoPE, values v
        [B, T, KVH, D]); the queries carry any `query_scale` beyond `d ** -0.5`."""
        b, t = positions.shape
        h, kvh, d = self.shape
        cfg = self.config
        q_pre, k, v = dense_together(x, (self.q_proj, self.k_proj, self.v_proj))
        q_pre = q_pre.reshape(b, t, h, d)
        k = k.reshape(b, t, kvh, d)
        if self.q_norm is not None:
            q_pre, k = self.q_norm(q_pre), self.k_norm(k)
        if cfg.query_scale is not None:  # kvjax.attend scales by d ** -0.5: fold in the rest
            q_pre = q_pre * np.float32(cfg.query_scale * math.sqrt(d))
        q, k = rotate_queries_and_keys(cfg, q_pre, k, positions, local=self.window is not None)
        return q_pre, q, k, v.reshape(b, t, kvh, d)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Dense(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.up_proj = Dense(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = Dense(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.activation = cfg.activation

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = dense_together(x, (self.gate_proj, self.up_proj))
        act = (jax.nn.silu(gate) if self.activation == "silu"
               else jax.nn.gelu(gate, approximate=True))
        return self.down_proj(act * up)


class Block(nnx.Module):
    """Pre-norm decoder layer; with `sandwich_norms` (Gemma 3) the attention's and the MLP's
    outputs are normed too before they join the residual stream."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, window: int | None = None):
        self.input_norm = _norm(cfg, cfg.hidden_size, dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, window=window)
        self.post_attn_norm = _norm(cfg, cfg.hidden_size, dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        # sandwich: post_attn_norm norms the attention output; these norm the MLP's in and out
        self.pre_mlp_norm = _norm(cfg, cfg.hidden_size, dtype) if cfg.sandwich_norms else None
        self.post_mlp_norm = _norm(cfg, cfg.hidden_size, dtype) if cfg.sandwich_norms else None

    def __call__(self, x, positions, cache, impl, stats=None, spec=NO_STATS):  # x [B*T, hidden]
        a, cache, stats = self.attn(self.input_norm(x), positions, cache, impl, stats, spec)
        return self.after_attention(x, a), cache, stats

    def after_attention(self, x: jax.Array, a: jax.Array) -> jax.Array:
        """The residual stream [B*T, hidden] after this layer, from its input `x` and its
        attention's output `a` (the MLP half of the block)."""
        if self.pre_mlp_norm is None:
            x = x + a
            return x + self.mlp(self.post_attn_norm(x))
        x = x + self.post_attn_norm(a)
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


# Under jit with impl="xla", trace and lower a layer once per cache type. Kernel impls keep
# the per-layer trace (their tests count one kernel trace per layer).
SHARED_LAYER_PROGRAM = True


def _shared_block():
    """A fresh jitted decoder layer for one `Llama.forward` trace: its layers of equal
    weights' shapes and cache type reuse one traced and lowered body (a `call` that XLA
    inlines, so the compiled program is the same), and tracing and lowering no longer grow
    with the layer count. Fresh per trace so that its trace cache lives only as long as the
    enclosing one (a later trace sees whatever module functions are then in place)."""
    def _block(graphdef, state, x, positions, cache, stats, spec, impl):
        return nnx.merge(graphdef, state)(x, positions, cache, impl, stats, spec)
    return jax.jit(_block, static_argnames=("graphdef", "spec", "impl"))


class Llama(nnx.Module):
    """Decoder-only transformer; `__call__(tokens, positions, cache) -> (logits, cache)`.

    Positions are absolute token indices per sequence; a negative position
    marks a padding token, which is neither cached as visible nor attended.
    """

    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                                 dtype) * 0.02)
        self.layers = nnx.List([Block(cfg, dtype=dtype, rngs=rngs, window=w)
                                for w in cfg.layer_windows])
        self.norm = _norm(cfg, cfg.hidden_size, dtype)
        self.lm_head = None if cfg.tie_embeddings else Dense(
            cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def hidden(self, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
               impl: str = "xla") -> tuple[jax.Array, Cache]:
        """Final-norm hidden states [B, T, hidden] float32 and the updated cache."""
        h, cache, _ = self.forward(tokens, positions, cache, impl=impl)
        return h, cache

    def forward(self, tokens: jax.Array, positions: jax.Array, cache: Cache,
                stats: tuple[LayerStats, ...] | None = None, spec: StatsSpec = NO_STATS, *,
                impl: str = "xla") -> tuple[jax.Array, Cache, tuple[LayerStats, ...] | None]:
        """`hidden` that also folds this step into per-layer policy statistics.

        `stats` comes from `init_stats(spec, ...)` (None collects nothing);
        returns (hidden [B, T, hidden] float32, cache, stats).
        """
        if positions.shape != tokens.shape:
            raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
        return self.forward_embedded(self.embed_tokens(tokens), positions, cache, stats, spec,
                                     impl=impl)

    def forward_embedded(self, x: jax.Array, positions: jax.Array, cache: Cache,
                         stats: tuple[LayerStats, ...] | None = None,
                         spec: StatsSpec = NO_STATS, *, impl: str = "xla"
                         ) -> tuple[jax.Array, Cache, tuple[LayerStats, ...] | None]:
        """`forward` from the residual stream's start `x` [B*T, hidden] float32 (what
        `embed_tokens` makes of tokens, or learned embeddings that stand for no token)."""
        b, t = positions.shape
        if x.shape != (b * t, self.config.hidden_size):
            raise ValueError(f"x {x.shape} must be [B*T, hidden] = "
                             f"{(b * t, self.config.hidden_size)} for positions {positions.shape}")
        kvjax.check_cache(cache, self.config.cache_spec, b)
        # The residual stream stays [B*T, hidden], the kernels' own shape: reshapes around
        # its adds would make XLA's reshape-mover sink them one add per simplification
        # round, ~2 rounds per layer (DECISIONS "Compile: the residual stream in 2-D").
        new_cache, new_stats = [], []
        block = _shared_block()
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            layer_stats = None if stats is None else stats[i]
            if SHARED_LAYER_PROGRAM and impl == "xla" and isinstance(x, jax.core.Tracer):
                graphdef, state = nnx.split(layer)
                x, layer_cache, layer_stats = block(graphdef, state, x, positions,
                                                    layer_cache, layer_stats, spec, impl)
            else:
                x, layer_cache, layer_stats = layer(x, positions, layer_cache, impl,
                                                    layer_stats, spec)
            new_cache.append(layer_cache)
            new_stats.append(layer_stats)
        return (self.norm(x).reshape(b, t, -1), tuple(new_cache),
                None if stats is None else tuple(new_stats))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> their embeddings [B*T, hidden] float32, the residual stream's start
        (Gemma's scaled by sqrt(hidden) rounded to the weights' dtype)."""
        b, t = tokens.shape
        return self.scale_embedded(
            jnp.take(self.embed[...], tokens.reshape(b * t), axis=0).astype(jnp.float32))

    def scale_embedded(self, x: jax.Array) -> jax.Array:
        """Embeddings [N, hidden] float32 as the residual stream starts with them: Gemma's
        times sqrt(hidden) rounded to the weights' dtype (transformers scales `inputs_embeds`
        alike), anyone else's unchanged."""
        if self.config.scale_embeddings:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, self.embed.dtype).astype(jnp.float32)
        return x

    def init_stats(self, spec: StatsSpec, cache: Cache) -> tuple[LayerStats, ...] | None:
        """Empty statistics for `spec` (None when the spec needs nothing per step)."""
        if not spec.per_step:
            return None
        if spec.token_scores is not None:
            cfg = self.config
            spec.token_scores.check_model(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads)
        out_proj = ([layer.attn.o_proj.kernel[...] for layer in self.layers]
                    if spec.output_projection else None)  # W_o [H*D, hidden] per layer
        return init_stats(spec, cache, self.config.num_heads, fixed_rope_frequencies(self.config),
                          out_proj)

    def logits(self, h: jax.Array) -> jax.Array:
        """[..., hidden] float32 -> [..., vocab] float32.

        Tied embeddings [V, D]: a decode step's 1-8 rows on the CPU run in kvjax's few-row
        kernel, reading the embedding in place (`kvjax.core.cpu_kernel.matmul_t`); elsewhere up to
        `FEW_ROWS` rows on XLA:CPU are a multiply-reduce over the contiguous hidden axis,
        which XLA fuses into one loop that reads the embedding once (~35% less CPU than its
        dot at 2-32 rows, docs/DECISIONS.md); one row and long blocks keep the dot.
        """
        logits = self._logits(h)
        cap = self.config.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def _logits(self, h: jax.Array) -> jax.Array:
        if self.lm_head is not None:
            return self.lm_head(h)
        emb = self.embed[...]
        concrete = all(isinstance(n, int) for n in h.shape[:-1])  # not a symbolic export batch
        rows = math.prod(h.shape[:-1]) if concrete else 0

        def without_kernel(h, emb):
            if 2 <= rows <= FEW_ROWS and emb.dtype == jnp.float32 and jax.default_backend() == "cpu":
                rows_h = h.reshape(rows, -1).astype(jnp.float32)  # [N, D]
                out = jnp.sum(emb[None] * rows_h[:, None, :], axis=-1)  # [N, V]; emb first: the
                return out.reshape(*h.shape[:-1], emb.shape[0])  # other order ran 1.7x slower
            return jnp.einsum("...d,vd->...v", h.astype(emb.dtype), emb,
                              preferred_element_type=jnp.float32)

        return cpu_kernel.matmul_t(h, emb, otherwise=without_kernel)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
                 impl: str = "xla") -> tuple[jax.Array, Cache]:
        """tokens, positions: [B, T] int32 -> logits [B, T, vocab] float32, cache."""
        h, cache = self.hidden(tokens, positions, cache, impl=impl)
        return self.logits(h), cache


def new_cache(cfg: LlamaConfig, batch: int, capacity: int, dtype=jnp.float32) -> Cache:
    """An empty cache of `capacity` slots per layer for `cfg`."""
    return kvjax.init_model_cache(cfg.cache_spec, batch, capacity, dtype)


def windowed_layers(model: Llama) -> tuple[int, ...]:
    """The model's sliding-window layers: their cache holds the window by construction
    (`CacheSpec.windows`), so it never runs out of room and no method compresses it."""
    windows = getattr(model.config.cache_spec, "windows", None) or ()
    return tuple(i for i, w in enumerate(windows) if w is not None)
