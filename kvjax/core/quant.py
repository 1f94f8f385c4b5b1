"""Bit packing and uniform quantization: the building blocks of the cache codecs.

Packing. `bits`-bit codes (bits in 1, 2, 4, 8) are packed into uint32 words
along the last axis, in *strided planes*: with `n = 32 // bits` codes per
word and `W = D // n` words, element `e = j * W + w` sits in word `w` at bits
`[j * bits, (j + 1) * bits)`. Unpacking is then `n` shifts of the whole word
vector, concatenated in order: no lane shuffles or gathers, which is what a
Pallas kernel on TPU (32-bit lanes) or GPU wants (docs/DECISIONS.md).

Quantization. `quantize` maps groups of `group` consecutive elements along
one axis to integer codes with one float32 scale (and, asymmetric, one
offset) per group; `dequantize` inverts it to within half a step:
`|x - dequantize(quantize(x))| <= scale / 2` (plus float rounding). A
constant group gets scale 0 and dequantizes exactly.

Example:
    >>> k = jax.random.normal(jax.random.key(0), (2, 8, 64))  # [..., D] per token
    >>> q = quantize(k, bits=4, group=32, axis=-1)
    >>> words = pack(q.codes, 4)                              # [..., D // 8] uint32
    >>> words.shape
    (2, 8, 8)
    >>> k_hat = dequantize(q._replace(codes=unpack(words, 4, k.shape[-1])), group=32, axis=-1)
    >>> bool(jnp.all(jnp.abs(k - k_hat) <= jnp.repeat(q.scale, 32, -1) / 2))  # the error bound
    True
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

BITS = (1, 2, 4, 8)
PARAM_DTYPES = ("float16", "bfloat16", "float32")  # a packed store's scales and offsets


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """[..., D] integer codes < 2**bits -> [..., D * bits // 32] uint32 (strided planes)."""
    _check_bits(bits)
    per_word = 32 // bits
    d = codes.shape[-1]
    if d % per_word:
        raise ValueError(f"pack: the last axis ({d}) must be a multiple of {per_word} "
                         f"for {bits}-bit codes in 32-bit words")
    planes = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], per_word, d // per_word)
    shifts = (jnp.arange(per_word, dtype=jnp.uint32) * bits)[:, None]
    return jnp.bitwise_or.reduce(planes << shifts, axis=-2) if per_word > 1 else planes[..., 0, :]


def unpack(words: jax.Array, bits: int, d: int) -> jax.Array:
    """Inverse of `pack`: [..., D * bits // 32] uint32 -> [..., D] uint8 codes."""
    _check_bits(bits)
    per_word = 32 // bits
    if words.shape[-1] * per_word != d:
        raise ValueError(f"unpack: {words.shape[-1]} words hold {words.shape[-1] * per_word} "
                         f"{bits}-bit codes, not {d}")
    shifts = (jnp.arange(per_word, dtype=jnp.uint32) * bits)[:, None]
    planes = (words[..., None, :] >> shifts) & jnp.uint32((1 << bits) - 1)
    return planes.reshape(*words.shape[:-1], d).astype(jnp.uint8)


class Quantized(NamedTuple):
    """Codes and per-group parameters; `x ~ codes * scale + offset` group-wise."""

    codes: jax.Array  # uint8, the shape of x
    scale: jax.Array  # float32, x's shape with the group axis divided by `group`
    offset: jax.Array  # float32, same shape as scale (symmetric: -2**(bits-1) * scale)


