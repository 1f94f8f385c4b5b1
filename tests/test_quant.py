"""Packing and uniform quantization: exact round trips and per-element error bounds."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvjax.core.quant import dequantize, pack, quantize, to_fp8, unpack


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), words=st.integers(1, 5), rows=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_is_exact_for_every_value(bits, words, rows, seed):
    d = words * 32 // bits
    codes = np.random.default_rng(seed).integers(0, 2**bits, (rows, d))
    codes[0, :] = 2**bits - 1  # all bits set survives the shifts
    packed = pack(jnp.asarray(codes, jnp.uint8), bits)
    assert packed.dtype == jnp.uint32 and packed.shape == (rows, words)
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits, d)), codes)


def test_pack_layout_is_strided_planes():
    codes = jnp.arange(16, dtype=jnp.uint8) % 4  # 2-bit codes, one word
    word = int(pack(codes, 2)[0])
    assert all(((word >> (2 * j)) & 3) == int(codes[j]) for j in range(16))  # W = 1: e = j
    codes = jnp.arange(16, dtype=jnp.uint8)  # 4-bit codes, two words: e = j*2 + w
    w0, w1 = (int(x) for x in pack(codes, 4))
    assert [(w0 >> (4 * j)) & 15 for j in range(8)] == list(range(0, 16, 2))
    assert [(w1 >> (4 * j)) & 15 for j in range(8)] == list(range(1, 16, 2))


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), symmetric=st.booleans(), axis=st.sampled_from([0, 1]),
       group=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_round_trip_error_is_at_most_half_a_step(bits, symmetric, axis, group, seed, scale):
    x = np.random.default_rng(seed).standard_normal((8, 16)).astype(np.float32) * scale
    q = quantize(jnp.asarray(x), bits, group, axis=axis, symmetric=symmetric)
    assert q.codes.dtype == jnp.uint8 and int(q.codes.max()) < 2**bits
    back = np.asarray(dequantize(q, group, axis=axis))
    step = np.repeat(np.asarray(q.scale), group, axis=axis)
    assert np.all(np.abs(back - x) <= step / 2 + 1e-6 * np.abs(x) + 1e-7)
    if symmetric:
        np.testing.assert_array_less(np.abs(np.asarray(q.codes, int) - 2 ** (bits - 1)), 2 ** (bits - 1))


@pytest.mark.parametrize("symmetric", [False, True])
def test_zero_and_constant_groups_are_exact_and_finite(symmetric):
    x = jnp.array([[0.0, 0.0, 0.0, 0.0], [3.5, 3.5, 3.5, 3.5], [-2.0, -2.0, -2.0, -2.0]])
    q = quantize(x, 2, 4, axis=-1, symmetric=symmetric)
    back = dequantize(q, 4, axis=-1)
    assert np.all(np.isfinite(np.asarray(q.scale))) and np.all(np.isfinite(np.asarray(back)))
    if not symmetric:
        np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    else:  # a constant group sits at its absmax: the top symmetric level
        np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=1e-6)


def test_fp8_saturates_instead_of_overflowing():
    x = jnp.array([1e6, -1e6, 0.1, jnp.float32(300.0)])
    for fmt in ("e4m3", "e5m2"):
        y = np.asarray(to_fp8(x, fmt).astype(jnp.float32))
        assert np.all(np.isfinite(y)) and y[0] > 400 and y[1] < -400
    # 0.1 = 1.6 * 2^-4 rounds to the nearest value with 3 (e4m3) or 2 (e5m2) mantissa bits:
    # 1.625 * 2^-4 and 1.5 * 2^-4, within half a unit of the last place, 2^-4 and 2^-3 relative
    for fmt, mantissa, want in (("e4m3", 3, 0.1015625), ("e5m2", 2, 0.09375)):
        got = float(np.asarray(to_fp8(x, fmt).astype(jnp.float32))[2])
        assert got == want, (fmt, got)
        assert abs(got - 0.1) <= 0.1 * 2.0 ** -(mantissa + 1)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="bits"):
        pack(jnp.zeros((8,), jnp.uint8), 3)
    with pytest.raises(ValueError, match="multiple"):
        pack(jnp.zeros((6,), jnp.uint8), 4)
    with pytest.raises(ValueError, match="group"):
        quantize(jnp.zeros((4, 6)), 4, 4, axis=-1)
    with pytest.raises(ValueError, match="fp8"):
        to_fp8(jnp.zeros(3), "e3m4")
