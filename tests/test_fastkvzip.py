"""Fast KVzip (`fastkvzip`, kvpress FastKVzipPress): the gates' scores, the kept tokens,
training and the orbax round trip, against numpy.

* Scores: the gate by its definition in float64 numpy (two projections, RMSNorms, the sink
  keys' competition, the mean over query groups) of each layer's attention input
  (`probe_forward`); the scores the model wrote as tokens entered, in one prefill chunk or
  several, must equal it at float32 rounding.
* Eviction: in a left-padded batch of two lengths, per prompt the sinks and the newest 2% are
  kept and the `floor(L * KVH * n * ratio)` lowest numpy scores of all layers and KV heads go
  (`layerwise`: per layer), the budgets differing by layer and head.
* Training: `fit_gates` learns a random teacher gate's scores (optax SGD, binary
  cross-entropy) far better than the untrained gates predict them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.core.cache import EMPTY
from kvjax.policies.eviction_fastkvzip import (FastKVzipGates, fastkvzip, fit_gates,
                                               load_fastkvzip)
from models.sampler import prefill_batch
from tests.test_bad_inputs import tiny_gguf  # noqa: F401  (a fixture: a tiny GGUF model)
from tests.test_kvzap import attention_inputs

SCORE_ATOL = 1e-5  # scores in (0, 1) from float32 matmuls over hidden 64 (measured ~1e-7)


def random_gates(layers: int, hidden: int, kvh: int, groups: int = 2, seed: int = 0,
                 dim: int = 4, sink: int = 3) -> FastKVzipGates:
    rng = np.random.default_rng(seed)
    f = lambda scale, *shape: (rng.standard_normal(shape) * scale).astype(np.float32)
    return FastKVzipGates(q_proj=f(hidden ** -0.5, layers, hidden, kvh * groups * dim),
                          q_bias=f(0.3, layers, kvh * groups * dim),
                          k_proj=f(hidden ** -0.5, layers, hidden, kvh * dim),
                          q_norm=1 + f(0.2, layers, dim), k_norm=1 + f(0.2, layers, dim),
                          k_base=f(1.0, layers, kvh, sink, dim), bias=f(1.0, layers, kvh, groups))


def numpy_gate(g: FastKVzipGates, layer: int, h: np.ndarray) -> np.ndarray:
    """[T, hidden] float64 -> [T, KVH]: the gate by its definition."""
    f64 = lambda name: getattr(g, name)[layer].astype(np.float64)
    kvh, sink, dim = g.k_base.shape[1:]
    groups = g.bias.shape[-1]
    rms = lambda v, w: v / np.sqrt((v ** 2).mean(-1, keepdims=True) + g.eps) * w
    q = rms((h @ f64("q_proj") + f64("q_bias")).reshape(-1, kvh, groups, dim), f64("q_norm"))
    k = rms((h @ f64("k_proj")).reshape(-1, kvh, 1, dim), f64("k_norm"))
    logit = (k * q).sum(-1) / np.sqrt(dim) + f64("bias")  # [T, KVH, G]
    base = np.einsum("thgd,hsd->thsg", q, f64("k_base")) / np.sqrt(dim)  # [T, KVH, sink, G]
    return (1 / (1 + np.exp(base - logit[:, :, None]).sum(2))).mean(-1)


def gates_for(model, seed: int = 0) -> FastKVzipGates:
    cfg = model.config
    return random_gates(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads,
                        cfg.num_heads // cfg.num_kv_heads, seed)


def test_scores_written_as_tokens_enter_are_the_gate_of_their_attention_input(tiny_model):
    """Prefill in chunks of 8 and 40 tokens alike: `position_scores[l][b, h, p]` is layer l's
    gate of token p's attention input, in (0, 1)."""
    gates = gates_for(tiny_model)
    ids = np.random.default_rng(1).integers(3, 256, 40).tolist()
    inputs = attention_inputs(tiny_model, ids)
    spec = fastkvzip(ratio=0.5, gates=gates).stats
    for chunk in (8, 40):
        pre = prefill_batch(tiny_model, [ids], stats=spec, chunk=chunk)
        for layer, s in enumerate(pre.stats):
            want = numpy_gate(gates, layer, inputs[layer]).T  # [KVH, T]
            assert 0 < want.min() and want.max() < 1 and want.std() > 0.05
            got = np.asarray(s.position_scores)[0]
            np.testing.assert_allclose(got[:, :40], want, atol=SCORE_ATOL, err_msg=f"{layer}")


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_kept_tokens_are_the_best_scored_over_layers_and_heads(tiny_model, ratio, layerwise):
    """A batch of two prompts (60 and 101 tokens, left-padded): each keeps its 4 sinks, its
    newest `max(1, floor(0.02 n))` and all but the `floor(L * KVH * n * ratio)` lowest
    numpy-scored tokens of all layers and KV heads (`layerwise`: `floor(KVH * n * ratio)` per
    layer); the budgets differ by layer (global) and by head."""
    cfg = tiny_model.config
    gates = gates_for(tiny_model, seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (60, 101)]
    t = fastkvzip(ratio=ratio, gates=gates, layerwise=layerwise)
    pre = prefill_batch(tiny_model, prompts, stats=t.stats)
    out, _ = t.update(pre.cache, t.init(pre.cache), pre.stats)
    counts = set()
    for b, ids in enumerate(prompts):
        n = len(ids)
        inputs = attention_inputs(tiny_model, ids)
        score = np.stack([numpy_gate(gates, i, inputs[i]).T for i in range(cfg.num_layers)])
        score[:, :, n - max(1, int(n * 0.02)):] = 1.0  # [L, KVH, n]: the window
        score[:, :, :4] = np.inf  # the sinks
        if layerwise:
            want = np.ones(score.shape, bool)  # C order: want[layer].ravel() is a view
            for layer in range(cfg.num_layers):
                flat = score[layer].ravel()
                gone = np.argsort(flat, kind="stable")[:int(cfg.num_kv_heads * n * ratio)]
                want[layer].ravel()[gone] = False
        else:
            gone = np.argsort(score.ravel(), kind="stable")[:int(score.size * ratio)]
            want = np.ones(score.size, bool)
            want[gone] = False
            want = want.reshape(score.shape)
        for layer, after in enumerate(out):
            for h in range(cfg.num_kv_heads):
                kept = np.asarray(after.pos[b, h])  # pooled rows: EMPTY where another head's
                got = set(kept[kept != EMPTY].tolist())
                w = set(np.flatnonzero(want[layer, h]).tolist())
                assert got == w, (layer, b, h, sorted(got - w), sorted(w - got), len(got), len(w))
                counts.add(int(want[layer, h].sum()))
    assert len(counts) > 2


