"""KVzap (`kvzap`, kvpress KVzapPress): the surrogate's scores, the kept tokens, training and
the orbax round trip, against numpy.

* Scores: each layer's attention input is computed here in numpy for layer 0 (embedding,
  RMSNorm) and by `probe_forward` for every layer; the surrogate is applied in numpy (exact
  GELU by `math.erf`); the scores the model wrote as tokens entered (`observe`), prefill in
  one chunk or several, and decode steps, must equal them at float32 rounding.
* Eviction: per layer and KV head, the `floor(n (1 - ratio))` best-scored positions of each
  prompt in a left-padded batch of two lengths (kvpress's ScorerPress rule).
* Training: ridge regression's solution has a zero gradient of the ridge objective; the
  optax MLP learns a random teacher MLP to a small fraction of the targets' variance.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.core.cache import EMPTY
from kvjax.policies.eviction_kvzap import KVzapModel, fit_linear, fit_mlp, kvzap, load_kvzap
from models.sampler import prefill_batch
from tests.test_bad_inputs import tiny_gguf  # noqa: F401  (a fixture: a tiny GGUF model)

SCORE_ATOL = 2e-4  # float32 matmuls over hidden 64 of unit-RMS inputs (measured ~1e-5)


def random_surrogate(cfg, kind: str, seed: int = 0, width: int = 8) -> KVzapModel:
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    layers, hidden, kvh = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads
    if kind == "linear":
        return KVzapModel(w1=f(layers, hidden, kvh) / 8, b1=f(layers, kvh))
    return KVzapModel(w1=f(layers, hidden, width) / 8, b1=f(layers, width),
                      w2=f(layers, width, kvh) / 3, b2=f(layers, kvh))


def numpy_apply(surrogate: KVzapModel, layer: int, h: np.ndarray) -> np.ndarray:
    """[..., hidden] float64 -> [..., KVH]: the surrogate by its definition."""
    x = h @ surrogate.w1[layer].astype(np.float64) + surrogate.b1[layer]
    if surrogate.w2 is None:
        return x
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    return gelu(x) @ surrogate.w2[layer].astype(np.float64) + surrogate.b2[layer]


def attention_inputs(model, ids: list[int]) -> list[np.ndarray]:
    """Per layer [T, hidden]: the attention input of each token (`probe_forward`)."""
    from kvjax.core.stats import NO_STATS
    from models.reconstruction import probe_forward
    tokens = jnp.asarray([ids])
    cache = kvjax.init_model_cache(model.config.cache_spec, 1, len(ids))
    _, _, _, inputs = probe_forward(model, tokens, jnp.arange(len(ids))[None], cache, None,
                                    NO_STATS)
    return [np.asarray(h[0], np.float64) for h in inputs]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_scores_written_as_tokens_enter_are_the_surrogate_of_their_attention_input(
        tiny_model, kind):
    """Prefill in chunks of 8 and 40 tokens alike: `position_scores[l][b, h, p]` is the
    surrogate of token p's attention input in layer l; layer 0's input is checked against a
    numpy RMSNorm of the embedding."""
    cfg = tiny_model.config
    surrogate = random_surrogate(cfg, kind)
    ids = np.random.default_rng(1).integers(3, 256, 40).tolist()
    inputs = attention_inputs(tiny_model, ids)
    x = np.asarray(tiny_model.embed[...], np.float64)[ids]
    norm = tiny_model.layers[0].input_norm
    x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + norm.eps) * np.asarray(norm.weight[...])
    np.testing.assert_allclose(inputs[0], x, rtol=1e-5, atol=1e-5)
    spec = kvzap(ratio=0.5, weights=surrogate).stats
    for chunk in (8, 40):
        pre = prefill_batch(tiny_model, [ids], stats=spec, chunk=chunk)
        for layer, s in enumerate(pre.stats):
            want = numpy_apply(surrogate, layer, inputs[layer]).T  # [KVH, T]
            got = np.asarray(s.position_scores)[0]  # [KVH, P]
            np.testing.assert_allclose(got[:, :40], want, atol=SCORE_ATOL, err_msg=f"{layer}")
            assert not got[:, 40:].any()  # positions not reached yet: nothing written


@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_kept_tokens_are_each_heads_best_predicted(tiny_model, kind, ratio):
    """A batch of two prompts (23 and 40 tokens, left-padded): per layer and KV head, the
    `floor(n (1 - ratio))` positions with the highest numpy-predicted score."""
    cfg = tiny_model.config
    surrogate = random_surrogate(cfg, kind, seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (23, 40)]
    t = kvzap(ratio=ratio, weights=surrogate)
    pre = prefill_batch(tiny_model, prompts, stats=t.stats)
    out, _ = t.update(pre.cache, t.init(pre.cache), pre.stats)
    for b, ids in enumerate(prompts):
        inputs = attention_inputs(tiny_model, ids)
        for layer, after in enumerate(out):
            score = numpy_apply(surrogate, layer, inputs[layer])  # [n, KVH]
            for h in range(cfg.num_kv_heads):
                want = set(np.argsort(-score[:, h])[:int(len(ids) * (1 - ratio))].tolist())
                kept = np.asarray(after.pos[b, h])
                assert set(kept[kept != EMPTY].tolist()) == want, (layer, b, h)


def test_decode_steps_score_their_tokens_and_generation_compresses(tiny_model):
    """A decode step (the model's forward over one token, statistics carried) scores its
    token at its position; `generate` with `compress_every` re-plans and keeps the budget."""
    from models.sampler import generate
    cfg = tiny_model.config
    surrogate = random_surrogate(cfg, "mlp", seed=3)
    ids = np.random.default_rng(4).integers(3, 256, 36).tolist()
    t = kvzap(ratio=0.5, weights=surrogate)
    pre = prefill_batch(tiny_model, [ids[:32]], stats=t.stats, room=4)
    cache, stats = pre.cache, pre.stats
    for p in range(32, 36):
        _, cache, stats = tiny_model.forward(jnp.asarray([[ids[p]]]), jnp.asarray([[p]]),
                                             cache, stats, t.stats)
    inputs = attention_inputs(tiny_model, ids)
    for layer, s in enumerate(stats):
        np.testing.assert_allclose(np.asarray(s.position_scores)[0],
                                   numpy_apply(surrogate, layer, inputs[layer]).T,
                                   atol=SCORE_ATOL, err_msg=f"layer {layer}")
    out = generate(tiny_model, [ids], max_new_tokens=6, compress_every=2, transform=t)
    assert int(kvjax.num_valid(out.cache[0]).max()) <= 18 + 2  # half of 36, then 2 per re-plan


def test_ridge_solution_zeroes_the_ridge_objectives_gradient():
    """fit_linear minimises sum ||x w + b - y||^2 + alpha ||w||^2 per layer (scikit-learn's
    Ridge, kvpress's linear surrogate): at its solution both gradients vanish."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 2, 6)).astype(np.float32) * [1, 3, 0.5, 2, 1, 1]
    y = (x @ rng.standard_normal((6, 3)) + rng.standard_normal((300, 2, 3))).astype(np.float32)
    alpha = 5.0
    m = fit_linear(x, y, alpha=alpha)
    for layer in range(2):
        w, b = m.w1[layer].astype(np.float64), m.b1[layer].astype(np.float64)
        r = x[:, layer] @ w + b - y[:, layer]
        np.testing.assert_allclose(x[:, layer].T @ r + alpha * w, 0, atol=2e-2)
        np.testing.assert_allclose(r.sum(0), 0, atol=2e-2)
    assert np.abs(fit_linear(x, y, alpha=0.0).w1 - m.w1).max() > 1e-3  # alpha matters


def test_mlp_learns_a_teacher_mlp():
    """Targets from a random teacher MLP (16 units): the optax fit's error on fresh inputs is
    under 10% of the targets' variance; the linear fit's is not (the GELU matters)."""
    cfg = type("C", (), {"num_layers": 2, "hidden_size": 8, "num_kv_heads": 2})
    teacher = random_surrogate(cfg, "mlp", seed=5, width=16)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4096, 2, 8)).astype(np.float32) * 3
    fresh = rng.standard_normal((512, 2, 8)).astype(np.float32) * 3
    target = lambda a: np.stack([numpy_apply(teacher, i, a[:, i]) for i in range(2)], 1)
    student = fit_mlp(x, target(x).astype(np.float32), hidden=32, epochs=40, lr=1e-2, batch=256)
    want = target(fresh)
    assert ((student.predict(fresh) - want) ** 2).mean() < 0.1 * want.var(0).mean()
    linear = fit_linear(x, target(x).astype(np.float32))
    assert ((linear.predict(fresh) - want) ** 2).mean() > 0.1 * want.var(0).mean()


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_orbax_round_trip_and_spec_string(tiny_model, tmp_path, kind):
    """`save` then `load_kvzap` gives equal arrays (and an equal, same-hash surrogate); the spec
    string `kvzap:ratio=...,weights=DIR` builds the same transform."""
    surrogate = random_surrogate(tiny_model.config, kind)
    surrogate.save(tmp_path / "w")
    back = load_kvzap(tmp_path / "w")
    assert back == surrogate and hash(back) == hash(surrogate) and back.kind == kind
    t = kvjax.parse_method(f"kvzap:ratio=0.5,weights={tmp_path / 'w'}")
    assert t.stats.token_scores == surrogate


