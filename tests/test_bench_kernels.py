"""experiments/bench/kernels.py --smoke: every code path of the GPU benchmark on tiny shapes in
interpret mode (CPU), and its outputs written; the timings themselves mean nothing here. Both
GPU scripts run through their command lines (tests import no benchmark script)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = {"bf16", "fp8", "int8", "int4", "kivi4", "kivi2"}  # every page format it times


def bench(name, *args):
    """`python -m experiments.bench.NAME ARGS` from the repository root."""
    return subprocess.run([sys.executable, "-m", f"experiments.bench.{name}", *map(str, args)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_smoke_runs_every_format_and_jax_kernel(tmp_path):
    run = bench("kernels", "--smoke", "--out", tmp_path / "smoke")
    assert run.returncode == 0, run.stderr[-3000:]
    written = json.loads((tmp_path / "smoke.json").read_text())
    rows, meta = written["rows"], written["meta"]
    assert meta["copy_gbs"] > 0
    ours = {r["format"] for r in rows if r["method"] == "kvjax paged"}
    assert ours == FORMATS
    others = {r["method"]: r for r in rows if r["method"] != "kvjax paged"}
    # jax's own GPU paged attention, kvjax's Mosaic GPU kernel and the XLA path on the same
    # bf16 pages agree with kvjax's (Triton) output
    assert set(others) == {"jax.experimental gpu paged_attention", "kvjax xla (contiguous)",
                           "kvjax mosaic"}
    for r in others.values():
        assert r["max_diff_vs_kvjax"] < 0.05, r
    for r in rows:
        assert r["error"] is None, r  # a method that fails is a row with its error, not a crash
        assert r["ms"] > 0 and r["bytes"] > 0 and r["of_copy"] > 0
    by = {r["format"]: r["bytes"] for r in rows if r["method"] == "kvjax paged"}
    assert by["int4"] < by["int8"] < by["bf16"] and by["fp8"] < by["bf16"]
    assert meta["interpret"] and meta["not_run"] == []
    assert (tmp_path / "smoke.csv").exists() and (tmp_path / "smoke.png").exists()


def test_model_check_rows_on_cpu(tmp_path):
    """experiments/bench/gpu_model_check.py's report on CPU (`--smoke`), where impl="pallas"
    takes the XLA path: every token identical, no kernel call in the step, one row per method
    with its timings."""
    methods = ["full", "snapkv:ratio=0.5+kivi:bits=4"]
    out = tmp_path / "model_check.json"
    run = bench("gpu_model_check", "--smoke", "--layers", 1, "--methods", *methods,
                "--prompt-lengths", 40, 9, "--new-tokens", 3, "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["rows"]] == methods
    for r in report["rows"]:
        assert "error" not in r, r
        assert r["identical_tokens"] == r["tokens"] == 2 * 3
        assert r["first_difference"] == [None, None]
        assert r["pallas_kernel_calls_in_step"] == 0  # CPU: no Pallas kernel
        assert set(r["warm_generate_s"]) == {"xla", "pallas"}
