"""`kvjax eval` under bad input and interruption (issue 21): the output folder is checked
before the sweep, a damaged results line is skipped with a warning naming file and line,
config mistakes are refused with a did-you-mean, cells a model cannot run are refused
before any worker starts, and Ctrl-C exits with code 130 keeping every finished row.

Cells run stand-in functions (no model); tests/test_eval_cells.py runs real cells."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from experiments.eval import grid

from experiments.eval import harness
from experiments.eval.grid import Cell

ROOT = Path(__file__).parents[1]
TINY_HF = ROOT / "tests" / "golden" / "tiny_hf" / "llama_tied"  # 2 layers, 128 positions

CONFIG = """
model = "smollm2"
trials = 2
[[grid]]
tasks = ["passkey"]
lengths = [256, 512]
methods = ["full", "snapkv:ratio=0.5"]
"""


def fake_cell(cell: Cell | tuple[Cell, ...]) -> dict | list[dict]:
    """A row per cell; a unit of cells sharing a prefill (`harness.run_cells`) gives a list."""
    if isinstance(cell, tuple):
        return [fake_cell(c) for c in cell]
    return dict(asdict(cell), status="ok", score=cell.length / 1000, scores=[])


def slow_cell(cell: Cell) -> dict:
    """The 256-token cells finish at once, the others take a minute (to be interrupted)."""
    if cell.length != 256:
        time.sleep(60)
    return fake_cell(cell)


def cli(capsys, *argv):
    from experiments.cli.main import main
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_cells(monkeypatch):
    """Fail the test if any cell starts (the checks must come before the sweep)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a cell ran")
    monkeypatch.setattr(harness, "run_in_worker", refuse)
    monkeypatch.setattr(harness, "check_models", lambda cells: None)


def config(tmp_path, text=CONFIG) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- output folder


@pytest.mark.parametrize("where, message", [
    ("{tmp}/afile/out", "cannot be written (Not a directory)"),
    ("{tmp}/afile", "is a file: need a folder"),
])
def test_an_unusable_out_folder_fails_before_any_cell(tmp_path, capsys, no_cells, where, message):
    (tmp_path / "afile").write_text("not a folder")
    out = where.replace("{tmp}", str(tmp_path))
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path), "--out", out)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"kvjax: error: --out {out}: ") and message in err


def test_an_unusable_results_file_fails_before_any_cell(tmp_path, capsys, no_cells):
    (tmp_path / "afile").write_text("x")
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path), "--out", tmp_path / "out",
                       "--results", tmp_path / "afile" / "RESULTS.md")
    assert code == 2 and "--results" in err and "cannot be written" in err
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path), "--out", tmp_path / "out",
                       "--results", tmp_path)
    assert code == 2 and "is a directory: need a Markdown file" in err


def test_report_without_results_says_so(tmp_path, capsys, no_cells):
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path), "--out", tmp_path / "none",
                       "--report")
    assert code == 2 and "has no cells.jsonl to report on" in err


# ----------------------------------------------------------------------------- damaged rows


def test_a_damaged_line_is_skipped_with_file_and_line_and_its_cell_reruns(tmp_path, capsys):
    cells = [Cell("passkey", n, "full", trials=2) for n in (100, 200, 300)]
    harness.sweep(cells, tmp_path, limit_gb=8, fn=fake_cell)
    path = tmp_path / "cells.jsonl"
    lines = path.read_text().splitlines()
    # the second row cut short, as by a killed write, and no newline after the last one
    path.write_text(lines[0] + "\n" + lines[1][:40] + "\n" + lines[2][:25])
    capsys.readouterr()
    rows = grid.read_rows(path)
    err = capsys.readouterr().err
    assert [r["length"] for r in rows] == [100]
    assert f"{path}:2: skipping a damaged result line" in err and f"{path}:3:" in err
    again = harness.sweep(cells, tmp_path, limit_gb=8, fn=fake_cell)
    assert sorted(r["length"] for r in again) == [200, 300]  # the damaged cells rerun
    capsys.readouterr()
    rows = grid.read_rows(path)  # the new rows were not glued onto the cut line
    assert sorted(r["length"] for r in rows) == [100, 200, 300]
    from experiments.eval import report
    assert "passkey" in report.report(tmp_path)


