import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import CacheTransform, chain, full, parse_method


def _cache():
    c = kvjax.init_model_cache(kvjax.CacheSpec(2, 2, 4), batch=1, capacity=4)
    return tuple(kvjax.write(layer, jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 2, 4)),
                             jnp.array([[0, 1]])) for layer in c)


def test_full_is_identity_under_jit():
    cache = _cache()
    t = full()
    new, state = jax.jit(t.update)(cache, t.init(cache), None)
    jax.tree_util.tree_map(np.testing.assert_array_equal, new, cache)


def test_chain_applies_in_order_and_threads_state():
    calls = []

    def counter(tag):
        def update(cache, state, stats=None):
            calls.append(tag)
            return cache, state + 1
        return CacheTransform(lambda cache: 0, update)

    t = chain(counter("a"), full(), counter("b"))
    cache = _cache()
    state = t.init(cache)
    _, state = t.update(cache, state, None)
    _, state = t.update(cache, state, None)
    assert calls == ["a", "b", "a", "b"]
    assert state[0] == 2 and state[2] == 2


def test_parse_method_returns_the_same_object_for_the_same_spec():
    assert parse_method("full") is parse_method("full")
    assert isinstance(parse_method("full+full"), CacheTransform)


@pytest.mark.parametrize("spec, match", [
    ("nosuch", "unknown method 'nosuch'"),
    ("full:ratio=0.5", "bad arguments"),
    ("full:ratio", "not key=value"),
    ("", "empty"),
])
def test_parse_method_rejects_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_method(spec)
