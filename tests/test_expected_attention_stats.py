"""ExpectedAttention with calibrated query statistics (`expected_attention_stats`, kvpress
ExpectedAttentionStatsPress): the statistics `kvjax calibrate --query-stats` computes against
numpy, the scorer against ExpectedAttention given the same moments, and bad inputs. Parity
with kvpress given the same statistics is in `tests/test_kvpress_zoo_third.py`."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.core.stats import StatsSpec
from models.calibration import calibrate_query_stats
from models.sampler import prefill_batch


def test_statistics_are_numpy_moments_of_layer0_queries(tiny_model):
    """Layer 0's pre-RoPE queries from the weights in numpy, each window's first 4 positions
    left out: the mean, and the covariance with N - 1 (kvpress's `collect_queries`)."""
    cfg = tiny_model.config
    rng = np.random.default_rng(0)
    windows = [rng.integers(3, 256, n).tolist() for n in (30, 30, 30)]
    mean, cov = calibrate_query_stats(tiny_model, windows, progress=False)
    assert mean.shape == (cfg.num_layers, cfg.num_heads, cfg.head_dim)
    norm = tiny_model.layers[0].input_norm
    queries = []
    for ids in windows:
        x = np.asarray(tiny_model.embed[...], np.float64)[ids]
        x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + norm.eps) * np.asarray(norm.weight[...])
        q = x @ np.asarray(tiny_model.layers[0].attn.q_proj.kernel[...])
        queries.append(q.reshape(len(ids), cfg.num_heads, cfg.head_dim)[4:])
    q = np.concatenate(queries)  # [N, H, D]
    np.testing.assert_allclose(mean[0], q.mean(0), rtol=1e-4, atol=1e-5)
    want = np.einsum("nhi,nhj->hij", q - q.mean(0), q - q.mean(0)) / (len(q) - 1)
    np.testing.assert_allclose(cov[0], want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


def test_scores_are_expected_attentions_with_those_moments(tiny_model, tmp_path):
    """With the prompt's own moments saved as the statistics, `expected_attention_stats` keeps
    what `expected_attention` keeps (same rotation, sinks and value norms); with others it
    keeps something else."""
    ids = np.random.default_rng(1).integers(3, 256, 60).tolist()
    spec = StatsSpec(query_moments=True, moments_skip=4, window=1)
    pre = prefill_batch(tiny_model, [ids], stats=spec)
    mean = np.stack([np.asarray(s.q_sum)[0] / float(s.q_count[0]) for s in pre.stats])
    cov = np.stack([np.asarray(s.q_outer)[0] / float(s.q_count[0])
                    - np.einsum("hi,hj->hij", m, m) for s, m in zip(pre.stats, mean)])
    path = str(tmp_path / "stats.npz")
    np.savez(path, query_mean=mean, query_cov=cov)

    def kept(spec_str):
        t = kvjax.parse_method(spec_str)
        out, _ = t.update(pre.cache, t.init(pre.cache), pre.stats)
        return [np.sort(np.asarray(layer.pos)[0], -1).tolist() for layer in out]

    assert kept(f"expected_attention_stats:ratio=0.5,stats={path}") == \
        kept("expected_attention:ratio=0.5")
    other = np.random.default_rng(2).standard_normal(mean.shape) * 5
    np.savez(path, query_mean=other, query_cov=np.zeros_like(cov))
    assert kept(f"expected_attention_stats:ratio=0.5,stats={path}") != \
        kept("expected_attention:ratio=0.5")


@pytest.mark.parametrize("make, match", [
    (None, "needs stats=PATH"),
    (lambda p: p.write_text("x"), "holds no query_mean"),
    (lambda p: np.savez(p, query_mean=np.zeros((2, 4, 16)), query_cov=np.zeros((2, 4, 16))),
     "holds no query_mean"),
    (lambda p: np.savez(p, query_mean=np.full((2, 4, 16), np.nan),
                        query_cov=np.zeros((2, 4, 16, 16))), "not all finite"),
])
def test_bad_statistics_files_are_refused_by_name(tmp_path, make, match):
    path = tmp_path / "stats.npz"
    if make is not None:
        make(path)
    spec = "expected_attention_stats:ratio=0.5" + ("" if make is None else f",stats={path}")
    with pytest.raises(ValueError, match=match):
        kvjax.parse_method(spec)


@pytest.mark.parametrize("shape, match", [((3, 4, 16), "statistics for 3 layers"),
                                          ((2, 2, 16), "statistics of 2 query heads"),
                                          ((2, 4, 8), "statistics of 4 query heads x 8")])
def test_statistics_of_another_model_are_refused(tiny_model, tmp_path, shape, match):
    path = str(tmp_path / "stats.npz")
    np.savez(path, query_mean=np.zeros(shape, np.float32),
             query_cov=np.zeros(shape + shape[-1:], np.float32))
    t = kvjax.parse_method(f"expected_attention_stats:ratio=0.5,stats={path}")
    pre = prefill_batch(tiny_model, [list(range(3, 30))], stats=t.stats)
    with pytest.raises(ValueError, match=match):
        t.update(pre.cache, t.init(pre.cache), pre.stats)
