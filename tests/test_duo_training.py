"""DuoAttention's trained head patterns (`models.duo_training`): the gated attention against a
numpy model of the paper's rule, the gated forward against the model itself, the loss's
gradient against finite differences, training that prunes a head that cannot matter and keeps
one that does, the multi-passkey samples, and `kvjax calibrate --duo-train` on SmolLM2."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.policies.eviction_duo import gated_attention, streaming_visible
from models.duo_training import (DuoTraining, distill_loss, duo_hidden, passkey_sample,
                                 teacher_hidden, train_duo_gates)
from models.llama import Llama, LlamaConfig

F32 = 2e-5  # float32 attention and residual sums over a few layers (measured <= 3e-6)


def paper_mask(t, sink, recent):
    """DuoAttention's `generate_streaming_mask`, written as the paper's code builds it."""
    ones = np.ones((t, t), bool)
    causal = ~np.triu(ones, 1)
    recent_mask = np.triu(ones, -recent + 1)
    sink_mask = ones.copy()
    sink_mask[:, sink:] = False
    return (recent_mask | sink_mask) & causal


@pytest.mark.parametrize("t,sink,recent", [(12, 2, 4), (9, 0, 1), (6, 8, 8)])
def test_streaming_visible_is_the_papers_mask(t, sink, recent):
    np.testing.assert_array_equal(streaming_visible(t, sink, recent), paper_mask(t, sink, recent))


def numpy_gated_attention(q, k, v, gates, sink, recent):
    """Per query head, float64: gate * softmax over causal keys + (1 - gate) * softmax over
    the streaming keys, the gate clipped to [0, 1] and taken from the head's KV head."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    out = np.zeros((b, t, h, d))
    for bi, hi in np.ndindex(b, h):
        kv = hi // (h // kvh)
        g = min(max(gates[kv], 0.0), 1.0)
        for i in range(t):
            logits = k[bi, :, kv].astype(np.float64) @ q[bi, i, hi] / np.sqrt(d)
            mixed = 0
            for weight, keys in ((g, range(i + 1)),
                                 (1 - g, [j for j in range(i + 1) if j < sink or i - j < recent])):
                keys = list(keys)
                p = np.exp(logits[keys] - logits[keys].max())
                mixed = mixed + weight * (p / p.sum()) @ v[bi, keys, kv]
            out[bi, i, hi] = mixed
    return out


def test_gated_attention_is_the_papers_mix():
    rng = np.random.default_rng(0)
    b, t, h, kvh, d = 2, 10, 4, 2, 8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k = rng.normal(size=(b, t, kvh, d)).astype(np.float32)
    v = rng.normal(size=(b, t, kvh, d)).astype(np.float32)
    for gates in ([0.3, 0.8], [1.4, -0.2]):  # the second clipped to [1, 0]
        got = gated_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                              jnp.asarray(gates, jnp.float32), 2, 3)
        np.testing.assert_allclose(got, numpy_gated_attention(q, k, v, gates, 2, 3),
                                   atol=F32, rtol=F32)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def tokens_of(length, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 200, (1, length)), jnp.int32)


def test_unit_gates_are_the_model_itself(model):
    """All gates 1: the model's own hidden states (its cache-and-kernel forward); all gates 0
    with a window covering the text: the same, as streaming heads then see every key."""
    tokens = tokens_of(24)
    want = teacher_hidden(model, tokens)
    ones = jnp.ones((2, 2))
    np.testing.assert_allclose(duo_hidden(model, tokens, ones, 4, 8), want, atol=F32)
    np.testing.assert_allclose(duo_hidden(model, tokens, 0 * ones, 4, 20), want, atol=F32)
    assert float(jnp.abs(duo_hidden(model, tokens, 0 * ones, 4, 8) - want).max()) > 100 * F32


