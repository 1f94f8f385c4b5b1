"""RestoreKV (`restorekv`, kvpress RestoreKVPress): the restore pass against a float64 numpy
decoder, the eviction against a numpy model of kvpress's rule, training, the orbax and PEFT
round trips and refusals by name. The real model beside kvpress itself is in
`tests/test_kvpress_ppl.py` (the adapter `kvjax calibrate --restorekv` trained, handed to
kvpress in PEFT's format).

* The pass: `n` restore embeddings at the positions after each prompt of a left-padded batch,
  every projection adapted by LoRA (`W + alpha / r * A B`), over the base model's cache of the
  prompt: their keys and values must equal a float64 numpy decoder's (RMSNorm, RoPE, grouped
  softmax attention, SwiGLU) where the prompt's rows use the base weights and the restore
  rows the adapted ones; the prompt's slots are left as they were.
* The eviction: per row, the restore slots (the `n` newest positions) kept and not ranked; of
  the context, the sinks kept and the `floor(N * ratio) + R` lowest scores of every layer and
  KV head together dropped (`layerwise`: per layer), N the context's and R the restore slots'
  count there; kvpress's `int(N * min(1, ratio + n / T))`, which equals it in exact arithmetic.
* Training lowers the distillation loss it follows and its gradient equals central
  differences.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.core.cache import EMPTY
from kvjax.policies.eviction_kvzip import ReconstructionPrompt, kvzip_keep
from kvjax.policies.eviction_restorekv import RestoreTokens, load_restore_tokens, restorekv
from models.llama import Llama, LlamaConfig, rope_frequencies
from models.restorekv import initial_tokens, restore_pass, save_peft, train_restorekv
from models.sampler import generate, prefill_and_compress, prefill_batch
from tests.test_bad_inputs import tiny_gguf  # noqa: F401  (a fixture: a tiny GGUF model)

PASS_ATOL = 2e-5  # keys and values of order 1 through two float32 layers (measured ~1e-6)


def random_restore_tokens(layers: int, hidden: int, kv_heads: int, head_dim: int, n: int = 4,
                          heads: int | None = None, intermediate: int | None = None,
                          seed: int = 0, targets=("v_proj",)) -> RestoreTokens:
    """Random restore embeddings and a random (nonzero) LoRA on `targets` for a model of these
    shapes (`heads`, `intermediate` for the q_proj, o_proj and MLP targets)."""
    rng = np.random.default_rng(seed)
    heads = heads or kv_heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
              "down_proj": (intermediate, hidden)}
    f = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)
    return RestoreTokens(f(n, hidden) * 5, {t: f(layers, shapes[t][0], 2) for t in targets},
                         {t: f(layers, 2, shapes[t][1]) for t in targets}, alpha=4.0)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def tokens_for(model, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"), n: int = 3, seed: int = 0) -> RestoreTokens:
    cfg = model.config
    return random_restore_tokens(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads,
                                 cfg.head_dim, n, cfg.num_heads, cfg.intermediate_size, seed,
                                 targets)


# ----------------------------------------------------------------------------- the pass


def weights(model, tokens: RestoreTokens | None, i: int) -> dict:
    """Layer i's weights in float64, adapted by `tokens`' LoRA (None: the base model)."""
    layer = model.layers[i]
    w = {"q_proj": layer.attn.q_proj, "k_proj": layer.attn.k_proj, "v_proj": layer.attn.v_proj,
         "o_proj": layer.attn.o_proj, "gate_proj": layer.mlp.gate_proj,
         "up_proj": layer.mlp.up_proj, "down_proj": layer.mlp.down_proj}
    out = {t: np.asarray(d.kernel[...], np.float64) for t, d in w.items()}
    if tokens is not None:
        for t in tokens.lora_a:
            rank = tokens.lora_a[t].shape[-1]
            out[t] = out[t] + tokens.alpha / rank * (tokens.lora_a[t][i].astype(np.float64)
                                                     @ tokens.lora_b[t][i].astype(np.float64))
    out["input_norm"] = np.asarray(layer.input_norm.weight[...], np.float64)
    out["post_attn_norm"] = np.asarray(layer.post_attn_norm.weight[...], np.float64)
    return out


def numpy_decoder_kv(model, prompt: np.ndarray, tokens: RestoreTokens):
    """Per layer (keys, values) [KVH, P + n, D] float64 of the prompt's ids followed by the
    restore embeddings, positions 0..P+n-1: the prompt's rows by the base weights, the restore
    rows by the adapted ones (each attends causally to everything before it)."""
    cfg = model.config
    p, n = len(prompt), tokens.n
    h_, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = np.concatenate([np.asarray(model.embed[...], np.float64)[prompt],
                        tokens.embeddings.astype(np.float64)])  # [P+n, hidden]
    inv = rope_frequencies(cfg).astype(np.float64)
    angle = np.arange(p + n)[:, None] * inv[None]  # [T, D/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

    def rope(v):  # [T, N, D], the rotate-half convention
        a, b = v[..., :d // 2], v[..., d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    def rms(v, w):
        return v / np.sqrt((v ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    silu = lambda v: v / (1 + np.exp(-v))
    out = []
    for i in range(cfg.num_layers):
        w_base, w_lora = weights(model, None, i), weights(model, tokens, i)
        rows = lambda name, v: np.concatenate([v[:p] @ w_base[name], v[p:] @ w_lora[name]])
        hn = rms(x, w_base["input_norm"])
        q = rope(rows("q_proj", hn).reshape(-1, h_, d))
        k = rope(rows("k_proj", hn).reshape(-1, kvh, d))
        v = rows("v_proj", hn).reshape(-1, kvh, d)
        out.append((k.transpose(1, 0, 2), v.transpose(1, 0, 2)))
        kk, vv = np.repeat(k, h_ // kvh, 1), np.repeat(v, h_ // kvh, 1)
        s = np.einsum("thd,shd->hts", q, kk) / math.sqrt(d)
        s = np.where(np.tril(np.ones((p + n, p + n), bool))[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("hts,shd->thd", a / a.sum(-1, keepdims=True), vv).reshape(p + n, -1)
        x = x + rows("o_proj", a)
        m = rms(x, w_base["post_attn_norm"])
        x = x + rows("down_proj", silu(rows("gate_proj", m)) * rows("up_proj", m))
    return out


def test_restore_pass_equals_a_numpy_decoder_with_the_adapter_on_the_restore_rows(model):
    tokens = tokens_for(model)
    prompts = [list(range(5, 29)), list(range(40, 51))]  # 24 and 11 tokens: left padding
    pre = prefill_batch(model, prompts, room=tokens.n + 2)
    cache = restore_pass(model, pre.cache, pre.next_pos, tokens)
    for b, prompt in enumerate(prompts):
        want = numpy_decoder_kv(model, np.array(prompt), tokens)
        for i, layer in enumerate(cache):
            pos = np.asarray(layer.pos)[b, 0]
            slots = [int(np.flatnonzero(pos == q)[0]) for q in range(len(prompt) + tokens.n)]
            k, v = (np.asarray(x)[b][:, slots] for x in (layer.logical_k, layer.logical_v))
            np.testing.assert_allclose(k, want[i][0], atol=PASS_ATOL, err_msg=f"k {b} {i}")
            np.testing.assert_allclose(v, want[i][1], atol=PASS_ATOL, err_msg=f"v {b} {i}")
            before = np.asarray(pre.cache[i].logical_k)[b][:, slots[:len(prompt)]]
            np.testing.assert_array_equal(k[:, :len(prompt)], before)  # the prompt untouched


def test_restore_pass_needs_room_and_the_models_shape(model):
    tokens = tokens_for(model)
    pre = prefill_batch(model, [list(range(5, 21))])  # no room
    with pytest.raises(ValueError, match="free slots, the restore pass writes 3"):
        restore_pass(model, pre.cache, pre.next_pos, tokens)
    other = random_restore_tokens(3, 64, 2, 16)
    pre = prefill_batch(model, [[5, 6]], room=4)
    with pytest.raises(ValueError, match="adapter is for a model of 3 layers"):
        restore_pass(model, pre.cache, pre.next_pos, other)


# ----------------------------------------------------------------------------- the eviction


def numpy_keep(scores, pos, ratio, n_sink, layerwise, restored):
    """kvpress's rule per row, numpy: the restore slots (the `restored` newest positions)
    kept; of the context (T tokens, N = layers x KVH x T in the group ranked together), the
    sinks kept and the `N * (ratio + restored / T)` lowest (exact rationals, rounded down)
    dropped, ties to the earlier layer, head and slot."""
    num_layers, b, kvh, c = scores.shape
    keep = np.zeros(scores.shape, bool)
    for row in range(b):
        p = pos[:, row]  # [L, KVH, C]
        t = int(p.max()) + 1 - restored  # the context's length
        context = (p >= 0) & (p < t)
        keep[:, row] = p >= t
        s = np.where(p < n_sink, np.inf, scores[:, row].astype(np.float64))
        for layers in ([[i] for i in range(num_layers)] if layerwise else [range(num_layers)]):
            slots = [(i, h, j) for i in layers for h in range(kvh) for j in range(c)
                     if context[i, h, j]]
            n_ctx = len(slots)
            drop = min(math.floor(n_ctx * (Fraction(float(np.float32(ratio)))
                                           + Fraction(restored, t))), n_ctx)
            for i, h, j in sorted(slots, key=lambda x: (s[x], x))[drop:]:
                keep[i, row, h, j] = True
    return keep


@pytest.mark.parametrize("layerwise", [False, True])
def test_keep_equals_a_numpy_model_of_kvpress_rule(layerwise):
    rng = np.random.default_rng(1)
    num_layers, kvh, c, n = 3, 2, 20, 3
    lengths = [17, 12]  # each row's context; the restore slots follow it
    pos = np.full((num_layers, 2, kvh, c), EMPTY, np.int32)
    for row, t in enumerate(lengths):
        pos[:, row, :, c - t - n:] = np.arange(t + n)  # left-padded
    scores = rng.random(pos.shape).astype(np.float32)
    scores[0, 0, 0, 5] = scores[1, 0, 1, 6]  # a tie: the earlier layer goes first
    for ratio in (0.25, 0.5, 0.8):
        got = np.asarray(kvzip_keep(jnp.asarray(scores), jnp.asarray(pos), jnp.float32(ratio),
                                    2, layerwise, restored=n))
        want = numpy_keep(scores, pos, ratio, 2, layerwise, n)
        np.testing.assert_array_equal(got, want, err_msg=f"ratio {ratio}")
        for row, t in enumerate(lengths):  # budget-matched: what kvzip alone keeps of the
            context_only = np.where(pos[:, row] >= t, EMPTY, pos[:, row])[:, None]  # context
            kept = np.asarray(kvzip_keep(jnp.asarray(scores[:, row:row + 1]),
                                         jnp.asarray(context_only), jnp.float32(ratio), 2,
                                         layerwise)).sum()
            total = num_layers * kvh * t  # unless the restore slots alone pass the budget
            over = math.floor(total * ratio) + num_layers * kvh * n > total
            assert got[:, row].sum() == (num_layers * kvh * n if over else kept), (ratio, row)


def test_restorekv_keeps_kvzips_budget_and_decodes_after_the_restore_tokens(model):
    tokens = tokens_for(model, ("v_proj",), n=4)
    prompts = [list(range(3, 35)), list(range(60, 80))]
    t = restorekv(0.5, tokens, prompt="bare")
    out = prefill_and_compress(model, prompts, transform=t, room=6)
    alone = prefill_and_compress(model, prompts, room=6,
                                 transform=kvjax.parse_method("kvzip:ratio=0.5,prompt=bare"))
    np.testing.assert_array_equal(out.next_pos, np.array([32, 20]) + 4)
    for row in range(2):
        got = sum(int(kvjax.num_valid(layer)[row].sum()) for layer in out.cache)
        assert got == sum(int(kvjax.num_valid(layer)[row].sum()) for layer in alone.cache)
        newest = [np.asarray(layer.pos)[row] for layer in out.cache]
        for p in newest:  # every head of every layer kept the 4 restore positions
            for h in range(p.shape[0]):
                assert set(range(out.next_pos[row] - 4, out.next_pos[row])) <= set(p[h].tolist())
    gen = generate(model, prompts, max_new_tokens=3, transform=t)
    assert gen.tokens.shape == (2, 3)
    with pytest.raises(ValueError, match="compress"):
        generate(model, prompts, max_new_tokens=3, transform=t, compress_every=2)


def test_a_second_parse_of_the_same_adapter_compiles_nothing(model, tmp_path, count_traces):
    """The restore tokens are hashed by content: two parses of one directory (two loads, two
    objects) share every compiled program, the restore pass's included."""
    tokens_for(model, ("v_proj", "o_proj")).save(tmp_path / "adapter")
    spec = f"restorekv:ratio=0.5,adapter={tmp_path / 'adapter'},prompt=bare"
    prompts = [list(range(3, 40))]
    first = prefill_and_compress(model, prompts, transform=kvjax.parse_method(spec), room=2)
    with count_traces() as t:
        again = prefill_and_compress(model, prompts, transform=kvjax.parse_method(spec), room=2)
    assert t.count == 0
    np.testing.assert_array_equal(np.asarray(first.cache[1].pos), np.asarray(again.cache[1].pos))


