import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import EMPTY


def test_init_cache_is_empty_and_sized():
    c = kvjax.init_cache(batch=2, kv_heads=3, capacity=16, head_dim=8)
    assert c.k.shape == c.v.shape == (6, 16, 8)  # batch and KV heads folded
    assert c.logical_k.shape == (2, 3, 16, 8) and (c.batch, c.kv_heads, c.capacity) == (2, 3, 16)
    assert c.pos.shape == (2, 3, 16) and c.pos.dtype == jnp.int32
    assert bool(jnp.all(c.pos == EMPTY)) and int(c.length) == 0
    assert np.all(np.asarray(kvjax.num_valid(c)) == 0)


def test_nbytes_is_exact():
    c = kvjax.init_cache(batch=2, kv_heads=3, capacity=16, head_dim=8, dtype=jnp.bfloat16)
    want = 2 * (2 * 3 * 16 * 8 * 2) + 2 * 3 * 16 * 4 + 4
    assert kvjax.nbytes(c) == want
    assert kvjax.nbytes(jax.eval_shape(lambda: c)) == want  # works on shape structs too
    model_cache = kvjax.init_model_cache(kvjax.CacheSpec(5, 3, 8), batch=2, capacity=16)
    assert kvjax.nbytes(model_cache) == 5 * (2 * (2 * 3 * 16 * 8 * 4) + 2 * 3 * 16 * 4 + 4)
    # as a bfloat16 cache stores it: float32 keys and values at 2 bytes, positions as they are
    assert kvjax.nbytes(model_cache, float_dtype=jnp.bfloat16) == \
        5 * (2 * (2 * 3 * 16 * 8 * 2) + 2 * 3 * 16 * 4 + 4)
    fp8 = {"codes": jnp.zeros((4, 8), jnp.float8_e4m3fn), "scale": jnp.zeros((4,), jnp.float32)}
    assert kvjax.nbytes(fp8, float_dtype=jnp.bfloat16) == 4 * 8 * 1 + 4 * 2  # fp8 not widened


def test_write_appends_at_cursor_and_marks_padding_empty():
    c = kvjax.init_cache(batch=2, kv_heads=1, capacity=6, head_dim=2)
    k = jnp.arange(2 * 1 * 3 * 2, dtype=jnp.float32).reshape(2, 1, 3, 2)
    pos = jnp.array([[0, 1, 2], [EMPTY, 0, 1]])
    c = kvjax.write(c, k, -k, pos)
    c = kvjax.write(c, k[:, :, :1] + 100, k[:, :, :1], jnp.array([[3], [2]]))
    assert int(c.length) == 4
    np.testing.assert_array_equal(c.pos[:, 0], [[0, 1, 2, 3, EMPTY, EMPTY], [EMPTY, 0, 1, 2, EMPTY, EMPTY]])
    np.testing.assert_array_equal(c.logical_k[:, :, :3], k)
    np.testing.assert_array_equal(c.logical_v[:, :, :3], -k)
    np.testing.assert_array_equal(c.logical_k[:, :, 3], k[:, :, 0] + 100)
    np.testing.assert_array_equal(c.logical_k[:, :, 4:], 0)


def test_folded_rows_are_batch_major():
    c = kvjax.init_cache(batch=2, kv_heads=3, capacity=2, head_dim=1)
    k = jnp.arange(6, dtype=jnp.float32).reshape(2, 3, 1, 1)  # value = b * 3 + h
    c = kvjax.write(c, k, k, jnp.zeros((2, 1), jnp.int32))
    np.testing.assert_array_equal(c.k[:, 0, 0], np.arange(6))


def test_write_jits_without_recompiling_per_cursor():
    c = kvjax.init_cache(batch=1, kv_heads=2, capacity=8, head_dim=4)
    step = jax.jit(chex.assert_max_traces(kvjax.write, n=1), donate_argnums=0)  # 2nd trace raises
    for t in range(5):
        c = step(c, jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4)), jnp.array([[t]]))
    np.testing.assert_array_equal(c.pos[0, 0], [0, 1, 2, 3, 4, EMPTY, EMPTY, EMPTY])


