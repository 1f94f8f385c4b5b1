"""kvjax eval's harness: config grids, worker processes with a memory bound, resumable and
parallel sweeps, the report and the RESULTS.md section. Cells run stand-in functions here;
tests/test_eval_cells.py runs real cells on the real model."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import pytest

from experiments.eval import grid

from experiments.eval import harness

from experiments.eval import report
from experiments.eval.grid import Cell


def fake_cell(cell: Cell) -> dict:
    """A cell result that depends only on the cell (a stand-in for run_cell)."""
    return dict(asdict(cell), status="ok", score=(cell.length % 7) / 7, scores=[])


def hungry_cell(cell: Cell) -> dict:
    blocks = [bytearray(256 * 2 ** 20) for _ in range(40)]  # 10 GiB, page by page
    return dict(asdict(cell), status="ok", score=float(len(blocks)))


def env_cell(cell: Cell) -> dict:
    import os
    return dict(asdict(cell), status="ok", mmap=os.environ.get("MALLOC_MMAP_THRESHOLD_"))


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
    cells, limit_gb, workers, bases = harness.load_config(path)
    assert bases == {}
    assert len(cells) == 2 * 2 * 2 + 1 and all(c.trials == 4 for c in cells)
    assert (limit_gb, workers) == (16, 1)  # the defaults
    assert cells[-1] == Cell("niah_multikey", 512, "kivi:bits=2", trials=4)
    assert not any(c.timed for c in cells)
    for bad, message in [(CONFIG.replace('"passkey"', '"trivia"'), "unknown task"),
                         (CONFIG.replace("snapkv:ratio", "snapkv:ration"), "ration"),
                         (CONFIG.replace("trials = 4", ""), "trials"),
                         (CONFIG.replace('lengths = [512]', ''), "lacks"),
                         (CONFIG + 'engines = ["vllm"]', "unknown engine"),
                         (CONFIG + 'lenghts = [1]', "unknown"),
                         (CONFIG.replace('"niah_multikey"', '"speed"') +
                          'engines = ["kvpress"]', "runs ppl and retrieval tasks")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            harness.load_config(path)


BLOCKS = """
model = "smollm2"
trials = 4
batch = 4
workers = 2
[[grid]]
tasks = ["passkey"]
lengths = [1024]
methods = ["full", "snapkv:ratio=0.5"]
engines = ["kvjax", "kvpress"]
batch = 8
[[grid]]
tasks = ["speed", "ppl"]
lengths = [512]
methods = ["full"]
batches = [1, 8]
trials = 3
"""


def test_blocks_override_settings_and_expand_engines_and_batches(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text(BLOCKS)
    loaded = harness.load_config(path)
    assert loaded.workers == 2
    compare, rest = loaded.cells[:4], loaded.cells[4:]
    assert [(c.method, c.engine, c.batch, c.warmup) for c in compare] == [
        ("full", "kvjax", 8, True), ("full", "kvpress", 8, True),
        ("snapkv:ratio=0.5", "kvjax", 8, True), ("snapkv:ratio=0.5", "kvpress", 8, True)]
    assert all(c.timed and c.trials == 4 for c in compare)
    assert [(c.task, c.batch, c.trials, c.timed) for c in rest] == [
        ("speed", 1, 3, True), ("speed", 8, 3, True), ("ppl", 1, 3, False), ("ppl", 8, 3, False)]
    path.write_text(BLOCKS.replace('"snapkv:ratio=0.5"]', '"snapkv:ratio=0.5+kivi:bits=4"]'))
    with pytest.raises(ValueError, match="no kvpress press"):  # a chain has no press
        harness.load_config(path)


def test_untimed_cells_run_in_parallel_then_timed_cells_alone(tmp_path):
    cells = [Cell("speed", 64, "full", trials=1), Cell("passkey", 100, "full", trials=1),
             Cell("passkey", 200, "full", trials=1), Cell("passkey", 300, "full", trials=1)]
    rows = harness.sweep(cells, tmp_path, limit_gb=8, fn=fake_cell, workers=3)
    assert sorted(r["length"] for r in rows[:3]) == [100, 200, 300]
    assert rows[3]["task"] == "speed"
    assert harness.sweep(cells, tmp_path, limit_gb=8, fn=fake_cell, workers=3) == []


def test_rows_of_older_sweeps_still_name_their_cell():
    row = dict(task="passkey", length=1024, method="full", trials=5, model="smollm2", seed=0,
               batch=5, max_new_tokens=32, status="ok")  # written before engine and warmup
    assert grid.cell_of(row) == Cell("passkey", 1024, "full", 5, batch=5, max_new_tokens=32)


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
    text = report.report(tmp_path)
    assert "#### passkey" in text and "| `snapkv:ratio=0.5` | 0.29 | 0.57 |" in text
    assert (tmp_path / "passkey.png").stat().st_size > 0
    assert (tmp_path / "tables.md").read_text() == text


def _write_rows(out, rows):
    out.mkdir(exist_ok=True)
    (out / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(cell, **fields):
    return dict(asdict(cell), status="ok", **fields)


def test_report_ppl_front_speed_depth_maps_and_kvpress_table(tmp_path):
    ppl = {"full": (5.0, 1000), "snapkv:ratio=0.5": (5.5, 500), "knorm:ratio=0.5": (6.0, 500),
           "kivi:bits=4": (5.1, 350), "quantize:bits=2": (40.0, 200)}
    rows = [_row(Cell("ppl", 1024, m, trials=8), score=p, cache_bytes_per_token=b, prefix=768,
                 tokens_scored=2048, text="kjv_genesis.txt") for m, (p, b) in ppl.items()]
    rows += [_row(Cell("passkey", n, m, trials=4), score=0.5, scores=[1, 0, 1, 0],
                  depths=[0.1, 0.5, 0.9, 0.1]) for n in (512, 1024) for m in ("full", "tova:ratio=0.5")]
    rows += [_row(Cell("speed", n, "full", trials=3, batch=b), decode_ms=2.0 * n / 512,
                  floor_ms=1.0, prefill_tok_s=1000.0, cache_bytes_per_seq=2 ** 20 * n / 512,
                  bandwidth_gbs=10.0, peak_rss_gb=1.5) for n in (512, 1024) for b in (1, 8)]
    compare = Cell("passkey", 512, "snapkv:ratio=0.5", trials=2, batch=8, warmup=True)
    rows += [_row(compare, score=1.0, outputs=["12345.<|im_end|>", "777"], seconds_per_trial=0.5),
             _row(dataclasses.replace(compare, engine="kvpress"), score=0.5,
                  outputs=["12345.", "778"], seconds_per_trial=2.0)]
    rows.append(dict(asdict(Cell("passkey", 4096, "full", trials=4)), status="killed: big"))
    _write_rows(tmp_path, rows)
    text = report.report(tmp_path)
    # the front: kivi-4 (350 B) beats snapkv (500 B) and the full cache; int2 is the smallest
    assert "| `kivi:bits=4` * | 5.100 | +2.0% | 350 | 0.350 |" in text
    assert "| `snapkv:ratio=0.5` | 5.500 | +10.0% | 500 | 0.500 |" in text
    assert "| `quantize:bits=2` * |" in text and "| `full` * | 5.000 | +0.0% |" in text
    assert "| passkey | 512 | `snapkv:ratio=0.5` | 1.00 | 0.50 | 1/2 | 0.50 (batch 8) | " \
           "2.00 (batch 1) | 4.0x |" in text
    assert "| `full` | 8 | 1024 | 1000 | 4.0 | 1.0 | 4.00 | 2.0 |  | 1.5 |" in text  # no compile_s
    assert "killed: big" in text
    table = (tmp_path / "cells.csv").read_text().splitlines()
    assert len(table) == 1 + len(rows) and "cache_bytes_per_token" in table[0]
    for png in ("ppl_1024.png", "passkey_depth.png", "speed.png", "passkey.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_results_section_is_replaced_in_place(tmp_path):
    harness.sweep([Cell("passkey", 1024, "full", trials=2)], tmp_path / "eval", limit_gb=8,
                  fn=fake_cell)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nwritten by hand\n")
    report.write_results(tmp_path / "eval", results, header="Generated.\n\n")
    first = results.read_text()
    assert first.startswith("# Results\n\nwritten by hand\n") and "Generated." in first
    assert "](eval/passkey.png)" in first  # image links relative to the Markdown file
    results.write_text(first + "\nmore by hand\n")
    report.write_results(tmp_path / "eval", results, header="Generated.\n\n")
    assert results.read_text() == first + "\nmore by hand\n"


def test_cli_eval_reports_a_bad_config_clearly(tmp_path, capsys):
    from experiments.cli.main import main
    path = tmp_path / "grid.toml"
    path.write_text(CONFIG.replace('"passkey"', '"trivia"'))
    assert main(["eval", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "unknown task 'trivia'" in capsys.readouterr().err


def test_cli_bench_runs_only_speed_cells(tmp_path, capsys):
    from experiments.cli.main import main
    path = tmp_path / "grid.toml"
    path.write_text(CONFIG)
    assert main(["bench", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "no `speed` cells" in capsys.readouterr().err


def test_same_numbers_flags_a_changed_score_and_ignores_timings(tmp_path):
    from experiments.eval.same_numbers import differences
    cells = [Cell("passkey", 100, "full", trials=2), Cell("speed", 64, "full", trials=1)]
    for name in ("a", "b"):
        harness.sweep(cells, tmp_path / name, limit_gb=8, fn=fake_cell)
    assert differences(tmp_path / "a", tmp_path / "b") == (1, [])
    rows = grid.read_rows(tmp_path / "b" / "cells.jsonl")
    rows[0]["score"] += 0.5
    _write_rows(tmp_path / "b", rows)
    count, lines = differences(tmp_path / "a", tmp_path / "b")
    assert count == 1 and lines == ["passkey 100 full (kvjax): score differ"]


def test_side_by_side_cells_stay_out_of_the_quality_tables(tmp_path):
    plain = Cell("passkey", 1024, "full", trials=10)
    warm = Cell("passkey", 1024, "full", trials=8, batch=8, warmup=True)
    _write_rows(tmp_path, [_row(plain, score=0.3, scores=[0.3] * 10, depths=[0.1] * 10),
                           _row(warm, score=0.9, outputs=["1"] * 8, seconds_per_trial=1.0)])
    text = report.report(tmp_path)
    assert "| `full` | 0.30 |" in text and "0.90" not in text


def test_a_task_asked_for_two_answer_budgets_gets_a_table_for_each(tmp_path):
    """ruler_long.toml asks niah_single_2 for 128 new tokens in the grid and 32 beside kvpress:
    each budget has its own table and map, neither row hides the other."""
    long = Cell("niah_single_2", 3840, "full", trials=5, max_new_tokens=128)
    short = dataclasses.replace(long, max_new_tokens=32)
    _write_rows(tmp_path, [_row(long, score=0.8, scores=[0.8] * 5),
                           _row(short, score=0.4, scores=[0.4] * 5)])
    text = report.report(tmp_path)
    tables = text.split("#### niah_single_2 (score, 5 trials per cell, ")
    assert [t.split(")")[0] for t in tables[1:]] == ["128 new tokens", "32 new tokens"]
    assert "| `full` | 0.80 |" in tables[1] and "| `full` | 0.40 |" in tables[2]
    assert all((tmp_path / f"niah_single_2_{n}_tokens.png").exists() for n in (128, 32))


def test_untimed_workers_map_large_blocks_and_timed_workers_keep_the_default(monkeypatch):
    """glibc's mmap threshold is fixed at 1 MB in untimed workers (a 4k RULER group held 4 GB
    less), not in timed ones, and not in the parent after the start; a user's value wins."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    untimed = harness.run_in_worker(env_cell, Cell("passkey", 512, "full", trials=1), limit_gb=4)
    timed = harness.run_in_worker(env_cell, Cell("speed", 512, "full", trials=1), limit_gb=4)
    assert (untimed["mmap"], timed["mmap"]) == (str(1 << 20), None)
    assert "MALLOC_MMAP_THRESHOLD_" not in __import__("os").environ
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    mine = harness.run_in_worker(env_cell, Cell("passkey", 512, "full", trials=1), limit_gb=4)
    assert mine["mmap"] == "65536"


