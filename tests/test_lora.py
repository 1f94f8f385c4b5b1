"""LoRA adapters (`models.lora`): the merged weights against numpy, gradients through a merged
forward against central differences, `Llama.forward_embedded`, the orbax round trip and
refusals by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.core import cpu_kernel
from models.lora import LoRA, load_lora, merged


def random_lora(model, rank: int = 3, seed: int = 0, targets=("q_proj", "v_proj", "down_proj")):
    lora = LoRA.initial(model, rank=rank, alpha=6.0, targets=targets, seed=seed)
    rng = np.random.default_rng(seed + 1)
    b = {t: rng.standard_normal(x.shape).astype(np.float32) * 0.1 for t, x in lora.b.items()}
    return LoRA(lora.a, b, lora.alpha)


def test_merged_weights_are_w_plus_scaled_a_b_and_the_model_is_untouched(tiny_model):
    lora = random_lora(tiny_model)
    before = np.asarray(tiny_model.layers[1].mlp.down_proj.kernel[...]).copy()
    out = merged(tiny_model, lora.params(), lora.alpha)
    for i, layer in enumerate(out.layers):
        for t, (group, name) in (("q_proj", ("attn", "q_proj")), ("v_proj", ("attn", "v_proj")),
                                 ("down_proj", ("mlp", "down_proj"))):
            w = np.asarray(getattr(getattr(tiny_model.layers[i], group), name).kernel[...],
                           np.float64)
            want = w + lora.alpha / lora.rank * (lora.a[t][i].astype(np.float64)
                                                 @ lora.b[t][i].astype(np.float64))
            got = np.asarray(getattr(getattr(layer, group), name).kernel[...])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{t} {i}")
        np.testing.assert_array_equal(np.asarray(layer.attn.k_proj.kernel[...]),
                                      np.asarray(tiny_model.layers[i].attn.k_proj.kernel[...]))
    np.testing.assert_array_equal(np.asarray(tiny_model.layers[1].mlp.down_proj.kernel[...]),
                                  before)


def test_forward_embedded_of_the_embeddings_is_forward(tiny_model):
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, 256, (2, 9)))
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    cache = kvjax.init_model_cache(tiny_model.config.cache_spec, 2, 16)
    h1, c1, _ = tiny_model.forward(tokens, positions, cache)
    h2, c2, _ = tiny_model.forward_embedded(tiny_model.embed_tokens(tokens), positions, cache)
    np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))
    np.testing.assert_array_equal(np.asarray(c1[0].k), np.asarray(c2[0].k))
    with pytest.raises(ValueError, match=r"x \(18, 63\) must be \[B\*T, hidden\]"):
        tiny_model.forward_embedded(jnp.zeros((18, 63)), positions, cache)


def test_gradient_through_merged_layers_matches_central_differences(tiny_model):
    """d/dB of a loss on every merged layer's projections and MLP of a fixed input (XLA's ops,
    as kvjax's trainings run them: `cpu_kernel.disabled`), against float32 central differences
    at three entries (step 1e-2; the loss is smooth)."""
    lora = random_lora(tiny_model, targets=("k_proj", "up_proj"))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((6, 64)), jnp.float32)
    positions = jnp.arange(6)[None]

    def loss(params):
        total = 0.0
        for layer in merged(tiny_model, params, lora.alpha).layers:
            _, q, k, v = layer.attn.project(layer.input_norm(x), positions)
            total += jnp.mean(q ** 2) + jnp.mean(k ** 2) + jnp.mean(layer.mlp(x) ** 2)
        return total

    params = lora.params()
    with cpu_kernel.disabled():  # XLA's ops: the CPU kernels have no derivative
        grads = jax.grad(loss)(params)
        assert float(jnp.abs(grads["k_proj"][1]).max()) > 0
        step = 1e-2
        for t, layer, i, j in (("k_proj", 0, 1, 2), ("up_proj", 1, 0, 5), ("k_proj", 1, 2, 0)):
            def at(delta):
                a, b = params[t]
                return float(loss({**params, t: (a, b.at[layer, i, j].add(delta))}))
            numeric = (at(step) - at(-step)) / (2 * step)
            np.testing.assert_allclose(float(grads[t][1][layer, i, j]), numeric, rtol=2e-2,
                                       atol=1e-5, err_msg=f"{t} {layer} {i} {j}")


def test_orbax_round_trip_and_refusals_by_name(tiny_model, tmp_path):
    lora = random_lora(tiny_model)
    lora.save(tmp_path / "a")
    back = load_lora(tmp_path / "a")
    assert back.alpha == lora.alpha and back.rank == lora.rank and set(back.a) == set(lora.a)
    for t in lora.a:
        np.testing.assert_array_equal(back.a[t], lora.a[t])
        np.testing.assert_array_equal(back.b[t], lora.b[t])
    back.check_model(tiny_model)
    with pytest.raises(ValueError, match="is not an orbax checkpoint directory"):
        load_lora(tmp_path / "missing")
    from kvjax.tools import checkpoint
    checkpoint.save(tmp_path / "other", {"w": np.zeros(3)}, meta=dict(kind="weights"))
    with pytest.raises(ValueError, match="kind"):  # another kind of kvjax checkpoint
        load_lora(tmp_path / "other")
    with pytest.raises(ValueError, match="targets must be among"):
        LoRA.initial(tiny_model, targets=("wq",))
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        LoRA.initial(tiny_model, rank=0)
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        LoRA(lora.a, lora.b, alpha=float("nan"))
    with pytest.raises(ValueError, match="q_proj needs a"):
        LoRA({**lora.a, "q_proj": lora.a["q_proj"][0]}, lora.b)
    with pytest.raises(ValueError, match="v_proj is not all finite"):
        LoRA(lora.a, {**lora.b, "v_proj": np.full_like(lora.b["v_proj"], np.inf)})
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    wider = Llama(LlamaConfig.tiny(hidden_size=32), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="q_proj adapts a"):
        lora.check_model(wider)
