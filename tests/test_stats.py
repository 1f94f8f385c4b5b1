"""Statistics the model collects for policies, against plain numpy over the whole prompt."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.core.stats import (can_project, covering, mean_rotation, project_cache,
                              project_stats, query_mean_cov)
from models.llama import apply_rope, rope_frequencies
from models.sampler import prefill_batch


U = np.finfo(np.float32).eps / 2  # float32 unit roundoff, 2^-24


def test_chunked_statistics_equal_whole_prompt_statistics(tiny_model):
    """Chunked statistics against plain numpy (float64) over the whole prompt.

    Tolerances are float32 error bounds, element-wise: a sum of n float32 terms is within
    n*u of the sum of their magnitudes (u = 2^-24). The queries come from the same float32
    ops in another chunking, so within (K+2)*u of |x| @ |W_q| (K = hidden size, doubled
    through RoPE's pairs); the moments add n terms; the mass of a layer is H*T softmax
    rows of C slots, each summing to 1 within (C+2)*u, then summed over the C slots.
    """
    cfg = tiny_model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 21).tolist(), rng.integers(3, 256, 13).tolist()]
    spec = kvjax.StatsSpec(window=5, query_moments=True, moments_skip=2, attention_mass=True)
    pre = prefill_batch(tiny_model, prompts, stats=spec, chunk=4)
    k, d = cfg.hidden_size, cfg.head_dim
    # the reference: layer-0 queries of the whole prompt, computed directly
    for b, ids in enumerate(prompts):
        x = tiny_model.embed[...][jnp.asarray(ids)][None].astype(jnp.float32)
        block = tiny_model.layers[0]
        xn = block.input_norm(x)
        q = block.attn.q_proj(xn).reshape(1, len(ids), cfg.num_heads, d)
        q_rot = apply_rope(q, jnp.arange(len(ids))[None], rope_frequencies(cfg))
        stats = pre.stats[0]
        mag = (np.abs(np.asarray(xn)) @ np.abs(np.asarray(block.attn.q_proj.kernel[...])))
        mag = mag.reshape(len(ids), cfg.num_heads, d)
        mag = np.concatenate([mag[..., :d // 2] + mag[..., d // 2:]] * 2, axis=-1)  # RoPE pairs
        err = np.abs(np.asarray(stats.queries[b]) - np.asarray(q_rot[0, -5:]))
        assert np.all(err <= 2 * (k + 2) * U * mag[-5:]), err.max()
        assert np.asarray(stats.query_pos[b]).tolist() == list(range(len(ids) - 5, len(ids)))
        qs = np.asarray(q[0, 2:], np.float64)  # positions >= moments_skip
        n = len(qs)
        mean, cov = query_mean_cov(stats)
        m = qs.mean(0)
        centered = qs - m
        want_cov = np.einsum("thi,thj->hij", centered, centered) / n
        # mean: n float32 additions and a division, of queries a few ulps off
        assert np.all(np.abs(np.asarray(mean[b]) - m) <= (n + 2) * U * np.abs(qs).mean(0))
        # cov = E[q q'] - m m': n additions of products, then a subtraction (both terms' size)
        size = np.einsum("thi,thj->hij", np.abs(qs), np.abs(qs)) / n + \
            np.abs(m)[:, :, None] * np.abs(m)[:, None, :]
        assert np.all(np.abs(np.asarray(cov[b]) - want_cov) <= (n + 4) * U * size)
    # every query's attention sums to one per head: the mass of a layer totals heads x tokens
    total = np.asarray(pre.cache[0].mass).sum((1, 2))
    c = pre.cache[0].capacity
    np.testing.assert_allclose(total, [cfg.num_heads * 21, cfg.num_heads * 13], rtol=(2 * c + 4) * U)


def test_statistics_cut_from_a_union_prefill_equal_each_policys_own_prefill(tiny_model):
    """One prefill collecting the union of several policies' statistics serves each: the cache
    (`project_cache`: H2O's attention mass dropped for the others), the logits and the
    statistics `project_stats` cuts for a policy are bit for bit those of a prefill collecting
    only its own (the same float32 values, not recomputed)."""
    import jax
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, 37).tolist(), rng.integers(3, 256, 22).tolist()]
    own_specs = [kvjax.StatsSpec(), kvjax.StatsSpec(window=1), kvjax.StatsSpec(window=6),
                 kvjax.StatsSpec(query_moments=True, moments_skip=4),
                 kvjax.StatsSpec(window=3, query_moments=True, moments_skip=4),
                 kvjax.StatsSpec(attention_mass=True)]
    union = own_specs[0]
    for spec in own_specs[1:]:
        union = covering(union, spec)
    assert union == kvjax.StatsSpec(window=6, query_moments=True, moments_skip=4,
                                    attention_mass=True)
    shared = prefill_batch(tiny_model, prompts, stats=union, chunk=8, room=4)
    for spec in own_specs:
        alone = prefill_batch(tiny_model, prompts, stats=spec, chunk=8, room=4)
        cut = (project_cache(shared.cache, union, spec), shared.logits,
               project_stats(shared.stats, union, spec))
        want = (alone.cache, alone.logits, alone.stats)
        assert jax.tree_util.tree_structure(cut) == jax.tree_util.tree_structure(want), spec
        for a, b in zip(jax.tree_util.tree_leaves(cut), jax.tree_util.tree_leaves(want)):
            assert a.shape == b.shape and a.dtype == b.dtype, spec
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(spec))
    # what a union cannot serve: moments skipping otherwise, a longer window, mass not tracked
    assert covering(union, kvjax.StatsSpec(query_moments=True, moments_skip=1)) is None
    assert not can_project(kvjax.StatsSpec(window=2), kvjax.StatsSpec(window=3))
    assert not can_project(kvjax.StatsSpec(window=6), kvjax.StatsSpec(attention_mass=True))
    with pytest.raises(ValueError, match="cannot be cut from those collected"):
        project_stats(shared.stats, union, kvjax.StatsSpec(window=7))
    with pytest.raises(ValueError, match="cannot serve"):
        project_cache(alone.cache, kvjax.StatsSpec(), kvjax.StatsSpec(attention_mass=True))


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
