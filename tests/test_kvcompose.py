"""KVCompose (`kvcompose`, kvpress KVComposePress): the selection rule against a numpy
transcription of kvpress's, and a batch against its rows alone. Parity with kvpress on SmolLM2
(its own second pass included) is in `tests/test_kvpress_zoo_third.py`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.policies.eviction_compose import kvcompose_keep
from tests.test_kvpress_parity import keep_by_position


def kvpress_keep(scores: np.ndarray, ratio: float) -> np.ndarray:
    """KVComposePress.prepare_important_masks at its defaults, transcribed: [L, KVH, T]."""
    num_layers, kvh, t = scores.shape
    scores = scores + scores.mean(axis=1, keepdims=True)  # add_mean_across_heads
    composite = np.sort(scores, axis=-1)[..., ::-1].mean(axis=1)  # [L, T] (agg_head mean)
    composite[0] = composite.max(axis=0)
    n_kept = max(1, int(composite.size * (1 - ratio)))
    kept = np.argsort(-composite.ravel(), kind="stable")[:n_kept] // t
    counts = np.maximum(np.bincount(kept, minlength=num_layers), 1)
    keep = np.zeros(scores.shape, bool)
    for layer in range(num_layers):
        for h in range(kvh):
            keep[layer, h, np.argsort(-scores[layer, h], kind="stable")[:counts[layer]]] = True
    return keep


@pytest.mark.parametrize("seed", range(8))
def test_rule_is_kvpress_on_random_scores(seed):
    rng = np.random.default_rng(seed)
    num_layers, kvh, t = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(3, 40))
    # ratios exact in binary: kvjax computes floor(N (1 - r)) from a float32 r, kvpress from a
    # float64 one, which puts N (1 - 0.9) = 6 at 5.999... and keeps one token fewer
    ratio = float(rng.choice([0.25, 0.5, 0.75, 0.875]))
    scores = rng.random((num_layers, kvh, t)).astype(np.float32) ** 3
    pos = np.broadcast_to(np.arange(t), (num_layers, 1, kvh, t))
    got = np.asarray(kvcompose_keep(jnp.asarray(scores)[:, None], jnp.asarray(pos),
                                    jnp.float32(ratio)))[:, 0]
    np.testing.assert_array_equal(got, kvpress_keep(scores, ratio))


def test_a_batch_keeps_what_each_row_keeps_alone(tiny_model):
    """Left padding and empty slots change nothing: two prompts of 40 and 23 tokens."""
    from models.sampler import prefill_and_compress
    t = kvjax.parse_method("kvcompose:ratio=0.75")
    a, b = list(range(3, 43)), list(range(50, 73))
    both = prefill_and_compress(tiny_model, [a, b], transform=t, room=2)
    for row, ids in enumerate((a, b)):
        alone = prefill_and_compress(tiny_model, [ids], transform=t, room=2)
        mine = tuple(layer.replace(pos=layer.pos[row:row + 1]) for layer in both.cache)
        np.testing.assert_array_equal(keep_by_position(mine, len(ids)),
                                      keep_by_position(alone.cache, len(ids)))
        kept = keep_by_position(alone.cache, len(ids)).sum(-1)  # [L, KVH]
        assert kept.sum(0).tolist() and (kept == kept[:, :1]).all()  # one count a layer
        assert kept[:, 0].sum() == max(1, int(len(ids) * len(alone.cache) * 0.25))


@pytest.mark.parametrize("spec, words", [("kvcompose", ["ratio", "None"]),
                                         ("kvcompose:ratio=1.0", ["ratio", "1.0"]),
                                         ("kvcompose:ratio=0.5,chunk=3", ["chunk"])])
def test_bad_arguments_are_refused_by_name(spec, words):
    with pytest.raises(ValueError) as e:
        kvjax.parse_method(spec)
    assert all(w in str(e.value) for w in words), str(e.value)
