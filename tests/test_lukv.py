"""LU-KV (`lukv`, kvpress LUKVPress): the per-head counts, the budget curve kvjax profiles, and
the method's bad inputs. Parity with kvpress given the same curve is in
`tests/test_kvpress_zoo_third.py`; here each piece is checked against numpy:

* `head_keep_counts` against a transcription of kvpress's rounding;
* `utility_curves` against a loop; `allocate` against an exhaustive search of the best
  allocation of the hull utilities (and of the utilities themselves where they are concave);
* `calibrate_lukv`'s future attention of layer 0 against numpy attention from the weights;
* the kept slots of a batch with different prompt lengths against a numpy top-k per head.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvjax
from kvjax.core.cache import EMPTY
from kvjax.policies.eviction_lukv import (_hull_segments, allocate, budget_curve,
                                          head_keep_counts, utility_curves)
from models.sampler import prefill_batch
from tests.test_qfilter import layer0_queries


def kvpress_counts(prune: np.ndarray, n: int) -> list[int]:
    """LUKVPress.compress's per-head counts, transcribed (float32 as torch computes them)."""
    ideal = np.clip(1.0 - prune.astype(np.float32), 0, 1) * np.float32(n)
    total = int(np.round(ideal.sum(dtype=np.float32)))
    total = max(len(prune), min(len(prune) * n, total))
    base = np.floor(ideal).astype(np.int64)
    remainder = total - int(base.sum())
    if remainder > 0:
        frac = ideal - base
        base[np.argsort(-frac, kind="stable")[:min(remainder, len(prune))]] += 1
    return np.clip(base, 1, n).tolist()


def test_head_counts_are_kvpress_rounding():
    rng = np.random.default_rng(0)
    for trial in range(300):
        kvh, n = int(rng.integers(1, 9)), int(rng.integers(1, 700))
        prune = rng.uniform(-0.1, 1.1, kvh).astype(np.float32)  # clipped to [0, 1]
        if trial % 3 == 0:
            prune = np.round(prune * 4) / 4  # exact halves: ties in the fractional parts
        got = np.asarray(head_keep_counts(prune, np.array([n])))[0].tolist()
        assert got == kvpress_counts(prune, n), (prune, n)


def test_utility_curves_hold_the_top_k_share():
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((3, 7))
    scores[0, 2] = np.inf  # protected: first
    scores[1, 3] = scores[1, 5]  # a tie: the earlier token first
    importance = rng.random((3, 7))
    got = utility_curves(scores, importance)
    for row in range(3):
        order = sorted(range(7), key=lambda j: (-scores[row, j], j))
        want = [0.0] + list(np.cumsum(importance[row, order]) / importance[row].sum())
        np.testing.assert_allclose(got[row], want, rtol=1e-12)


def hull_values(u: np.ndarray) -> np.ndarray:
    """The upper concave hull of (k, u[k]) evaluated at every k (from `_hull_segments`)."""
    out, k = [u[0]], 0
    for length, slope in _hull_segments(u):
        for _ in range(length):
            k += 1
            out.append(out[-1] + slope)
    return np.asarray(out)


def best_by_search(curves: np.ndarray, total: int) -> float:
    width = curves.shape[-1] - 1
    return max(sum(c[k] for c, k in zip(curves, ks))
               for ks in itertools.product(range(width + 1), repeat=len(curves))
               if sum(ks) == total)


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_best_for_the_hulls(seed):
    """Three heads of 6 tokens, every total budget: the greedy's hull utility is the best any
    allocation reaches; on concave curves (hull = curve) it is the best of the curves."""
    rng = np.random.default_rng(seed)
    raw = np.concatenate([np.zeros((3, 1)), np.cumsum(rng.random((3, 6)) ** 3, -1)], -1)
    raw /= raw[:, -1:]
    hulls = np.stack([hull_values(u) for u in raw])
    assert (hulls >= raw - 1e-12).all() and (np.diff(hulls, 2) <= 1e-12).all()  # concave, above
    for total in range(0, 19):
        keep = total / 18
        counts = allocate(raw, keep)
        assert counts.sum() == total and (counts <= 6).all()
        got = sum(h[k] for h, k in zip(hulls, counts))
        assert got == pytest.approx(best_by_search(hulls, total), abs=1e-12)
        concave = np.sort(np.diff(raw, axis=-1), axis=-1)[:, ::-1].cumsum(-1)  # rearranged
        concave = np.concatenate([np.zeros((3, 1)), concave], -1)
        counts = allocate(concave, keep)
        assert sum(c[k] for c, k in zip(concave, counts)) == pytest.approx(
            best_by_search(concave, total), abs=1e-12)


def test_budget_curve_rows_meet_their_ratio_and_grow_with_it():
    rng = np.random.default_rng(2)
    u = np.concatenate([np.zeros((2, 3, 1)), np.cumsum(rng.random((2, 3, 40)), -1)], -1)
    curve = budget_curve(u / u[..., -1:])
    assert curve.shape == (99, 2, 3)
    kept = np.round((1 - curve) * 40).astype(int).sum((1, 2))  # tokens kept per row
    np.testing.assert_array_equal(kept, [round((1 - (i + 1) / 100) * 240) for i in range(99)])
    assert (np.diff(curve, axis=0) >= -1e-7).all()  # each head prunes more as r grows


