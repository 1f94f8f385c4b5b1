"""The bookkeeping of the results sweeps: batch rows merge into cells, resume, Pareto front."""

from experiments.codec_results import METHODS, pareto_front, theoretical_bytes
from experiments.eviction_results import is_done, whole_cells


def row(policy, ratio, first, correct, depth):
    return {"length": 4096, "policy": policy, "ratio": ratio, "first": first, "trials": 10,
            "correct": correct, "by_depth": {depth: correct}}


def test_batch_rows_merge_into_whole_cells():
    rows = [row("snapkv", 0.5, 0, 3, "0.1"), row("snapkv", 0.5, 10, 4, "0.3"),
            row("h2o", 0.5, 0, 1, "0.1")]
    cells = {(r["policy"], r["ratio"]): r for r in whole_cells(rows)}
    assert cells[("snapkv", 0.5)]["trials"] == 20 and cells[("snapkv", 0.5)]["correct"] == 7
    assert cells[("snapkv", 0.5)]["accuracy"] == 0.35
    assert cells[("snapkv", 0.5)]["by_depth"] == {"0.1": 3, "0.3": 4}
    assert cells[("h2o", 0.5)]["trials"] == 10 and "first" not in cells[("h2o", 0.5)]
    assert rows[0]["trials"] == 10  # the input rows are not modified


def test_a_finished_batch_or_whole_cell_is_not_rerun():
    done = {(4096, "snapkv", 0.5, 0), (2048, "h2o", 0.25, "all")}
    assert is_done(done, 4096, ("snapkv", 0.5), 0)
    assert not is_done(done, 4096, ("snapkv", 0.5), 10)
    assert is_done(done, 2048, ("h2o", 0.25), 10)  # a whole-cell row covers every batch


def test_pareto_front_keeps_only_undominated_points():
    points = [(100, 5.0, "a"), (50, 6.0, "b"), (60, 7.0, "c"), (200, 4.0, "d"), (150, 4.5, "e")]
    assert [n for _, _, n in pareto_front(points)] == ["b", "a", "e", "d"]


def test_theoretical_bytes_follow_the_formats():
    layers_heads = 30 * 3
    assert theoretical_bytes("full", 4096) == layers_heads * (2 * 64 * 2 + 4)
    assert theoretical_bytes("fp8-e4m3", 4096) == layers_heads * (2 * 64 + 4)
    assert theoretical_bytes("int4", 4096) == layers_heads * (2 * (32 + 2 * 2 * 2) + 4)
    # KIVI-2 at 4096 tokens: 3968 tokens quantized, the newest 128 exact
    kivi = (3968 * (16 + 2 + 8 + 16 + 8 + 4) + 128 * 260) * layers_heads / 4096
    assert abs(theoretical_bytes("kivi-2", 4096) - kivi) < 1e-9
    # eviction keeps floor(n * (1 - r)) tokens, then the codec applies to them
    chain = (1920 * 54 + 128 * 260) * layers_heads / 4096  # 2048 kept, 1920 of them quantized
    assert abs(theoretical_bytes("snapkv-0.5+kivi-2", 4096) - chain) < 1e-9
    assert set(METHODS) >= {"full", "kivi-2", "kivi-4", "int8", "int4", "int2", "fp8-e4m3"}


def test_codec_passkey_batches_merge_by_method():
    from experiments.codec_results import passkey_cells
    rows = [{"method": "kivi-2", "length": 2048, "first": 0, "trials": 10, "correct": 1},
            {"method": "kivi-2", "length": 2048, "first": 10, "trials": 10, "correct": 2},
            {"method": "kivi-2", "length": 1024, "first": 0, "trials": 10, "correct": 9}]
    assert passkey_cells(rows, 2048) == {"kivi-2": {"trials": 20, "correct": 3, "accuracy": 0.15}}


def test_kernel_benchmark_runs_in_smoke_mode(tmp_path):
    """bench_kernels.py on CPU: tiny shapes in interpret mode; every method times something."""
    from experiments.bench_kernels import main
    rows = main(["--smoke", "--out", str(tmp_path / "b")])
    methods = [r["method"] for r in rows]
    assert methods == ["kvjax paged bf16", "kvjax paged int8", "kvjax paged int4",
                       "kvjax xla (contiguous)"]
    assert all(r["ms"] > 0 and r["bytes"] > 0 for r in rows)
    by = {r["method"]: r["bytes"] for r in rows}
    assert by["kvjax paged int4"] < by["kvjax paged int8"] < by["kvjax paged bf16"]
    assert not list(tmp_path.iterdir())  # smoke runs write no results
