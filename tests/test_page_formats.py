"""The reference's page decoding against independent dequantizations, for every page format.

`paged_attention_reference` decodes pages with the same `decode` the kernel
runs, so the kernel/reference equality tests cannot catch a decode that is
wrong in both. Here every format's decode is checked against (1) a numpy
dequantization written from the format's definition (codes, strided bit
planes, 16-bit parameter pairs built with numpy's own float16/bfloat16
views), and (2) kvjax's own `stores.read()` through `kvjax.backends.pallas`'s
conversion of a real cache layer.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kvjax
from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import decode_pages
from kvjax.backends import pallas as ka
from kvjax.core.cache import init_cache, write

NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def f32_close(got, want):
    """Equal up to a few float32 roundings (the decode is one multiply-add per element)."""
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=4e-7,
                               atol=4e-7 * float(np.abs(want).max() + 1e-30))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_widening_is_exact_for_every_bit_pattern(dtype):
    """All 65536 16-bit patterns widen like numpy's cast (NaNs stay NaN)."""
    bits = np.arange(2 ** 16, dtype=np.uint32)
    got = np.asarray(pf.half_to_f32(jnp.asarray(bits.astype(np.int32)), dtype))
    want = bits.astype(np.uint16).view(NP_DTYPES[dtype]).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


