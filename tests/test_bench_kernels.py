"""experiments/bench/kernels.py --smoke: every code path of the GPU benchmark on tiny shapes in
interpret mode (CPU), and its outputs written; the timings themselves mean nothing here."""

import json

from experiments.bench import kernels as bench_kernels


def test_smoke_runs_every_format_and_jax_kernel(tmp_path):
    rows, copy_bw = bench_kernels.main(["--smoke", "--out", str(tmp_path / "smoke")])
    assert copy_bw > 0
    ours = {r["format"] for r in rows if r["method"] == "kvjax paged"}
    assert ours == set(bench_kernels.FORMATS)
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
    meta = json.loads((tmp_path / "smoke.json").read_text())["meta"]
    assert meta["interpret"] and meta["not_run"] == []
    assert (tmp_path / "smoke.csv").exists() and (tmp_path / "smoke.png").exists()


def test_model_check_rows_on_cpu():
    """experiments/bench/gpu_model_check.py's report on CPU, where impl="pallas" takes the XLA path:
    every token identical, no kernel call in the step, one row per method with its timings."""
    import argparse

    from experiments.bench import gpu_model_check
    args = argparse.Namespace(layers=1, methods=["full", "snapkv:ratio=0.5+kivi:bits=4"],
                              prompt_lengths=[40, 9], new_tokens=3)
    report = gpu_model_check.run(args)
    assert [r["method"] for r in report["rows"]] == args.methods
    for r in report["rows"]:
        assert "error" not in r, r
        assert r["identical_tokens"] == r["tokens"] == 2 * 3
        assert r["first_difference"] == [None, None]
        assert r["pallas_kernel_calls_in_step"] == 0  # CPU: no Pallas kernel
        assert set(r["warm_generate_s"]) == {"xla", "pallas"}
