"""The harness's cells on the real model: the ppl cell's metric against a direct computation,
seeded reproducibility, the speed cell's measurements, the passkey trial order, and the
kvpress press mapping."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from experiments.eval import cells

from experiments.eval import harness
from experiments.eval.grid import Cell
from experiments.eval.kvpress_engine import parse_press_spec


@pytest.fixture(scope="module")
def smollm2():
    from models.loading import load_model
    return load_model("smollm2")


@pytest.mark.parametrize("own_text", [False, True])
def test_ppl_cell_equals_a_direct_computation(smollm2, tmp_path, own_text):
    """The cell's perplexity is exp(mean NLL) of every window's last quarter, from the model's
    own logits over the whole window (full cache: compression changes nothing); with
    `text = PATH` the windows come from that file."""
    import jax
    import jax.numpy as jnp

    from experiments.eval.ppl import window_ids
    from models.llama import new_cache

    model, tokenizer = smollm2
    text = cells.PPL_TEXT
    if own_text:
        text = tmp_path / "mine.txt"
        text.write_text((cells.DATA / "devils_dictionary.txt").read_text(encoding="utf-8")[:20000],
                        encoding="utf-8")
    row = cells.run_ppl_cell(Cell("ppl", 64, "full", trials=3, batch=2,
                                  text_path=str(text) if own_text else ""))
    assert row["text"] == text.name
    windows = np.asarray(window_ids(tokenizer, text, 64, 3))  # [3, 64]
    positions = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), windows.shape)
    logits, _ = model(jnp.asarray(windows), positions, new_cache(model.config, 3, 64))  # [3, 64, V]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1), np.float64)
    nll = -sum(logp[b, t - 1, windows[b, t]] for b in range(3) for t in range(48, 64))
    assert row["tokens_scored"] == 3 * 16 and row["prefix"] == 48
    assert row["score"] == pytest.approx(math.exp(nll / 48), rel=1e-4)
    assert row["cache_bytes_per_token"] > 0


def test_cells_are_reproducible_and_compression_shrinks_the_cache(smollm2):
    cell = Cell("ppl", 128, "snapkv:ratio=0.5+kivi:bits=4,group=16,residual=16", trials=2, batch=2)
    first, second = harness.run_cell(cell), harness.run_cell(cell)
    assert first["score"] == second["score"] and first["nll"] == second["nll"]
    full = cells.run_kvjax_cell(Cell("ppl", 128, "full", trials=2, batch=2))
    assert first["cache_bytes_per_token"] < 0.3 * full["cache_bytes_per_token"]
    assert first["score"] != full["score"]


def test_memory_cell_counts_the_bytes_the_formats_say(smollm2):
    """bfloat16 full cache: 2 x 64 x 2 B of keys and values + a 4-byte position per token,
    layer and KV head, plus each layer's 4-byte cursor, exactly; KIVI-4 after SnapKV within
    its per-layer constants (group tables, cursors) of the formats' arithmetic."""
    full = cells.run_memory_cell(Cell("memory", 256, "full", trials=1, batch=1))
    assert full["theoretical"] == 30 * 3 * (2 * 64 * 2 + 4)
    assert full["score"] == full["bytes_per_token"] == full["theoretical"] + 30 * 4 / 256
    chain = cells.run_memory_cell(Cell("memory", 256, "snapkv:ratio=0.5+kivi:bits=4,residual=32",
                                       trials=1, batch=1))
    assert chain["theoretical"] == cells.theoretical_bytes(chain["method"], 256)
    assert chain["bytes_per_token"] < 0.3 * full["bytes_per_token"]
    assert abs(chain["bytes_per_token"] - chain["theoretical"]) < 0.03 * chain["theoretical"]


def test_a_haystack_file_replaces_the_prose_and_query_aware_compresses_the_question(smollm2,
                                                                                    tmp_path):
    model, tokenizer = smollm2
    hay = tmp_path / "hay.txt"
    hay.write_text(" ".join(f"The zebra number {i} grazed on the plain." for i in range(400)),
                   encoding="utf-8")
    prompts = cells.make_prompts(Cell("passkey", 256, "full", trials=2, haystack_path=str(hay)),
                                 tokenizer)
    for ids in prompts.contexts:
        text = tokenizer.decode(ids)
        assert "zebra" in text and "pass key" in text.lower()
    builtin = cells.make_prompts(Cell("passkey", 256, "full", trials=2), tokenizer)
    assert all("zebra" not in tokenizer.decode(ids) for ids in builtin.contexts)
    # the full cache compresses nothing: compressing the question too changes no answer
    plain = cells.run_retrieval_cell(Cell("passkey", 256, "full", trials=2, batch=2,
                                          max_new_tokens=8, haystack_path=str(hay)))
    aware = cells.run_retrieval_cell(Cell("passkey", 256, "full", trials=2, batch=2,
                                          max_new_tokens=8, haystack_path=str(hay),
                                          query_aware=True))
    assert aware["outputs"] == plain["outputs"] and aware["score"] == plain["score"] == 1.0


