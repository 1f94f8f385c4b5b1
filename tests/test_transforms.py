import re

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


def test_a_rewritten_artifact_file_parses_anew(tmp_path):
    """Specs are cached, but one naming a file is keyed on the file too: filters rewritten
    under the same path give a new transform with the new filters, not the cached one."""
    import numpy as np
    path = tmp_path / "q.npz"
    np.savez(path, q_filters=np.zeros((2, 2, 4), np.float32))
    first = parse_method(f"qfilter:ratio=0.5,filters={path}")
    assert parse_method(f"qfilter:ratio=0.5,filters={path}") is first  # unchanged: cached
    np.savez(path, q_filters=np.ones((2, 2, 8), np.float32))
    again = parse_method(f"qfilter:ratio=0.5,filters={path}")
    assert again is not first and again.update.scorer.filters.shape == (2, 2, 8)


@pytest.mark.parametrize("spec, match", [
    ("nosuch", "unknown method 'nosuch'"),
    ("full:ratio=0.5", "bad arguments"),
    ("full:ratio", "not key=value"),
    ("", "empty"),
])
def test_parse_method_rejects_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_method(spec)


def _filled_layers(capacities, tokens=24, seed=0):
    """Layers of SmolLM2's head shape holding `tokens` random keys/values each."""
    out = []
    for i, cap in enumerate(capacities):
        layer = kvjax.init_cache(batch=2, kv_heads=3, capacity=cap, head_dim=64)
        k, v = jax.random.normal(jax.random.key(seed + i), (2, 2, 3, tokens, 64))
        out.append(kvjax.write(layer, k, v, jnp.broadcast_to(jnp.arange(tokens), (2, tokens))))
    return tuple(out)


@pytest.mark.parametrize("method", ["kivi:bits=4", "random:ratio=0.5+kivi:bits=2",
                                    "random:ratio=0.5", "quantize:bits=8"])
def test_compression_under_jit_equals_eager_and_compiles_one_body_per_equal_layers(method):
    # layers 0, 1, 3 share shapes (one compiled loop), layer 2 is larger (its own body)
    cache = _filled_layers([32, 32, 48, 32])
    t = parse_method(method)
    eager, _ = t.update(cache, t.init(cache), None)
    compiled, _ = jax.jit(t.update)(cache, t.init(cache), None)
    jax.tree_util.tree_map(np.testing.assert_array_equal, compiled, eager)
    # the compiled program's loops do not grow with the number of equal layers (a Python loop
    # over layers inlines every loop of the policy once per layer, or has none)
    loops = lambda n: jax.jit(t.update).lower(cache[:1] * n, t.init(cache[:1] * n),
                                              None).compile().as_text().count(" while(")
    assert loops(2) == loops(6) >= 1