@pytest.mark.parametrize("codec", ["quantize:bits=4,group=16", "quantize:bits=2,group=16", "fp8",
                                   "kivi:bits=4"])
def test_chains_with_codecs_shrink_the_restored_cache_further(model, codec):
    """Per-token codecs after it shrink the cache further; a per-channel one (KIVI) is refused
    by name: KVzip's budgets differ by KV head, so its rows are pooled (as every head-wise
    eviction's)."""
    tokens = tokens_for(model, ("v_proj",), n=4)
    prompts = [list(range(3, 45)), list(range(60, 85))]
    alone = restorekv(0.5, tokens, prompt="bare")
    chained = kvjax.chain(alone, kvjax.parse_method(codec))
    a = prefill_and_compress(model, prompts, transform=alone, room=4)
    if codec.startswith("kivi"):
        with pytest.raises(ValueError, match="per-channel and low-rank codecs need per-head"):
            prefill_and_compress(model, prompts, transform=chained, room=4)
        return
    b = prefill_and_compress(model, prompts, transform=chained, room=4)
    np.testing.assert_array_equal(a.next_pos, b.next_pos)
    assert kvjax.nbytes(b.cache) < kvjax.nbytes(a.cache)
    out = generate(model, prompts, max_new_tokens=3, transform=chained)
    assert out.tokens.shape == (2, 3)