def test_the_kvjax_engine_refuses_a_kvpress_cell():
    """The engine is picked by `harness.run_cell`; the kvjax engine never runs another's cell."""
    from experiments.eval.cells import run_kvjax_cell
    with pytest.raises(ValueError, match="engine 'kvjax' cells, not 'kvpress'"):
        run_kvjax_cell(Cell("passkey", 256, "full", trials=1, engine="kvpress"))


# ----------------------------------------------------------------------------- your own text


def _toml(tmp_path, body: str):
    path = tmp_path / "grid.toml"
    path.write_text('model = "smollm2"\ntrials = 2\n' + body)
    return path


def test_text_and_haystack_go_to_the_cells_that_read_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths are relative to the working directory
    (tmp_path / "mine.txt").write_text("Some prose. More prose.\n", encoding="utf-8")
    (tmp_path / "hay.txt").write_text("Hay. More hay.\n", encoding="utf-8")
    g = grid.read_config(_toml(tmp_path, 'text = "mine.txt"\n[[grid]]\n'
                               'tasks = ["ppl", "memory", "passkey", "speed"]\nlengths = [256]\n'
                               'methods = ["full"]\nhaystack = "hay.txt"\n'))
    by_task = {c.task: c for c in g.cells}
    assert by_task["ppl"].text_path == by_task["memory"].text_path == "mine.txt"
    assert by_task["passkey"].haystack_path == "hay.txt" and by_task["passkey"].text_path == ""
    assert by_task["speed"].text_path == by_task["speed"].haystack_path == ""
    assert by_task["ppl"].haystack_path == ""


