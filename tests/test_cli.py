import json
from pathlib import Path

import numpy as np
import pytest

from experiments.cli.main import main
from tests.conftest import smollm2_path

DATA = Path(__file__).parents[1] / "experiments" / "data"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_on_the_real_model(capsys):
    code, out, _ = run(capsys, "generate", "--model", str(smollm2_path()), "--chat",
                       "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
                       "--json")
    assert code == 0
    result = json.loads(out)
    assert "Paris" in result["text"]
    assert 0 < len(result["tokens"]) <= 12 and result["method"] == "full"


def test_ppl_json_on_real_text(capsys, tmp_path):
    code, out, _ = run(capsys, "ppl", "--model", str(smollm2_path()), "--text",
                       str(DATA / "kjv_genesis.txt"), "--context", "128", "--stride", "64",
                       "--max-tokens", "384", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["tokens_scored"] == 383
    assert 1.5 < result["ppl"] < 100  # a real model on real prose, not a uniform guess (49152)


def test_ppl_prefix_with_a_method(capsys):
    common = ["ppl", "--model", str(smollm2_path()), "--text", str(DATA / "kjv_genesis.txt"),
              "--context", "256", "--prefix", "192", "--max-tokens", "512", "--json"]
    _, full_out, _ = run(capsys, *common)
    code, out, _ = run(capsys, *common, "--method", "snapkv:ratio=0.75")
    full, snap = json.loads(full_out), json.loads(out)
    assert code == 0 and snap["tokens_scored"] == full["tokens_scored"] == 2 * 64
    assert snap["prefix"] == 192 and snap["method"] == "snapkv:ratio=0.75"
    assert 1.5 < full["ppl"] < snap["ppl"] < 1000  # losing 3/4 of the context costs something


def test_generate_compresses_a_context_file(capsys, tmp_path):
    context = tmp_path / "context.txt"
    context.write_text((DATA / "kjv_genesis_1-3.txt").read_text(encoding="utf-8")[:2500])
    common = ["generate", "--model", str(smollm2_path()), "--chat", "--context-file", str(context),
              "--prompt", "What did God create in the beginning?", "--max-new-tokens", "8", "--json"]
    _, full_out, _ = run(capsys, *common)
    code, out, _ = run(capsys, *common, "--method", "streaming_llm:ratio=0.5")
    full, half = json.loads(full_out), json.loads(out)
    assert code == 0 and half["context_tokens"] == full["context_tokens"] > 400
    # the compressed context holds half its tokens; question, answer and metadata add a little
    assert half["cache_bytes"] < 0.62 * full["cache_bytes"]


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"], "not found"),
    (["generate", "--model", "{gguf}", "--prompt", "hi", "--method", "nosuch"], "unknown method"),
    (["ppl", "--model", "{gguf}", "--text", "/no/such.txt", "--context", "8"], "text file not found"),
    (["ppl", "--model", "{gguf}", "--text", str(DATA / "kjv_genesis.txt"), "--context", "64",
      "--max-tokens", "100", "--method", "knorm:ratio=0.5"], "prefix"),
    (["generate", "--model", "{gguf}", "--prompt", "hi", "--method", "snapkv:ratio=2"], "ratio"),
    (["train-state", "--out", "/tmp/x", "--steps", "0"], "--steps 0: must be >= 1"),
    (["train-state", "--out", "/tmp/x", "--features", "3"], "--features 3: must be even"),
    (["train-state", "--out", "/tmp/x", "--data", "/no/such.txt"], "--data /no/such.txt"),
])
def test_bad_input_gives_one_clear_error(capsys, argv, message):
    argv = [a.replace("{gguf}", str(smollm2_path())) for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_train_state_writes_maps_a_curve_and_a_summary(capsys, tmp_path):
    """`kvjax train-state` on the real model, a few optax steps on tiny windows: the maps load
    as a fold method, and the summary is JSON with the losses."""
    import kvjax

    code, out, err = run(capsys, "train-state", "--model", str(smollm2_path()), "--out",
                         str(tmp_path), "--seq-len", "64", "--queries", "16", "--windows", "2",
                         "--heldout", "1", "--batch", "1", "--steps", "3", "--features", "8",
                         "--json")
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["last_loss"] <= summary["first_loss"]
    assert {"learned", "elu"} <= set(summary["heldout_mean"])
    assert (tmp_path / "loss.png").is_file() and (tmp_path / "summary.json").is_file()
    assert isinstance(kvjax.parse_method(f"snapkv:ratio=0.5+fold:map={tmp_path}"),
                      kvjax.CacheTransform)


def test_run_exported_imports_neither_flax_nor_models(tmp_path):
    """`kvjax run-exported` builds the whole parser and runs without Flax or the model code
    (here on a missing artifact: a one-line error, exit 2)."""
    import subprocess
    import sys

    code = ("import sys\nfrom experiments.cli.main import main\n"
            f"rc = main(['run-exported', {str(tmp_path / 'none')!r}, '--prompt', 'hi'])\n"
            "print(rc, sorted(m for m in ('flax', 'models') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.split("\n")[-2] == "2 []", out.stdout + out.stderr
    assert "kvjax: error:" in out.stderr


def test_generate_parses_its_method_once(capsys, monkeypatch):
    """The spec is parsed once (kvjax.Method) and carried from the command line to the
    sampler: checks, --monitor and the pipeline use the parsed object."""
    import kvjax.policies.methods as methods

    calls = []
    real = methods.parse_method
    monkeypatch.setattr(methods, "parse_method", lambda spec: calls.append(spec) or real(spec))
    code, out, _ = run(capsys, "generate", "--model", str(smollm2_path()), "--prompt", "Hi",
                       "--max-new-tokens", "2", "--method", "snapkv:ratio=0.5,layers=0-29",
                       "--monitor", "--json")
    assert code == 0 and calls == ["snapkv:ratio=0.5,layers=0-29"]
    result = json.loads(out)
    assert result["method"] == "snapkv:ratio=0.5,layers=0-29" and result["monitor"]["layers"] == 30
    assert "plan" not in result["monitor"]


def test_generate_monitor_reports_autos_plan(capsys):
    """`--monitor` with `auto`: the plan (bits, key coding, token share per layer, the damage
    table's source) and what the update decided (budget bytes, tokens per layer and head),
    consistent with the monitor's own token count."""
    code, out, _ = run(capsys, "generate", "--model", str(smollm2_path()), "--prompt",
                       "Tell me about the sea. " * 20, "--max-new-tokens", "2",
                       "--method", "auto:budget=0.25", "--monitor", "--json")
    assert code == 0
    monitor = json.loads(out)["monitor"]
    plan = monitor["plan"]
    assert len(plan["bits"]) == len(plan["keys"]) == len(plan["kept"]) == 30
    assert set(plan["keys"]) <= {"token", "channel"} and plan["budget_bytes"] > 0
    assert plan["source"].startswith("end-to-end table")  # the shipped KL table
    kept = np.asarray(plan["kept"])  # [L, KVH] at the last update (after the prefill)
    assert (kept > 0).all() and kept.sum() <= monitor["tokens"] + 2 * kept.size