def numpy_decode_keep(held: list[dict], scores: list[np.ndarray], budget, layerwise: bool,
                      n_sink: int = 4, window_ratio: float = 0.02) -> list[dict]:
    """The paper's decoding rule for one row in numpy: `held[l][h]` the positions layer l,
    KV head h holds, `scores[l]` [KVH, P] the gate scores by position; sinks and the newest
    `max(1, floor(T * window_ratio))` positions stay, and the lowest-scored go until the row
    (`layerwise`: each layer) is back at `budget` (an int, or one per layer)."""
    seen = 1 + max(p for layer in held for head in layer.values() for p in head)
    window = seen - max(1, int(seen * window_ratio))
    entries = [(layer, h, p) for layer, heads in enumerate(held) for h in sorted(heads)
               for p in sorted(heads[h])]
    score = lambda e: np.inf if e[2] < n_sink else 1.0 if e[2] >= window else \
        float(scores[e[0]][e[1], e[2]])
    groups = [[e for e in entries if e[0] == layer] for layer in range(len(held))] \
        if layerwise else [entries]
    budgets = budget if layerwise else [budget]
    gone = set()
    for group, b in zip(groups, budgets):
        order = sorted(group, key=score)  # stable: ties to the earlier layer, head, position
        gone |= set(order[:max(0, len(group) - b)])
    return [{h: {p for p in heads[h] if (layer, h, p) not in gone} for h in heads}
            for layer, heads in enumerate(held)]


def held_positions(cache, b: int) -> list[dict]:
    """Per layer {KV head: positions} row b holds (per-head or pooled rows)."""
    return [{h: {int(p) for p in np.asarray(layer.pos[b, h]) if p != EMPTY}
             for h in range(layer.pos.shape[1])} for layer in cache]


