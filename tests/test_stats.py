"""Statistics the model collects for policies, against plain numpy over the whole prompt."""

import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.stats import mean_rotation, query_mean_cov
from models.llama import apply_rope, rope_frequencies
from models.sampler import prefill_batch


def test_chunked_statistics_equal_whole_prompt_statistics(tiny_model):
    cfg = tiny_model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 21).tolist(), rng.integers(3, 256, 13).tolist()]
    spec = kvjax.StatsSpec(window=5, query_moments=True, moments_skip=2, attention_mass=True)
    pre = prefill_batch(tiny_model, prompts, stats=spec, chunk=4)
    # the reference: layer-0 queries of the whole prompt, computed directly
    for b, ids in enumerate(prompts):
        x = tiny_model.embed[...][jnp.asarray(ids)][None].astype(jnp.float32)
        block = tiny_model.layers[0]
        q = block.attn.q_proj(block.input_norm(x)).reshape(1, len(ids), cfg.num_heads, cfg.head_dim)
        q_rot = apply_rope(q, jnp.arange(len(ids))[None], rope_frequencies(cfg))
        stats = pre.stats[0]
        np.testing.assert_allclose(np.asarray(stats.queries[b]), np.asarray(q_rot[0, -5:]),
                                   rtol=1e-5, atol=1e-5)
        assert np.asarray(stats.query_pos[b]).tolist() == list(range(len(ids) - 5, len(ids)))
        qs = np.asarray(q[0, 2:], np.float64)  # positions >= moments_skip
        mean, cov = query_mean_cov(stats)
        centered = qs - qs.mean(0)
        np.testing.assert_allclose(np.asarray(mean[b]), qs.mean(0), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(cov[b]),
                                   np.einsum("thi,thj->hij", centered, centered) / len(qs),
                                   rtol=1e-3, atol=1e-4)
    # every query's attention sums to one per head: the mass of a layer totals heads x tokens
    total = np.asarray(pre.cache[0].mass).sum((1, 2))
    np.testing.assert_allclose(total, [cfg.num_heads * 21, cfg.num_heads * 13], rtol=1e-4)


def test_mean_rotation_is_the_average_rope_matrix():
    inv_freq = rope_frequencies(kvjax_tiny_config())
    d = 2 * len(inv_freq)
    rot = np.asarray(mean_rotation(jnp.asarray(inv_freq), jnp.array([7]), 5))[0]
    x = np.random.default_rng(1).standard_normal(d)
    rotated = [np.asarray(apply_rope(jnp.asarray(x, jnp.float32)[None, None, None],
                                     jnp.array([[p]]), inv_freq))[0, 0, 0] for p in range(7, 12)]
    np.testing.assert_allclose(rot @ x, np.mean(rotated, 0), rtol=1e-4, atol=1e-5)


def kvjax_tiny_config():
    from models.llama import LlamaConfig
    return LlamaConfig.tiny()