@pytest.mark.parametrize("bad", [
    dict(k=(1, 2, 1, 4), v=(1, 2, 1, 4), pos=(1, 2)),   # positions wrong length
    dict(k=(1, 3, 1, 4), v=(1, 3, 1, 4), pos=(1, 1)),   # wrong kv heads
    dict(k=(1, 2, 1, 5), v=(1, 2, 1, 5), pos=(1, 1)),   # wrong head_dim
    dict(k=(1, 2, 9, 4), v=(1, 2, 9, 4), pos=(1, 9)),   # more tokens than capacity
    dict(k=(1, 2, 1, 4), v=(1, 2, 2, 4), pos=(1, 1)),   # k/v mismatch
])
def test_write_rejects_bad_shapes(bad):
    c = kvjax.init_cache(batch=1, kv_heads=2, capacity=8, head_dim=4)
    with pytest.raises(ValueError, match="write"):
        kvjax.write(c, jnp.ones(bad["k"]), jnp.ones(bad["v"]), jnp.zeros(bad["pos"], jnp.int32))


@pytest.mark.parametrize("kwargs", [dict(capacity=0), dict(head_dim=-1), dict(dtype=jnp.int8)])
def test_init_cache_rejects_bad_arguments(kwargs):
    args = dict(batch=1, kv_heads=1, capacity=4, head_dim=4) | kwargs
    with pytest.raises(ValueError, match="init_cache"):
        kvjax.init_cache(**args)


def test_check_cache_names_the_mismatch():
    spec = kvjax.CacheSpec(num_layers=2, kv_heads=3, head_dim=8)
    good = kvjax.init_model_cache(spec, batch=2, capacity=4)
    kvjax.check_cache(good, spec, batch=2)
    with pytest.raises(ValueError, match="layers"):
        kvjax.check_cache(good[:1], spec, batch=2)
    with pytest.raises(ValueError, match="kv_heads=3"):
        kvjax.check_cache(kvjax.init_model_cache(kvjax.CacheSpec(2, 2, 8), 2, 4), spec, batch=2)
    with pytest.raises(ValueError, match="head_dim=8"):
        kvjax.check_cache(kvjax.init_model_cache(kvjax.CacheSpec(2, 3, 4), 2, 4), spec, batch=2)
    with pytest.raises(ValueError, match="batch=1"):
        kvjax.check_cache(good, spec, batch=1)


def test_cache_is_a_pytree_that_vmaps_and_round_trips():
    c = kvjax.init_cache(batch=2, kv_heads=1, capacity=4, head_dim=2)
    leaves, treedef = jax.tree_util.tree_flatten(c)
    assert len(leaves) == 4
    rebuilt = jax.tree_util.tree_unflatten(treedef, [x + 1 for x in leaves])
    assert isinstance(rebuilt, kvjax.TokenCache) and int(rebuilt.length) == 1
    counts = jax.vmap(lambda cache: jnp.sum(cache.pos != EMPTY),
                      in_axes=(kvjax.TokenCache(0, 0, 0, None),))(c)
    assert counts.shape == (2,)


def test_counted_writes_drop_what_a_scatter_drops():
    """`stores._put_rows` with a count writes new slot i at `at + i` for i < count and inside
    the capacity, and leaves every other slot alone: the scatter's result (`mode="drop"`), for
    every capacity, span, cursor (past the end too) and count on small shapes, now as one
    read-modify-write of a span inside the store (docs/DECISIONS.md, "Store layouts in the
    decode loop")."""
    from kvjax.core.stores import _put_rows

    put = jax.jit(_put_rows, static_argnames="codes")
    rng = np.random.default_rng(0)
    for c, t in ((5, 1), (5, 3), (5, 5), (8, 3), (3, 5)):  # (3, 5): a span past the store
        x = rng.normal(size=(2, c, 3)).astype(np.float32)
        new = rng.normal(size=(2, t, 3)).astype(np.float32)
        for at in range(c + 3):
            for count in range(t + 1):
                idx = np.where(np.arange(t) < count, at + np.arange(t), c)
                want = np.asarray(jnp.asarray(x).at[:, idx].set(new, mode="drop"))
                got = np.asarray(put(jnp.asarray(x), jnp.asarray(new), at, count))
                np.testing.assert_array_equal(got, want, err_msg=f"C={c} T={t} at={at} "
                                                                 f"count={count}")