def test_distill_loss_is_the_mean_squared_difference_over_answer_tokens():
    rng = np.random.default_rng(1)
    full, mixed = rng.normal(size=(2, 2, 5, 3)).astype(np.float32)
    answer = np.array([[0, 1, 1, 0, 1], [0, 0, 0, 1, 1]], bool)
    want = np.mean([np.mean((full[b, i] - mixed[b, i]) ** 2) for b, i in zip(*np.nonzero(answer))])
    np.testing.assert_allclose(distill_loss(full, mixed, answer), want, rtol=1e-6)


def test_gradient_of_the_distillation_equals_finite_differences(model):
    tokens = tokens_of(24, seed=2)
    answer = jnp.arange(24)[None] >= 16
    full = teacher_hidden(model, tokens)
    loss = jax.jit(lambda g: distill_loss(full, duo_hidden(model, tokens, g, 2, 6), answer))
    gates = jnp.asarray([[0.3, 0.7], [0.5, 0.4]])
    grad = jax.grad(loss)(gates)
    eps = 1e-2
    for idx in np.ndindex(2, 2):
        step = jnp.zeros((2, 2)).at[idx].set(eps)
        numeric = (loss(gates + step) - loss(gates - step)) / (2 * eps)
        np.testing.assert_allclose(grad[idx], numeric, rtol=2e-2, atol=1e-7)
    assert float(jnp.abs(grad).max()) > 1e-5


def test_training_prunes_a_head_that_cannot_matter_and_keeps_one_that_does():
    """KV head 1 of every layer has zero values (its output is zero under any mask): only the
    gates' mean pulls on its gate, which falls to 0; head 0's distillation pushes back, so its
    gate stays near 1. Gates stay in [0, 1]; the distillation stays small."""
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(3))
    d = model.config.head_dim
    for layer in model.layers:
        kernel = layer.attn.v_proj.kernel
        kernel[...] = kernel[...].at[:, d:].set(0.0)
    rng = np.random.default_rng(4)
    samples = [(rng.integers(3, 200, 48), np.arange(48) >= 32) for _ in range(3)]
    out = train_duo_gates(model, samples, steps=40, lr=0.05, reg=1e-4, sink=2, recent=6,
                          progress=False)
    assert out.gates.shape == (2, 2) and out.history.shape == (40, 2)
    assert (out.gates[:, 1] < 0.05).all(), out.gates
    assert (out.gates[:, 0] > 0.8).all(), out.gates
    assert out.history[0, 0] < 1e-9 < out.history[:, 0].max()  # 0 at the start, then not


def test_saved_patterns_drive_duo_attention(model, tmp_path):
    """The `.npz` holds the gates as `head_scores`: `duo_attention:scores=PATH` at head_ratio
    0.5 makes streaming heads of the lower-gated half."""
    import kvjax
    from kvjax.policies.eviction_duo import load_head_scores, streaming_heads
    gates = np.array([[0.9, 0.1], [0.2, 0.7]], np.float32)
    DuoTraining(gates, 4, 8, np.zeros((3, 2), np.float32), {"steps": 3}).save(tmp_path / "d.npz")
    np.testing.assert_array_equal(load_head_scores(str(tmp_path / "d.npz")), gates)
    np.testing.assert_array_equal(streaming_heads(gates, 0.5), [[False, True], [True, False]])
    kvjax.parse_method(f"duo_attention:head_ratio=0.5,scores={tmp_path / 'd.npz'},sink=4,recent=8")


class WordTokenizer:
    """One id per space-separated word (a newline its own word): enough to see the layout."""

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        words = text.replace("\n", " \n ").split(" ")
        return [self.vocab.setdefault(w, len(self.vocab) + 1000) for w in words if w]

    def decode(self, ids):
        inverse = {i: w for w, i in self.vocab.items()}
        return " ".join(inverse.get(int(i), f"<{int(i)}>") for i in ids)


