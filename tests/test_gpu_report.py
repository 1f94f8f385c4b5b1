"""`experiments/bench/gpu_report.py`: BENCHMARKS' GPU tables come from the committed JSON rows.
The scripts run through their command lines (tests import no benchmark script)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script(name, *args):
    """`python experiments/bench/NAME.py ARGS` from the repository root."""
    return subprocess.run([sys.executable, f"experiments/bench/{name}.py", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


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
    run = script("gpu_report", path)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout
    assert "driver 580.1, jax 0.11.2" in text and "python experiments/bench/kernels.py" in text
    assert "| llama3-8b | 64 x 32768 | bf16 | 2.0 | 1.6 (ppb=2) | 1.00 |" in text
    assert "| llama3-8b | 64 x 32768 | int4 | 1.0 | 0.8 (warps=4 stages=3) | 0.50 |" in text
    assert "jax.experimental" not in text.split("failed")[0].split("|---|")[-1]  # kvjax rows only
    assert "failed: llama3-8b kvjax paged kivi2: LoweringError: boom" in text


def test_missing_file_and_bad_launch_are_argument_errors(tmp_path):
    run = script("gpu_report", tmp_path / "none.json")
    assert run.returncode == 2 and "no such file" in run.stderr
    # `--launch` is parsed before anything runs: 0 or WARPSxSTAGES, warps 1-16 (powers of 2),
    # stages 1-8; the good values before the bad one pass
    for bad, why in (("3x2", "warps must be"), ("x", "takes 0 or WARPSxSTAGES")):
        run = script("kernels", "--smoke", "--launch", "0", "4x3", bad)
        assert run.returncode == 2 and why in run.stderr and "'4x3'" not in run.stderr, run.stderr


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
