"""Bad inputs at every boundary (issue 21): a clear error naming argument, value and range,
never NaN, silent garbage or a raw traceback; and the caches that repair themselves.

Python API: ValueError. CLI: exit code 2 and one line `kvjax: error: <argument> <value>:
<allowed>`. The CLI checks run on a tiny GGUF written here (2 layers, 128 positions, a
128-token vocabulary), so they need no real model.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.policies import eviction
from kvjax.core.cache import EMPTY
from kvjax.policies.eviction import debug_checks, scored_policy
from kvjax.core.selection import best_first, keep_top_k, rank
from kvjax.policies.methods import check_method, parse_method

DATA = Path(__file__).parents[1] / "experiments" / "data"


@pytest.fixture(autouse=True)
def private_kvjax_cache(tmp_path, monkeypatch):
    """Converted stores and compilation caches of this file live in a temporary folder."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "kvjax-cache"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A GGUF of the golden tiny Llama (2 layers, max_position 128, vocab 128)."""
    from tests.test_loading import write_gguf
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama_tied")


# ----------------------------------------------------------------------------- NaN-safe ranking


def reference_order(scores: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Slots best first: valid numbers (descending, ties to the earlier slot), valid NaN,
    then invalid slots, each in slot order."""
    out = np.empty(scores.shape, np.int64)
    for idx in np.ndindex(scores.shape[:-1]):
        s, v = scores[idx], valid[idx]
        numbers = [i for i in range(len(s)) if v[i] and not np.isnan(s[i])]
        numbers.sort(key=lambda i: (-s[i], i))
        nans = [i for i in range(len(s)) if v[i] and np.isnan(s[i])]
        empty = [i for i in range(len(s)) if not v[i]]
        out[idx] = numbers + nans + empty
    return out


def test_nan_scores_rank_below_every_valid_slot_and_above_empty_ones():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, 2, 16)).astype(np.float32)
    scores[rng.random(scores.shape) < 0.3] = np.nan
    scores[0, 0, :4] = [np.inf, -np.inf, 0.0, -0.0]
    scores[1, 1, :] = np.nan  # a row of NaN only
    valid = rng.random(scores.shape) < 0.7
    order = np.asarray(best_first(jnp.asarray(scores), jnp.asarray(valid)))
    np.testing.assert_array_equal(order, reference_order(scores, valid))
    ranks = np.asarray(rank(jnp.asarray(scores), jnp.asarray(valid)))
    np.testing.assert_array_equal(np.argsort(ranks, axis=-1), order)
    for k in (1, 5, 16):
        kept = np.asarray(keep_top_k(jnp.asarray(scores), k, jnp.asarray(valid)))
        want = np.zeros_like(valid)
        np.put_along_axis(want, order[..., :k], True, axis=-1)
        np.testing.assert_array_equal(kept, want & valid)
        # never fewer valid slots than min(k, valid slots): padding never takes a place
        np.testing.assert_array_equal(kept.sum(-1), np.minimum(k, valid.sum(-1)))


def _nan_scorer(layer, stats, budget, key):
    """Scores that are NaN for every even position (a broken scorer)."""
    pos = layer.pos.astype(jnp.float32)
    return jnp.where(layer.pos % 2 == 0, jnp.nan, pos), jnp.zeros(layer.pos.shape, bool)


def _prefilled(tiny_model, lengths=(20, 13)):
    from models.sampler import prefill_batch
    prompts = [list(range(3, 3 + n)) for n in lengths]
    return prefill_batch(tiny_model, prompts, room=8)


def test_a_nan_scorer_keeps_the_budget_of_valid_tokens(tiny_model):
    pre = _prefilled(tiny_model)  # capacity 28: padding and empty room around the tokens
    t = scored_policy("nan_scores", _nan_scorer, ratio=None, budget=10)
    cache, _ = t.update(pre.cache, t.init(pre.cache), pre.stats)
    for layer in cache:
        pos = np.asarray(layer.pos)
        kept = [sorted(p[p != EMPTY].tolist()) for p in pos.reshape(-1, pos.shape[-1])]
        for row, lengths in zip(kept, (20, 20, 13, 13)):  # [B * KVH] rows
            odd = [p for p in range(lengths) if p % 2]
            # the valid numbers first (latest odd positions), then NaN ones, never padding
            want = sorted(odd[-10:] if len(odd) >= 10 else
                          odd + [p for p in range(lengths) if p % 2 == 0][:10 - len(odd)])
            assert row == want


def test_debug_checks_make_a_nan_score_raise(tiny_model):
    pre = _prefilled(tiny_model)
    with debug_checks():
        assert eviction.debug_checks_enabled()
        checked = scored_policy("nan_scores", _nan_scorer, ratio=None, budget=10)
    assert not eviction.debug_checks_enabled()
    with pytest.raises(Exception, match="kvjax debug check: the eviction scorer gave 34 NaN "
                                        "scores in layer"):
        jax.block_until_ready(jax.jit(checked.update)(pre.cache, checked.init(pre.cache),
                                                      pre.stats))
    # a healthy policy built under the flag runs
    with debug_checks():
        ok = parse_method("knorm:budget=4")
    assert ok is not parse_method("knorm:budget=4")  # the flag is part of the cache key
    pre = _prefilled(tiny_model)
    jax.block_until_ready(ok.update(pre.cache, ok.init(pre.cache), pre.stats))


def test_debug_checks_follow_the_environment_and_jax_debug_nans(monkeypatch):
    monkeypatch.setattr(eviction, "_debug_checks", [False])
    assert not eviction.debug_checks_enabled()
    jax.config.update("jax_debug_nans", True)
    try:
        assert eviction.debug_checks_enabled()
    finally:
        jax.config.update("jax_debug_nans", False)


@pytest.mark.parametrize("n_future", [0, -4])
def test_expected_attention_rejects_a_useless_horizon(n_future):
    with pytest.raises(ValueError) as e:
        parse_method(f"expected_attention:ratio=0.5,n_future={n_future}")
    assert f"need n_future >= 1 (an int), got {n_future}" in str(e.value)


# ----------------------------------------------------------------------------- method specs


@pytest.mark.parametrize("spec, message", [
    ("expected_attention:ratio=0.5,sinks=-1", "need sinks >= 0 (an int)"),
    ("expected_attention:ratio=0.5,epsilon=-1", "epsilon must be a finite number"),
    ("snapkv:ratio=0.5,kernel=4", "kernel must be odd"),
    ("snapkv:ratio=0.5,kernel=0", "need kernel >= 1 (an int)"),
    ("snapkv:ratio=0.5,window=0", "need window >= 1 (an int), got 0"),
    ("snapkv:ratio=0.5,window=2.5", "need window >= 1 (an int), got 2.5"),
    ("snapkv:ratio=0.5,windw=8", "unknown argument 'windw' (did you mean 'window'?)"),
    ("snapkvv:ratio=0.5", "did you mean 'snapkv'"),
    ("knorm:ratio=1", "ratio is the fraction of tokens evicted, in [0, 1); got 1"),
    ("knorm:ratio=-0.1", "in [0, 1); got -0.1"),
    ("knorm:ratio=nan", "in [0, 1); got nan"),
    ("knorm:ratio=half", "in [0, 1); got 'half'"),
    ("knorm:budget=0", "budget must be a positive int, got 0"),
    ("knorm:budget=2.5", "budget must be a positive int, got 2.5"),
    ("knorm:ratio=0.5,budget=8", "exactly one of ratio"),
    ("knorm:ratio=0.5,alpha=2", "alpha must be a finite number in [0.0, 1.0]"),
    ("knorm:ratio=0.5,headwise=yes", "headwise must be true or false"),
    ("pyramidkv:ratio=0.5,beta=0", "beta must be a finite number"),
    ("random:ratio=0.5,seed=-1", "need seed >= 0 (an int)"),
    ("h2o:heavy=-1,recent=4", "need heavy >= 0 (an int), got -1"),
    ("h2o:heavy=0,recent=0", "budget must be a positive int, got 0"),
    ("h2o:ratio=0.5,recent_fraction=1.5", "recent_fraction must be a finite number"),
    ("streaming_llm:window=0", "need window >= 1 (an int), got 0"),
    ("streaming_llm:sinks=-2,window=8", "need sinks >= 0 (an int), got -2"),
    ("kivi:bits=3", "bits must be 2, 4 or 8, got 3"),
    ("quantize:bits=4.0", "bits must be 2, 4 or 8, got 4.0"),
    ("kivi:bits=4,group=2.5", "group must be a positive int, got 2.5"),
    ("kivi:bits=4,group=0", "group must be a positive int, got 0"),
    ("full:ratio=0.5", "unknown argument 'ratio'"),
    ("snapkv:ratio=0.5,layers=5-2", "layers='5-2'"),
    ("snapkv:ratio=0.5,layers=-1", "layers='-1'"),
    ("snapkv:ratio=0.5,layers=x", "layers='x'"),
    ("+", "empty method spec"),
])
def test_method_specs_reject_bad_parameters(spec, message):
    with pytest.raises(ValueError) as e:
        parse_method(spec)
    assert message in str(e.value)


def test_layers_beyond_the_model_are_a_value_error(tiny_model):
    with pytest.raises(ValueError, match="layers names layer 99; the model has 30 layers, 0-29"):
        check_method("snapkv:ratio=0.5,layers=0-99", 30)
    assert check_method("snapkv:ratio=0.5,layers=0-1", 2) is parse_method(
        "snapkv:ratio=0.5,layers=0-1")
    from models.sampler import generate
    with pytest.raises(ValueError, match="layer 99 does not exist; the cache has 2 layers"):
        generate(tiny_model, [[5, 6, 7]], max_new_tokens=2,
                 transform=parse_method("knorm:ratio=0.5,layers=0-99"))


def test_more_spec_mistakes(tmp_path):
    with pytest.raises(ValueError, match="argument 'ratio' is given twice"):
        parse_method("snapkv:ratio=0.5,ratio=0.3")
    (tmp_path / "notes.txt").write_text("not a basis")
    with pytest.raises(ValueError, match="notes.txt is not a basis written by `kvjax calibrate`"):
        parse_method(f"low_rank:rank=4,basis={tmp_path / 'notes.txt'}")
    with pytest.raises(ValueError, match="is a directory; pass the .npz file"):
        parse_method(f"low_rank:rank=4,basis={tmp_path}")
    with pytest.raises(ValueError, match="every schedule weight must be a finite number"):
        kvjax.knorm(ratio=0.5, schedule=(-1.0, 3.0))


# ----------------------------------------------------------------------------- model entries


@pytest.mark.parametrize("call, message", [
    (lambda m, g: g(m, [[300, 5]], max_new_tokens=2), r"token ids must be in \[0, 256\)"),
    (lambda m, g: g(m, [[-3, 5]], max_new_tokens=2), r"token ids must be in \[0, 256\)"),
    (lambda m, g: g(m, [[3, 5]], max_new_tokens=2.5), "max_new_tokens must be an int >= 1, got 2.5"),
    (lambda m, g: g(m, [[3, 5]], max_new_tokens=2, compress_every=-1),
     "compress_every must be an int >= 0"),
    (lambda m, g: g(m, [[3, 5]], max_new_tokens=2, chunk=0), "chunk must be an int >= 1, got 0"),
])
def test_generate_rejects_bad_arguments(tiny_model, call, message):
    from models.sampler import generate
    with pytest.raises(ValueError, match=message):
        call(tiny_model, generate)


@pytest.mark.parametrize("settings", [(float("nan"), 0, 1.0), (float("inf"), 0, 1.0),
                                      (1.0, 2.5, 1.0), (1.0, 0, float("nan"))])
def test_sampling_rejects_nan_and_non_integer_settings(settings):
    from models.sampler import Sampling
    with pytest.raises(ValueError, match="bad sampling settings"):
        Sampling(*settings)


@pytest.mark.parametrize("field, value", [("rope_theta", 0.0), ("rope_theta", float("nan")),
                                          ("rms_norm_eps", -1e-5), ("max_position", 0)])
def test_model_configs_that_would_give_nan_are_refused(field, value):
    from models.llama import LlamaConfig
    with pytest.raises(ValueError, match=f"LlamaConfig.{field} must be"):
        LlamaConfig.tiny(**{field: value})


def test_load_model_rejects_a_non_float_dtype(tiny_gguf):
    from models.loading import load_model
    with pytest.raises(ValueError, match="dtype must be a floating-point type"):
        load_model(tiny_gguf, dtype=jnp.int32)


def test_model_entries_check_positions_and_token_ids(tiny_model):
    from experiments.eval.ppl import perplexity
    from models.sampler import prefill_batch
    from models.scoring import token_logprobs

    cfg = tiny_model.config  # 512 positions, vocabulary 256
    ids = list(np.arange(600) % 200 + 3)
    with pytest.raises(ValueError, match="context 600 must be <= the model's 512 positions"):
        perplexity(tiny_model, ids, context=600)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        prefill_batch(tiny_model, [ids])
    tokens = np.full((1, 4), 7, np.int32)
    positions = np.arange(4, dtype=np.int32)[None]
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        token_logprobs(tiny_model, tokens + 300, positions, tokens)
    with pytest.raises(ValueError, match="position 515 is past the model's 512 positions"):
        token_logprobs(tiny_model, tokens, positions + 512, tokens)
    assert cfg.max_position == 512


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_load(tmp_path, monkeypatch):
    import tests.test_loading as tl
    from models.loading import load_model

    monkeypatch.setattr(tl, "TOKENS", tl.TOKENS + [f"extra{i}" for i in range(8)])
    path = tl.write_gguf(tmp_path / "big_vocab.gguf", "llama_tied")  # 136 tokens, vocab 128
    with pytest.raises(ValueError, match="tokenizer has 136 token ids but the model's "
                                         "vocabulary \\(vocab_size\\) is 128"):
        load_model(path)


# ----------------------------------------------------------------------------- the CLI


def cli(capsys, *argv):
    from experiments.cli.main import main
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, message", [
    (["ppl", "--context", "200"], "--context 200: must be <= the model's 128 positions"),
    (["ppl", "--context", "64", "--max-tokens", "-100"], "--max-tokens -100: must be an integer >= 2"),
    (["ppl", "--context", "64", "--stride", "0"], "--stride 0: must be an integer >= 1"),
    (["ppl", "--context", "64", "--stride", "65"], "--stride 65: must be in [1, --context 64]"),
    (["ppl", "--context", "1"], "--context 1: must be an integer >= 2"),
    (["ppl", "--context", "64", "--prefix", "64"], "--prefix 64: must be in [0, --context 64)"),
    (["ppl", "--context", "64", "--batch-size", "0"], "--batch-size 0: must be an integer >= 1"),
    (["ppl", "--context", "6.5"], "argument --context: invalid int value: '6.5'"),
    (["ppl", "--context", "64", "--method", "snapkv:ratio=0.5,layers=0-99", "--prefix", "32"],
     "layers names layer 99; the model has 2 layers, 0-1"),
    (["generate", "--prompt", "hi", "--compress-every", "-1"],
     "--compress-every -1: must be an integer >= 0"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"],
     "--max-new-tokens 0: must be an integer >= 1"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "500"],
     "--max-new-tokens 500: must be < the model's 128 positions"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature -1.0: must be a finite"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature nan: must be a finite"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--top-k", "-3"], "--top-k -3: must be an integer >= 0"),
    (["generate", "--prompt", ""], "--prompt '': must not be empty"),
    (["generate", "--prompt", "hi", "--method", "expected_attention:n_future=0,ratio=0.5"],
     "need n_future >= 1 (an int), got 0"),
    (["calibrate", "--tokens", "0", "--out", "{tmp}/basis.npz"], "--tokens 0: must be an integer >= 2"),
    (["calibrate", "--window", "4096", "--out", "{tmp}/basis.npz"],
     "--window 4096: must be <= the model's 128 positions"),
    (["calibrate", "--out", "{tmp}"], "is a directory: need a file name"),
    (["calibrate", "--qfilters", "--samples", "0", "--out", "{tmp}/q.npz"],
     "--samples 0: must be an integer >= 1"),
    (["calibrate", "--qfilters", "--duo", "--out", "{tmp}/q.npz"],
     "--duo, --duo-train, --qfilters, --lukv, --query-stats, --kvzap, --fastkvzip and --restorekv: give one"),
    (["calibrate", "--duo-train", "--passkeys", "11", "--out", "{tmp}/d.npz"],
     "--passkeys 11: must be an integer >= 1 and <= 10"),
    (["calibrate", "--duo-train", "--steps", "0", "--out", "{tmp}/d.npz"],
     "--steps 0: must be an integer >= 1"),
    (["calibrate", "--duo-train", "--words", "0", "--out", "{tmp}/d.npz"],
     "--words 0: must be an integer >= 1"),
])
def test_cli_rejects_bad_numbers_with_one_line(capsys, tmp_path, tiny_gguf, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] == "ppl":
        argv += ["--text", DATA / "kjv_genesis.txt"]
    code, out, err = cli(capsys, *argv, "--model", tiny_gguf)
    assert code == 2, err
    assert err.startswith("kvjax: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["ppl", "--context", "64", "--text", "{tmp}"], "--text {tmp}: is a directory: need a file"),
    (["ppl", "--context", "64", "--text", "{tmp}/none.txt"], "--text {tmp}/none.txt: text file not found"),
    (["ppl", "--context", "64", "--text", "{tmp}/binary.txt"], "is not UTF-8 text"),
    (["ppl", "--context", "64", "--text", "{tmp}/empty.txt"], "is empty"),
    (["generate", "--prompt", "hi", "--context-file", "{tmp}"], "is a directory: need a file"),
    (["generate", "--prompt", "hi", "--model", "{tmp}"], "has no config.json"),
    (["generate", "--prompt", "hi", "--model", "{tmp}/empty.txt"], "not a readable GGUF file"),
])
def test_cli_rejects_bad_paths_with_one_line(capsys, tmp_path, tiny_gguf, argv, message):
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "empty.txt").write_text("  \n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--model" not in argv:
        argv += ["--model", str(tiny_gguf)]
    code, _, err = cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message.replace("{tmp}", str(tmp_path)) in err


def test_cli_accepts_good_input_on_the_tiny_model(capsys, tiny_gguf):
    import json
    code, out, err = cli(capsys, "ppl", "--model", tiny_gguf, "--text", DATA / "kjv_genesis.txt",
                         "--context", "128", "--max-tokens", "256", "--json")
    assert code == 0, err
    result = json.loads(out)
    # two windows of 128; the first token of each is not scored (no context)
    assert result["text_tokens"] == 256 and result["tokens_scored"] == 254
    assert 1 < result["ppl"] < 128 * 2  # a random tiny model: near its 128-token vocabulary


def test_a_nan_perplexity_is_an_error_not_invalid_json(capsys, tiny_gguf, monkeypatch):
    import experiments.eval.ppl
    from experiments.eval.ppl import Perplexity
    monkeypatch.setattr(experiments.eval.ppl, "perplexity",
                        lambda *a, **k: Perplexity(float("nan"), float("nan"), 10))
    code, out, err = cli(capsys, "ppl", "--model", tiny_gguf, "--text", DATA / "kjv_genesis.txt",
                         "--context", "64", "--max-tokens", "128", "--json")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "perplexity is nan" in err and "not reporting it" in err


# ----------------------------------------------------------------------------- self-repair


def test_a_damaged_converted_store_is_rebuilt_with_a_notice(tmp_path, tiny_gguf, capsys):
    from models.loading import MANIFEST, converted_dir, load_model, store_damage

    fresh, _ = load_model(tiny_gguf, use_converted=False)
    load_model(tiny_gguf)  # writes the store
    store = converted_dir(tiny_gguf)
    assert store_damage(store) is None and (store / MANIFEST).is_file()
    weights = store / "weights.safetensors"

    def same_as_fresh(model):
        ids = jnp.asarray([[5, 9, 17, 33]], jnp.int32)
        pos = jnp.arange(4, dtype=jnp.int32)[None]
        from models.llama import new_cache
        a, _ = model(ids, pos, new_cache(model.config, 1, 4))
        b, _ = fresh(ids, pos, new_cache(fresh.config, 1, 4))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    for damage in ("truncate", "flip", "header", "delete_manifest_and_truncate"):
        data = bytearray(weights.read_bytes())
        if damage == "flip":  # same size, one tensor byte changed
            data[-5] ^= 0xFF
        elif damage == "header":
            data[:8] = b"\xff" * 8
        else:
            data = data[:len(data) // 2]
        weights.write_bytes(bytes(data))
        if damage.startswith("delete_manifest"):
            (store / MANIFEST).unlink()  # a store from before manifests
        capsys.readouterr()
        model, _ = load_model(tiny_gguf)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is damaged" in err and "converting the GGUF again" in err
        same_as_fresh(model)
        assert store_damage(store) is None  # rebuilt
        load_model(tiny_gguf)
        assert capsys.readouterr().err == ""  # and healthy from then on


def test_a_store_from_before_manifests_gets_one(tiny_gguf, capsys):
    from models.loading import MANIFEST, converted_dir, load_model, store_damage
    load_model(tiny_gguf)
    store = converted_dir(tiny_gguf)
    (store / MANIFEST).unlink()
    load_model(tiny_gguf)
    assert capsys.readouterr().err == "" and store_damage(store) is None


def test_damaged_compilation_cache_entries_are_removed(tmp_path, capsys):
    from models.hub import JIT_VERIFIED, repair_compilation_cache

    folder = tmp_path / "jit"
    folder.mkdir()
    payload = zlib.compress(os.urandom(4000))
    good, short, flipped, fresh = (folder / f"jit_{n}-abc-cache" for n in
                                   ("good", "short", "flipped", "fresh"))
    good.write_bytes(payload)
    short.write_bytes(payload[:len(payload) // 2])  # a write cut short
    flipped.write_bytes(payload[:100] + bytes([payload[100] ^ 1]) + payload[101:])
    fresh.write_bytes(payload[:10])  # being written right now: left alone
    old = (1_700_000_000, 1_700_000_000)
    for f in (good, short, flipped):
        os.utime(f, old)
    removed = repair_compilation_cache(folder)
    assert sorted(removed) == sorted([short.name, flipped.name])
    assert good.exists() and fresh.exists() and not short.exists() and not flipped.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "removed 2 damaged compilation cache entries" in err
    assert (folder / JIT_VERIFIED).is_file()
    assert repair_compilation_cache(folder) == [] and capsys.readouterr().err == ""


def test_jax_never_repairs_a_damaged_entry_by_itself(tmp_path):
    """The failure mode is real: jax warns and recompiles on every run, keeping the entry."""
    import subprocess
    import sys
    script = (f"import jax, jax.numpy as jnp\n"
              f"jax.config.update('jax_compilation_cache_dir', {str(tmp_path / 'jit')!r})\n"
              f"jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
              f"jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)\n"
              f"print(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8)))[0, 0])\n")
    run = lambda: subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                 timeout=120)
    assert run().returncode == 0
    entries = sorted((tmp_path / "jit").glob("jit__lambda*-cache"))
    assert entries
    entries[0].write_bytes(entries[0].read_bytes()[:50])
    for _ in range(2):
        result = run()
        assert result.returncode == 0 and "Error reading persistent compilation cache" in result.stderr
    from models.hub import repair_compilation_cache
    os.utime(entries[0], (1_700_000_000, 1_700_000_000))
    assert repair_compilation_cache(tmp_path / "jit") == [entries[0].name]
    result = run()
    assert "Error reading" not in result.stderr and entries[0].exists()  # written afresh