def _grouped(x: jax.Array, group: int, axis: int) -> jax.Array:
    """x with `axis` split into (n_groups, group), the group axis right after."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % group:
        raise ValueError(f"axis {axis} of length {n} is not a multiple of the group size {group}")
    return x.reshape(*x.shape[:axis], n // group, group, *x.shape[axis + 1:])


def round_to(x: jax.Array, dtype, direction: int) -> jax.Array:
    """`x` (float32) in `dtype`, rounded toward +inf (`direction=1`) or -inf (-1).

    Saturates at `dtype`'s largest finite value, so a stored quantization
    parameter is never Inf. Directed rounding keeps the round-trip bound
    exact when parameters are stored in a narrow float (see `quantize`).

    Round to nearest, then step one unit in the last place where that went the
    wrong way: a sign-magnitude float's bit pattern read as an integer grows
    with the magnitude, so the step is +-1 on the bits (from a zero too, whose
    sign the rounding kept). This is `jnp.nextafter` for the finite values met
    here in a few ops instead of its general expansion, which XLA inlines per
    call site: the int8 decode step compiled 2.8x longer than the full one's.

    >>> float(round_to(jnp.float32(0.1), jnp.float16, 1)) > 0.1
    True
    """
    dtype = jnp.dtype(dtype)
    big = float(jnp.finfo(dtype).max)
    x = jnp.clip(x.astype(jnp.float32), -big, big)
    if dtype == jnp.float32:
        return x
    y = x.astype(dtype)
    wrong = (y.astype(jnp.float32) < x) if direction > 0 else (y.astype(jnp.float32) > x)
    uint = jnp.dtype(f"uint{8 * dtype.itemsize}")
    bits = jax.lax.bitcast_convert_type(y, uint)
    away_from_zero = jnp.signbit(y) == (direction < 0)  # the step grows the magnitude
    stepped = jnp.where(away_from_zero, bits + uint.type(1), bits - uint.type(1))
    step = jnp.clip(jax.lax.bitcast_convert_type(stepped, dtype), -big, big)
    return jnp.where(wrong, step, y)


def quantize(x: jax.Array, bits: int, group: int, axis: int = -1,
             symmetric: bool = False, param_dtype=jnp.float32,
             valid: jax.Array | None = None) -> Quantized:
    """Uniform `bits`-bit quantization of groups of `group` elements along `axis`.

    Asymmetric: codes in [0, 2**bits - 1], offset = group min. Symmetric:
    codes - 2**(bits-1) in [-(2**(bits-1) - 1), 2**(bits-1) - 1], offset implied.
    Scale and offset are stored in `param_dtype` (rounded outward: the offset
    down, the scale up), and the codes are computed from the stored values,
    so `|x - dequantize(q)| <= scale / 2` holds for the stored scale.
    `valid` (x's shape, bool) leaves masked elements out of the group range;
    their codes are clipped and meaningless.
    """
    _check_bits(bits)
    axis = axis % x.ndim
    g = _grouped(x.astype(jnp.float32), group, axis)  # [..., n/G, G, ...]
    ok = None if valid is None else _grouped(valid, group, axis)
    red = axis + 1
    reduce = lambda f, fill, a: f(a if ok is None else jnp.where(ok, a, fill), axis=red,
                                  keepdims=True)
    if symmetric:
        if bits == 1:
            raise ValueError("symmetric quantization needs bits >= 2")
        half = 2 ** (bits - 1)
        absmax = reduce(jnp.max, 0.0, jnp.abs(g))
        scale = round_to(absmax / (half - 1), param_dtype, 1).astype(jnp.float32)
        safe = jnp.where(scale > 0, scale, 1.0)
        codes = jnp.clip(jnp.round(g / safe), -(half - 1), half - 1) + half
        offset = -half * scale
    else:
        low = round_to(reduce(jnp.min, jnp.inf, g), param_dtype, -1).astype(jnp.float32)
        high = reduce(jnp.max, -jnp.inf, g)
        low = jnp.where(jnp.isfinite(low), low, 0.0)  # a group with no valid element
        high = jnp.where(jnp.isfinite(high), high, low)
        scale = round_to((high - low) / (2 ** bits - 1), param_dtype, 1).astype(jnp.float32)
        safe = jnp.where(scale > 0, scale, 1.0)
        codes = jnp.clip(jnp.round((g - low) / safe), 0, 2 ** bits - 1)
        offset = low
    squeeze = lambda a: jnp.squeeze(a, red).astype(param_dtype)
    return Quantized(codes.reshape(x.shape).astype(jnp.uint8), squeeze(scale), squeeze(offset))


def dequantize(q: Quantized, group: int, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """`codes * scale + offset`, with each group's parameters broadcast over it."""
    axis = axis % q.codes.ndim
    g = _grouped(q.codes.astype(jnp.float32), group, axis)
    expand = lambda a: jnp.expand_dims(a, axis + 1)
    return (g * expand(q.scale) + expand(q.offset)).reshape(q.codes.shape).astype(dtype)


FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def to_fp8(x: jax.Array, fmt: str = "e4m3") -> jax.Array:
    """Round to an FP8 format (saturating to its largest finite value, never Inf/NaN)."""
    if fmt not in FP8:
        raise ValueError(f"fp8 format must be one of {sorted(FP8)}, got {fmt!r}")
    dtype = FP8[fmt]
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32), -big, big).astype(dtype)