def numpy_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [P, S, D] -> [P, W, S] uint32: word w holds channels j*W + w at bit j*bits."""
    p, s, d = codes.shape
    w = d * bits // 32
    words = np.zeros((p, w, s), np.uint32)
    for c in range(d):
        words[:, c % w, :] |= codes[:, :, c].astype(np.uint32) << np.uint32((c // w) * bits)
    return words


def numpy_pairs(rows: np.ndarray, dtype: str) -> np.ndarray:
    """[..., n, L] params -> uint32 words: 16-bit rows i (low half) and i + ceil(n/2) (high)."""
    if dtype == "float32":
        return rows.astype(np.float32).view(np.uint32)
    n = rows.shape[-2]
    half = -(-n // 2)
    h = rows.astype(NP_DTYPES[dtype]).view(np.uint16).astype(np.uint32)
    hi = np.zeros_like(h[..., :half, :])
    hi[..., : n - half, :] = h[..., half:, :]
    return h[..., :half, :] | (hi << np.uint32(16))


def params_as(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(NP_DTYPES[dtype]).astype(np.float32)


TOKEN_CASES = [(b, g, sym, pd) for b, g in ((8, 64), (4, 32), (2, 16)) for sym in (False, True)
               for pd in ("float16", "bfloat16", "float32")]


@pytest.mark.parametrize("bits,group,symmetric,param_dtype", TOKEN_CASES)
def test_per_token_pages_decode_like_numpy(bits, group, symmetric, param_dtype):
    rng = np.random.default_rng(bits * 7 + group)
    p, s, d = 3, 16, 64
    codes = rng.integers(0, 2 ** bits, size=(p, s, d))
    ng = d // group
    scale = params_as(rng.random((p, s, ng)) * 0.2 + 1e-6, param_dtype)
    scale[0, 0, 0] = 6e-8 if param_dtype == "float16" else scale[0, 0, 0]  # a subnormal half
    offset = params_as(rng.normal(size=(p, s, ng)), param_dtype)
    per_ch = lambda x: np.repeat(x, group, axis=-1)  # [P, S, D]
    lo = -(2.0 ** (bits - 1)) * per_ch(scale) if symmetric else per_ch(offset)
    want = codes * per_ch(scale) + lo
    params = scale if symmetric else np.concatenate([scale, offset], axis=-1)  # [P, S, n]
    pages = np.concatenate([numpy_words(codes, bits),
                            numpy_pairs(np.swapaxes(params, 1, 2), param_dtype)], axis=1)
    pages = pages.reshape(p, 1, -1)  # lane-flat: row r of a page at lanes r*S...
    fmt = pf.PackedTokens(bits, group, symmetric, param_dtype)
    fmt.check((jnp.asarray(pages),), d)
    f32_close(decode_pages(fmt, (jnp.asarray(pages),), d), want)


@pytest.mark.parametrize("bits,symmetric,param_dtype",
                         [(b, sym, pd) for b in (4, 2) for sym in (False, True)
                          for pd in ("float16", "bfloat16", "float32")])
def test_per_channel_pages_decode_like_numpy(bits, symmetric, param_dtype):
    rng = np.random.default_rng(bits + 3 * symmetric)
    p, s, d, window = 2, 32, 64, 3
    codes = rng.integers(0, 2 ** bits, size=(p, s, d))
    local = rng.integers(0, window, size=(p, s))
    scale = params_as(rng.random((p, window, d)) * 0.2, param_dtype)
    offset = params_as(rng.normal(size=(p, window, d)), param_dtype)
    slot_scale = np.take_along_axis(scale, local[..., None], axis=1)  # [P, S, D]
    slot_offset = (-(2.0 ** (bits - 1)) * slot_scale if symmetric
                   else np.take_along_axis(offset, local[..., None], axis=1))
    want = codes * slot_scale + slot_offset
    pages = np.concatenate([numpy_words(codes, bits), local[:, None].astype(np.uint32)], axis=1)
    table = numpy_pairs(scale if symmetric else np.concatenate([scale, offset], axis=1),
                        param_dtype)
    fmt = pf.PackedChannels(bits, window, symmetric, param_dtype)
    arrays = (jnp.asarray(pages.reshape(p, 1, -1)), jnp.asarray(table.reshape(p, 1, -1)))
    fmt.check(arrays, d)
    f32_close(decode_pages(fmt, arrays, d), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn,
                                   jnp.float8_e5m2])
def test_dense_pages_decode_to_their_values(dtype):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 64)), dtype)
    np.testing.assert_array_equal(np.asarray(decode_pages(pf.DENSE, (x,), 64)),
                                  np.asarray(x.astype(jnp.float32)))


def cache_layer(method, capacity=64, n=45, kvh=2, d=64):
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.normal(size=(2, kvh, n, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, kvh, n, d)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (2, n))
    layer = write(init_cache(2, kvh, capacity, d), k, v, pos)
    (out,), _ = kvjax.parse_method(method).update((layer,), (), None)
    return out


@pytest.mark.parametrize("method", [
    "fp8:fmt=e4m3", "quantize:bits=8,group=64", "quantize:bits=4", "quantize:bits=2,group=16",
    "quantize:bits=4,symmetric=true", "quantize:bits=2,group=32,symmetric=true",
    "quantize:bits=4,param_dtype=bfloat16", "quantize:bits=4,axis=channel",
    "quantize:bits=2,axis=channel,symmetric=true", "kivi:bits=2,group=16,residual=16",
    "kivi:bits=4,group=8,residual=8"])
def test_kernel_pages_of_a_cache_decode_to_what_the_store_reads(method):
    """kvjax's cache stores, converted to kernel pages, decode to `store.read()` slot by slot."""
    layer = cache_layer(method)
    layer = layer.body if isinstance(layer, kvjax.ResidualCache) else layer
    inputs = ka.kernel_inputs(layer)
    assert inputs is not None
    page = inputs["pos_pages"].shape[-1]
    valid = np.asarray(layer.pos != kvjax.EMPTY).reshape(-1)
    for side in ("k", "v"):
        store = getattr(layer, side)
        want = np.asarray(store if isinstance(store, jax.Array) else store.read(),
                          np.float32).reshape(-1, store.shape[-1])
        got = decode_pages(inputs[f"{side}_format"], inputs[f"{side}_pages"], store.shape[-1])
        got = np.asarray(got).reshape(-1, store.shape[-1])
        assert got.shape[0] == valid.shape[0] and page >= 8
        f32_close(got[valid], want[valid])


