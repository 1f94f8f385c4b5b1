"""The deeper sweeps of docs/RESULTS.md as `kvjax eval` configs: their rows, bytes arithmetic,
report sections; and the kernel benchmark's smoke mode."""

import json
from pathlib import Path

import pytest

from experiments.eval.cells import theoretical_bytes
from experiments.eval.grid import cell_of, read_config, read_rows
from experiments.eval.harness import load_config
from experiments.eval.report import memory_section, pareto_front, policy_and_ratio, ratio_section

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"
RESULTS = ROOT / "docs" / "results"


@pytest.mark.parametrize("name", ["eviction", "codecs"])
def test_the_config_has_exactly_the_committed_rows(name, monkeypatch):
    """Every cell of the config has its row and every row its cell: rerunning the config
    runs nothing, and nothing in the rows is outside what the config describes."""
    monkeypatch.chdir(ROOT)  # basis paths are relative to the repo root
    grid = load_config(CONFIGS / f"{name}.toml")
    rows = read_rows(RESULTS / name / "cells.jsonl")
    assert all(r["status"] == "ok" for r in rows)
    assert sorted(c.key for c in grid.cells) == sorted(cell_of(r).key for r in rows)


def test_passkey_rows_are_the_sum_of_their_batches():
    rows = [r for name in ("eviction", "codecs") for r in read_rows(RESULTS / name / "cells.jsonl")
            if r["task"] == "passkey"]
    assert len(rows) == 135 + 12
    for r in rows:
        assert sum(b["trials"] for b in r["batches"]) == r["trials"] == 20
        assert sum(b["correct"] for b in r["batches"]) == r["correct"]
        assert r["score"] == r["correct"] / r["trials"]
        if "correct_by_depth" in r:
            assert sum(r["correct_by_depth"].values()) == r["correct"]


def test_the_sliding_window_is_streaming_llm_without_sinks_everywhere():
    """`sliding_window` names a window (tokens) in parse_method; with a ratio the sweeps
    spell it `streaming_llm:sinks=0`, and no row or config uses the name with a ratio."""
    import kvjax
    for name in ("eviction", "codecs", "eval"):
        for r in read_rows(RESULTS / name / "cells.jsonl"):
            assert "sliding_window" not in r["method"]
    for config in CONFIGS.glob("*.toml"):
        for cell in read_config(config).cells:
            assert not cell.method.startswith("sliding_window"), (config, cell.method)
    a, b = kvjax.sliding_window(8), kvjax.parse_method("streaming_llm:sinks=0,budget=8")
    assert a.update == b.update  # the same compiled update: one policy, one meaning


def test_theoretical_bytes_are_the_committed_memory_rows():
    """The formats' arithmetic (now computed from the method spec) gives every memory row's
    `theoretical` column, written by the old label-based formula, exactly."""
    rows = [r for r in read_rows(RESULTS / "codecs" / "cells.jsonl") if r["task"] == "memory"]
    assert len(rows) == 21
    for r in rows:
        assert theoretical_bytes(r["method"], r["length"]) == r["theoretical"], r["method"]


def test_theoretical_bytes_follow_the_formats():
    layers_heads = 30 * 3
    assert theoretical_bytes("full", 4096) == layers_heads * (2 * 64 * 2 + 4)
    assert theoretical_bytes("fp8", 4096) == layers_heads * (2 * 64 + 4)
    assert theoretical_bytes("quantize:bits=4,group=32", 4096) == \
        layers_heads * (2 * (32 + 2 * 2 * 2) + 4)
    # symmetric codes keep one fp16 scale per group instead of scale and offset
    assert theoretical_bytes("quantize:bits=4,group=32,symmetric=true", 4096) == \
        layers_heads * (2 * (32 + 2 * 2) + 4)
    # KIVI-2 at 4096 tokens: 3968 tokens quantized, the newest 128 exact
    kivi = (3968 * (16 + 2 + 8 + 16 + 8 + 4) + 128 * 260) * layers_heads / 4096
    assert abs(theoretical_bytes("kivi:bits=2", 4096) - kivi) < 1e-9
    # eviction keeps floor(n * (1 - r)) tokens, then the codec applies to them
    chain = (1920 * 54 + 128 * 260) * layers_heads / 4096  # 2048 kept, 1920 of them quantized
    assert abs(theoretical_bytes("snapkv:ratio=0.5+kivi:bits=2", 4096) - chain) < 1e-9
    assert theoretical_bytes("h2o:ratio=0.5", 4096) == layers_heads * (260 + 4) / 2  # + mass


