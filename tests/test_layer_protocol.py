"""The `CacheLayer` protocol (kvjax.core.layer): every registered kind implements all of it,
and a new kind written here -- one class plus `register_layer` -- runs through `kvjax.write`,
`kvjax.attend`, `kvjax.view`, `kvjax.nbytes`, `check_cache`, `shard_cache`, `shrink`, the
monitor and a model's decode step without a line of library code changed."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.core.layer import PROPERTIES, PROTOCOL, CacheLayer, is_layer, layer_kinds, register_layer
from kvjax.memory.paged_kivi import PagedKivi, from_residual
from kvjax.memory.paging import PagedLayer, init_paged_cache, reserve
from kvjax.memory.tiers import TieredLayer, init_tiered_cache
from kvjax.tools.monitor import init_monitor, summary
from models.llama import Llama, LlamaConfig, new_cache

B, KVH, D = 1, 2, 16


# ----------------------------------------------------------------------------- a new kind


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingLayer:
    """A ring buffer of the newest `W` tokens: slot `n % W` takes the n-th token written.

    Attention over it is sliding-window attention (window `W`) for one-token writes; while
    fewer than `W` tokens were written it is exactly a `TokenCache`.
    """

    k: jax.Array  # [B*KVH, W, D] keys (after RoPE)
    v: jax.Array  # [B*KVH, W, D] values
    pos: jax.Array  # [B, KVH, W] int32 position per slot, EMPTY if none
    written: jax.Array  # [] int32 tokens written so far (the next slot is written % W)

    batch = property(lambda self: self.pos.shape[0])
    kv_heads = property(lambda self: self.pos.shape[1])
    head_dim = property(lambda self: self.k.shape[-1])
    window = property(lambda self: self.pos.shape[2])
    mass = property(lambda self: None)  # no accumulated attention (H2O needs a TokenCache)

    def replace(self, **changes: Any) -> "RingLayer":
        return dataclasses.replace(self, **changes)

    def write(self, k_new, v_new, pos_new) -> "RingLayer":
        b, h, t, d = k_new.shape
        if t > self.window:
            raise ValueError(f"RingLayer.write: k_new holds {t} tokens, more than the window "
                             f"{self.window}")
        slot = (self.written + jnp.arange(t)) % self.window  # [T]
        pos = jnp.where(pos_new < 0, kvjax.EMPTY, pos_new).astype(jnp.int32)
        return self.replace(k=self.k.at[:, slot].set(k_new.reshape(b * h, t, d)),
                            v=self.v.at[:, slot].set(v_new.reshape(b * h, t, d)),
                            pos=self.pos.at[:, :, slot].set(jnp.broadcast_to(pos[:, None],
                                                                             (b, h, t))),
                            written=self.written + t)

    def view(self, keep_latent: bool = False) -> kvjax.TokenCache:
        return kvjax.TokenCache(k=self.k, v=self.v, pos=self.pos,
                                length=jnp.minimum(self.written, self.window))

    def attend(self, q, q_pos, *, impl="xla", window=None, softcap=None):
        fn = kvjax.attend_reference if impl == "reference" else kvjax.attend_blockwise
        return fn(q, q_pos, self.view(), window=window, softcap=softcap)

    def counters(self) -> dict[str, jax.Array]:
        shape = self.pos.shape[:2]
        full = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), shape)
        return dict(tokens=jnp.sum(self.pos != kvjax.EMPTY, -1, dtype=jnp.int32),
                    slots_used=full(jnp.minimum(self.written, self.window)),
                    capacity=full(self.window), pages_device=full(0), pages_host=full(0),
                    prefetch_misses=full(0))

    def free_tokens(self) -> int:
        return 2 ** 31 - 1  # the ring never fills: it forgets the oldest token

    def check(self, index, spec, batch) -> None:
        if (self.batch, self.kv_heads, self.head_dim) != (batch, spec.kv_heads, spec.head_dim):
            raise ValueError(f"cache layer {index} is a ring for another model")

    def shardings(self, mesh, batch_axis, kv_axis) -> "RingLayer":
        from jax.sharding import NamedSharding, PartitionSpec as P
        return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), self)

    def parts(self) -> tuple:
        return ()  # slots in ring order, not a TokenCache: slot-level transforms pass it by

    def shrink_usage(self) -> None:
        return None

    def shrink_plan(self, usage, room, max_write, align=1):
        return None  # a ring is as small as its window

    def resized(self, plan) -> "RingLayer":
        return self


register_layer(RingLayer)


def init_ring(batch: int, kv_heads: int, window: int, head_dim: int) -> RingLayer:
    rows = batch * kv_heads
    return RingLayer(k=jnp.zeros((rows, window, head_dim)), v=jnp.zeros((rows, window, head_dim)),
                     pos=jnp.full((batch, kv_heads, window), kvjax.EMPTY, jnp.int32),
                     written=jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------- the new kind


def test_a_kind_defined_in_a_test_file_runs_through_the_library():
    keys = jax.random.normal(jax.random.key(0), (2, B, KVH, 6, D))  # [k/v, B, KVH, T, D]
    pos = jnp.arange(6)[None]
    ring = kvjax.write(init_ring(B, KVH, 8, D), keys[0], keys[1], pos)
    dense = kvjax.write(kvjax.init_cache(B, KVH, 8, D), keys[0], keys[1], pos)
    assert is_layer(ring) and isinstance(ring, CacheLayer)
    q = jax.random.normal(jax.random.key(1), (B, 1, 4, D))
    for impl in ("xla", "reference", "pallas"):  # no kernel for a ring: "pallas" falls back
        np.testing.assert_allclose(kvjax.attend(q, jnp.array([[5]]), ring, impl=impl),
                                   kvjax.attend(q, jnp.array([[5]]), dense), atol=1e-6)
    np.testing.assert_array_equal(kvjax.view(ring).pos, dense.pos)
    assert kvjax.nbytes(ring) == 2 * B * KVH * 8 * D * 4 + B * KVH * 8 * 4 + 4
    assert kvjax.free_tokens(ring) == 2 ** 31 - 1
    kvjax.check_cache((ring, ring), kvjax.CacheSpec(2, KVH, D), batch=B)
    with pytest.raises(ValueError, match="cache layer 0 is a ring"):
        kvjax.check_cache((ring, ring), kvjax.CacheSpec(2, KVH, D + 1), batch=B)
    mesh = jax.make_mesh((1, 1), ("batch", "kv"))
    placed = kvjax.shard_cache((ring,), mesh)
    jax.tree.map(np.testing.assert_array_equal, kvjax.shrink(placed), placed)
    assert summary(init_monitor((ring,)))["tokens"] == 6 * KVH  # summed over heads


def test_a_ring_of_one_token_writes_is_sliding_window_attention():
    keys = jax.random.normal(jax.random.key(2), (2, B, KVH, 11, D))
    ring, dense = init_ring(B, KVH, 4, D), kvjax.init_cache(B, KVH, 16, D)
    q = jax.random.normal(jax.random.key(3), (B, 1, 4, D))
    for t in range(11):
        k, v, p = keys[0, :, :, t:t + 1], keys[1, :, :, t:t + 1], jnp.array([[t]])
        ring, dense = kvjax.write(ring, k, v, p), kvjax.write(dense, k, v, p)
        np.testing.assert_allclose(kvjax.attend(q, p, ring),
                                   kvjax.attend(q, p, dense, window=4), atol=1e-6)
    with pytest.raises(ValueError, match="k_new holds 5 tokens"):
        kvjax.write(ring, keys[0, :, :, :5], keys[1, :, :, :5], jnp.arange(5)[None])


def test_a_model_decodes_with_the_new_kind():
    """A tiny Llama's prefill and decode steps over ring layers (window above the length)
    give the logits of its `TokenCache` cache, eager and jitted."""
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(4), (1, 7), 0, cfg.vocab_size)
    rings = tuple(init_ring(1, cfg.num_kv_heads, 8, cfg.head_dim) for _ in range(cfg.num_layers))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, pos, cache):
        return nnx.merge(graphdef, state)(tokens, pos, cache)

    for run in (model, lambda *a: step(state, *a)):
        cache_r, cache_t = rings, new_cache(cfg, 1, 8)
        for start, end in ((0, 5), (5, 6), (6, 7)):  # a prefill chunk, then decode steps
            pos = jnp.arange(start, end)[None]
            got, cache_r = run(tokens[:, start:end], pos, cache_r)
            want, cache_t = run(tokens[:, start:end], pos, cache_t)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert int(cache_r[0].written) == 7


# ----------------------------------------------------------------------------- every kind


def _instances() -> dict[type, Any]:
    """One small instance of every layer kind the library registers, holding 8 tokens."""
    k = jax.random.normal(jax.random.key(5), (B, KVH, 8, D))
    pos = jnp.arange(8)[None]
    dense = kvjax.write(kvjax.init_cache(B, KVH, 16, D), k, k, pos)
    kivi = kvjax.kivi(bits=4, group=4, residual=4)
    residual = kivi.update((dense,), kivi.init((dense,)), None)[0][0]
    pool, (paged,) = init_paged_cache(8, 4, B, KVH, 4, D, num_layers=1)
    pool, (paged,) = reserve(pool, (paged,), jnp.array([8]))
    pool, (tiered,) = init_tiered_cache(8, 4, 4, B, KVH, 4, D, num_layers=1)
    pool, (tiered,) = reserve(pool, (tiered,), jnp.array([8]))
    _, (paged_kivi,) = from_residual((residual,), max_pages=4, device_pages=8)
    linear = kvjax.init_linear_layer(B, KVH, D, kvjax.elu_map(D), window=8)
    fold = kvjax.fold_evicted(kvjax.streaming_llm(sinks=2, window=2), map="elu")
    folded = fold.update((dense,), fold.init((dense,)), None)[0][0]
    return {kvjax.TokenCache: dense, kvjax.ResidualCache: residual,
            PagedLayer: paged.write(k, k, pos), TieredLayer: tiered.write(k, k, pos),
            PagedKivi: paged_kivi, kvjax.LinearLayer: linear.write(k, k, pos),
            kvjax.FoldedLayer: folded, RingLayer: init_ring(B, KVH, 8, D).write(k, k, pos)}


def test_every_registered_kind_implements_the_whole_protocol():
    """Every registered kind has every method, and each method of a small instance does its
    job: write, attend (xla and reference agree), view (or a ValueError: no tokens), counters,
    free_tokens, check, shardings and the three shrink steps."""
    instances = _instances()
    assert set(layer_kinds()) == set(instances), "a registered kind without a test instance"
    spec, mesh = kvjax.CacheSpec(1, KVH, D), jax.make_mesh((1, 1), ("batch", "kv"))
    q = jax.random.normal(jax.random.key(6), (B, 1, 4, D))
    for kind, layer in instances.items():
        name = kind.__name__
        assert all(callable(getattr(kind, m, None)) for m in PROTOCOL), name
        assert all(hasattr(layer, p) for p in PROPERTIES), name
        assert type(layer) is kind and is_layer(layer), name
        assert (layer.batch, layer.kv_heads, layer.head_dim) == (B, KVH, D), name
        out = layer.attend(q, jnp.array([[8]]))
        assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out))), name
        np.testing.assert_allclose(out, layer.attend(q, jnp.array([[8]]), impl="reference"),
                                   atol=1e-5, err_msg=name)
        more = layer.write(q[:, :, :KVH].transpose(0, 2, 1, 3), q[:, :, :KVH].transpose(0, 2, 1, 3),
                           jnp.array([[8]]))
        assert type(more) is kind, name
        try:
            assert isinstance(layer.view(), kvjax.TokenCache), name
        except ValueError:
            assert kind is kvjax.LinearLayer  # a pure state holds no tokens
        counters = jax.device_get(layer.counters())
        assert set(counters) == {"tokens", "slots_used", "capacity", "pages_device",
                                 "pages_host", "prefetch_misses"}, name
        assert all(c.shape == (B, KVH) for c in counters.values()), name
        assert isinstance(layer.free_tokens(), int), name
        layer.check(0, spec, B)
        with pytest.raises(ValueError, match="cache layer 3"):
            layer.check(3, kvjax.CacheSpec(1, KVH, D), B + 1)
        shardings = layer.shardings(mesh, "batch", "kv")
        assert jax.tree.structure(shardings) == jax.tree.structure(layer), name
        plan = layer.shrink_plan(jax.device_get(layer.shrink_usage()), 2, 1)
        hash(plan)
        assert type(layer.resized(plan)) is kind, name


def test_register_layer_names_what_a_class_lacks():
    @dataclasses.dataclass(frozen=True)
    class Half:
        batch = kv_heads = head_dim = 1

        def write(self, k_new, v_new, pos_new):
            return self

    with pytest.raises(TypeError, match="Half does not implement CacheLayer: missing attend, "
                                        "view, counters"):
        register_layer(Half)
    assert Half not in layer_kinds()
    with pytest.raises(TypeError, match="cls must be a class"):
        register_layer(Half())
    with pytest.raises(ValueError, match="cache layer 0 is a Half, not a cache layer"):
        kvjax.check_cache((Half(),), kvjax.CacheSpec(1, 1, 1), 1)


def test_no_code_outside_the_registry_tests_a_layer_kind_by_isinstance():
    """Dispatch on layers goes through the protocol: `isinstance(x, <registered kind>)` appears
    only in kvjax/core/layer.py (`is_layer`, `kind_of`), anywhere in kvjax, models or
    experiments. A new kind then needs no hunt for type tests."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    kinds = {cls.__name__ for cls in layer_kinds()} - {"RingLayer"}
    assert {"TokenCache", "ResidualCache", "FoldedLayer", "LinearLayer"} <= kinds

    def named(node) -> set[str]:
        if isinstance(node, ast.Tuple):
            return set().union(*(named(e) for e in node.elts))
        return {node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")}

    found = []
    for path in sorted(p for d in ("kvjax", "models", "experiments") for p in (root / d).rglob("*.py")):
        if path == root / "kvjax" / "core" / "layer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                    and len(node.args) == 2 and named(node.args[1]) & kinds):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"isinstance on a layer kind outside the registry: {found}"