@pytest.mark.parametrize("layerwise", [False, True])
def test_decoding_updates_evict_back_to_the_prompts_budget_by_gate_scores(tiny_model,
                                                                         layerwise):
    """The paper's decoding rule (`compress_every`): two prompts (30 and 45 tokens) compressed
    at ratio 0.5, then 12 decode steps with an update every 4. At each update every row (or
    layer) goes back to exactly what the prompt's compression left, and the positions kept
    per layer and KV head are numpy's rule on the scores the model wrote as tokens entered;
    `generate` with `compress_every` keeps that budget too."""
    from models.sampler import generate
    gates = gates_for(tiny_model, seed=4)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, n).tolist() for n in (30, 45)]
    t = fastkvzip(ratio=0.5, gates=gates, layerwise=layerwise)
    pre = prefill_batch(tiny_model, prompts, stats=t.stats, room=12)
    cache, state = t.update(pre.cache, t.init(pre.cache), pre.stats)
    stats, first = pre.stats, np.asarray(state.kept)  # [L, B]
    assert (first >= 0).all() and first[:, 0].sum() < first[:, 1].sum()
    pos = np.asarray(pre.next_pos)
    for step in range(12):
        tokens = jnp.asarray(rng.integers(3, 256, (2, 1)))
        _, cache, stats = tiny_model.forward(tokens, jnp.asarray(pos + step)[:, None], cache,
                                             stats, t.stats)
        if step % 4 != 3:
            continue
        before = [held_positions(cache, b) for b in range(2)]
        scores = [[np.asarray(s.position_scores[b]) for s in stats] for b in range(2)]
        cache, state = t.update(cache, state, stats)
        np.testing.assert_array_equal(np.asarray(state.kept), first)
        for b in range(2):
            budget = first[:, b].tolist() if layerwise else int(first[:, b].sum())
            want = numpy_decode_keep(before[b], scores[b], budget, layerwise)
            assert held_positions(cache, b) == want, (step, b)
            got = [sum(map(len, layer.values())) for layer in want]
            assert got == first[:, b].tolist() if layerwise else sum(got) == budget
    out = generate(tiny_model, prompts, max_new_tokens=9, compress_every=4, transform=t)
    held = np.stack([np.asarray(kvjax.num_valid(layer)) for layer in out.cache])  # [L, B, ...]
    total = held.reshape(held.shape[0], 2, -1).sum(-1).sum(0)
    assert (total <= first.sum(0) + 4).all(), (total, first.sum(0))


def test_fit_gates_learns_a_teacher_gate():
    """Targets from a random teacher gate: after `fit_gates` the students' mean squared error
    on fresh inputs is under a third of the untrained gates' (same seed, same shapes)."""
    teacher = random_gates(2, 8, 2, groups=2, seed=5, dim=4, sink=3)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2048, 2, 8)).astype(np.float32)
    fresh = rng.standard_normal((512, 2, 8)).astype(np.float32)
    y = teacher.predict(x)
    student = fit_gates(x, y, groups=2, dim=4, sink=3, steps=300, batch=256, lr=0.2)
    untrained = FastKVzipGates.initial(2, 8, 2, 2, dim=4, sink=3)
    want = teacher.predict(fresh)
    err = lambda g: ((g.predict(fresh) - want) ** 2).mean()
    assert err(student) < err(untrained) / 3, (err(student), err(untrained))


def test_orbax_round_trip_and_spec_string(tiny_model, tmp_path):
    """`save` then `load_fastkvzip` gives equal arrays (an equal, same-hash gate set); the spec
    string `fastkvzip:ratio=...,gates=DIR` builds the same transform."""
    gates = gates_for(tiny_model)
    gates.save(tmp_path / "g")
    back = load_fastkvzip(tmp_path / "g")
    assert back == gates and hash(back) == hash(gates) and back.eps == gates.eps
    t = kvjax.parse_method(f"fastkvzip:ratio=0.5,gates={tmp_path / 'g'}")
    assert t.stats.token_scores == gates