def test_future_attention_of_layer0_is_numpy_attention(tiny_model):
    """`_lukv_scores`'s second output for layer 0: the softmax attention (causal, 1/sqrt(D))
    of the window's last 10 queries over its first 30 tokens, summed over the queries and
    each KV head's query heads, from the weights in numpy."""
    import jax.numpy as jnp
    from kvjax.core.stats import StatsSpec
    from kvjax.policies.eviction_wrappers import inner_scorer
    from models.calibration import _lukv_scores

    cfg = tiny_model.config
    ids = np.random.default_rng(3).integers(3, 256, 40).tolist()
    scorer, spec = inner_scorer(kvjax.policies.eviction.knorm, "lukv", 0.5)
    pre = prefill_batch(tiny_model, [ids[:30]], stats=spec)
    full = prefill_batch(tiny_model, [ids], stats=StatsSpec(window=10))
    _, got = _lukv_scores(scorer, 4, 1, 30, pre.cache[0], None, full.cache[0], full.stats[0])
    q = layer0_queries(tiny_model, ids)  # [T, H, D] post-RoPE
    x = np.asarray(tiny_model.embed[...], np.float64)[ids]
    norm = tiny_model.layers[0].input_norm
    x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + norm.eps) * np.asarray(norm.weight[...])
    k = (x @ np.asarray(tiny_model.layers[0].attn.k_proj.kernel[...])).reshape(
        40, cfg.num_kv_heads, cfg.head_dim)
    d = cfg.head_dim
    angle = np.arange(40)[:, None] / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    k = np.concatenate([k[..., :d // 2] * cos - k[..., d // 2:] * sin,
                        k[..., d // 2:] * cos + k[..., :d // 2] * sin], -1)
    group = cfg.num_heads // cfg.num_kv_heads
    want = np.zeros((cfg.num_kv_heads, 30))
    for t in range(30, 40):
        for h in range(cfg.num_heads):
            logits = k[:t + 1, h // group] @ q[t, h] / np.sqrt(d)
            p = np.exp(logits - logits.max())
            want[h // group] += (p / p.sum())[:30]
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=2e-4, atol=1e-6)
    assert jnp.isfinite(got).all()


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_kept_slots_are_each_heads_count_of_best_inner_scores(tiny_model, tmp_path, ratio):
    """Two prompts (37 and 22 tokens, left-padded), `lukv:inner=knorm`: each head keeps
    `head_keep_counts` of its row's n, the first 4 and the last token first, then the smallest
    key norms (Knorm), every layer."""
    cfg = tiny_model.config
    rng = np.random.default_rng(4)
    curve = rng.uniform(0.05, 0.95, (99, cfg.num_layers, cfg.num_kv_heads)).astype(np.float32)
    path = str(tmp_path / "curve.npy")
    np.save(path, curve)
    lengths = (37, 22)
    pre = prefill_batch(tiny_model, [rng.integers(3, 256, n).tolist() for n in lengths])
    t = kvjax.parse_method(f"lukv:inner=knorm,ratio={ratio},curve={path}")
    out, state = t.update(pre.cache, t.init(pre.cache), None)
    row = int(np.clip(round(ratio * 100) - 1, 0, 98))
    for layer, (before, after) in enumerate(zip(pre.cache, out)):
        k = np.asarray(before.k).reshape(2, cfg.num_kv_heads, before.capacity, cfg.head_dim)
        pos = np.asarray(before.pos)
        for b, n in enumerate(lengths):
            counts = kvpress_counts(curve[row, layer], n)
            assert np.asarray(state.counts)[layer, b].tolist() == counts
            for h in range(cfg.num_kv_heads):
                valid = pos[b, h] != EMPTY
                score = np.where(valid, -np.linalg.norm(k[b, h], axis=-1), -np.inf)
                protect = valid & ((pos[b, h] < 4) | (pos[b, h] == n - 1))
                score = np.where(protect, np.inf, score)
                want = set(pos[b, h][np.argsort(-score, kind="stable")[:counts[h]]].tolist())
                kept = np.asarray(after.pos[b, h])
                assert set(kept[kept != EMPTY].tolist()) == want, (layer, b, h)


@pytest.mark.parametrize("make, match", [
    (None, "lukv: needs curve=PATH"),
    (lambda p: p.write_text("x"), "holds no \\[99, L, KVH\\] budget curve"),
    (lambda p: np.save(p, np.zeros((98, 2, 2))), "holds no \\[99, L, KVH\\] budget curve"),
    (lambda p: np.save(p, np.full((99, 2, 2), 1.5)), "must be finite and in \\[0, 1\\]"),
    (lambda p: np.save(p, np.full((99, 2, 2), np.nan)), "must be finite and in \\[0, 1\\]"),
])
def test_bad_curves_are_refused_by_name(tmp_path, make, match):
    path = tmp_path / "curve.npy"
    if make is not None:
        make(path)
    spec = "lukv:ratio=0.5" + ("" if make is None else f",curve={path}")
    with pytest.raises(ValueError, match=match):
        kvjax.parse_method(spec)


def test_bad_arguments_and_other_models_are_refused(tiny_model, tmp_path):
    path = str(tmp_path / "curve.npy")
    np.save(path, np.full((99, 3, 2), 0.5, np.float32))
    for spec, match in [(f"lukv:curve={path}", "lukv: ratio"),
                        (f"lukv:ratio=1.0,curve={path}", "lukv: ratio"),
                        (f"lukv:ratio=0.5,sink=-1,curve={path}", "sink"),
                        (f"lukv:ratio=0.5,inner=nope,curve={path}", "not a registered method"),
                        (f"lukv:ratio=0.5,inner=kivi,curve={path}", "not a scored policy")]:
        with pytest.raises(ValueError, match=match):
            kvjax.parse_method(spec)
    pre = prefill_batch(tiny_model, [list(range(3, 30))])
    t = kvjax.parse_method(f"lukv:ratio=0.5,inner=knorm,curve={path}")
    with pytest.raises(ValueError, match="curve for 3 layers x 2 KV heads, the model has 2 x 2"):
        t.update(pre.cache, t.init(pre.cache), None)
