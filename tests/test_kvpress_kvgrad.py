"""Parity with kvpress 0.5.5 on SmolLM2: KVgradPress (`kvgrad`).

The golden (`experiments/golden/make_kvpress_kvgrad.py`, made by running
kvpress, never kvjax) holds, per text (the 640- and 300-token passages behind
the chat template's 24-token opening, as for KVzip) and ratio (0.5, 0.75), the
positions KVgradPress kept at its defaults (chunk_size=512: 2 chunks and 1) in
every layer and KV head, and layers 0 and 29's scores for one case.

kvjax runs KVzip's reconstruction with the gradient of `Phi = sum_p ||h_p||^2`
by every attention output (`models.reconstruction.attention_output_gradients`, layer by
layer; equal to `jax.grad` of `probe_forward`, the model's forward with an offset on
every attention output, at zero: tests/test_reconstruction_memory.py), binds the
prompt from its own tokenizer and compresses with `kvgrad:ratio=r`. A swap
between a kept and an evicted slot is allowed only inside the golden's band
and only where `NEAR_TIES` names it.
"""

import os

import numpy as np
import pytest

import kvjax
from tests.test_kvpress_parity import (compress_context, keep_by_position,
                                      reconstructed_contexts)
from tests.test_kvpress_zoo_parity import unpack

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_kvgrad.npz")
NEAR_TIES: dict[str, set] = {}  # case -> (layer, KV head) rows allowed to differ


def _cases() -> list[str]:
    g = np.load(GOLDEN)
    return sorted(k[:-len("_keep")] for k in g.files if k.endswith("_keep"))


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.fixture(scope="module")
def prefilled(smollm2, golden):
    """ctx -> (full cache, statistics with KVgrad's scores, tokens)."""
    return reconstructed_contexts(smollm2, golden, "kvgrad:ratio=0.5")


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases())
def test_kept_positions_match_kvpress(prefilled, golden, case):
    """Exactly kvpress's kept positions in every layer and KV head, but named near-ties."""
    ctx = case.split("_", 1)[0]
    ratio = float(case.rsplit("_r", 1)[1])
    out, n = compress_context(prefilled, ctx, f"kvgrad:ratio={ratio}")
    ours, theirs = keep_by_position(out, n), unpack(golden, f"{case}_keep", n)
    layers, kvh = ours.shape[:2]
    assert (~ours).sum() == (~theirs).sum() == int(layers * kvh * n * ratio)
    assert ours[:, :, :4].all()  # the sinks
    differ = {tuple(r) for r in np.argwhere((ours != theirs).any(-1)).tolist()}
    assert differ <= NEAR_TIES.get(case, set()), (case, sorted(differ))
    band = unpack(golden, f"{case}_band", n)
    assert not ((ours != theirs) & ~band).any(), case


@pytest.mark.slow
def test_scores_match_kvpress(prefilled, golden):
    """Layers 0 and 29's scores equal kvpress's `score_val` to float32 rounding (the sinks
    aside), both by token position (`LayerStats.position_scores`)."""
    cache, stats, n = prefilled["ctx2"]
    for key in (k for k in golden.files if k.startswith("ctx2_kvgrad_r0.50_scores_l")):
        layer = int(key.rsplit("_l", 1)[1])
        got = np.asarray(stats[layer].position_scores)[0, :, :n]  # by position
        np.testing.assert_allclose(got[:, 4:], golden[key][:, 4:], rtol=1e-3,
                                   atol=1e-6 * np.abs(golden[key][:, 4:]).max(), err_msg=key)


def test_probe_forward_at_zero_offsets_is_the_models_forward():
    """The function KVgrad differentiates is the model's forward when its offsets are zero."""
    import jax.numpy as jnp
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    from models.reconstruction import probe_forward
    from kvjax.core.stats import StatsSpec
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    tokens = jnp.arange(3, 15)[None]
    positions = jnp.arange(12)[None]
    cache = kvjax.init_model_cache(model.config.cache_spec, 1, 16)
    h, _, _, inputs = probe_forward(model, tokens, positions, cache,
                                   [jnp.zeros((12, model.config.hidden_size))] * len(model.layers),
                                   StatsSpec(window=12), "reference")
    want, _ = model.hidden(tokens, positions, cache, impl="reference")
    np.testing.assert_allclose(np.asarray(model.norm(h.reshape(12, -1))).reshape(want.shape),
                               np.asarray(want), rtol=1e-5, atol=1e-5)
    h_none, _, _, _ = probe_forward(model, tokens, positions, cache, None, StatsSpec(window=12),
                                    "reference")  # no offsets: the same forward
    np.testing.assert_array_equal(np.asarray(h_none), np.asarray(h))
    # KVzip+'s h (KVzap's input): layer 0's attention input is the RMS-normed embedding
    # (weights 1 at init)
    x = np.asarray(model.embed[...], np.float64)[np.arange(3, 15)]
    eps = model.layers[0].input_norm.eps
    normed = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
    np.testing.assert_allclose(np.asarray(inputs[0])[0], normed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec, words", [
    ("kvgrad", ["kvgrad", "ratio", "None"]),
    ("kvgrad:ratio=1.0", ["kvgrad", "ratio", "1.0", "[0.0, 1.0)"]),
    ("kvgrad:ratio=0.5,chunk_size=0", ["chunk_size", "0", ">= 1"]),
    ("kvgrad:ratio=0.5,n_sink=-2", ["n_sink", "-2"]),
    ("kvgrad:ratio=0.5,layerwise=1", ["layerwise", "1"]),
    ("kvgrad:ratio=0.5,prompt=x", ["prompt", "x", "chat", "bare"]),
])
def test_bad_arguments_raise_naming_them(spec, words):
    with pytest.raises(ValueError) as e:
        kvjax.parse_method(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_kvgrad_batch_rows_alone_and_prompt_only():
    """Two prompts of different lengths in one batch keep what each keeps alone (the
    gradient of one row's objective never reaches another row); compress_every refused."""
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    from models.sampler import generate, prefill_and_compress
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    t = kvjax.parse_method("kvgrad:ratio=0.5,prompt=bare,chunk_size=16")
    a, b = list(range(3, 40)), list(range(50, 72))

    def kept(out, row, n):
        return keep_by_position(tuple(layer.replace(pos=layer.pos[row:row + 1])
                                      for layer in out.cache), n)
    both = prefill_and_compress(model, [a, b], transform=t, room=2)
    for row, ids in enumerate((a, b)):
        alone = prefill_and_compress(model, [ids], transform=t, room=2)
        np.testing.assert_array_equal(kept(both, row, len(ids)), kept(alone, 0, len(ids)))
    with pytest.raises(ValueError, match="compress_every"):
        generate(model, [a], max_new_tokens=2, compress_every=1, transform=t)


def test_kvjax_methods_lists_kvgrad():
    from kvjax.policies.methods import describe_methods
    m = {m["name"]: m for m in describe_methods()}["kvgrad"]
    assert m["kvpress"] == "KVgradPress" and m["proof"] == "tests/test_kvpress_kvgrad.py"
    rec = kvjax.parse_method(m["spec"].format(r=0.5)).stats.reconstruction
    assert rec.gradient and rec.chunk_size == 512