def test_ask_answers_from_a_restored_cache(tiny_gguf, tmp_path):
    """`ask` with several questions: the context compressed once (KVzip's prompt bound from
    the tokenizer, which has no chat template here), each answer equal to asking alone."""
    from models.loading import load_model
    from models.pipeline import ask
    model, tokenizer = load_model(tiny_gguf)
    cfg = model.config
    random_restore_tokens(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, 4
                          ).save(tmp_path / "adapter")
    method = f"restorekv:ratio=0.5,adapter={tmp_path / 'adapter'}"
    context = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2
    both = ask(model, tokenizer, questions=["a b", "c d"], context=context, method=method,
               max_new_tokens=3, chat=False)
    one = ask(model, tokenizer, "c d", context=context, method=method, max_new_tokens=3,
              chat=False)
    assert both[1].tokens == one.tokens


# ----------------------------------------------------------------------------- training


def test_training_lowers_its_loss_and_its_gradient_is_central_differences(model):
    from models.restorekv import _kl, _prepare
    from kvjax.policies.eviction_kvzip import Reconstruction

    rng = np.random.default_rng(0)
    windows = [list(rng.integers(3, 250, 40)) for _ in range(2)]
    out = train_restorekv(model, windows, ReconstructionPrompt(), prefix=28, ratios=(0.5,),
                          n=2, rank=2, steps=25, lr=0.02, progress=False)
    assert out.history[-1] < 0.5 * out.history[0], out.history  # one (window, ratio) pair
    assert out.tokens.n == 2 and out.tokens.lora_a["q_proj"].shape == (2, 64, 2)
    assert set(out.held_out[0.5]) == {"kvzip", "untrained", "trained"}

    sample = _prepare(model, windows[0], 28, 2, (0.5,), Reconstruction(prompt=ReconstructionPrompt()))
    start = initial_tokens(model, 2, 2, targets=("v_proj",))
    params = {"v_proj": (jnp.asarray(start.lora_a["v_proj"]),
                         jnp.asarray(rng.standard_normal((2, 2, 32)).astype(np.float32) * 0.1))}
    emb = jnp.asarray(start.embeddings)
    loss = lambda e: _kl(model, params, e, 16.0, sample.cache, sample.keep[0.5],
                         sample.continuation, sample.teacher, sample.start)
    grad = np.asarray(jax.grad(loss)(emb))
    assert np.abs(grad).max() > 0
    for (i, j) in [(0, 3), (1, 17)]:
        eps = 1e-2
        step = np.zeros(emb.shape, np.float32)
        step[i, j] = eps
        numeric = (float(loss(emb + step)) - float(loss(emb - step))) / (2 * eps)
        assert grad[i, j] == pytest.approx(numeric, rel=5e-2, abs=1e-6)


