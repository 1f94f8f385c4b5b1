"""`experiments/bench/gpu_report.py`: BENCHMARKS' GPU tables come from the committed JSON rows."""

import json

import pytest

from experiments.bench import kernels as bench_kernels

from experiments.bench import gpu_report


def _row(method, fmt, ms, gbs=1000.0):
    return dict(shape="llama3-8b", method=method, format=fmt, batch=64, context=32768,
                page_size=64, ms=ms, bytes=int(gbs * (ms or 1) * 1e6), gbs=gbs,
                of_copy=gbs / 4000, max_diff_vs_kvjax=None, error=None)


def test_table_rows_name_the_fastest_variant_and_the_ratio_to_bf16(tmp_path):
    rows = [_row("kvjax paged", "bf16", 2.0), _row("kvjax paged ppb=2", "bf16", 1.6),
            _row("kvjax paged", "int4", 1.0), _row("kvjax paged warps=4 stages=3", "int4", 0.8),
            _row("jax.experimental gpu paged_attention", "bf16", 3.8),
            dict(_row("kvjax paged", "kivi2", None), error="LoweringError: boom")]
    meta = dict(device="cuda:0", driver="580.1", jax="0.11.2", copy_gbs=4000.0,
                command="python experiments/bench/kernels.py", date="2026-12-04")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    text = gpu_report.main([str(path)])
    assert "driver 580.1, jax 0.11.2" in text and "python experiments/bench/kernels.py" in text
    assert "| llama3-8b | 64 x 32768 | bf16 | 2.0 | 1.6 (ppb=2) | 1.00 |" in text
    assert "| llama3-8b | 64 x 32768 | int4 | 1.0 | 0.8 (warps=4 stages=3) | 0.50 |" in text
    assert "jax.experimental" not in text.split("failed")[0].split("|---|")[-1]  # kvjax rows only
    assert "failed: llama3-8b kvjax paged kivi2: LoweringError: boom" in text


def test_missing_file_and_bad_launch_are_argument_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_report.main([str(tmp_path / "none.json")])
    assert "no such file" in capsys.readouterr().err
    assert bench_kernels.launch_arg("0") is None
    assert bench_kernels.launch_arg("4x3") == (4, 3)
    for bad in ("4", "3x2", "4x0", "x"):
        with pytest.raises(Exception, match="--launch"):
            bench_kernels.launch_arg(bad)


def test_the_kernel_refuses_a_malformed_launch():
    import jax.numpy as jnp
    from kernels_pallas.paged_attention import paged_attention
    q = jnp.zeros((1, 1, 2, 16), jnp.float32)
    k = jnp.zeros((2, 16, 16), jnp.float32)
    pos = jnp.zeros((2, 1, 16), jnp.int32)
    tables, counts = jnp.zeros((1, 1, 2), jnp.int32), jnp.ones((1, 1), jnp.int32)
    for bad, backend in (((4,), "gpu"), ((4, 0), "gpu"), ((4, 2), "tpu")):
        with pytest.raises(ValueError, match="launch must be"):
            paged_attention(q, jnp.zeros((1, 1), jnp.int32), k, k, pos, tables, counts,
                            backend=backend, interpret=True, launch=bad)