def test_eval_report_survives_a_damaged_line(tmp_path, capsys):
    out = tmp_path / "out"
    harness.sweep([Cell("passkey", 256, "full", trials=2)], out, limit_gb=8, fn=fake_cell)
    with open(out / "cells.jsonl", "a") as f:
        f.write('{"task": "passkey", "length": 51')
    code, report_text, err = cli(capsys, "eval", "--config", config(tmp_path), "--out", out,
                                 "--report")
    assert code == 0 and "cells.jsonl:2: skipping a damaged result line" in err
    assert "passkey" in report_text


# ----------------------------------------------------------------------------- config mistakes


@pytest.mark.parametrize("edit, message", [
    (("trials = 2", "trails = 2"), "unknown top-level key 'trails' (did you mean 'trials'?)"),
    (("trials = 2", "trials = 2\nworker = 2"), "unknown top-level key 'worker' (did you mean "
                                               "'workers'?)"),
    (("methods =", "method ="), "unknown [[grid]] key 'method' (did you mean 'methods'?)"),
    (("trials = 2", "trials = 0"), "trials = 0: must be an integer >= 1"),
    (("trials = 2", "trials = 2.5"), "trials = 2.5: must be an integer >= 1"),
    (("trials = 2", "trials = 2\nworkers = 0"), "workers = 0: must be an integer >= 1"),
    (("trials = 2", "trials = 2\nmax_rss_gb = -1"), "max_rss_gb = -1: must be a number > 0"),
    (("lengths = [256, 512]", "lengths = [256, -512]"), "lengths has -512: must hold integers"),
    (("lengths = [256, 512]", "lengths = []"), "lengths = []: must be a non-empty list"),
    (('tasks = ["passkey"]', 'tasks = "passkey"'), "tasks = 'passkey': must be a non-empty list"),
    (('"snapkv:ratio=0.5"', '"snapkv:ratio=5"'), "ratio is the fraction of tokens evicted"),
    (("[[grid]]", "[grid]"), "`grid` must be [[grid]] tables"),
    (("trials = 2", "trials = = 2"), "not a valid TOML file"),
])
def test_config_mistakes_are_refused_naming_file_and_key(tmp_path, capsys, no_cells, edit,
                                                          message):
    path = config(tmp_path, CONFIG.replace(*edit))
    code, _, err = cli(capsys, "eval", "--config", path, "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(path) in err and message in err, err


def test_cells_the_model_cannot_run_are_refused_before_the_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(harness, "run_in_worker", lambda *a, **k: pytest.fail("a cell ran"))
    text = CONFIG.replace('"smollm2"', json.dumps(str(TINY_HF)))
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path, text), "--out", tmp_path / "o")
    assert code == 2 and "length 256 (+ 24 new tokens) exceeds" in err and "128 positions" in err
    text = text.replace("[256, 512]", "[64]").replace('"snapkv:ratio=0.5"',
                                                      '"snapkv:ratio=0.5,layers=0-5"')
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path, text), "--out", tmp_path / "o")
    assert code == 2 and "layers names layer 5; the model has 2 layers, 0-1" in err


# ----------------------------------------------------------------------------- Ctrl-C


def test_an_interrupt_keeps_every_finished_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(harness, "check_models", lambda cells: None)
    calls = []

    def run(fn, cell, limit_gb, poll_s=0.5):
        calls.append(cell)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return fake_cell(cell)
    monkeypatch.setattr(harness, "run_in_worker", run)
    out = tmp_path / "out"  # one cell per worker call, so the interrupt falls between two
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path), "--out", out,
                       "--no-shared-prefill")
    assert code == 130 and "Traceback" not in err
    assert "interrupted: 1 finished cells kept" in err and "rerun the same command" in err
    rows = grid.read_rows(out / "cells.jsonl")
    assert [(r["length"], r["method"]) for r in rows] == [(256, "full")]


SCRIPT = """
import sys
from experiments.eval import harness
from experiments.cli.main import main
import tests.test_eval_robustness as t
harness.run_cell = t.slow_cell  # one cell per worker (--no-shared-prefill): no real model
harness.check_models = lambda cells: None
sys.exit(main(["eval", "--config", sys.argv[1], "--out", sys.argv[2], "--no-shared-prefill"]))
"""


