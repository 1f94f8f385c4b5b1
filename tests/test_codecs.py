"""Codecs: stores round-trip within their bound, compaction moves codes exactly,
KIVI's residual and flush rule, attention over every representation, exact bytes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvjax
from kvjax import EMPTY
from kvjax.core.cache import ResidualCache, init_cache, view, write
from kvjax.core.layout import compact
from kvjax.policies.low_rank import LowRankBasis, accumulate_moments, basis_from_moments, low_rank
from kvjax.core.stores import Latent, PackedChannels, PackedTokens, param_values, put, read, take
from models.sampler import _compress, generate, prefill_batch

D = 32  # head_dim of the store-level tests


def rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def filled_layer(seed, batch=2, kvh=2, n=24, capacity=32, d=D):
    """A dense layer holding n tokens (positions 0..n-1) of random keys and values."""
    k, v = rand(seed, (batch, kvh, n, d)), rand(seed + 1, (batch, kvh, n, d), 3.0)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    return write(init_cache(batch, kvh, capacity, d), k, v, pos), k, v


# ----------------------------------------------------------------------------- stores


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([4, 8, 32]),
       symmetric=st.booleans(), param_dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       offset=st.sampled_from([0.0, 40.0]), seed=st.integers(0, 2**31 - 1))
def test_packed_tokens_round_trip_within_half_a_step(bits, group, symmetric, param_dtype, offset,
                                                     seed):
    x = rand(seed, (3, 5, D)) + offset  # a large offset stresses the rounded fp16/bf16 params
    store = put(PackedTokens.empty(3, 5, D, bits, group, symmetric, jnp.dtype(param_dtype)), x, 0)
    back = np.asarray(read(store))
    assert store.param_dtype == param_dtype
    step = np.repeat(np.asarray(param_values(store.scale), np.float32), group, axis=-1)
    err = np.abs(back - np.asarray(x))
    assert np.all(np.isfinite(back))
    assert np.all(err <= step / 2 + 1e-6 * np.abs(np.asarray(x)) + 1e-6)


def test_float16_parameters_are_stored_as_their_bits_and_float16_arrays_still_read():
    """A per-token store keeps float16 parameters as their uint16 bits (what the TPU kernel
    reads in place); one holding float16 arrays (a checkpoint saved before) reads, encodes
    and attends through the CPU kernel exactly as the bits do."""
    x = rand(3, (2, 8, D)) * 7 + 3
    bits_store = put(PackedTokens.empty(2, 8, D, 4, 32), x, 0)
    assert bits_store.scale.dtype == jnp.uint16 and bits_store.param_dtype == "float16"
    as_f16 = lambda s: s.replace(scale=param_values(s.scale), offset=param_values(s.offset))
    f16_store = as_f16(PackedTokens.empty(2, 8, D, 4, 32))
    assert f16_store.scale.dtype == jnp.float16 and f16_store.param_dtype == "float16"
    f16_store = put(f16_store, x, 0)
    assert f16_store.scale.dtype == jnp.float16  # new tokens keep the store's dtype
    np.testing.assert_array_equal(np.asarray(read(f16_store)), np.asarray(read(bits_store)))
    np.testing.assert_array_equal(np.asarray(f16_store.scale),
                                  np.asarray(param_values(bits_store.scale)))
    layer, _, _ = filled_layer(4, n=24, capacity=32)
    (enc,), _ = kvjax.parse_method("quantize:bits=4").update((layer,), (), None)
    old = enc.replace(k=as_f16(enc.k), v=as_f16(enc.v))
    q = rand(5, (2, 1, 4, D))
    q_pos = jnp.full((2, 1), 24, jnp.int32)
    np.testing.assert_array_equal(np.asarray(kvjax.attend(q, q_pos, old)),
                                  np.asarray(kvjax.attend(q, q_pos, enc)))


@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([2, 8]), symmetric=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_packed_channels_groups_tokens_per_channel(bits, group, symmetric, seed):
    t = 4 * group
    x = rand(seed, (2, t, D)) * jnp.arange(1, D + 1)  # channels of very different ranges
    store = put(PackedChannels.empty(2, t, D, bits, group, symmetric), x, 0)
    assert store.scale.shape[1:] == (t // group, D) and int(store.groups) == t // group
    np.testing.assert_array_equal(np.asarray(store.group_id[0]), np.arange(t) // group)
    # each (group of tokens, channel) has its own scale: the error bound is per channel
    step = np.asarray(store.scale, np.float32)[:, np.arange(t) // group]  # [R, T, D]
    err = np.abs(np.asarray(read(store)) - np.asarray(x))
    assert np.all(err <= step / 2 + 1e-6 * np.abs(np.asarray(x)) + 1e-6)


@pytest.mark.parametrize("make, rtol", [
    (lambda: PackedTokens.empty(2, 8, D, 2, 8), 0),
    (lambda: PackedChannels.empty(2, 8, D, 2, 4), 0),
    # symmetric: a constant sits on the top level, scale rounded up to fp16 (2**-11 relative)
    (lambda: PackedTokens.empty(2, 8, D, 4, 8, symmetric=True), 2e-3),
])
def test_zero_and_constant_inputs_stay_finite_and_exact(make, rtol):
    x = jnp.concatenate([jnp.zeros((2, 4, D)), jnp.full((2, 4, D), -2.5)], axis=1)
    back = read(put(make(), x, 0))
    assert np.all(np.isfinite(np.asarray(back)))
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-6, rtol=rtol)


@pytest.mark.parametrize("kind", ["tokens", "channels", "latent", "fp8"])
def test_compaction_moves_codes_without_drift(kind):
    rows, c = 4, 16
    x = rand(0, (rows, c, D), 2.0)
    store = {"tokens": lambda: PackedTokens.empty(rows, c, D, 2, 8),
             "channels": lambda: PackedChannels.empty(rows, c, D, 2, 4),
             "latent": lambda: Latent.empty(rows, c, jnp.linalg.qr(rand(1, (2, D, 8)))[0]),
             "fp8": lambda: jnp.zeros((rows, c, D), jnp.float8_e4m3fn)}[kind]()
    store = put(store, x, 0)
    before = np.asarray(read(store))
    keep = np.random.default_rng(2).random((rows, c)) < 0.4
    order = np.argsort(np.where(keep, np.arange(c), c + np.arange(c)), axis=1)
    kept = np.arange(c)[None] < keep.sum(1, keepdims=True)
    after = np.asarray(read(take(store, jnp.asarray(order), jnp.asarray(kept))))
    for r in range(rows):
        n = keep[r].sum()
        np.testing.assert_array_equal(after[r, :n], before[r, keep[r]])  # bit-exact
        assert np.all(after[r, n:] == 0) or kind == "channels"
    if kind == "channels":  # the table keeps only groups that still have a token
        compacted = take(store, jnp.asarray(order), jnp.asarray(kept))
        used = [len(set((np.arange(c)[keep[r]] // 4).tolist())) for r in range(rows)]
        assert int(compacted.groups) == max(used)


# ----------------------------------------------------------------------------- KIVI


def kivi_layer(n, residual=8, group=4, capacity=64):
    layer, k, v = filled_layer(0, n=n, capacity=capacity)
    (enc,), _ = kvjax.kivi(bits=2, group=group, residual=residual).update((layer,), (), None)
    return enc, k, v


def test_per_channel_store_past_its_int16_group_ids_is_refused_by_capacity():
    """KIVI's group ids are int16: 32,767 groups of 32 fit, one slot more is refused naming
    the capacity, the group and the most slots it holds (shapes only: nothing allocated)."""
    limit = (2 ** 15 - 1) * 32
    shapes = jax.eval_shape(lambda: PackedChannels.empty(1, limit, D, 4, 32))
    assert shapes.table_rows == 2 ** 15 - 1 and shapes.table.shape == (1, (2 ** 15 - 1) * D)
    with pytest.raises(ValueError, match=f"capacity {limit + 1}: .* groups of 32 tokens holds "
                                         f"at most {limit} slots"):
        PackedChannels.empty(1, limit + 1, D, 4, 32)


def test_kivi_stores_keys_per_channel_and_values_per_token():
    layer, _, _ = kivi_layer(24)
    assert isinstance(layer, ResidualCache)
    assert isinstance(layer.body.k, PackedChannels) and layer.body.k.group == 4
    assert isinstance(layer.body.v, PackedTokens) and layer.body.v.group == 4
    assert layer.body.k.bits == layer.body.v.bits == 2


@pytest.mark.parametrize("n0", [5, 8, 13, 24])
def test_kivi_flushes_whole_groups_and_keeps_the_newest_residual_exact(n0):
    residual, group = 8, 4
    layer, k, v = kivi_layer(n0, residual, group)
    step = jax.jit(write)
    ks, vs = [k], [v]
    for i in range(11):
        n = n0 + i  # tokens already cached
        # before the write: whole groups move out while at least `residual` stay
        expect_body = max(0, (n - residual) // group) * group if i == 0 else \
            max(0, (n - 1 - residual) // group * group)
        if i == 0:
            assert int(layer.body.length) == expect_body
        new_k, new_v = rand(100 + i, (2, 2, 1, D)), rand(200 + i, (2, 2, 1, D))
        layer = step(layer, new_k, new_v, jnp.full((2, 1), n, jnp.int32))
        ks.append(new_k), vs.append(new_v)
        assert int(layer.body.length) == max(0, (n - residual) // group) * group
        assert int(layer.body.length) + int(layer.recent.length) == n + 1
        # the newest `residual` tokens (and everything in `recent`) are exact
        all_k = jnp.concatenate(ks, axis=2).reshape(4, n + 1, D)
        all_v = jnp.concatenate(vs, axis=2).reshape(4, n + 1, D)
        r = int(layer.recent.length)
        assert r >= min(residual, n + 1)
        np.testing.assert_array_equal(np.asarray(layer.recent.k[:, :r]), np.asarray(all_k[:, -r:]))
        np.testing.assert_array_equal(np.asarray(layer.recent.v[:, :r]), np.asarray(all_v[:, -r:]))
        np.testing.assert_array_equal(np.asarray(layer.recent.pos[0, 0, :r]),
                                      np.arange(n + 1 - r, n + 1))
        # the body holds the older tokens, quantized (2-bit: not exact, but close)
        b = int(layer.body.length)
        body = view(layer.body)
        np.testing.assert_array_equal(np.asarray(layer.body.pos[0, 0, :b]), np.arange(b))
        if b:
            assert np.max(np.abs(np.asarray(body.k[:, :b] - all_k[:, :b]))) < 2.5


def test_shrink_with_an_empty_body_keeps_the_exact_part():
    """Fewer tokens than the residual: the shrunk body has no slots at all (once a crash)."""
    layer, _, _ = kivi_layer(5)
    (shrunk,) = kvjax.shrink((kvjax.shrink((layer,), room=0)[0],), room=0)
    assert shrunk.body.capacity == 0 and int(shrunk.recent.length) == 5
    assert kvjax.nbytes(shrunk) < kvjax.nbytes(layer)


def test_residual_layer_rejects_a_write_larger_than_its_exact_part():
    layer, _, _ = kivi_layer(24)
    layer = kvjax.shrink((layer,), room=2)[0]  # exact part: residual + group - 1 + 2 slots
    assert kvjax.free_tokens(layer) == 2 and kvjax.free_tokens(kvjax.shrink((layer,))[0]) == 0
    with pytest.raises(ValueError, match="exact part"):
        write(layer, rand(0, (2, 2, 4, D)), rand(1, (2, 2, 4, D)), jnp.zeros((2, 4), jnp.int32))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("method", ["quantize:bits=4,group=8", "quantize:bits=2,group=8,axis=channel",
                                    "kivi:bits=2,group=4,residual=8", "fp8", "fp8:fmt=e5m2",
                                    "quantize:bits=8,group=32,symmetric=true,residual=4"])
def test_attention_reads_encoded_layers_as_their_dequantized_tensors(method):
    layer, _, _ = filled_layer(3, n=24, capacity=32)
    (enc,), _ = kvjax.parse_method(method).update((layer,), (), None)
    q = rand(9, (2, 3, 4, D))  # 3 queries, 4 query heads (GQA 2)
    q_pos = jnp.array([[23, 24, 25], [20, 24, 30]], jnp.int32)
    dense = view(enc)
    assert dense.k.dtype == jnp.float32 and dense.k.shape[1] == dense.pos.shape[-1]
    expect = kvjax.attend_reference(q, q_pos, dense)
    for impl in ("xla", "reference"):
        np.testing.assert_allclose(np.asarray(kvjax.attend(q, q_pos, enc, impl=impl)),
                                   np.asarray(expect), atol=2e-5, rtol=1e-5)


def orthonormal_basis(num_layers, kvh, d, seed=0):
    q = np.linalg.qr(np.random.default_rng(seed).standard_normal((num_layers, kvh, d, d)))[0]
    energy = np.tile(np.arange(d, 0, -1, dtype=np.float32), (num_layers, kvh, 1))
    return LowRankBasis(q.astype(np.float32), q[..., ::-1].astype(np.float32), energy, energy, 1)


def test_low_rank_scores_in_latent_space_exactly():
    layer, _, _ = filled_layer(4, n=20, capacity=24)
    basis = orthonormal_basis(1, 2, D)
    q, q_pos = rand(5, (2, 2, 4, D)), jnp.array([[19, 25], [10, 19]], jnp.int32)
    full_rank = low_rank(basis, rank=D)
    (enc,), _ = full_rank.update((layer,), full_rank.init((layer,)), None)
    np.testing.assert_allclose(np.asarray(kvjax.attend(q, q_pos, enc)),
                               np.asarray(kvjax.attend(q, q_pos, layer)), atol=2e-5)
    t = low_rank(basis, rank=8, value_rank=4)
    (enc,), _ = t.update((layer,), t.init((layer,)), None)
    assert enc.k.z.shape[-1] == 8 and enc.v.z.shape[-1] == 4
    dense = view(enc)  # keys and values reconstructed as P z
    for impl in ("xla", "reference"):
        np.testing.assert_allclose(np.asarray(kvjax.attend(q, q_pos, enc, impl=impl)),
                                   np.asarray(kvjax.attend_reference(q, q_pos, dense)), atol=2e-5)


def test_calibrated_basis_captures_a_planted_subspace(tiny_model):
    """Bases of real caches: the energy is sorted and rank = head_dim reconstructs exactly."""
    pre = prefill_batch(tiny_model, [list(range(3, 60)), list(range(10, 50))])
    basis = basis_from_moments(accumulate_moments(None, pre.cache))
    cfg = tiny_model.config
    d = cfg.head_dim
    assert basis.keys.shape == (cfg.num_layers, cfg.num_kv_heads, d, d)
    assert np.all(np.diff(basis.key_energy, axis=-1) <= 1e-6)
    eye = np.einsum("lhdi,lhdj->lhij", basis.keys, basis.keys)
    np.testing.assert_allclose(eye, np.broadcast_to(np.eye(d), eye.shape), atol=1e-5)
    k = np.asarray(pre.cache[0].logical_k[0, 0, -40:])  # [40, D] layer 0, head 0 (valid rows)
    energy = np.linalg.svd(k, compute_uv=False) ** 2
    top = np.linalg.norm(k @ basis.keys[0, 0, :, :4]) ** 2
    assert top >= 0.5 * energy[:4].sum()  # the batch's top subspace, not a random one


# ----------------------------------------------------------------------------- memory


def test_nbytes_is_exact_for_every_codec():
    b, kvh, n, cap = 2, 2, 24, 32
    layer, _, _ = filled_layer(6, batch=b, kvh=kvh, n=n, capacity=cap)
    rows, meta = b * kvh, b * kvh * cap * 4 + 4  # pos + cursor
    expect = {
        "quantize:bits=4,group=8": rows * cap * 2 * (D * 4 // 8 + (D // 8) * 2 * 2) + meta,
        "quantize:bits=2,group=8,symmetric=true": rows * cap * 2 * (D * 2 // 8 + (D // 8) * 2) + meta,
        "quantize:bits=8,group=32,param_dtype=float32": rows * cap * 2 * (D + 2 * 4) + meta,
        "fp8": rows * cap * 2 * D + meta,
    }
    for method, nbytes in expect.items():
        (enc,), _ = kvjax.parse_method(method).update((layer,), (), None)
        assert kvjax.nbytes(enc) == nbytes, method
    # KIVI-2, G=4, R=8: body [keys: codes + int16 group id, table of G-groups; values:
    # codes + per-token params], recent dense float32, after shrink with no room
    (enc,), _ = kvjax.kivi(bits=2, group=4, residual=8).update((layer,), (), None)
    (small,) = kvjax.shrink((enc,))
    body_slots, groups = int(small.body.length), int(small.body.k.groups)
    assert body_slots == 16 and small.body.capacity == 16 and small.recent.capacity == 8
    table_rows = small.body.k.scale.shape[1]
    assert table_rows == groups  # no room: no spare rows
    body = rows * body_slots * (D * 2 // 8 + 2 + D * 2 // 8 + (D // 4) * 2 * 2) \
        + rows * table_rows * D * 2 * 2 + 4 + b * kvh * body_slots * 4 + 4
    recent = rows * 8 * D * 4 * 2 + b * kvh * 8 * 4 + 4
    assert kvjax.nbytes(small) == body + recent


# ----------------------------------------------------------------------------- chains


def test_eviction_after_kivi_keeps_the_exact_codes_of_kept_tokens(tiny_model):
    prompts = [list(range(3, 70)), list(range(20, 60))]
    quant = kvjax.kivi(bits=2, group=4, residual=8)
    evict = kvjax.chain(quant, kvjax.snapkv(ratio=0.5, window=4))
    pre = prefill_batch(tiny_model, prompts, stats=evict.stats)
    encoded, _ = _compress(quant.update, jax.tree_util.tree_map(jnp.copy, pre.cache), (), None)
    evicted, _ = _compress(evict.update, pre.cache, evict.init(pre.cache), pre.stats)
    for before, after in zip(encoded, evicted):
        dense_before, dense_after = view(before), view(after)
        for b in range(2):
            for h in range(dense_before.kv_heads):
                pos_b = np.asarray(dense_before.pos[b, h])
                pos_a = np.asarray(dense_after.pos[b, h])
                kept = pos_a[pos_a != EMPTY]
                assert 0 < len(kept) < (pos_b != EMPTY).sum()
                row = b * dense_before.kv_heads + h
                where_b = {p: i for i, p in enumerate(pos_b) if p != EMPTY}
                idx_b = [where_b[p] for p in kept]
                idx_a = np.flatnonzero(pos_a != EMPTY)
                np.testing.assert_array_equal(np.asarray(dense_after.k[row, idx_a]),
                                              np.asarray(dense_before.k[row, idx_b]))
                np.testing.assert_array_equal(np.asarray(dense_after.v[row, idx_a]),
                                              np.asarray(dense_before.v[row, idx_b]))


@pytest.mark.parametrize("method", ["snapkv:ratio=0.5,window=4+kivi:bits=4,group=4,residual=8",
                                    "kivi:bits=4,group=4,residual=8+h2o:ratio=0.5",
                                    "streaming_llm:sinks=2,ratio=0.5+quantize:bits=8,group=16"])
def test_chains_generate_and_keep_the_budget_during_decode(tiny_model, method):
    prompts = [list(range(3, 60)), list(range(9, 40))]
    t = kvjax.parse_method(method)
    out = generate(tiny_model, prompts, max_new_tokens=12, transform=t, compress_every=4)
    assert out.tokens.shape == (2, 12)
    for layer in out.cache:
        counts = np.asarray(kvjax.num_valid(view(layer)))
        assert counts.max() <= 0.5 * 57 + 12  # the budget plus at most one interval of tokens


def test_int8_cache_decodes_like_the_full_cache(tiny_model):
    prompts = [list(range(3, 60)), list(range(9, 40))]
    full = generate(tiny_model, prompts, max_new_tokens=10)
    q8 = generate(tiny_model, prompts, max_new_tokens=10,
                  transform=kvjax.quantize(bits=8, group=16, residual=0))
    assert (full.tokens == q8.tokens).mean() >= 0.9
    assert kvjax.nbytes(q8.cache) < 0.4 * kvjax.nbytes(full.cache)


# ----------------------------------------------------------------------------- errors


def test_bad_codec_arguments_raise():
    with pytest.raises(ValueError, match="bits"):
        kvjax.quantize(bits=3)
    with pytest.raises(ValueError, match="axis"):
        kvjax.quantize(axis="head")
    with pytest.raises(ValueError, match="multiple"):
        kvjax.kivi(group=32, residual=100)
    with pytest.raises(ValueError, match="fp8"):
        kvjax.fp8("e3m4")
    with pytest.raises(ValueError, match="param_dtype"):
        kvjax.quantize(param_dtype="float64")
    layer, _, _ = filled_layer(0)
    with pytest.raises(ValueError, match="group size"):
        kvjax.quantize(bits=4, group=12).update((layer,), (), None)
    with pytest.raises(ValueError, match="already encoded"):
        kvjax.parse_method("fp8+quantize:bits=4").update((layer,), ((), ()), None)
    pooled = kvjax.pool_heads(layer)
    with pytest.raises(ValueError, match="per-head"):
        kvjax.kivi(bits=2, group=4, residual=8).update((pooled,), (), None)
    with pytest.raises(ValueError, match="rank"):
        low_rank(orthonormal_basis(1, 2, D), rank=D + 1)
    with pytest.raises(ValueError, match="layers"):
        low_rank(orthonormal_basis(3, 2, D), rank=4).init((layer,))
    with pytest.raises(FileNotFoundError, match="calibrate"):
        kvjax.parse_method("low_rank:rank=4,basis=/nonexistent/basis.npz")