def test_bad_weights_are_refused_by_name(tiny_model, tmp_path):
    cfg = tiny_model.config
    with pytest.raises(ValueError, match="kvzap: needs weights=DIR"):
        kvzap(ratio=0.5)
    with pytest.raises(ValueError, match="is not an orbax checkpoint directory"):
        kvzap(ratio=0.5, weights=str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not an orbax checkpoint directory"):
        kvzap(ratio=0.5, weights=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="w2 has shape"):
        KVzapModel(w1=np.zeros((2, 4, 3), np.float32), b1=np.zeros((2, 3), np.float32),
                   w2=np.zeros((2, 5, 1), np.float32), b2=np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="give both w2 and b2"):
        KVzapModel(w1=np.zeros((2, 4, 3), np.float32), b1=np.zeros((2, 3), np.float32),
                   w2=np.zeros((2, 3, 1), np.float32))
    with pytest.raises(ValueError, match="b1 is not all finite"):
        KVzapModel(w1=np.zeros((2, 4, 3), np.float32), b1=np.full((2, 3), np.nan, np.float32))
    with pytest.raises(ValueError, match="ratio is the fraction of tokens evicted"):
        kvzap(ratio=1.5, weights=random_surrogate(cfg, "linear"))
    other = type("C", (), {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size + 1,
                           "num_kv_heads": cfg.num_kv_heads})
    t = kvzap(ratio=0.5, weights=random_surrogate(other, "linear"))
    with pytest.raises(ValueError, match=f"hidden size {cfg.hidden_size + 1}.*train its own"):
        prefill_batch(tiny_model, [list(range(3, 20))], stats=t.stats)
    t = kvzap(ratio=0.5, weights=random_surrogate(cfg, "linear"))
    pre = prefill_batch(tiny_model, [list(range(3, 20))])
    with pytest.raises(ValueError, match="kvzap scores tokens as the model runs them"):
        t.update(pre.cache, t.init(pre.cache), None)


def test_a_kvzip_pass_and_a_token_scorer_are_refused_together(tiny_model):
    """Both write `position_scores`: a chain of kvzip and kvzap is refused by name."""
    t = kvzap(ratio=0.5, weights=random_surrogate(tiny_model.config, "linear"))
    with pytest.raises(ValueError, match="reconstruction pass .* and a token scorer"):
        kvjax.chain(kvjax.parse_method("kvzip:ratio=0.5,prompt=bare"), t)


def test_training_data_targets_are_the_log_of_kvzip_plus_scores(tiny_model):
    """`kvzap_training_data`: inputs are `probe_forward`'s attention inputs of the drawn
    tokens; targets the log of the scores `kvzip:plus=true` ranks by (its reconstruction)."""
    from kvjax.policies.eviction_kvzip import Reconstruction, ReconstructionPrompt
    from models.calibration import kvzap_training_data
    from models.reconstruction import reconstruct
    ids = np.random.default_rng(7).integers(3, 256, 32).tolist()
    x, y = kvzap_training_data(tiny_model, [ids], ReconstructionPrompt(), samples=10, seed=3,
                               progress=False)
    take = np.sort(np.random.default_rng(3).permutation(np.arange(32))[:10])
    inputs = attention_inputs(tiny_model, ids)
    np.testing.assert_allclose(x, np.stack([h[take] for h in inputs], 1), rtol=1e-5, atol=1e-5)
    pre = prefill_batch(tiny_model, [ids])
    stats = reconstruct(tiny_model, pre.cache, None, np.array([32]), [ids],
                        Reconstruction(chunk_size=32, prompt=ReconstructionPrompt(), plus=True))
    want = np.stack([np.log(np.asarray(s.position_scores)[0][:, take]).T for s in stats], 1)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_calibrate_command_trains_saves_and_reports_a_held_out_fit(capsys, tmp_path, tiny_gguf):
    """`kvjax calibrate --kvzap linear --json`: an orbax directory `kvzap:weights=DIR` reads,
    made for that model, and the held-out fit in the JSON; a second run replaces it; an
    existing directory that is not such a checkpoint is refused by name."""
    import json
    from tests.test_bad_inputs import cli
    out = tmp_path / "kvzap"
    argv = ["calibrate", "--kvzap", "linear", "--model", tiny_gguf, "--tokens", "256",
            "--window", "64", "--samples", "16", "--out", out, "--json"]
    for _ in range(2):
        code, stdout, err = cli(capsys, *argv)
        assert code == 0, err
    report = json.loads(stdout)
    assert report["kind"] == "linear" and report["windows"] == 4 and report["held_out"] == 1
    assert report["train_tokens"] == 48 and report["held_out_tokens"] == 16
    assert -1 <= report["held_out_spearman"] <= 1
    surrogate = load_kvzap(out)
    assert (surrogate.num_layers, surrogate.hidden_size) == (2, 64)
    (tmp_path / "other").mkdir()
    code, _, err = cli(capsys, *argv[:-3], "--out", tmp_path / "other")
    assert code == 2 and "exists and is not a checkpoint `calibrate --kvzap` wrote" in err


@pytest.mark.parametrize("threshold, window", [(0.0, 8), (-1.0, 0), (1.5, 128)])
def test_threshold_keeps_scores_at_least_t_and_the_newest_window(tiny_model, threshold, window):
    """`kvzap:threshold=t,window=w` (DMSPress's rule): per layer and KV head of each prompt in
    a left-padded batch, exactly the positions whose numpy-predicted score is >= t, plus the
    newest w."""
    cfg = tiny_model.config
    surrogate = random_surrogate(cfg, "linear", seed=8)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 256, n).tolist() for n in (23, 40)]
    t = kvzap(threshold=threshold, window=window, weights=surrogate)
    pre = prefill_batch(tiny_model, prompts, stats=t.stats)
    out, _ = t.update(pre.cache, t.init(pre.cache), pre.stats)
    counts = set()
    for b, ids in enumerate(prompts):
        inputs = attention_inputs(tiny_model, ids)
        for layer, after in enumerate(out):
            score = numpy_apply(surrogate, layer, inputs[layer])  # [n, KVH]
            for h in range(cfg.num_kv_heads):
                n = len(ids)
                want = {p for p in range(n) if score[p, h] >= threshold or p >= n - window}
                kept = np.asarray(after.pos[b, h])
                assert set(kept[kept != EMPTY].tolist()) == want, (layer, b, h)
                counts.add(len(want))
    assert len(counts) > 1


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold": 0.0, "ratio": 0.5}, "threshold=0.0 decides the kept count"),
    ({"threshold": 0.0, "schedule": "pyramid"}, "give no ratio, budget or schedule"),
    ({"threshold": 0.0, "headwise": "yes"}, "headwise must be true or false"),
    ({"ratio": 0.5, "window": 64}, "window=64 goes with threshold="),
    ({"threshold": float("nan")}, "threshold must be a finite number"),
    ({"threshold": 0.0, "window": -1}, "window"),
])
def test_bad_threshold_arguments_are_refused_by_name(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvzap(weights=random_surrogate(tiny_model.config, "linear"), **kwargs)
