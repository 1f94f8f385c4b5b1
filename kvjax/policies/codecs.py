"""Codecs: transforms that change how cached keys and values are stored.

A codec's first `update` re-encodes every layer of a dense cache; the layer
then encodes the tokens the model writes later by itself, so later updates
change nothing. Tokens are never requantized: compaction after eviction
moves their codes and parameters exactly (`kvjax.core.stores`).

- `quantize(bits, group, axis, symmetric, residual)`: uniform integer codes,
  bit-packed into uint32 words. `axis="token"`: each token's channels in
  groups of `group`; `axis="channel"`: each channel over groups of `group`
  consecutive tokens (the newest partial group stays exact).
- `kivi(bits, group, residual)`: keys per channel, values per token, the
  newest `residual` tokens exact (Liu et al. 2024, "KIVI").
- `fp8(fmt)`: keys and values stored as float8 (e4m3 or e5m2), saturating.
- `low_rank(basis, rank)`: keys and values stored as rank-r coordinates on
  calibrated per-head bases (`kvjax.policies.low_rank`).

Chains put eviction and codecs together: `chain(snapkv(ratio=0.5), kivi(bits=2))`
evicts at full precision, then quantizes what is kept;
`chain(kivi(bits=2), snapkv(ratio=0.5))` quantizes first and evicts codes.

Example:
    >>> import kvjax
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 64), 1, 1024, dtype=jnp.float16)
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 1024, 64), jnp.float16)
    >>> cache = (kvjax.write(cache[0], k, v, jnp.arange(1024)[None]),)   # 1024 tokens
    >>> t = kivi(bits=2, group=32, residual=32)
    >>> small, state = t.update(cache, t.init(cache), None)
    >>> round(kvjax.nbytes(kvjax.shrink(small)) / kvjax.nbytes(cache), 2)  # of the fp16 cache
    0.23
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY, Cache, ResidualCache, TokenCache, flush_residual
from kvjax.core.layer import has_exact_part
from kvjax.core.layout import map_layers
from kvjax.core.stores import Latent, PackedChannels, PackedTokens, is_dense, is_encoded, put
from kvjax.core.quant import FP8, PARAM_DTYPES
from kvjax.core.transforms import CacheTransform, EmptyState

AXES = ("token", "channel")


@dataclasses.dataclass(frozen=True)
class Codec:
    """Static description of how one tensor (keys or values) is stored.

    kind: "tokens" (per-token groups of channels), "channels" (per-channel
    groups of tokens), "fp8" (float8 array; `fmt` in `bits`' place), or
    "latent" (low-rank; the basis comes from the transform state).
    """

    kind: str
    bits: int = 0
    group: int = 1
    symmetric: bool = False
    param_dtype: str = "float16"
    fmt: str = "e4m3"

    def empty(self, rows: int, capacity: int, dim: int, basis: jax.Array | None = None,
              dtype=jnp.float32) -> Any:
        """An empty store; `dtype` is the dense cache's (latent coordinates use it)."""
        if self.kind == "tokens":
            return PackedTokens.empty(rows, capacity, dim, self.bits, self.group, self.symmetric,
                                      jnp.dtype(self.param_dtype))
        if self.kind == "channels":
            return PackedChannels.empty(rows, capacity, dim, self.bits, self.group,
                                        self.symmetric, jnp.dtype(self.param_dtype))
        if self.kind == "fp8":
            return jnp.zeros((rows, capacity, dim), FP8[self.fmt])
        if self.kind == "latent":
            return Latent.empty(rows, capacity, basis, dtype)
        raise ValueError(f"unknown codec kind {self.kind!r}")


def _check_uniform(bits: int, group: int, axis: str, param_dtype: str) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {param_dtype!r}")


def _uniform(bits, group, axis, symmetric, param_dtype) -> Codec:
    _check_uniform(bits, group, axis, param_dtype)
    return Codec("tokens" if axis == "token" else "channels", bits, group, symmetric, param_dtype)


def _encoded_as(layer: Any, codecs: tuple[Codec, Codec], residual: int) -> bool:
    """True when `layer` is stored the way `codecs` store it."""
    if has_exact_part(layer) != bool(residual or any(c.kind == "channels" for c in codecs)):
        return False
    if has_exact_part(layer):
        if layer.residual != residual:
            return False
        layer = layer.body
    for store, codec in zip((layer.k, layer.v), codecs):
        kind = "fp8" if is_dense(store) else store.codec_kind
        if kind != codec.kind or (kind in ("tokens", "channels")
                                  and (store.bits, store.group) != (codec.bits, codec.group)):
            return False
    return True


def _encode_layer(layer: Any, codecs: tuple[Codec, Codec], residual: int, block: int,
                  basis: tuple[Any, Any] = (None, None)) -> Any:
    """A dense layer in the codecs' encoding; an already encoded layer is returned unchanged."""
    if has_exact_part(layer) or is_encoded(layer.k):
        if not _encoded_as(layer, codecs, residual):
            raise ValueError("the cache is already encoded by another codec; chain one codec")
        return layer  # encoded by this codec's first update; new tokens encode on write
    rows, capacity, dim = layer.k.shape
    if layer.pooled and any(c.kind in ("channels", "latent") for c in codecs):
        raise ValueError("per-channel and low-rank codecs need per-head rows; apply head-wise "
                         "eviction after them, or use a per-token codec")
    stores = [c.empty(rows, capacity, dim, b, layer.k.dtype) for c, b in zip(codecs, basis)]
    if not residual and block == 1:
        return layer.replace(k=put(stores[0], layer.k, 0), v=put(stores[1], layer.v, 0))
    body = TokenCache(k=stores[0], v=stores[1], pos=jnp.full(layer.pos.shape, EMPTY, jnp.int32),
                      length=jnp.zeros((), jnp.int32),
                      mass=None if layer.mass is None else jnp.zeros_like(layer.mass))
    return flush_residual(ResidualCache(body=body, recent=layer, residual=residual, block=block))


@functools.lru_cache(maxsize=None)
def _codec_update(codecs: tuple[Codec, Codec], residual: int, block: int):
    def update(cache: Cache, state, stats=None):
        bases = tuple(tuple(b) for b in state) if state else ((None, None),) * len(cache)
        encode = lambda layer, base: _encode_layer(layer, codecs, residual, block, base)
        return map_layers(encode, cache, bases), state  # one compiled body per equal layers
    return update


def _codec_transform(codecs: tuple[Codec, Codec], residual: int = 0, block: int = 1,
                     init=lambda cache: EmptyState()) -> CacheTransform:
    return CacheTransform(init=init, update=_codec_update(codecs, residual, block))


def quantize(bits: int = 4, group: int = 32, axis: str = "token", symmetric: bool = False,
             residual: int = 0, param_dtype: str = "float16") -> CacheTransform:
    """Store keys and values as `bits`-bit uniform codes (bit-packed), both the same way.

    Args:
      bits: 2, 4 or 8.
      group: elements sharing one scale (and offset): channels of a token
        (`axis="token"`) or consecutive tokens of a channel (`axis="channel"`).
      symmetric: scale only (codes centred on zero); else scale and offset.
      residual: the newest tokens kept exact. With `axis="channel"` tokens
        are encoded a whole group at a time, so up to `group - 1` more stay exact.
      param_dtype: storage of scales and offsets (rounded outward, so the
        error bound `scale / 2` still holds).

    Example:
        >>> import kvjax
        >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 64), batch=1, capacity=16)
        >>> t = quantize(bits=4, group=32)   # scale + offset in fp16 per 32 channels
        >>> small, _ = t.update(cache, t.init(cache), None)
        >>> kvjax.nbytes(small[0].k) * 8 / (16 * 64)   # bits per element: 4 + 2 x 16 / 32
        5.0
    """
    codec = _uniform(bits, group, axis, symmetric, param_dtype)
    if residual < 0:
        raise ValueError(f"residual must be >= 0, got {residual}")
    block = group if axis == "channel" else 1
    return _codec_transform((codec, codec), residual, block)


def kivi(bits: int = 2, group: int = 32, residual: int = 128,
         param_dtype: str = "float16") -> CacheTransform:
    """KIVI: keys quantized per channel (groups of `group` tokens), values per token
    (groups of `group` channels), asymmetric; the newest `residual` tokens exact.

    Keys leave the exact window a whole group at a time, so between `residual`
    and `residual + group - 1` of the newest tokens are exact (KIVI's code
    flushes all `residual` at once; here the newest `residual` are always exact).

    Example:
        >>> t = kivi(bits=2, group=32, residual=128)   # the paper's LongBench setting
    """
    keys = _uniform(bits, group, "channel", False, param_dtype)
    values = _uniform(bits, group, "token", False, param_dtype)
    if residual < 0 or residual % group:
        raise ValueError(f"kivi: residual ({residual}) must be a non-negative multiple of the "
                         f"group ({group})")
    return _codec_transform((keys, values), residual, group)


def fp8(fmt: str = "e4m3") -> CacheTransform:
    """Store keys and values as float8 (`e4m3` or `e5m2`); values beyond the range saturate.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 64), batch=1, capacity=16)
        >>> t = fp8("e4m3")
        >>> small, _ = t.update(cache, t.init(cache), None)
        >>> str(small[0].k.dtype), kvjax.nbytes(small[0].k)   # 1 byte per element, no scales
        ('float8_e4m3fn', 1024)
    """
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"fp8 format must be 'e4m3' or 'e5m2', got {fmt!r}")
    codec = Codec("fp8", fmt=fmt)
    return _codec_transform((codec, codec))