def _ctrl_c_as_in_a_terminal() -> None:
    """A child's SIGINT as a shell gives it: default action, not blocked. A child inherits its
    parent's signal mask and ignored signals, and something earlier in a pytest worker (seen in
    CI runs of the whole suite, never alone) left SIGINT blocked: the sweep then never saw the
    Ctrl-C (reproduced by running this test with SIGINT blocked)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_on_a_real_sweep_exits_130_without_a_traceback(tmp_path):
    out = tmp_path / "out"
    text = CONFIG.replace("trials = 2", "trials = 2\nworkers = 2")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(config(tmp_path, text)), str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # its own process group, like a terminal's
                            preexec_fn=_ctrl_c_as_in_a_terminal)
    rows = out / "cells.jsonl"
    deadline = time.time() + 300  # a cold, loaded 2-core machine: spawned workers import slowly
    while time.time() < deadline and not (rows.exists() and rows.read_text().count("\n") >= 2):
        time.sleep(0.5)
    if not (rows.exists() and rows.read_text().count("\n") >= 2):  # never interrupt a start-up
        proc.kill()
        pytest.fail(f"the sweep wrote no two rows in 300 s: {proc.communicate()[1][-2000:]}")
    time.sleep(1.0)  # the two slow cells are running now
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the parent and its workers
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - start < 15  # the workers were killed, not waited for
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted: 2 finished cells kept" in err
    kept = grid.read_rows(rows)
    assert sorted((r["length"], r["method"]) for r in kept) == [(256, "full"),
                                                                (256, "snapkv:ratio=0.5")]


def test_a_nan_perplexity_cell_fails_instead_of_scoring(tmp_path, monkeypatch):
    import numpy as np

    import models.scoring
    from experiments.eval.cells import run_ppl_cell
    from tests.test_loading import write_gguf

    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "tiny.gguf", "llama_tied")
    monkeypatch.setattr(models.scoring, "score_continuations",
                        lambda model, pre, conts, **k: [np.full(len(c), np.nan, np.float32)
                                                        for c in conts])
    cell = Cell("ppl", 64, "full", trials=1, batch=1, model=str(gguf))
    with pytest.raises(FloatingPointError, match="the summed NLL of 16 tokens is nan"):
        run_ppl_cell(cell)


def test_a_write_failure_during_the_sweep_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(harness, "check_models", lambda cells: None)
    monkeypatch.setattr(harness, "run_in_worker", lambda fn, cell, limit_gb: fake_cell(cell))
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if str(path).endswith("cells.jsonl") and "a" in mode and full_disk.rows_written >= 1:
            raise OSError(28, "No space left on device")
        if str(path).endswith("cells.jsonl") and "a" in mode:
            full_disk.rows_written += 1
        return real_open(path, mode, *args, **kwargs)
    full_disk.rows_written = -1  # the pre-sweep writability probe opens it once
    monkeypatch.setattr("builtins.open", full_disk)
    out = tmp_path / "out"
    out.mkdir()
    (out / "cells.jsonl").write_text("")
    code, _, err = cli(capsys, "eval", "--config", config(tmp_path), "--out", out,
                       "--no-shared-prefill")
    monkeypatch.undo()
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "kvjax: error: [Errno 28] No space left on device"
    assert len(grid.read_rows(out / "cells.jsonl")) == 1  # the row written before is kept


# ----------------------------------------------------------------------------- progress bars


def test_progress_bars_go_to_stderr_only_when_asked_or_on_a_terminal(monkeypatch, capsys):
    """`perplexity` draws a bar over its windows on stderr with progress=True (or
    $KVJAX_PROGRESS=1), none by default when stderr is not a terminal, never on stdout;
    the numbers are the same either way."""
    import numpy as np
    from flax import nnx

    from experiments.eval.ppl import perplexity
    from models.llama import Llama, LlamaConfig
    from models.loading import PROGRESS_ENV, progress_enabled

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(3, 256, 80).tolist()
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    quiet = perplexity(model, ids, context=32, batch_size=2)
    out, err = capsys.readouterr()
    assert out == "" and "ppl windows" not in err  # pytest's stderr is no terminal
    loud = perplexity(model, ids, context=32, batch_size=2, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "ppl windows" in err and "window" in err
    assert loud == quiet
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert progress_enabled() and not progress_enabled(False)
    perplexity(model, ids, context=32, batch_size=2, prefix=16,
               transform=__import__("kvjax").snapkv(ratio=0.5, window=4))
    assert "ppl windows" in capsys.readouterr().err
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert not progress_enabled() and progress_enabled(True)
