"""Bounded-memory long prefill (models/bounded_prefill.py): with `full` the chunked prefill's
logits and cache equal a one-shot prefill's within float32 rounding; with SnapKV at a token
budget the cache stays at budget + one chunk however long the context, measured with
kvjax.nbytes against an independent byte count. A random-weight model of SmolLM2's shape
(layers cut to 2 to keep CPU time down, positions extended to 4096)."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from models.bounded_prefill import prefill_bounded
from models.sampler import pad_prompts, prefill

EPS = np.finfo(np.float32).eps


@pytest.fixture(scope="module")
def smollm2_shape():
    import dataclasses

    from flax import nnx
    from models.llama import Llama, LlamaConfig
    cfg = dataclasses.replace(LlamaConfig.smollm2_135m(), num_layers=2, max_position=4096)
    return Llama(cfg, rngs=nnx.Rngs(0))


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, 49152, n).tolist()


def test_full_chunked_equals_one_shot(smollm2_shape):
    model, n, chunk = smollm2_shape, 768, 128
    ids = _ids(n)
    bounded = prefill_bounded(model, [ids], kvjax.full(), chunk=chunk)
    padded = pad_prompts([ids], n)
    cache = kvjax.init_model_cache(model.config.cache_spec, 1, n, np.float32)
    logits, one_shot = prefill(model, padded.tokens, padded.positions, cache, chunk=n)
    got, want = np.asarray(bounded.prefilled.logits), np.asarray(logits)
    # float32: attention over the same n keys summed in another order (per chunk vs whole),
    # through 2 layers: rounding grows like sqrt(n) ulps of the logits' scale; 4 sqrt(n) (111
    # ulps at n = 768; measured 7) where a bug moves them by O(1)
    tol = 4 * np.sqrt(n) * EPS * np.abs(want).max()
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    assert np.argmax(got) == np.argmax(want)
    k_got = np.asarray(bounded.prefilled.cache[1].k)[:, :n]
    k_want = np.asarray(one_shot[1].k)[:, :n]
    assert np.abs(k_got - k_want).max() <= 4 * np.sqrt(n) * EPS * np.abs(k_want).max()
    assert bounded.chunk_cache_bytes == sorted(bounded.chunk_cache_bytes)  # full grows


@pytest.mark.parametrize("n", [1024, 3072])
def test_snapkv_budget_bounds_the_cache(smollm2_shape, n):
    model, budget, chunk = smollm2_shape, 256, 256
    out = prefill_bounded(model, [_ids(n, 1)], kvjax.parse_method(f"snapkv:budget={budget}"),
                          chunk=chunk)
    cfg = model.config
    # independent count: per layer, K and V float32 [KVH, budget + chunk, D], pos int32
    # [KVH, budget + chunk], the cursor int32 []
    slots = budget + chunk
    per_layer = cfg.num_kv_heads * slots * (2 * cfg.head_dim * 4 + 4) + 4
    assert out.peak_cache_bytes == cfg.num_layers * per_layer
    assert out.chunk_cache_bytes[1:] == [out.peak_cache_bytes] * (n // chunk - 1)
    for layer in out.prefilled.cache:
        assert int(layer.counters()["tokens"].min()) == int(layer.counters()["tokens"].max()) \
            == budget
    assert int(out.prefilled.next_pos[0]) == n
    assert np.isfinite(np.asarray(out.prefilled.logits)).all()


def test_prefill_flops_count_every_weight_matmul_and_causal_attention():
    """`experiments.eval.floor.prefill_flops`, the floor of experiments/bench/prefill_throughput.py: two FLOPs per weight of
    every layer's matmuls per token (the weights counted from the model itself, norms left
    out), causal attention's two products over T (T + 1) / 2 query-key pairs per head and
    layer, one row of logits."""
    import numpy as np
    from flax import nnx

    from experiments.eval.floor import prefill_flops
    from models.llama import Llama, LlamaConfig
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    weights = sum(int(np.prod(p.shape)) for path, p in nnx.to_flat_state(
        nnx.state(model.layers, nnx.Param)) if "norm" not in "/".join(map(str, path)))
    t = 10
    flops = prefill_flops(cfg, t)
    assert flops["dense"] == 2 * t * weights
    assert flops["attention"] == cfg.num_layers * cfg.num_heads * 4 * cfg.head_dim * 55
    assert flops["total"] == flops["dense"] + flops["attention"] + 2 * cfg.hidden_size * cfg.vocab_size
