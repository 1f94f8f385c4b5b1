"""QFilter (kvpress QFilterPress; Q-Filters, Godey et al. 2025) against numpy models of the
paper's rule.

kvpress cannot run QFilterPress offline (it downloads each model's filters from the hub), so
there is no kvpress golden: kvjax computes the filters itself (`kvjax calibrate --qfilters`,
`models.calibration.calibrate_qfilters`) and each half of the method is checked against numpy:

* the filters: post-RoPE queries of layer 0 computed here from the weights (embedding, RMSNorm,
  q_proj, rotate-half RoPE), and every layer's filter from its queries by the rule of the
  paper's `make_filters.py` written with an eigendecomposition of Q^T Q instead of an SVD;
* the eviction: per KV head, the `floor(n (1 - ratio))` slots with the largest
  `-(filter . k)` (kvpress's score), on a batch of prompts of different lengths.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.core.cache import EMPTY
from kvjax.core.stats import StatsSpec
from kvjax.policies.eviction_geometry import qfilter
from models.calibration import calibrate_qfilters
from models.sampler import prefill_batch

FILTER_ATOL = 2e-5  # float32 queries through two factorizations; unit vectors (measured ~1e-6)


def numpy_rule(queries: np.ndarray, kv_heads: int) -> np.ndarray:
    """[n, H, D] post-RoPE queries -> [KVH, D]: per head the top eigenvector `v` of Q^T Q,
    signed so that most `q . v` are positive; filter `-v`; mean over each KV head's group."""
    out = []
    for q in queries.transpose(1, 0, 2).astype(np.float64):  # [n, D] per head
        _, vecs = np.linalg.eigh(q.T @ q)
        v = vecs[:, -1]
        v = v if (q @ v > 0).mean() > 0.5 else -v
        out.append(-v)
    return np.stack(out).reshape(kv_heads, -1, queries.shape[-1]).mean(1)


def layer0_queries(model, ids: list[int]) -> np.ndarray:
    """[T, H, D] layer 0's post-RoPE queries, from the weights in numpy."""
    cfg = model.config
    x = np.asarray(model.embed[...], np.float64)[ids]
    norm = model.layers[0].input_norm
    x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + norm.eps) * np.asarray(norm.weight[...])
    q = (x @ np.asarray(model.layers[0].attn.q_proj.kernel[...])).reshape(
        len(ids), cfg.num_heads, cfg.head_dim)
    d = cfg.head_dim
    angle = np.arange(len(ids))[:, None] / cfg.rope_theta ** (np.arange(0, d, 2) / d)  # [T, D/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    q1, q2 = q[..., :d // 2], q[..., d // 2:]
    return np.concatenate([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)


@pytest.fixture(scope="module")
def windows():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 256, 40).tolist() for _ in range(3)]


def test_layer0_filter_is_the_papers_rule_on_queries_computed_from_the_weights(tiny_model,
                                                                               windows):
    """Every token's query (samples >= 120 tokens): layer 0's filter from a numpy forward."""
    got = calibrate_qfilters(tiny_model, windows, samples=10_000, progress=False)
    cfg = tiny_model.config
    assert got.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    queries = np.concatenate([layer0_queries(tiny_model, w) for w in windows])
    np.testing.assert_allclose(got[0], numpy_rule(queries, cfg.num_kv_heads), atol=FILTER_ATOL)


def test_every_layer_follows_the_rule_on_the_drawn_tokens(tiny_model, windows):
    """`samples` tokens drawn by `default_rng(seed).permutation(total)[:samples]` (the same for
    every head and layer); each layer's filter is the rule on exactly those queries."""
    cfg = tiny_model.config
    got = calibrate_qfilters(tiny_model, windows, samples=50, seed=3, batch=2, progress=False)
    pre = prefill_batch(tiny_model, windows, stats=StatsSpec(window=40))
    drawn = np.random.default_rng(3).permutation(120)[:50]
    for layer, stats in enumerate(pre.stats):
        queries = np.asarray(stats.queries).reshape(120, cfg.num_heads, cfg.head_dim)[drawn]
        np.testing.assert_allclose(got[layer], numpy_rule(queries, cfg.num_kv_heads),
                                   atol=FILTER_ATOL, err_msg=f"layer {layer}")
    other = calibrate_qfilters(tiny_model, windows, samples=50, seed=4, progress=False)
    assert np.abs(other - got).max() > 1e-3  # the draw matters: a different seed, other filters


