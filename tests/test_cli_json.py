"""Every `kvjax` command takes `--json` and then prints one JSON object on stdout.

`generate`, `ppl`, `calibrate`, `compile`, `export`, `run-exported` and `inspect` had it (their
own tests parse it); these are the four that gained it: `eval` and `bench` (here on committed
result folders with `--report`, so no cell runs), `train-state` (a tiny GGUF, three steps)
and `launch` (two processes of a plain Python command).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from experiments.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _json_out(capsys, *argv: str) -> dict:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1, out  # one object, nothing else on stdout
    result = json.loads(out)
    assert isinstance(result, dict)
    return result


def test_every_command_has_a_json_option():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"generate", "ppl", "eval", "bench", "train-state", "launch", "calibrate",
            "compile", "export", "run-exported", "inspect"} <= set(commands)
    missing = [name for name, sub in commands.items()
               if "--json" not in sub._option_string_actions]
    assert not missing, missing


@pytest.mark.parametrize("command, config, folder", [
    ("eval", "experiments/configs/results.toml", "docs/results/eval"),
    ("bench", "experiments/configs/speed.toml", "docs/results/speed")])
def test_eval_and_bench_report_as_json(capsys, tmp_path, command, config, folder):
    out = tmp_path / "out"
    shutil.copytree(ROOT / folder, out)
    result = _json_out(capsys, command, "--config", str(ROOT / config), "--out", str(out),
                       "--report", "--json")
    rows = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines() if line]
    assert result["command"] == command and result["out"] == str(out)
    assert result["ok"] + result["failed"] == len(result["rows"]) > 0
    assert len(result["rows"]) <= len(rows)  # the newest row of each cell
    assert all(r["status"] == "ok" for r in result["rows"][:result["ok"]]) or result["failed"]
    if command == "bench":
        assert {r["task"] for r in result["rows"]} == {"speed"}
    assert (out / "tables.md").is_file()  # the report was still written


def test_json_safe_turns_non_finite_numbers_into_null():
    from experiments.cli.main import json_safe
    value = json_safe({"a": float("nan"), "b": [1.0, float("inf")], "c": "x", "d": 2})
    assert value == {"a": None, "b": [1.0, None], "c": "x", "d": 2}
    json.dumps(value, allow_nan=False)


def test_train_state_json(capsys, tmp_path):
    from tests.test_loading import write_gguf
    gguf = write_gguf(tmp_path / "tiny.gguf", "llama_tied")  # 2 layers, 128 positions
    result = _json_out(capsys, "train-state", "--model", str(gguf), "--out", str(tmp_path / "m"),
                       "--seq-len", "64", "--queries", "16", "--windows", "2", "--heldout", "1",
                       "--batch", "1", "--steps", "3", "--features", "8", "--json")
    assert result["out"] == str(tmp_path / "m")
    assert result["last_loss"] <= result["first_loss"]
    assert {"learned", "elu"} <= set(result["heldout_mean"])
    assert (tmp_path / "m" / "summary.json").is_file()


def test_launch_json(capsys):
    script = "import json, os; print(json.dumps({'id': int(os.environ['KVJAX_PROCESS_ID'])}))"
    result = _json_out(capsys, "launch", "-n", "2", "--local-devices", "0", "--json", "--",
                       sys.executable, "-c", script)
    assert result["status"] == 0 and result["returncodes"] == [0, 0]
    assert result["processes"] == 2 and result["result"] == {"id": 0}  # process 0's output


def test_launch_json_reports_a_failing_process(capsys):
    script = "import os, sys; sys.exit(int(os.environ['KVJAX_PROCESS_ID']) * 3)"
    code = main(["launch", "-n", "2", "--local-devices", "0", "--json", "--",
                 sys.executable, "-c", script])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert code == 3 and result["status"] == 3 and result["returncodes"] == [0, 3]
    assert "result" not in result and "[process 1 exited 3]" in err
