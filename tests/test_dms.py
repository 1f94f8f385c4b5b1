"""`dms` (kvpress DMSPress) against numpy on a tiny model: no budget, a threshold on the inner
method's raw scores, the newest `window` tokens of each row kept (kvpress parity on SmolLM2:
`tests/test_kvpress_zoo_third.py`)."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.core.cache import EMPTY
from models.sampler import generate, prefill_batch


@pytest.mark.parametrize("threshold, window", [(-4.0, 8), (-3.0, 0), (-100.0, 16)])
def test_dms_keeps_scores_at_least_t_and_the_newest_window(tiny_model, threshold, window):
    """Knorm inside (score -||k||), a left-padded batch of 23 and 40 tokens: per layer and KV
    head, exactly the positions with -||k|| >= t plus the newest `window`."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (23, 40)]
    pre = prefill_batch(tiny_model, prompts)
    t = kvjax.parse_method(f"dms:inner=knorm,threshold={threshold},window={window}")
    out, _ = t.update(pre.cache, t.init(pre.cache), None)
    counts = set()
    for layer, (before, after) in enumerate(zip(pre.cache, out)):
        k, pos = np.asarray(before.logical_k, np.float64), np.asarray(before.pos)
        for b, ids in enumerate(prompts):
            for h in range(k.shape[1]):
                valid = pos[b, h] != EMPTY
                newest = pos[b, h][valid].max()
                score = -np.linalg.norm(k[b, h], axis=-1)
                want = set(pos[b, h][valid & ((score >= threshold)
                                              | (pos[b, h] > newest - window))].tolist())
                kept = np.asarray(after.pos[b, h])
                assert set(kept[kept != EMPTY].tolist()) == want, (layer, b, h)
                counts.add(len(want))
    if threshold > -100:
        assert len(counts) > 1  # the counts follow the scores


def test_without_headwise_each_head_keeps_its_row_and_kivi_can_follow():
    """`headwise=false`: the same kept tokens in per-head rows, so a per-channel codec (KIVI,
    which the pooled row refuses by name) can follow."""
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    model = Llama(LlamaConfig.tiny(head_dim=32, max_position=512), rngs=nnx.Rngs(0))
    ids = np.random.default_rng(3).integers(3, 256, 200).tolist()
    pooled, rows = (kvjax.parse_method(f"dms:inner=knorm,threshold=-4,window=16{extra}")
                    for extra in ("", ",headwise=false"))
    pre = prefill_batch(model, [ids])
    a, _ = pooled.update(pre.cache, pooled.init(pre.cache), None)
    b, _ = rows.update(pre.cache, rows.init(pre.cache), None)
    for x, y in zip(a, b):
        assert x.pooled and not y.pooled
        for h in range(y.kv_heads):
            got = np.asarray(y.pos[0, h])
            assert set(got[got != EMPTY].tolist()) == set(
                np.asarray(x.pos[0, h])[np.asarray(x.pos[0, h]) != EMPTY].tolist())
    with pytest.raises(ValueError, match="per-channel"):
        generate(model, [ids], max_new_tokens=2, transform=kvjax.parse_method(
            "dms:inner=knorm,threshold=-4,window=16+kivi:bits=4"))
    out = generate(model, [ids], max_new_tokens=2, transform=kvjax.parse_method(
        "dms:inner=knorm,threshold=-4,window=16,headwise=false+kivi:bits=4"))
    assert out.tokens.shape == (1, 2)


def test_dms_runs_during_decode_and_refuses_bad_arguments(tiny_model):
    ids = np.random.default_rng(1).integers(3, 256, 40).tolist()
    out = generate(tiny_model, [ids], max_new_tokens=4, compress_every=2,
                   transform=kvjax.parse_method("dms:inner=knorm,threshold=-4,window=8"))
    assert int(kvjax.num_valid(out.cache[0]).min()) >= 8
    for spec, match in [("dms:inner=knorm", "dms: needs threshold=T"),
                        ("dms:inner=knorm,threshold=nan", "threshold must be a finite number"),
                        ("dms:inner=knorm,threshold=0,window=-1", "window"),
                        ("dms:inner=full,threshold=0", "inner=full")]:
        with pytest.raises(ValueError, match=match):
            kvjax.parse_method(spec)


def test_dms_frees_the_bytes_of_what_it_evicts(tiny_model):
    """Heads keep different counts, so the layer is pooled: after `shrink` the cache holds the
    kept tokens of all heads together (+ room), not the longest head's count in every head."""
    from models.sampler import prefill_and_compress
    ids = np.random.default_rng(2).integers(3, 256, 64).tolist()
    t = kvjax.parse_method("dms:inner=knorm,threshold=-4,window=8")
    out = prefill_and_compress(tiny_model, [ids], transform=t, room=0)
    full = prefill_and_compress(tiny_model, [ids], room=0)
    kept = sum(int(kvjax.num_valid(layer).sum()) for layer in out.cache)
    total = sum(int(kvjax.num_valid(layer).sum()) for layer in full.cache)
    assert kept < 0.9 * total
    for layer in out.cache:  # one pooled row: every head's kept tokens, nothing more
        assert layer.pooled and layer.capacity == int(kvjax.num_valid(layer).sum())
    assert kvjax.nbytes(out.cache) <= kvjax.nbytes(full.cache) * kept / total * 1.05