def _entry_instructions(hlo_text: str) -> int:
    """Instructions of a compiled program's entry computation other than its parameters
    (each output copy is one)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    return entry.count(" = ") - entry.count(" parameter(")


@pytest.mark.parametrize("method", ["kivi:bits=4", "random:ratio=0.5", "quantize:bits=8",
                                    "random:ratio=0.5+kivi:bits=2", "kivi:bits=2+random:ratio=0.5"])
def test_sampler_compression_returns_layers_stacked_and_equals_eager(method):
    """`_compress` (prefill's compression) equals the eager update element-wise; its compiled
    program returns equal layers stacked and a chain's second stage reads the first's stacked
    output, so no instruction per layer and cache leaf remains (slicing outputs back into
    layers and feeding those slices to the next stage added 8-22 per layer). What still grows:
    the per-layer inputs an eviction picks (its key and budget: 2 per layer)."""
    from models import sampler
    cache = _filled_layers([32, 32, 48, 32])
    t = parse_method(method)
    eager, _ = t.update(cache, t.init(cache), None)
    compiled, _ = sampler._compress(t.update, jax.tree_util.tree_map(jnp.copy, cache),
                                    t.init(cache), None)
    assert len(compiled) == len(eager)
    jax.tree_util.tree_map(np.testing.assert_array_equal, compiled, eager)
    size = lambda n: _entry_instructions(sampler._compress_stacked.lower(
        t.update, cache[:1] * n, t.init(cache[:1] * n), None).compile().as_text())
    assert size(6) - size(2) <= 4 * 2


@pytest.mark.parametrize("method", ["random:ratio=0.5+kivi:bits=4", "knorm:ratio=0.5,headwise=true",
                                    "quantize:bits=4"])
def test_a_compression_compiles_no_integer_tree_reductions(method):
    """Counts over the slot axis are float sums (`count_true`): XLA:CPU splits an integer or
    boolean reduction over more than 32 slots into three separately compiled kernels (two
    reduce-windows and a reduce). The compiled compression and `shrink`'s reader hold no
    integer or boolean reduce-window (before: 1-5 in these compressions, 1 in the reader)."""
    from kvjax.core.layout import _usage
    from models import sampler
    cache = _filled_layers([128, 128], tokens=100)
    t = parse_method(method)
    texts = [sampler._compress_stacked.lower(t.update, cache, t.init(cache), None).compile()
             .as_text(), _usage.lower(cache[0], False).compile().as_text()]
    for text in texts:
        assert not re.findall(r"= (?:s32|pred)\[[^\]]*\][^ ]* reduce-window\(", text)


def test_count_true_counts_exactly_on_short_and_long_axes():
    rng = np.random.default_rng(0)
    for shape, axis in (((3, 4112), -1), ((5, 40, 7), 1), ((1, 2 ** 24 + 3), 1)):
        mask = rng.random(shape) < 0.999
        got = kvjax.core.stores.count_true(jnp.asarray(mask), axis)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, np.count_nonzero(mask, axis=axis))


@pytest.mark.parametrize("method", ["kivi:bits=4", "random:ratio=0.5",
                                    "random:ratio=0.5+kivi:bits=2"])
def test_shrink_takes_stacked_layers_apart_with_one_program_per_layout(method):
    """`shrink` of a compiled compression's stacked output equals `shrink` of its layers taken
    apart, element-wise, and compiles one reader of the cursors and table usage and one
    take-and-cut per layer layout and size (the three equal layers share both), not one per
    layer or part."""
    from kvjax.core.layout import _take_resized, _usage, unstack_layers
    from models import sampler
    cache = _filled_layers([32, 32, 48, 32])
    t = parse_method(method)
    stacked, _ = sampler._compress_stacked(t.update, jax.tree_util.tree_map(jnp.copy, cache),
                                           t.init(cache), None)
    want = kvjax.shrink(unstack_layers(stacked), room=3, max_write=1)
    _usage.clear_cache()
    _take_resized.clear_cache()
    got = kvjax.shrink(stacked, room=3, max_write=1)
    assert len(got) == 4
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
    assert kvjax.nbytes(got) == kvjax.nbytes(want) < kvjax.nbytes(stacked)
    assert _usage._cache_size() == 2 and _take_resized._cache_size() == 2


@pytest.mark.parametrize("reorder", [lambda ys: ys, lambda ys: ys[::-1], lambda ys: ys[1:] + ys[:1],
                                     lambda ys: (ys[0], ys[0], ys[2], ys[3])])
def test_map_layers_reads_an_earlier_result_stacked_only_in_its_own_order(reorder):
    """A second `map_layers` over the first's layers (a chain) reads them stacked when they are
    that group's outputs in order; reordered or repeated layers are picked one by one."""
    xs = (jnp.arange(3.0), jnp.ones(5), 2 * jnp.ones(3), jnp.arange(3.0) + 7)
    first = lambda x: (x * 2, x.sum())
    second = lambda y: y[0] + y[1]
    run = lambda xs: kvjax.core.layout.map_layers(second, reorder(kvjax.core.layout.map_layers(first, xs)))
    want = run(xs)
    got = jax.jit(run)(xs)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_map_layers_groups_by_shape_and_keeps_layer_order():
    xs = (jnp.ones(3), jnp.ones(5), 2 * jnp.ones(3), 3 * jnp.ones(3))
    ws = (1.0, 2.0, 3.0, 4.0)
    f = jax.jit(lambda xs, ws: kvjax.core.layout.map_layers(lambda x, w: w * x, xs, ws))
    out = f(xs, ws)
    for x, w, y in zip(xs, ws, out):
        np.testing.assert_array_equal(y, w * x)
    assert f.lower(xs, ws).compile().as_text().count(" while(") == 1  # layers 0, 2, 3


def test_stateless_transforms_hold_an_empty_named_state(tmp_path):
    """full()'s state is EmptyState: named, no leaves, and it round-trips a checkpoint."""
    from kvjax.tools import checkpoint

    cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=8)
    state = full().init(cache)
    assert state == kvjax.EmptyState() and jax.tree_util.tree_leaves(state) == []
    assert chain(full(), full()).init(cache) == (kvjax.EmptyState(),) * 2
    checkpoint.save(tmp_path, {"cache": cache, "state": state})
    again, _ = checkpoint.restore(tmp_path)
    assert type(again["state"]) is kvjax.EmptyState


def test_a_method_is_parsed_once_and_carried():
    """kvjax.Method: the spec, its transform and the layers it names, parsed once; parsing
    a Method returns it; wrapping its transform keeps the spec."""
    m = kvjax.Method.parse("snapkv:ratio=0.5,layers=0-3+kivi:bits=2")
    assert m.transform is parse_method(m.spec) and kvjax.Method.parse(m) is m
    assert m.layers == (("snapkv", (0, 1, 2, 3)),) and m.check(4) is m
    with pytest.raises(ValueError, match="layers names layer 3; the model has 3 layers"):
        m.check(3)
    wrapped = m.with_transform(full())
    assert wrapped.spec == m.spec and wrapped.transform is full()
    assert kvjax.check_method(m, 4) is m.transform