# ----------------------------------------------------------------------------- files


def test_orbax_and_peft_round_trips(model, tmp_path):
    tokens = tokens_for(model)
    tokens.save(tmp_path / "adapter")
    back = load_restore_tokens(tmp_path / "adapter")
    assert back == tokens and back.alpha == tokens.alpha
    np.testing.assert_array_equal(back.lora_b["down_proj"], tokens.lora_b["down_proj"])
    from safetensors.numpy import load_file
    import json
    save_peft(tokens, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["lora_alpha"] == tokens.alpha
    assert sorted(config["target_modules"]) == sorted(tokens.lora_a)
    w = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    a = w["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = w["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    np.testing.assert_array_equal(a, tokens.lora_a["q_proj"][1].T)  # torch: [r, d_in]
    np.testing.assert_array_equal(b, tokens.lora_b["down_proj"][1].T)  # [d_out, r]
    e = load_file(str(tmp_path / "peft" / "restore_embeddings.safetensors"))
    np.testing.assert_array_equal(e["restore_embeddings"], tokens.embeddings)


def test_refusals_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="needs adapter=DIR"):
        restorekv(0.5)
    with pytest.raises(ValueError, match="adapter='/no/such' is not an orbax checkpoint"):
        kvjax.parse_method("restorekv:ratio=0.5,adapter=/no/such")
    with pytest.raises(ValueError, match="ratio"):
        restorekv(1.5, random_restore_tokens(2, 64, 2, 16))
    with pytest.raises(ValueError, match="embeddings must be a finite float32"):
        RestoreTokens(np.full((2, 4), np.nan, np.float32), {"v_proj": np.zeros((1, 4, 1), np.float32)},
                      {"v_proj": np.zeros((1, 1, 4), np.float32)})
    with pytest.raises(ValueError, match="same targets among"):
        RestoreTokens(np.zeros((2, 4), np.float32), {"w_proj": np.zeros((1, 4, 1), np.float32)},
                      {"w_proj": np.zeros((1, 1, 4), np.float32)})
    np.savez(tmp_path / "x.npz", a=np.zeros(2))
    other = tmp_path / "gates"
    from tests.test_fastkvzip import random_gates
    random_gates(2, 64, 2).save(other)  # another method's orbax checkpoint
    with pytest.raises(ValueError, match="not embeddings, alpha and a_T, b_T"):
        load_restore_tokens(other)


def test_calibrate_command_trains_and_the_cli_generates_with_the_adapter(capsys, tmp_path,
                                                                         tiny_gguf):
    """`kvjax calibrate --restorekv --json` writes an orbax directory `restorekv:adapter=DIR`
    reads and reports the held-out KL per ratio; `kvjax generate` runs the method with it; an
    existing directory that is not such a checkpoint is refused by name."""
    import json
    from tests.test_bad_inputs import cli
    out = tmp_path / "restore"
    argv = ["calibrate", "--restorekv", "--model", tiny_gguf, "--tokens", "192", "--window",
            "64", "--steps", "3", "--out", out, "--json"]
    code, stdout, err = cli(capsys, *argv)
    assert code == 0, err
    report = json.loads(stdout)
    assert report["windows"] == 3 and report["held_out"] == 1 and report["prefix"] == 48
    assert set(report["held_out_kl"]) == {"0.5", "0.75"}
    assert all(v >= 0 for r in report["held_out_kl"].values() for v in r.values())
    tokens = load_restore_tokens(out)
    assert tokens.n == 8 and tokens.num_layers == 2
    code, stdout, err = cli(capsys, "generate", "--model", tiny_gguf, "--prompt",
                            "a b c d e f g h i j k l m n o p", "--max-new-tokens", "3",
                            "--method", f"restorekv:ratio=0.5,adapter={out}")
    assert code == 0, err
    (tmp_path / "other").mkdir()
    code, _, err = cli(capsys, *argv[:-3], "--out", tmp_path / "other")
    assert code == 2 and "exists and is not a checkpoint `calibrate --restorekv` wrote" in err


# ----------------------------------------------------------------------------- beside kvpress


GOLDEN = Path(__file__).parent / "golden" / "kvpress_restorekv.npz"
ADAPTER = Path(__file__).parents[1] / "experiments" / "data" / "restorekv" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def restored_contexts(smollm2):
    """ctx -> (SmolLM2's cache of the golden's ids with the restore tokens written after them,
    the reconstruction pass's statistics, the context's length)."""
    from models.reconstruction import reconstruct, with_tokenizer
    golden = np.load(GOLDEN)
    model, tokenizer = smollm2
    rec = with_tokenizer(restorekv(0.5, ADAPTER), tokenizer).stats.reconstruction
    out = {}
    for ctx in ("ctx1", "ctx2"):
        ids = golden[f"{ctx}_ids"].tolist()
        pre = prefill_batch(model, [ids], room=rec.restore.n)
        stats = reconstruct(model, pre.cache, pre.stats, pre.next_pos, [ids], rec)
        out[ctx] = (restore_pass(model, pre.cache, pre.next_pos, rec.restore), stats, len(ids))
    return out


@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_kept_positions_match_kvpress_given_the_same_adapter(restored_contexts, ctx, ratio):
    """kvpress's RestoreKVPress handed SmolLM2's committed adapter in PEFT's format
    (`experiments/golden/make_kvpress_restorekv.py`): the same context positions kept in
    every layer and KV head, and every restore slot kept; the same count evicted."""
    from models.sampler import _compress
    from tests.test_kvpress_zoo_parity import unpack

    golden = np.load(GOLDEN)
    cache, stats, n = restored_contexts[ctx]
    t = restorekv(ratio, ADAPTER)
    out, _ = _compress(t.update, cache, t.init(cache), stats)
    ours = np.zeros((len(out), out[0].kv_heads, n), bool)
    for i, layer in enumerate(out):
        for h, pos in enumerate(np.asarray(layer.pos)[0]):
            assert set(range(n, n + 8)) <= set(pos.tolist()), (i, h)  # the restore slots
            ours[i, h, pos[(pos >= 0) & (pos < n)]] = True
    key = f"{ctx}_restorekv_r{ratio:.2f}"
    theirs = unpack(golden, f"{key}_keep", n)
    layers, kvh = ours.shape[:2]
    assert (~theirs).sum() == int(layers * kvh * n * min(1.0, ratio + 8 / n))  # kvpress's count
    assert (~ours).sum() == math.floor(layers * kvh * n * ratio) + layers * kvh * 8
    np.testing.assert_array_equal(ours, theirs)  # measured: no near-tie swaps in these four