@pytest.mark.parametrize("bits,group,symmetric,param_dtype", TOKEN_CASES)
def test_per_token_row_pages_decode_like_numpy(bits, group, symmetric, param_dtype):
    """`PackedTokenRows` (words [P, W, S], scale and offset [P, NG, S]: a store's own arrays,
    slot-last) decodes like the numpy dequantization, and its `from_store` gives the words and
    the parameters as they are (float16 as its bits in uint16: Mosaic takes no float16)."""
    rng = np.random.default_rng(bits * 5 + group)
    p, s, d = 3, 16, 64
    codes = rng.integers(0, 2 ** bits, size=(p, s, d))
    ng = d // group
    scale = params_as(rng.random((p, s, ng)) * 0.2 + 1e-6, param_dtype)
    offset = params_as(rng.normal(size=(p, s, ng)), param_dtype)
    per_ch = lambda x: np.repeat(x, group, axis=-1)
    lo = -(2.0 ** (bits - 1)) * per_ch(scale) if symmetric else per_ch(offset)
    want = codes * per_ch(scale) + lo
    dt = NP_DTYPES[param_dtype]
    as_bits = lambda x: np.ascontiguousarray(np.swapaxes(x.astype(dt), 1, 2)).view(
        np.uint16 if param_dtype == "float16" else dt)
    params = (scale,) if symmetric else (scale, offset)
    numpy_arrays = (numpy_words(codes, bits), *map(as_bits, params))
    fmt = pf.PackedTokenRows(bits, group, symmetric, param_dtype)
    store_words = jnp.asarray(np.swapaxes(numpy_arrays[0], 1, 2))  # a store's [P, S, W]
    arrays = fmt.from_store(store_words, jnp.asarray(scale.astype(dt)),
                            None if symmetric else jnp.asarray(offset.astype(dt)))
    assert len(arrays) == len(numpy_arrays) == fmt.arity()
    for got, ref in zip(arrays, numpy_arrays):
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(got), ref)
    fmt.check(arrays, d)
    with pytest.raises(ValueError, match="per-token scale pages must be"):
        fmt.check((arrays[0], arrays[1].astype(jnp.int32), *arrays[2:]), d)
    f32_close(decode_pages(fmt, arrays, d), want)


@pytest.mark.parametrize("method", ["quantize:bits=4", "quantize:bits=8,group=64",
                                    "quantize:bits=2,group=32,symmetric=true",
                                    "quantize:bits=4,param_dtype=bfloat16", "fp8:fmt=e4m3", "full"])
def test_row_pools_of_a_cache_decode_to_what_the_store_reads(method):
    """A cache with lane-aligned pages (S = 128) goes to the TPU kernel as row pools; their
    pages (`rows_as_pages`) decode to `store.read()` slot by slot."""
    from kernels_pallas.paged_attention import rows_as_pages
    layer = cache_layer(method, capacity=256, n=200)
    inputs = ka.kernel_inputs(layer, backend="tpu")
    assert inputs["row_pages"] == 1
    k_fmt, v_fmt = inputs["k_format"], inputs["v_format"]
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)
    pos, k, v = rows_as_pages(inputs["pos_pages"], as_tuple(inputs["k_pages"]),
                              as_tuple(inputs["v_pages"]), k_fmt, v_fmt, inputs["row_pages"])
    valid = np.asarray(layer.pos != kvjax.EMPTY).reshape(-1)
    np.testing.assert_array_equal(np.asarray(pos).reshape(-1), np.asarray(layer.pos).reshape(-1))
    for store, fmt, arrays in ((layer.k, k_fmt, k), (layer.v, v_fmt, v)):
        want = np.asarray(store if isinstance(store, jax.Array) else store.read(),
                          np.float32).reshape(-1, store.shape[-1])
        got = np.asarray(decode_pages(fmt, arrays, store.shape[-1])).reshape(want.shape)
        f32_close(got[valid], want[valid])


@pytest.mark.parametrize("bits,symmetric,param_dtype,d", [
    (4, False, "float16", 64), (2, True, "bfloat16", 64), (4, False, "float32", 128),
    (8, True, "float32", 64), (2, False, "bfloat16", 128)])