def test_bad_gates_and_arguments_are_refused_by_name(tiny_model, tmp_path):
    cfg = tiny_model.config
    gates = gates_for(tiny_model)
    with pytest.raises(ValueError, match="fastkvzip: needs gates=DIR"):
        fastkvzip(ratio=0.5)
    with pytest.raises(ValueError, match="is not an orbax checkpoint directory"):
        fastkvzip(ratio=0.5, gates=str(tmp_path / "missing"))
    for kwargs, match in [({"ratio": 1.0}, "ratio"), ({"ratio": None}, "ratio"),
                          ({"ratio": 0.5, "n_sink": -1}, "n_sink"),
                          ({"ratio": 0.5, "window_ratio": 2.0}, "window_ratio"),
                          ({"ratio": 0.5, "window_size": 0}, "window_size"),
                          ({"ratio": 0.5, "layerwise": "no"}, "layerwise")]:
        with pytest.raises(ValueError, match=match):
            fastkvzip(gates=gates, **kwargs)
    with pytest.raises(ValueError, match="k_proj has shape"):
        FastKVzipGates(**{**{k: getattr(gates, k) for k in ("q_proj", "q_bias", "q_norm",
                                                              "k_norm", "k_base", "bias")},
                          "k_proj": np.zeros((2, 64, 5), np.float32)})
    with pytest.raises(ValueError, match="bias is not all finite"):
        FastKVzipGates(**{**{k: getattr(gates, k) for k in ("q_proj", "q_bias", "k_proj",
                                                              "q_norm", "k_norm", "k_base")},
                          "bias": np.full(gates.bias.shape, np.nan, np.float32)})
    other = random_gates(cfg.num_layers, cfg.hidden_size + 1, cfg.num_kv_heads)
    t = fastkvzip(ratio=0.5, gates=other)
    with pytest.raises(ValueError, match=f"hidden size {cfg.hidden_size + 1}.*train its own"):
        prefill_batch(tiny_model, [list(range(3, 20))], stats=t.stats)
    t = fastkvzip(ratio=0.5, gates=gates)
    pre = prefill_batch(tiny_model, [list(range(3, 20))])
    with pytest.raises(ValueError, match="fastkvzip scores tokens as the model runs them"):
        t.update(pre.cache, t.init(pre.cache), None)


def test_training_data_targets_are_kvzip_scores(tiny_model):
    """`kvzip_training_data`: the targets are the scores `kvzip` ranks by (its reconstruction),
    in [0, 1]; `kvzap_training_data`'s are the log of KVzip+'s."""
    from kvjax.policies.eviction_kvzip import Reconstruction, ReconstructionPrompt
    from models.calibration import kvzip_training_data
    from models.reconstruction import reconstruct
    ids = np.random.default_rng(7).integers(3, 256, 32).tolist()
    _, y = kvzip_training_data(tiny_model, [ids], ReconstructionPrompt(), samples=10, seed=3,
                               progress=False)
    take = np.sort(np.random.default_rng(3).permutation(np.arange(32))[:10])
    pre = prefill_batch(tiny_model, [ids])
    stats = reconstruct(tiny_model, pre.cache, None, np.array([32]), [ids],
                        Reconstruction(chunk_size=32, prompt=ReconstructionPrompt()))
    want = np.stack([np.asarray(s.position_scores)[0][:, take].T for s in stats], 1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert 0 < y.min() and y.max() <= 1


def test_calibrate_command_trains_saves_and_reports_a_held_out_fit(capsys, tmp_path, tiny_gguf):
    """`kvjax calibrate --fastkvzip --json`: an orbax directory `fastkvzip:gates=DIR` reads,
    made for that model, and the held-out fit in the JSON; an existing directory that is not
    such a checkpoint is refused by name."""
    import json
    from tests.test_bad_inputs import cli
    out = tmp_path / "gates"
    argv = ["calibrate", "--fastkvzip", "--model", tiny_gguf, "--tokens", "256", "--window",
            "64", "--samples", "16", "--out", out, "--json"]
    code, stdout, err = cli(capsys, *argv)
    assert code == 0, err
    report = json.loads(stdout)
    assert report["windows"] == 4 and report["held_out"] == 1 and report["train_tokens"] == 48
    assert -1 <= report["held_out_spearman"] <= 1
    gates = load_fastkvzip(out)
    assert (gates.num_layers, gates.hidden_size) == (2, 64)
    (tmp_path / "other").mkdir()
    code, _, err = cli(capsys, *argv[:-3], "--out", tmp_path / "other")
    assert code == 2 and "exists and is not a checkpoint `calibrate --fastkvzip` wrote" in err
