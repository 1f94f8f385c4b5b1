"""KVzip's and KVgrad's reconstruction pass in bounded memory (issue 50).

A batch of 8 contexts of 1,024 tokens in SmolLM2 needed 18 GiB of temporaries for KVzip's
pass and 36 GiB for KVgrad's (the zoo's passkey cells were killed); they now need 1.4 and
2.5 GiB (`experiments/eval/reconstruction_memory.py`). Three changes, each checked here on
tiny configs against its plain definition and against growth with the layer count:

- `chunk_scores` takes the pass's queries `query_block` at a time (a running maximum);
- KVgrad's backward runs layer by layer (`attention_output_gradients`), each layer's forward
  recomputed once the gradient above it is ready, equal to `jax.grad` of `probe_forward`;
- plain attention reads "sees nothing" from its scores (tests/test_attention.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.core.attention import attention_weights
from kvjax.core.stats import StatsSpec
from kvjax.policies.eviction_kvzip import chunk_scores


def _pass_layer(seed: int, b=2, kvh=2, g=3, c=40, w=13, d=8):
    """A layer holding a 20-token context then the pass's `w` tokens (row 1 shorter)."""
    rng = np.random.default_rng(seed)
    pos = np.full((b, c), kvjax.EMPTY, np.int32)
    pos[0, :20 + w] = np.arange(20 + w)
    pos[1, :17 + w - 3] = np.concatenate([np.arange(17), 17 + np.arange(w - 3)])
    layer = kvjax.init_cache(batch=b, kv_heads=kvh, capacity=c, head_dim=d)
    layer = kvjax.write(layer, jnp.asarray(rng.normal(size=(b, kvh, c, d)), jnp.float32),
                        jnp.asarray(rng.normal(size=(b, kvh, c, d)), jnp.float32),
                        jnp.asarray(pos))
    q_pos = np.full((b, w), kvjax.EMPTY, np.int32)
    q_pos[0] = 20 + np.arange(w)
    q_pos[1, 3:] = 17 + np.arange(w - 3)  # left-padded
    queries = jnp.asarray(rng.normal(size=(b, w, kvh * g, d)), jnp.float32)
    extras = (jnp.asarray(rng.uniform(size=(b, kvh, g, c)), jnp.float32),
              jnp.asarray(rng.uniform(size=(b, w)), jnp.float32))
    bounds = tuple(jnp.asarray(x, jnp.int32) for x in ([5, 2], [15, 17], [4, 2], [20, 17]))
    return layer, queries, jnp.asarray(q_pos), bounds, extras


@pytest.mark.parametrize("block", [1, 4, 13, 64])
@pytest.mark.parametrize("group_mean", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_chunk_scores_by_query_blocks_equal_all_queries_at_once(block, group_mean, weighted):
    """Every query block size gives the plain definition's scores exactly: all queries'
    attention weights at once (KVgrad's value norms and query weights applied), their
    maximum over queries and query heads (KVCompose: mean over query heads)."""
    layer, queries, q_pos, (start, end, sinks, context), (norms, qw) = _pass_layer(block)
    got = chunk_scores(layer, queries, q_pos, start, end, sinks, context,
                       norms if weighted else None, qw if weighted else None,
                       group_mean=group_mean, query_block=block)
    pos = np.asarray(layer.pos)
    row = lambda x: np.asarray(x)[:, None, None]
    in_chunk = (pos >= row(start)) & (pos < row(end))
    seen = in_chunk | (pos < row(sinks)) | (pos >= row(context))
    sub = layer.replace(pos=jnp.asarray(np.where(seen & (pos != kvjax.EMPTY), pos, kvjax.EMPTY)))
    weights = np.asarray(attention_weights(queries, q_pos, sub))  # [B, KVH, G, W, C]
    if weighted:
        weights = weights * np.asarray(norms)[:, :, :, None] * np.asarray(qw)[:, None, None, :,
                                                                              None]
    best = weights.max(3).mean(2) if group_mean else weights.max((2, 3))
    want = np.where(in_chunk, best, 0.0)
    assert (want > 0).sum() > 20  # the chunk is scored in both rows
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=0)


def _tiny(layers: int):
    from models.llama import Llama, LlamaConfig
    return Llama(LlamaConfig.tiny(num_layers=layers, max_position=2048), rngs=nnx.Rngs(0))


def test_layer_by_layer_gradients_equal_jax_grad_of_the_probe():
    """KVgrad's per-layer gradients are `jax.grad` of `probe_forward` by its offsets (the
    definition) on a left-padded batch of two, to float32 rounding."""
    from models.reconstruction import attention_output_gradients, probe_forward
    model = _tiny(3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 250, (2, 12)))
    positions = jnp.asarray(np.stack([np.arange(12), np.r_[[kvjax.EMPTY] * 4, np.arange(8)]]))
    cache = kvjax.init_model_cache(model.config.cache_spec, 2, 16)
    spec = StatsSpec(window=12)
    real = (positions != kvjax.EMPTY)[..., None]

    def objective(offsets):
        h, _, _, _ = probe_forward(model, tokens, positions, cache, offsets, spec, "reference")
        return jnp.sum(jnp.square(h) * real)

    zeros = tuple(jnp.zeros((24, model.config.hidden_size)) for _ in model.layers)
    from kvjax.core import cpu_kernel
    with cpu_kernel.disabled():  # FFI calls have no derivative
        want = jax.grad(objective)(zeros)
    got, _, _ = attention_output_gradients(model, tokens, positions, cache, spec)
    for layer, (a, b) in enumerate(zip(got, want)):
        scale = float(jnp.abs(b).max())
        assert scale > 0, layer
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=f"layer {layer}")


@pytest.mark.parametrize("method, name", [("kvzip:ratio=0.5,prompt=bare", "_pass_scores"),
                                          ("kvgrad:ratio=0.5,prompt=bare",
                                           "_gradient_pass_scores")])
def test_pass_temporaries_do_not_grow_with_the_layer_count(monkeypatch, method, name):
    """A pass's compiled temporaries grow by well under one layer's attention weights
    ([B*H, W, C] float32) per layer, from 2 layers to 16: each layer's attention is scored and
    freed before the next (before: 1 to 17 such arrays for KVgrad, 1.4 to 21)."""
    import models.reconstruction as R
    from models.sampler import prefill_and_compress
    original = getattr(R, name)
    measured = {}

    def measure(*args, **kwargs):
        model, tokens, _, cache = args[:4]
        memory = original.lower(*args, **kwargs).compile().memory_analysis()
        unit = tokens.shape[0] * model.config.num_heads * tokens.shape[1] * cache[0].capacity * 4
        measured[len(model.layers)] = memory.temp_size_in_bytes / unit
        raise StopIteration  # the compile is all this test needs

    monkeypatch.setattr(R, name, measure)
    prompts = [list(np.random.default_rng(b).integers(3, 250, 500)) for b in range(4)]
    for layers in (2, 16):
        with pytest.raises(StopIteration):
            prefill_and_compress(_tiny(layers), prompts, transform=kvjax.parse_method(method),
                                 room=4)
    growth = (measured[16] - measured[2]) / 14
    assert growth < 0.25 and measured[2] < 6, measured