def test_per_channel_row_pools_decode_like_numpy(bits, symmetric, param_dtype, d):
    """`PackedChannelRows` (KIVI keys read where the store keeps them: its words, each slot's
    row in its page's table window, the lane-flat table of one uint32 row per group) decodes
    every valid slot like the numpy dequantization of the store; the window starts are
    multiples of `row_align` rows (128-lane aligned copies); a page whose groups spread wider
    than its window is reported (`fits` False)."""
    from kernels_pallas.paged_attention import rows_as_pages
    rng = np.random.default_rng(bits * 11 + d)
    r, c, page, group = 3, 256, 64, 8
    ng = c // group
    ids = np.repeat(np.arange(ng), group)[None].repeat(r, 0)  # [R, C] in write order
    ids[1, :100] = ids[1, 28:128]  # row 1: an evicted prefix compacted (ids still ascending)
    valid = np.ones((r, c), bool)
    valid[2, 200:] = False  # row 2 shorter
    codes = rng.integers(0, 2 ** bits, size=(r, c, d))
    scale = params_as(rng.random((r, ng, d)) * 0.2 + 1e-3, param_dtype)
    offset = params_as(rng.normal(size=(r, ng, d)), param_dtype)
    take = lambda t: np.take_along_axis(t, ids[..., None], axis=1)
    want = codes * take(scale) + (-(2.0 ** (bits - 1)) * take(scale) if symmetric
                                  else take(offset))
    words = np.swapaxes(numpy_words(codes, bits), 1, 2)  # a store's [R, C, W]
    lanes = (2 if param_dtype == "float32" and not symmetric else 1) * d
    fmt = pf.PackedChannelRows(bits, pf.PackedChannelRows.window_rows(page, group, lanes),
                               symmetric, param_dtype)
    dt = NP_DTYPES[param_dtype]
    table = fmt.pack_table(jnp.asarray(scale.astype(dt)),
                           None if symmetric else jnp.asarray(offset.astype(dt))).reshape(r, -1)
    arrays, starts, fits = fmt.from_store(
        jnp.asarray(words), jnp.asarray(ids, jnp.int16), jnp.asarray(valid), table, page)
    assert bool(fits)
    # ids and table as the kernel reads positions: a row a sublane, [R / n, n, ...]
    assert arrays[1].shape == (r, 1, c) and arrays[2].shape == (r, 1, ng * lanes)
    first = np.asarray(pf.unpack_pairs(starts, r * c // page))  # each page's first table row
    assert starts.shape == (r * c // page // 2,) and np.all(first * lanes % 128 == 0)
    window = lambda p, i: ids[p // (c // page), (p % (c // page)) * page + i]
    assert all(0 <= window(p, 0) - first[p] < fmt.window for p in range(r * c // page))
    pos = jnp.where(jnp.asarray(valid), jnp.arange(c), -1)[:, None].astype(jnp.int32)
    _, k, _ = rows_as_pages(pos, arrays, (pos,), fmt, pf.DENSE_T, c // page, starts)
    fmt.check(k, d)
    got = np.asarray(decode_pages(fmt, k, d)).reshape(r, c, d)
    f32_close(got[valid], want[valid])
    spread = ids.copy()
    spread[0, 1] = ng - 1  # one slot of page 0 in the last group
    assert not bool(fmt.from_store(jnp.asarray(words), jnp.asarray(spread, jnp.int16),
                                   jnp.asarray(valid), table, page)[2])


@pytest.mark.parametrize("method", ["kivi:bits=4,group=32,residual=32",
                                    "kivi:bits=2,group=16,residual=16,param_dtype=bfloat16",
                                    "kivi:bits=4,group=32,residual=32,param_dtype=float32"])
def test_kivi_row_pools_of_a_cache_decode_to_what_the_store_reads(method):
    """A KIVI body with lane-aligned pages goes to the TPU kernel as row pools: keys in
    `PackedChannelRows` (the store's own words; `table_windows` names each page's window) and
    values in `PackedTokenRows`; their pages decode to `store.read()` slot by slot."""
    from kernels_pallas.paged_attention import rows_as_pages
    layer = cache_layer(method, capacity=256, n=250).body
    assert layer.capacity % 128 == 0
    inputs = ka.kernel_inputs(layer, backend="tpu")
    k_fmt, v_fmt = inputs["k_format"], inputs["v_format"]
    assert isinstance(k_fmt, pf.PackedChannelRows) and isinstance(v_fmt, pf.PackedTokenRows)
    assert inputs["k_pages"][0].shape == (4, 64 * layer.k.bits // 32, layer.capacity)
    pos, k, v = rows_as_pages(inputs["pos_pages"], inputs["k_pages"], inputs["v_pages"], k_fmt,
                              v_fmt, inputs["row_pages"], inputs["table_windows"])
    valid = np.asarray(layer.pos != kvjax.EMPTY).reshape(-1)
    assert valid.sum() > 0
    for store, fmt, arrays in ((layer.k, k_fmt, k), (layer.v, v_fmt, v)):
        want = np.asarray(store.read(), np.float32).reshape(-1, 64)
        got = np.asarray(decode_pages(fmt, arrays, 64)).reshape(want.shape)
        f32_close(got[valid], want[valid])