@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_kept_slots_are_each_heads_largest_minus_filter_dot_key(tiny_model, tmp_path, ratio):
    """A batch of two prompts (23 and 40 tokens, left-padded) prefilled, then `qfilter`."""
    cfg = tiny_model.config
    rng = np.random.default_rng(0)
    filters = rng.standard_normal((cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    path = str(tmp_path / "q.npz")
    np.savez(path, q_filters=filters.astype(np.float32))
    prompts = [rng.integers(3, 256, n).tolist() for n in (23, 40)]
    pre = prefill_batch(tiny_model, prompts)
    t = qfilter(ratio=ratio, filters=path)
    out, _ = t.update(pre.cache, t.init(pre.cache), None)
    for layer, (before, after) in enumerate(zip(pre.cache, out)):
        k = np.asarray(before.k).reshape(2, cfg.num_kv_heads, before.capacity, cfg.head_dim)
        pos = np.asarray(before.pos)
        for b, n in enumerate((23, 40)):
            for h in range(cfg.num_kv_heads):
                valid = pos[b, h] != EMPTY
                score = np.where(valid, -(k[b, h] @ filters[layer, h]), -np.inf)
                want = set(pos[b, h][np.argsort(-score)[:int(n * (1 - ratio))]].tolist())
                kept = np.asarray(after.pos[b, h])
                assert set(kept[kept != EMPTY].tolist()) == want, (layer, b, h)


def test_calibrated_filters_run_through_the_sampler_and_shrink(tiny_model, windows, tmp_path):
    """Filters from `calibrate_qfilters` saved as `kvjax calibrate --qfilters` saves them; the
    method parses, generates, and `shrink` leaves half the tokens' bytes."""
    from models.sampler import generate

    path = str(tmp_path / "q.npz")
    np.savez(path, q_filters=calibrate_qfilters(tiny_model, windows, progress=False))
    prompt = windows[0] + windows[1]
    full = generate(tiny_model, [prompt], max_new_tokens=4, shrink=True)
    out = generate(tiny_model, [prompt], max_new_tokens=4, shrink=True,
                   transform=kvjax.parse_method(f"qfilter:ratio=0.5,filters={path}"))
    assert kvjax.num_valid(out.cache[0]).tolist() == [[40 + 3] * 2]  # 40 kept, 3 decoded
    assert kvjax.nbytes(out.cache) < 0.6 * kvjax.nbytes(full.cache)


@pytest.mark.parametrize("make, match", [
    (None, "qfilter: needs filters=PATH"),
    (lambda p: p.write_text("x"), "holds no q_filters"),
    (lambda p: np.savez(p, q_filters=np.zeros((2, 2))), "holds no q_filters"),
    (lambda p: np.savez(p, q_filters=np.full((2, 2, 16), np.nan)), "are not all finite"),
])
def test_bad_filter_files_are_refused_by_name(tmp_path, make, match):
    path = tmp_path / "q.npz"
    if make is not None:
        make(path)
    with pytest.raises(ValueError, match=match):
        qfilter(ratio=0.5, filters=None if make is None else str(path))
    with pytest.raises(ValueError, match="is not a file"):
        qfilter(ratio=0.5, filters=str(tmp_path / "missing.npz"))


@pytest.mark.parametrize("shape, match", [((3, 2, 16), "filters for 3 layers, the cache has 2"),
                                          ((2, 1, 16), "filters of 1 KV heads x 16 dims"),
                                          ((2, 2, 8), "filters of 2 KV heads x 8 dims")])
def test_filters_of_another_model_are_refused_at_trace_time(tiny_model, tmp_path, shape, match):
    path = str(tmp_path / "q.npz")
    np.savez(path, q_filters=np.ones(shape, np.float32))
    pre = prefill_batch(tiny_model, [list(range(3, 30))])
    t = qfilter(ratio=0.5, filters=path)
    with pytest.raises(ValueError, match=match):
        t.update(pre.cache, t.init(pre.cache), None)


def test_a_wrapper_refuses_it_as_inner_by_name(tmp_path):
    """Per-layer filters cannot be indexed inside a wrapper's scoring: a clear ValueError when
    the wrapper is built, not a failure inside jit."""
    import functools
    from kvjax.policies.eviction_wrappers import chunkkv
    path = str(tmp_path / "q.npz")
    np.savez(path, q_filters=np.ones((2, 2, 16), np.float32))
    with pytest.raises(ValueError, match="chunkkv: inner=.* per-layer constants"):
        chunkkv(inner=functools.partial(qfilter, filters=path), ratio=0.5)