@pytest.mark.parametrize("content, message", [
    (None, "text = 'mine.txt': no such file"),
    (b"", "text = 'mine.txt': the file is empty"),
    (b"  \n\t\n", "text = 'mine.txt': the file is empty"),
    (b"caf\xe9 latin-1", "text = 'mine.txt': not UTF-8 text"),
])
def test_a_missing_empty_or_non_utf8_text_fails_when_the_config_loads(tmp_path, monkeypatch,
                                                                      content, message):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / "mine.txt").write_bytes(content)
    path = _toml(tmp_path, 'text = "mine.txt"\n[[grid]]\ntasks = ["ppl"]\nlengths = [256]\n'
                           'methods = ["full"]\n')
    with pytest.raises(ValueError, match="grid.toml: " + message.replace("(", r"\(")):
        harness.load_config(path)
    (tmp_path / "hay.txt").write_bytes(b"\xff\xfe")  # the same checks for a haystack
    path = _toml(tmp_path, '[[grid]]\ntasks = ["passkey"]\nlengths = [256]\n'
                           'methods = ["full"]\nhaystack = "hay.txt"\n')
    with pytest.raises(ValueError, match=r"\[\[grid\]\] haystack = 'hay.txt': not UTF-8"):
        harness.load_config(path)


def test_query_aware_cells_are_retrieval_cells_on_kvjax(tmp_path):
    block = '[[grid]]\ntasks = ["{task}"]\nlengths = [256]\nmethods = ["full"]\n' \
            'query_aware = {value}\n{extra}'
    ok = grid.read_config(_toml(tmp_path, block.format(task="passkey", value="true", extra="")))
    assert [c.query_aware for c in ok.cells] == [True]
    for task, value, extra, message in [
            ("ppl", "true", "", "query_aware applies to retrieval tasks, not 'ppl'"),
            ("passkey", "1", "", "query_aware = 1: must be true or false"),
            ("passkey", "true", 'engines = ["kvpress"]\n', "kvjax engine only")]:
        with pytest.raises(ValueError, match=message):
            grid.read_config(_toml(tmp_path, block.format(task=task, value=value, extra=extra)))


