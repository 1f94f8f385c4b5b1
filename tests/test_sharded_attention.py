"""`kvjax.attend(..., impl=PallasOnMesh(mesh))` on one device: the kernel under `shard_map`
(interpret mode) against the reference, the CPU fallback, and the impl check. The 8-device
checks are in tests/test_sharding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.backends.sharded import PallasOnMesh, query_specs


def _layer(b=2, kvh=2, t=40, cap=64, d=16):
    k, v = jax.random.normal(jax.random.key(0), (2, b, kvh, t, d))
    cache = kvjax.write(kvjax.init_cache(b, kvh, cap, d), k, v, jnp.arange(t)[None].repeat(b, 0))
    q = jax.random.normal(jax.random.key(1), (b, 1, 2 * kvh, d))
    return q, jnp.full((b, 1), t - 1), cache


def test_pallas_on_a_one_device_mesh_matches_the_reference():
    q, q_pos, layer = _layer()
    mesh = jax.make_mesh((1, 1), ("batch", "kv"))
    out = jax.jit(lambda q, p, l: kvjax.attend(
        q, p, l, impl=PallasOnMesh(mesh, backend="tpu", interpret=True)))(q, q_pos, layer)
    ref = kvjax.attend(q, q_pos, layer, impl="reference")
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)  # f32 kernel vs f32 reference


def test_without_a_kernel_backend_it_is_the_xla_path():
    if jax.default_backend() != "cpu":
        pytest.skip("[optional] the fallback is CPU's (a TPU/GPU runs the kernel)")
    q, q_pos, layer = _layer()
    mesh = jax.make_mesh((1, 1), ("batch", "kv"))
    out = kvjax.attend(q, q_pos, layer, impl=PallasOnMesh(mesh))
    assert jnp.array_equal(out, kvjax.attend(q, q_pos, layer, impl="xla"))


def test_query_specs_follow_the_cache_split_and_bad_impl_is_refused():
    q, q_pos, layer = _layer()
    mesh = jax.make_mesh((1, 1), ("batch", "kv"))
    q_spec, pos_spec, layer_specs = query_specs(layer, mesh, "batch", "kv")
    # a 1 x 1 mesh splits nothing (cache_axes drops size-1 axes): queries whole, like pos
    assert tuple(q_spec) == (None,) * 4 and tuple(pos_spec) == (None, None)
    assert tuple(layer_specs.pos) == ()
    with pytest.raises(ValueError, match="unknown impl 'mosaic'.*PallasOnMesh"):
        kvjax.attend(q, q_pos, layer, impl="mosaic")