def test_pareto_front_keeps_only_undominated_points():
    points = [(100, 5.0, "a"), (50, 6.0, "b"), (60, 7.0, "c"), (200, 4.0, "d"), (150, 4.5, "e")]
    assert pareto_front(points) == ["b", "a", "e", "d"]


def test_policy_and_ratio_name_the_table_rows():
    row = lambda m, qa=False: {"method": m, "query_aware": qa}
    assert policy_and_ratio(row("full")) == ("full", 0.0)
    assert policy_and_ratio(row("streaming_llm:sinks=0,ratio=0.5")) == ("streaming_llm:sinks=0", 0.5)
    assert policy_and_ratio(row("snapkv:ratio=0.9,headwise=true")) == ("snapkv:headwise=true", 0.9)
    assert policy_and_ratio(row("snapkv:ratio=0.25", True)) == ("snapkv (query-aware)", 0.25)
    assert policy_and_ratio(row("snapkv:ratio=0.5+kivi:bits=4")) is None
    assert policy_and_ratio(row("kivi:bits=4")) is None


def _row(task, method, score, length=1024, **extra):
    return dict(task=task, length=length, method=method, trials=20, status="ok", score=score,
                engine="kvjax", warmup=False, **extra)


def test_ratio_section_tables_policies_by_ratio(tmp_path):
    rows = [_row("passkey", "full", 1.0), _row("passkey", "h2o:ratio=0.5", 0.5),
            _row("passkey", "h2o:ratio=0.75", 0.25), _row("passkey", "snapkv:ratio=0.5", 0.1),
            _row("passkey", "snapkv:ratio=0.5", 0.9, query_aware=True),
            _row("passkey", "snapkv:ratio=0.5+kivi:bits=4", 0.0)]  # a chain: not by ratio
    lines = ratio_section(rows, tmp_path, "img/")
    table = [line for line in lines if line.startswith("|")]
    assert table == ["| policy | r=0.5 | r=0.75 |", "|---|---|---|",
                     "| **full cache** | 20/20 | 20/20 |", "| `h2o` | 10/20 | 5/20 |",
                     "| `snapkv` | 2/20 | - |", "| `snapkv (query-aware)` | 18/20 | - |"]
    assert (tmp_path / "ratio_passkey_1024.png").stat().st_size > 0


def test_memory_section_joins_quality_and_marks_the_front(tmp_path):
    rows = [_row("memory", "full", 100.0, 4096, bytes_per_token=100.0, theoretical=100.0),
            _row("memory", "kivi:bits=4", 35.0, 4096, bytes_per_token=35.0, theoretical=34.9),
            _row("memory", "kivi:bits=2", 23.0, 4096, bytes_per_token=23.0, theoretical=23.0),
            _row("ppl", "full", 5.0), _row("ppl", "kivi:bits=4", 5.1),
            _row("ppl", "kivi:bits=2", 6.0), _row("passkey", "kivi:bits=4", 1.0, 2048)]
    lines = memory_section(rows, tmp_path, "")
    assert "| `kivi:bits=4` | 35 | 35 | 0.350 | 5.100 | 20/20 |" in lines
    assert "| `kivi:bits=2` | 23 | 23 | 0.230 | 6.000 | - |" in lines
    front = [line for line in lines if line.startswith("Perplexity Pareto front")]
    assert front == ["Perplexity Pareto front (bytes/token, ppl): `kivi:bits=2` (23, 6.00), "
                     "`kivi:bits=4` (35, 5.10), `full` (100, 5.00)"]


def test_compile_only_bench_compresses_a_filled_cache_to_the_real_prefills_layout(tmp_path):
    """`experiments/bench/compile.py --compile-only` times the programs a cold `generate`
    compiles on a cache filled without the model: after `compress` it must have the real
    prefill's layout (every leaf's shape and dtype, so the decode compiled is the real one) and
    cursors. The script checks that itself (`--check-layout`, the tiny model, two prompts of
    unequal length), here for five methods."""
    import subprocess
    import sys
    methods = ["snapkv:ratio=0.75", "kivi:bits=4,group=16,residual=16",
               "quantize:bits=8,group=16", "pyramidkv:ratio=0.5",
               "snapkv:ratio=0.5+kivi:bits=2,group=16,residual=16"]
    out = tmp_path / "layout.json"
    run = subprocess.run([sys.executable, "-m", "experiments.bench.compile", "--check-layout",
                          "--methods", *methods, "--new-tokens", "16", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    rows = json.loads(out.read_text()) if out.is_file() else run.stderr[-3000:]
    assert run.returncode == 0, rows
    assert [r["method"] for r in rows] == methods
    for r in rows:
        assert r["same_layout"] and r["same_cursors"] and r["same_next_pos"], r