def test_passkey_sample_layout():
    """Exactly `length` tokens; each passkey once in the book (needles in order, inside the
    5%-95% depths) and once after its question; the answer mask covers every token after
    the book's closing."""
    tok = WordTokenizer()
    haystack = list(range(10, 10 + 400))  # ids no word gets
    ids, answer = passkey_sample(tok, haystack, 300, 3, 4, np.random.default_rng(0))
    assert ids.shape == answer.shape == (300,)
    text = tok.decode(ids)
    book, qa = text.split("</book>.")
    assert tok.decode(ids[answer]).split() == qa.split()
    keys = [qa.split("vault?")[i + 1].split("Passkey:")[1].split()[:4] for i in range(3)]
    for ordinal, key in zip(("first", "second", "third"), keys):
        assert book.count(f"the {ordinal} passkey to the vault: {' '.join(key)}") == 1
    assert book.index("the first passkey") < book.index("the second") < book.index("the third")
    hay_positions = np.nonzero(ids < 1000)[0]
    assert len(hay_positions) == 300 - len(tok.encode(tok.decode(ids[ids >= 1000])))
    with pytest.raises(ValueError, match="length=60 is too short for 3 passkeys of 4 words"):
        passkey_sample(tok, haystack, 60, 3, 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="passkeys <= 10"):
        passkey_sample(tok, haystack, 300, 11, 4, np.random.default_rng(0))


def test_bad_training_arguments_are_refused_by_name(model):
    good = [(np.arange(3, 19), np.arange(16) > 10)]
    for kwargs, message in (({"steps": 0}, "steps >= 1"), ({"lr": 0.0}, "lr"),
                            ({"reg": -1.0}, "reg"), ({"recent": 0}, "recent >= 1")):
        with pytest.raises(ValueError, match=message):
            train_duo_gates(model, good, progress=False, **kwargs)
    with pytest.raises(ValueError, match="at least one answer token"):
        train_duo_gates(model, [(np.arange(16), np.zeros(16, bool))], progress=False)
    windowed = Llama(LlamaConfig.tiny(sliding_window=8, layer_types=("sliding",
                                                                     "full")),
                     rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layers \[0\] attend through a sliding window"):
        train_duo_gates(windowed, good, progress=False)


def test_calibrate_duo_train_on_smollm2(smollm2_file, capsys, tmp_path):
    """`kvjax calibrate --duo-train --json` trains on SmolLM2 (two short steps) and writes the
    patterns `duo_attention` reads; a window too short for the passkeys is refused naming
    --window."""
    from tests.test_bad_inputs import cli
    out = tmp_path / "duo.npz"
    argv = ["calibrate", "--duo-train", "--model", str(smollm2_file), "--steps", "2",
            "--window", "400", "--passkeys", "2", "--words", "4", "--out", out, "--json"]
    code, stdout, err = cli(capsys, *argv)
    assert code == 0, err
    report = json.loads(stdout)
    assert report["gates_shape"] == [30, 3] and report["steps"] == 2
    data = np.load(out)
    assert data["head_scores"].shape == (30, 3) and int(data["recent"]) == 256
    assert json.loads(str(data["config"]))["lengths"] == [400]
    code, _, err = cli(capsys, *argv[:6], "--window", "60", *argv[8:])
    assert code == 2 and "--window 60" in err and "too short" in err


def test_committed_patterns_report_is_what_the_script_computes(monkeypatch):
    """docs/results/duo/patterns.json (RESULTS' numbers on the trained SmolLM2 patterns) is
    `experiments/eval/duo_patterns.py`'s report of the committed score files."""
    from pathlib import Path

    from experiments.eval.duo_patterns import report
    from experiments.eval.rank_stats import spearman
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the report names the score files relative to the repository
    committed = json.loads((root / "docs/results/duo/patterns.json").read_text())
    assert report(committed["trained"], committed["on_the_fly"]) == committed
    assert committed["config"]["steps"] == 100 and committed["shape"] == [30, 3]
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 40, 30])) == \
        pytest.approx(0.8)
    assert spearman(np.array([1.0, 1, 2]), np.array([3.0, 3, 1])) == pytest.approx(-1.0)