def test_speed_cell_measures_prefill_decode_and_bytes(smollm2):
    full = cells.run_speed_cell(Cell("speed", 64, "full", trials=1, batch=2, max_new_tokens=4))
    half = cells.run_speed_cell(Cell("speed", 64, "streaming_llm:ratio=0.5", trials=1, batch=2,
                                     max_new_tokens=4))
    for row in (full, half):
        assert row["decode_ms"] > 0 and row["prefill_tok_s"] > 0 and row["floor_ms"] > 0
        assert row["score"] == row["decode_ms"]
    assert half["cache_bytes_per_seq"] < 0.7 * full["cache_bytes_per_seq"]


def test_passkey_trials_take_depths_round_robin(smollm2):
    _, tokenizer = smollm2
    prompts = cells.make_prompts(Cell("passkey", 256, "full", trials=7), tokenizer)
    assert prompts.depths == list(cells.PASSKEY_DEPTHS) + list(cells.PASSKEY_DEPTHS[:2])
    assert len(prompts.contexts) == len(prompts.questions) == 7
    assert all(250 <= len(c) <= 256 for c in prompts.contexts)


@pytest.mark.slow
def test_a_full_cache_kvpress_cell_answers_as_kvjax_does():
    """The kvpress engine's `full` cell (no press: kvpress's pipeline must still be registered;
    it was not, and ruler_long's first kvpress cell failed) gives kvjax's answers."""
    pytest.importorskip("kvpress", reason="[optional] kvpress is in the `compare` extra, not "
                                          "installed")
    from experiments.eval.kvpress_engine import run_kvpress_cell
    from experiments.eval.report import _normalized
    cell = Cell("niah_single_2", 256, "full", trials=2, batch=1, max_new_tokens=8)
    theirs = run_kvpress_cell(replace(cell, engine="kvpress"))
    ours = cells.run_retrieval_cell(cell)
    assert theirs["status"] == "ok"
    assert list(map(_normalized, theirs["outputs"])) == list(map(_normalized, ours["outputs"]))