def test_a_step_traced_with_usual_branches_only_drops_the_flush_conditional():
    """kvjax.core.branches: a KIVI layer's write holds its residual flush as a conditional;
    traced inside `usual_branches_only()` (what `kvjax compile --step-bytes` counts) the
    conditional is gone, the step equals the real one while no flush is due, differs when
    one is, and the compiler counts fewer bytes for it."""
    from kvjax.core.branches import usual_branches_only
    from kvjax.policies.codecs import kivi

    k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 64, 32))
    cache = (kvjax.write(kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 32), 1, 128)[0], k, v,
                         jnp.arange(64)[None]),)
    t = kivi(bits=4, group=16, residual=16)
    (layer,), _ = t.update(cache, t.init(cache), None)
    step = lambda layer, x, p: kvjax.write(layer, x, x, p)
    x = jnp.ones((1, 1, 1, 32))
    every = jax.jit(lambda *a: step(*a)).lower(layer, x, jnp.array([[64]])).compile()
    with usual_branches_only():
        usual = jax.jit(lambda *a: step(*a)).lower(layer, x, jnp.array([[64]])).compile()
    assert " conditional(" in every.as_text()
    assert " conditional(" not in usual.as_text()
    assert usual.cost_analysis()["bytes accessed"] < every.cost_analysis()["bytes accessed"]
    for steps, flushes in ((1, False), (24, True)):  # a flush is due past 16 + 16 recent
        a = b = layer
        for i in range(steps):
            p = jnp.array([[64 + i]])
            a, b = every(a, x, p), usual(b, x, p)
        same = all(bool(jnp.array_equal(u, w)) for u, w in
                   zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        assert same != flushes, (steps, int(a.recent.length), int(b.recent.length))


@pytest.mark.parametrize("method", ["full", "quantize:bits=4,group=8", "kivi:bits=4,group=8,residual=8",
                                    "knorm:ratio=0.5+kivi:bits=2,group=8,residual=8"])
def test_shrink_aligned_to_a_tile_attends_as_unaligned(method):
    """`shrink(align=)`: every slot capacity (a residual layer's body and exact part each)
    becomes a multiple of `align`, the new slots are empty, and attention over the aligned
    cache equals attention over the unaligned one, before and after decode writes."""
    k, v = jax.random.normal(jax.random.key(0), (2, 2, 2, 45, 16))
    cache = (kvjax.write(kvjax.init_model_cache(kvjax.CacheSpec(1, 2, 16), 2, 64)[0], k, v,
                         jnp.broadcast_to(jnp.arange(45), (2, 45))),)
    t = kvjax.Method.parse(method).transform
    small, _ = t.update(cache, t.init(cache), None)
    plain, aligned = kvjax.shrink(small, room=4), kvjax.shrink(small, room=4, align=16)
    parts = lambda layer: layer.parts() or (layer,)
    assert any(layer.capacity % 16 for layer in parts(plain[0]))  # alignment has work to do
    for layer in parts(aligned[0]):
        assert layer.capacity % 16 == 0, (method, layer.capacity)
    q = jax.random.normal(jax.random.key(1), (2, 1, 4, 16))
    for step in range(3):
        pos = jnp.full((2, 1), 45 + step)
        np.testing.assert_allclose(kvjax.attend(q, pos, aligned[0]), kvjax.attend(q, pos, plain[0]),
                                   rtol=1e-6, atol=1e-6)
        x = jax.random.normal(jax.random.key(2 + step), (2, 2, 1, 16))
        plain = (kvjax.write(plain[0], x, x, pos),)
        aligned = (kvjax.write(aligned[0], x, x, pos),)
    with pytest.raises(ValueError, match="align must be a positive int"):
        kvjax.shrink(small, room=4, align=0)


def test_tile_slots_is_the_kernels_tile_where_a_kernel_runs():
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert kvjax.tile_slots("xla") == kvjax.tile_slots("reference") == 1
    assert kvjax.tile_slots("pallas") == 1  # CPU: no compiled kernel, nothing to align for
    assert kvjax.tile_slots(kvjax.PallasOnMesh(mesh, backend="tpu")) == 128
    assert kvjax.tile_slots(kvjax.PallasOnMesh(mesh, backend="gpu")) == 64
