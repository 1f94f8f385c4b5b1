"""Parity with kvpress 0.5.5's DuoAttentionPress (on-the-fly scoring) on SmolLM2.

The golden (`experiments/golden/make_kvpress_duo.py`, made by running kvpress in float32,
never kvjax) holds kvpress's `duo_attention_on_the_fly` head scores [L, KVH] of SmolLM2 over
50 calibration texts (passages of The Devil's Dictionary standing in for the hub's BookSum,
which is out of reach; their ids are stored), the streaming-head masks of
`DuoAttentionPress(head_compression_ratio=r, on_the_fly_scoring=True)` for r in 0.5 and 0.75,
and the positions each press masks in every layer and KV head on the 640- and 300-token texts.

kvjax computes the scores itself (`models.calibration.calibrate_duo_attention`), from its own
prefill of the same ids, and `duo_attention:head_ratio=r,scores=PATH` evicts what kvpress
masks.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.policies.eviction_duo import duo_head_scores, duo_keep, streaming_heads
from kvjax.policies.eviction_duo import duo_attention

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_duo.npz")
SCORE_ATOL = 1e-5  # the two prefills' means and float32 rounding (measured: 1.2e-7)
RATIOS = (0.5, 0.75)


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.fixture(scope="module")
def kvjax_scores(smollm2, golden, tmp_path_factory):
    """(kvjax's head scores of the golden's calibration texts, the .npz path holding them)."""
    from models.calibration import calibrate_duo_attention
    texts = [row[row >= 0].tolist() for row in golden["texts_ids"]]
    scores = calibrate_duo_attention(smollm2[0], texts, progress=False)
    path = str(tmp_path_factory.mktemp("duo") / "smollm2_duo.npz")
    np.savez(path, head_scores=scores)
    return scores, path


@pytest.mark.slow
def test_head_scores_and_streaming_heads_equal_kvpress(golden, kvjax_scores):
    """kvjax's calibration gives kvpress's on-the-fly head scores to `SCORE_ATOL`, hence the
    same streaming heads at r = 0.5 (45 of 90 (layer, KV head)s) and 0.75 (68 of 90)."""
    scores, _ = kvjax_scores
    want = golden["head_scores"]
    assert scores.shape == want.shape
    assert np.abs(scores - want).max() < SCORE_ATOL, np.abs(scores - want).max()
    for r in RATIOS:
        np.testing.assert_array_equal(streaming_heads(scores, r), golden[f"r{r:.2f}_streaming"])
    # not a near-tie: at each cut the two scores either side are far apart (4.9e-4 at 0.5,
    # 5.4e-3 at 0.75) next to the scores' error
    flat = np.sort(want.ravel())
    for r in RATIOS:
        n = round(flat.size * r)
        assert flat[n] - flat[n - 1] > 10 * SCORE_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
@pytest.mark.parametrize("r", RATIOS)
def test_kept_positions_equal_kvpress(smollm2, golden, kvjax_scores, ctx, r):
    """`duo_attention:head_ratio=r,scores=PATH` (kvjax's own scores) keeps, in every layer and
    KV head, exactly the positions kvpress's DuoAttentionPress leaves unmasked (the 300-token
    text: all of them, as kvpress's `[128:-256]` slice is empty there)."""
    from models.sampler import compress, prefill_batch
    from tests.test_kvpress_parity import keep_by_position
    _, path = kvjax_scores
    ids = golden[f"{ctx}_ids"].tolist()
    n = len(ids)
    layers, kvh = int(golden["num_layers"]), int(golden["kv_heads"])
    masked = np.unpackbits(golden[f"{ctx}_r{r:.2f}_masked"])[:layers * kvh * n]
    masked = masked.reshape(layers, kvh, n).astype(bool)
    pre = prefill_batch(smollm2[0], [ids])
    out = compress(pre, kvjax.parse_method(f"duo_attention:head_ratio={r},scores={path}"))
    np.testing.assert_array_equal(keep_by_position(out.cache, n), ~masked)
    if ctx == "ctx1":  # the cache holds what it keeps: pooled slots, no masked tokens
        kept = int((~masked).sum(axis=(1, 2)).max())
        assert max(layer.capacity for layer in out.cache) == kept


# ----------------------------------------------------------------------------- the rules


def _numpy_scores(q_mean, k_mean, inv_freq, q_len):
    """kvpress's duo_attention_on_the_fly for one text, in float64 numpy."""
    num_layers, h, d = q_mean.shape
    kvh = k_mean.shape[1]
    ang = np.arange(q_len)[:, None] * inv_freq.astype(np.float64)
    cos, sin = np.cos(np.concatenate([ang] * 2, -1)), np.sin(np.concatenate([ang] * 2, -1))
    half = lambda x: np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    out = np.zeros((num_layers, kvh))
    for layer in range(num_layers):
        q = np.repeat(q_mean[layer][:, None], q_len, 1)  # [H, T, D]
        k = np.repeat(k_mean[layer][:, None], q_len, 1)
        q, k = q * cos + half(q) * sin, k * cos + half(k) * sin
        k = np.repeat(k, h // kvh, axis=0)
        w = np.einsum("hd,htd->ht", q[:, -1], k) / np.sqrt(d)
        w = np.exp(w - w.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[layer] = np.cumsum(w, -1).mean(-1).reshape(kvh, -1).mean(-1)
    return out


def test_head_scores_match_numpy():
    """`duo_head_scores` is kvpress's rule (GQA groups of 3, 2 layers) to float32 rounding."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 6, 16)) * 2, rng.standard_normal((2, 2, 16)) * 2
    inv = 1.0 / 10000 ** (np.arange(0, 16, 2) / 16)
    got = duo_head_scores(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                          jnp.asarray(inv, jnp.float32), 60)
    np.testing.assert_allclose(np.asarray(got), _numpy_scores(q, k, inv, 60), atol=2e-6)


def test_keep_rule_matches_kvpress_slices():
    """Streaming heads lose their `[sink:-recent]` slots by position, whatever the slot order
    and left padding; a head of at most `sink + recent` tokens keeps all; retrieval heads all."""
    rng = np.random.default_rng(1)
    pos = np.full((2, 2, 12), kvjax.EMPTY, np.int32)
    pos[0, :, :10] = rng.permutation(10)  # 10 tokens, shuffled slots
    pos[1, :, 5:] = np.arange(7)  # 7 tokens after padding
    keep = np.asarray(duo_keep(jnp.asarray(pos), jnp.array([True, False]), 2, 3))
    for b, n in ((0, 10), (1, 7)):
        kept = set(pos[b, 0][keep[b, 0]].tolist())
        assert kept == set(range(2)) | set(range(n - 3, n))
        assert set(pos[b, 1][keep[b, 1]].tolist()) == set(range(n))  # retrieval head
    short = np.asarray(duo_keep(jnp.asarray(pos[1:]), jnp.array([True, True]), 4, 3))
    assert short.sum() == 14  # 7 <= 4 + 3: all kept, as kvpress's empty slice


def _scores_file(tmp_path, layers: int, kvh: int) -> str:
    path = str(tmp_path / "duo.npz")
    np.savez(path, head_scores=np.random.default_rng(0).random((layers, kvh)))
    return path


def test_batched_rows_generate_as_alone_and_the_cache_shrinks(tiny_model, tmp_path):
    """Prompts of different lengths in one batch generate what each generates alone; a
    streaming head's slots are freed (pooled layout), so the compressed cache is smaller."""
    from models.sampler import generate, prefill_and_compress
    cfg = tiny_model.config
    path = _scores_file(tmp_path, cfg.num_layers, cfg.num_kv_heads)
    t = kvjax.parse_method(f"duo_attention:head_ratio=0.5,scores={path},sink=4,recent=8")
    prompts = [np.random.default_rng(i).integers(3, 250, n).tolist()
               for i, n in enumerate([41, 26])]
    batch = generate(tiny_model, prompts, max_new_tokens=6, transform=t, eos_ids=())
    for row, prompt in enumerate(prompts):
        alone = generate(tiny_model, [prompt], max_new_tokens=6, transform=t, eos_ids=())
        assert batch.tokens[row].tolist() == alone.tokens[0].tolist()
    small = prefill_and_compress(tiny_model, [prompts[0]], transform=t)
    full = prefill_and_compress(tiny_model, [prompts[0]], transform=kvjax.parse_method("full"))
    streaming = int(streaming_heads(np.load(path)["head_scores"], 0.5).sum())
    assert streaming > 0
    held = sum(int((np.asarray(layer.pos) != kvjax.EMPTY).sum()) for layer in small.cache)
    assert held == cfg.num_layers * cfg.num_kv_heads * 41 - streaming * (41 - 12)
    assert kvjax.nbytes(small.cache) < kvjax.nbytes(full.cache)


@pytest.mark.parametrize("spec, words", [
    ("duo_attention:head_ratio=1.5,scores=x", ("head_ratio", "[0.0, 1.0]", "1.5")),
    ("duo_attention:head_ratio=0.5", ("scores=PATH",)),
    ("duo_attention:head_ratio=0.5,scores=/nope.npz", ("scores", "/nope.npz", "not a file")),
    ("duo_attention:head_ratio=0.5,scores=x,sink=-1", ("sink", ">= 0", "-1")),
    ("duo_attention:head_ratio=0.5,scores=x,recent=0", ("recent", ">= 1", "0")),
])
def test_bad_arguments_name_the_argument(spec, words):
    with pytest.raises(ValueError) as e:
        kvjax.parse_method(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_scores_of_another_model_are_refused(tiny_model, tmp_path):
    """Scores for another shape than the model's: a ValueError naming both shapes."""
    from models.sampler import prefill_and_compress
    t = duo_attention(0.5, _scores_file(tmp_path, 7, 3))
    with pytest.raises(ValueError, match="7 layers x 3 KV heads"):
        prefill_and_compress(tiny_model, [list(range(3, 30))], transform=t)


def test_kvjax_methods_lists_duo_attention(tmp_path):
    """`kvjax methods` names DuoAttentionPress, this test, and a spec that parses once a
    scores file is given."""
    from kvjax.policies.methods import describe_methods
    m = {m["name"]: m for m in describe_methods()}["duo_attention"]
    assert m["kvpress"] == "DuoAttentionPress" and m["proof"] == "tests/test_kvpress_duo.py"
    path = _scores_file(tmp_path, 2, 2)
    t = kvjax.parse_method(m["spec"].format(r=0.5).replace("=PATH", f"={path}"))
    assert sum(map(sum, t.update.streaming)) == 2 and t.update.sink == 128