def test_kvpress_specs_map_to_presses_or_fail_clearly(tmp_path):
    assert parse_press_spec("full") is None
    assert parse_press_spec("snapkv:ratio=0.25") == ("SnapKVPress", {"compression_ratio": 0.25})
    assert parse_press_spec("snapkv:ratio=0.5,headwise=true") == (
        "AdaKVPress", {"press": ("SnapKVPress", {"compression_ratio": 0.5})})
    assert parse_press_spec("critical:inner=snapkv,ratio=0.75") == (
        "CriticalKVPress", {"press": ("SnapKVPress", {"compression_ratio": 0.75})})
    assert parse_press_spec("chunk:inner=snapkv,ratio=0.5,chunk_length=256") == (
        "ChunkPress", {"press": ("SnapKVPress", {"compression_ratio": 0.5}), "chunk_length": 256})
    assert parse_press_spec("chunkkv:inner=knorm,ratio=0.5") == (  # any inner kvpress runs
        "ChunkKVPress", {"press": ("KnormPress", {"compression_ratio": 0.5})})
    assert parse_press_spec("think:ratio=0.5") == (
        "ThinKPress", {"key_channel_compression_ratio": 0.5})
    for bad in ("snapkv:ratio=0.5+kivi:bits=4", "kivi:bits=4", "h2o:ratio=0.5",
                "snapkv:ratio=0.5,window=32", "tova:ratio=0.5,headwise=true",
                "chunkkv:inner=kivi,ratio=0.5", "finch:ratio=0.5,window=8",
                "chunk:inner=knorm,ratio=0.5,chunk_length=x",
                "decoding_ratio:inner=knorm,ratio=0.5", "random:ratio=0.5", "keydiff"):
        with pytest.raises(ValueError, match="no kvpress press"):
            parse_press_spec(bad)
    kvpress = pytest.importorskip(
        "kvpress", reason="[optional] kvpress is in the `compare` extra, not installed")
    from experiments.eval.kvpress_engine import press_for
    press = press_for("streaming_llm:ratio=0.5")
    assert isinstance(press, kvpress.StreamingLLMPress) and press.compression_ratio == 0.5
    assert isinstance(press_for("snapkv:ratio=0.5,headwise=true"), kvpress.AdaKVPress)
    # hub artifacts: the file the spec names, read by kvjax's checked loader
    golden = Path(__file__).parent / "golden"
    assert parse_press_spec(f"qfilter:ratio=0.5,filters={golden}/smollm2_qfilters.npz") == (
        "QFilterPress", {"compression_ratio": 0.5,
                         "filters": f"{golden}/smollm2_qfilters.npz"})
    press = press_for(f"lukv:ratio=0.75,curve={golden}/smollm2_lukv_curve.npz")
    assert isinstance(press, kvpress.LUKVPress) and press.compression_ratio == 0.75
    assert press._load_budget_curves(None).shape == (99, 30, 3)
    with pytest.raises(ValueError, match="is not a file"):
        press_for("qfilter:ratio=0.5,filters=/no/such.npz")
    # KVzap: the surrogate kvjax trained, in kvpress's own KVzapModel (weights transposed)
    import torch
    from kvjax.policies.eviction_kvzap import load_kvzap
    weights = Path(__file__).parents[1] / "experiments/data/kvzap/SmolLM2-135M-Instruct-linear"
    press = press_for(f"kvzap:ratio=0.5,weights={weights}")
    assert isinstance(press, kvpress.KVzapPress) and press.model_type == "linear"
    press.post_init_from_model(None)
    ours = load_kvzap(weights)
    h = np.random.default_rng(0).standard_normal((1, 5, ours.hidden_size)).astype(np.float32)
    with torch.no_grad():
        theirs = press.kvzap_model.layers[7](torch.from_numpy(h)).numpy()
    np.testing.assert_allclose(theirs, np.asarray(ours.apply(ours.layer_params(7), h)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="is not an orbax checkpoint directory"):
        press_for("kvzap:ratio=0.5,weights=/no/such")
    # Fast KVzip: the gates kvjax trained, in kvpress's own FastKVzipGate modules
    from kvjax.policies.eviction_fastkvzip import load_fastkvzip
    gates = Path(__file__).parents[1] / "experiments/data/fastkvzip/SmolLM2-135M-Instruct"
    press = press_for(f"fastkvzip:ratio=0.5,gates={gates}")
    assert isinstance(press, kvpress.FastKVzipPress) and len(press.gates) == 30
    ours = load_fastkvzip(gates)
    with torch.no_grad():
        theirs = press.gates[7](torch.from_numpy(h)).numpy()  # [1, KVH, T]
    np.testing.assert_allclose(theirs[0].T, np.asarray(ours.apply(ours.layer_params(7), h))[0],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="is not an orbax checkpoint directory"):
        press_for("fastkvzip:ratio=0.5,gates=/no/such")
    # DuoAttention: the head scores kvjax trained (or computed) as kvpress's loaded pattern,
    # its streaming heads chosen by kvpress's own code
    from types import SimpleNamespace

    from kvjax.policies.eviction_duo import streaming_heads
    scores = np.random.default_rng(1).uniform(-0.2, 1.2, (30, 3)).astype(np.float32)
    np.savez(tmp_path / "duo.npz", head_scores=scores)
    assert parse_press_spec(f"duo_attention:head_ratio=0.25,scores={tmp_path}/duo.npz") == (
        "DuoAttentionPress", {"head_compression_ratio": 0.25,
                              "scores": f"{tmp_path}/duo.npz"})
    press = press_for(f"duo_attention:head_ratio=0.5,scores={tmp_path}/duo.npz")
    assert isinstance(press, kvpress.DuoAttentionPress) and not press.on_the_fly_scoring
    press.post_init_from_model(SimpleNamespace(device="cpu"))
    assert (press.sink_size, press.recent_size) == (128, 256)
    np.testing.assert_array_equal(press.streaming_mask.numpy(),
                                  streaming_heads(np.clip(scores, 0, 1), 0.5))
    with pytest.raises(ValueError, match="no kvpress press"):
        parse_press_spec(f"duo_attention:head_ratio=0.5,scores={tmp_path}/duo.npz,sink=64")