# ----------------------------------------------------------------------------- [bases]


BASES = """
[bases.mine]
path = "{path}"
tokens = 2048
text = "{text}"
[[grid]]
tasks = ["ppl"]
lengths = [256]
methods = ["full", "low_rank:rank=8,basis={path}"]
"""


def test_a_declared_basis_is_calibrated_once_before_the_sweep(tmp_path, monkeypatch):
    import types

    import models.calibration
    import models.loading
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calib.txt").write_text("word " * 5000, encoding="utf-8")
    path = _toml(tmp_path, BASES.format(path="b/basis.npz", text="calib.txt"))
    g = harness.load_config(path)  # a missing declared basis is not an error: it will be made
    assert g.bases["mine"] == grid.Basis("b/basis.npz", "calib.txt", 2048, "smollm2")
    calls = []

    class Tokenizer:
        def encode(self, text):
            return list(range(len(text.split())))

    class Basis:
        def save(self, where):
            (tmp_path / where).write_bytes(b"npz")

    monkeypatch.setattr(models.loading, "load_model", lambda name: (types.SimpleNamespace(),
                                                                    Tokenizer()))
    monkeypatch.setattr(models.calibration, "calibrate_low_rank",
                        lambda model, ids, progress: calls.append(ids) or Basis())
    assert harness.prepare_bases(g, [], tmp_path / "out") == []  # no cell needs it yet
    assert harness.prepare_bases(g, g.cells, tmp_path / "out") == ["b/basis.npz"]
    assert calls == [list(range(5000 - 2048, 5000))]  # the last `tokens` tokens of the text
    assert harness.prepare_bases(g, g.cells, tmp_path / "out") == []  # made once


def test_bad_bases_tables_and_undeclared_missing_bases_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calib.txt").write_text("word " * 5000, encoding="utf-8")
    for old, new, message in [("tokens = 2048", "tokens = 10", "tokens = 10: must be an integer"),
                              ('path = "b/basis.npz"', 'path = "b/basis.txt"', "must be a .npz"),
                              ("tokens = 2048", "tokens = 2048\nwindow = 3",
                               "unknown \\[bases.mine\\] key 'window'"),
                              ('text = "calib.txt"', 'text = "none.txt"', "no such file")]:
        body = BASES.format(path="b/basis.npz", text="calib.txt").replace(old, new)
        with pytest.raises(ValueError, match=message):
            harness.load_config(_toml(tmp_path, body))
    undeclared = BASES.format(path="b/basis.npz", text="calib.txt").replace(
        "basis=b/basis.npz", "basis=other.npz")
    with pytest.raises(ValueError, match="method 'low_rank:rank=8,basis=other.npz'"):
        harness.load_config(_toml(tmp_path, undeclared))
