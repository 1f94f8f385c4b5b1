"""kvjax eval's harness: config grids, worker processes with a memory bound, resumable sweeps,
the report. Cells run a stand-in function here; the real-model cell is in test_cli-like runs."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from experiments import harness
from experiments.harness import Cell


def fake_cell(cell: Cell) -> dict:
    """A cell result that depends only on the cell (a stand-in for run_cell)."""
    return dict(asdict(cell), status="ok", score=(cell.length % 7) / 7, scores=[])


def hungry_cell(cell: Cell) -> dict:
    blocks = [bytearray(256 * 2 ** 20) for _ in range(40)]  # 10 GiB, page by page
    return dict(asdict(cell), status="ok", score=float(len(blocks)))


def failing_cell(cell: Cell) -> dict:
    raise ValueError("no such thing")


CONFIG = """
model = "smollm2"
trials = 4
[[grid]]
tasks = ["passkey", "common_words"]
lengths = [1024, 2048]
methods = ["full", "snapkv:ratio=0.5"]
[[grid]]
tasks = ["niah_multikey"]
lengths = [512]
methods = ["kivi:bits=2"]
"""


def test_config_expands_the_grid_and_rejects_mistakes(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text(CONFIG)
    cells, limit_gb = harness.load_config(path)
    assert len(cells) == 2 * 2 * 2 + 1 and all(c.trials == 4 for c in cells)
    assert limit_gb == 16  # the default bound
    assert cells[-1] == Cell("niah_multikey", 512, "kivi:bits=2", trials=4)
    for bad, message in [(CONFIG.replace('"passkey"', '"trivia"'), "unknown task"),
                         (CONFIG.replace("snapkv:ratio", "snapkv:ration"), "ration"),
                         (CONFIG.replace("trials = 4", ""), "trials"),
                         (CONFIG.replace('lengths = [512]', ''), "lacks")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            harness.load_config(path)


def test_sweep_resumes_and_never_recomputes_a_finished_cell(tmp_path):
    cells = [Cell("passkey", n, "full", trials=2) for n in (100, 200, 300)]
    first = harness.sweep(cells[:2], tmp_path, limit_gb=8, fn=fake_cell)
    assert [r["length"] for r in first] == [100, 200]
    again = harness.sweep(cells, tmp_path, limit_gb=8, fn=fake_cell)  # an interrupted run resumes
    assert [r["length"] for r in again] == [300]
    rows = [json.loads(x) for x in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["status"] == "ok" and r["peak_rss_gb"] >= 0 for r in rows)


def test_a_worker_over_its_memory_bound_is_killed_and_the_sweep_goes_on(tmp_path):
    cells = [Cell("passkey", 100, "full", trials=1), Cell("passkey", 200, "full", trials=1)]
    rows = harness.sweep(cells[:1], tmp_path, limit_gb=1.0, fn=hungry_cell)
    assert rows[0]["status"].startswith("killed")
    rows = harness.sweep(cells, tmp_path, limit_gb=8, fn=failing_cell)
    assert [r["status"] for r in rows] == ["error: ValueError: no such thing"] * 2  # not done: rerun


def test_report_tables_and_heatmaps(tmp_path):
    cells = [Cell(t, n, m, trials=2) for t in ("passkey", "variable_tracking")
             for n in (1024, 2048) for m in ("full", "snapkv:ratio=0.5")]
    harness.sweep(cells, tmp_path, limit_gb=8, fn=fake_cell)
    text = harness.report(tmp_path)
    assert "### passkey" in text and "| snapkv:ratio=0.5 | 0.29 | 0.57 |" in text
    assert (tmp_path / "passkey.png").stat().st_size > 0
    assert (tmp_path / "tables.md").read_text() == text


def test_cli_eval_reports_a_bad_config_clearly(tmp_path, capsys):
    from experiments.cli import main
    path = tmp_path / "grid.toml"
    path.write_text(CONFIG.replace('"passkey"', '"trivia"'))
    assert main(["eval", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "unknown task 'trivia'" in capsys.readouterr().err
