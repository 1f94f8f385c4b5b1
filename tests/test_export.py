import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from models.export import export_decode_step, params_dict
from models.llama import Llama, LlamaConfig, new_cache


def test_exported_decode_step_round_trips_with_identical_logits():
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    exported = export_decode_step(model, batch=2, capacity=8)
    step = jax.export.deserialize(exported.serialize())

    tokens = jnp.array([[5, 6, 7], [8, 9, 10]])
    cache_eager, cache_exported, cache_restored = (new_cache(cfg, 2, 8) for _ in range(3))
    params = params_dict(model)
    assert "layers/0/attn/q_proj/kernel" in params
    for t in range(3):
        tok, pos = tokens[:, t:t + 1], jnp.full((2, 1), t)
        eager, cache_eager = model(tok, pos, cache_eager)
        before, cache_exported = exported.call(params, tok, pos, cache_exported)
        after, cache_restored = step.call(params, tok, pos, cache_restored)
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))  # bit-identical
        np.testing.assert_allclose(np.asarray(after), np.asarray(eager[:, -1]), rtol=1e-5, atol=1e-6)
    assert isinstance(cache_restored[0], kvjax.TokenCache) and int(cache_restored[0].length) == 3
    jax.tree_util.tree_map(np.testing.assert_array_equal, cache_restored, cache_exported)
    np.testing.assert_allclose(cache_restored[1].k, cache_eager[1].k, rtol=1e-5, atol=1e-6)


def test_export_lowers_for_accelerators():
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    exported = export_decode_step(model, batch=1, capacity=8, platforms=["tpu", "cuda"])
    assert set(exported.platforms) == {"tpu", "cuda"}


def test_exported_decode_step_writes_into_a_kivi_cache():
    """The exported step takes the codec's layout and encodes what it writes (KIVI-4)."""
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    kivi = kvjax.kivi(bits=4, group=4, residual=4)
    step = jax.export.deserialize(
        export_decode_step(model, batch=2, capacity=16, transform=kivi).serialize())
    encode = lambda c: kivi.update(c, kivi.init(c), None)[0]
    cache_eager, cache_restored = (encode(new_cache(cfg, 2, 16)) for _ in range(2))
    params = params_dict(model)
    for t in range(11):  # past residual + group: one group moves into the quantized body
        tok, pos = jnp.full((2, 1), 5 + t), jnp.full((2, 1), t)
        eager, cache_eager = model(tok, pos, cache_eager)
        after, cache_restored = step.call(params, tok, pos, cache_restored)
        np.testing.assert_allclose(np.asarray(after), np.asarray(eager[:, -1]), rtol=1e-5, atol=1e-5)
    assert isinstance(cache_restored[0], kvjax.ResidualCache)
    assert int(cache_restored[0].body.length) == 4  # 11 tokens: flushed before the 9th write
    jax.tree_util.tree_map(np.testing.assert_array_equal, cache_restored[0].body.k.words,
                           cache_eager[0].body.k.words)
