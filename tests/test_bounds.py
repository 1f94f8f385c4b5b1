"""Bounds on the newer surfaces: the method spec grammar, `launch`, `export`, tiers' page ids.

Every bad value is an error that names the option (or argument), the value and the allowed
range, raised before any work (no model load, no process started).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

import kvjax
from kvjax.memory import tiers


@pytest.mark.parametrize("spec, part", [("snapkv:ratio=0.5+", "part 2 of 2 ('')"),
                                        ("+full", "part 1 of 2 ('')"),
                                        ("full++kivi:bits=4", "part 2 of 3 ('')"),
                                        ("full+ +kivi:bits=4", "part 2 of 3 ('')"),
                                        ("full+:bits=4", "part 2 of 2 (':bits=4')")])
def test_method_spec_rejects_empty_parts(spec, part):
    with pytest.raises(ValueError, match=f"method spec .*: {part.replace('(', '[(]')}"
                                         .replace(")", "[)]") + " has no method name"):
        kvjax.parse_method(spec)
    with pytest.raises(ValueError, match="empty method spec"):
        kvjax.parse_method("+")
    assert kvjax.parse_method("full") is kvjax.parse_method("full")


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "-5"], "--timeout -5.0: must be a finite number of seconds >= 0"),
    (["--timeout", "nan"], "--timeout nan: must be a finite number"),
    (["--timeout", "inf"], "--timeout inf: must be a finite number"),
    (["--port", "99999"], r"--port 99999: must be in \[0, 65535\]"),
    (["--port", "-1"], r"--port -1: must be in \[0, 65535\]"),
    (["--port", "80"], r"--port 80: must be 0 \(a free one\) or in \[1024, 65535\]"),
    (["-n", "0"], r"-n 0: must be an integer in \[1, 256\]"),
    (["-n", "100000"], r"-n 100000: must be an integer in \[1, 256\]"),
    (["--local-devices", "-2"], r"--local-devices -2: must be an integer in \[0, 1024\]"),
])
def test_launch_rejects_out_of_range_options(argv, message, capsys, monkeypatch):
    import subprocess
    from experiments.cli import main as cli

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    assert cli.main(["launch", *argv, "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvjax: error: ")
    assert __import__("re").search(message, err[0]), err[0]


@pytest.mark.parametrize("argv, message", [
    (["--chunk", "0"], "--chunk 0: must be an integer >= 1"),
    (["--max-len", "10", "--chunk", "8"], "--max-len 10: must be >= 2 x --chunk"),
    (["--buckets", "64,9999", "--max-len", "128", "--chunk", "16"],
     r"--buckets 64,9999: each must be in \[--chunk \+ 1 = 17, --max-len = 128\]"),
    (["--buckets", "x"], "--buckets 'x': need comma-separated integers"),
    (["--platforms", "cpu,gameboy"], "--platforms 'cpu,gameboy': must be"),
    (["--platforms", ","], "--platforms ',': must be"),
])
def test_export_rejects_bad_options_before_loading_the_model(argv, message, capsys, tmp_path,
                                                              monkeypatch):
    import models.loading
    from experiments.cli import main as cli

    monkeypatch.setattr(models.loading, "load_model",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["export", "--out", str(tmp_path / "a"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and __import__("re").search(message, err[0]), err


def test_run_exported_rejects_a_missing_folder_and_bad_counts(tmp_path, capsys):
    from experiments.cli import main as cli

    assert cli.main(["run-exported", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no such artifact folder" in capsys.readouterr().err
    assert cli.main(["run-exported", str(tmp_path), "--prompt", "x",
                     "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens 0: must be an integer >= 1" in capsys.readouterr().err


@pytest.fixture
def tiered():
    pool, layers = tiers.init_tiered_cache(device_pages=6, host_pages=4, page_size=4, batch=1,
                                           kv_heads=1, max_pages=8, head_dim=2, num_layers=2)
    pool, layers = kvjax.memory.paging.reserve(pool, layers, jnp.array([10]))
    k = jnp.arange(20.).reshape(1, 1, 10, 2)
    layers = [l.write(k, -k, jnp.arange(10)[None]) for l in layers]
    return pool, layers


@pytest.mark.parametrize("pages, message", [
    ([99], r"spill: pages \[99\] are out of range: the device pages are \[1, 6\)"),
    ([0], r"spill: pages \[0\] are out of range"),  # the null page never moves
    ([6], r"spill: pages \[6\] are out of range"),  # a host page
    ([-7, 1], r"spill: pages \[-7\] are out of range"),
    ([1.0], "spill: pages must be a 1-D array of integer page ids, got float64"),
    ([[1]], "spill: pages must be a 1-D array of integer page ids"),
])
def test_spill_rejects_out_of_range_pages(tiered, pages, message):
    pool, layers = tiered
    with pytest.raises(ValueError, match=message):
        tiers.spill(pool, layers, pages)


def test_restore_and_prefetch_reject_out_of_range_pages(tiered):
    pool, layers = tiered
    pool, layers = tiers.spill(pool, layers, [1, tiers.NO_PAGE])  # NO_PAGE: skipped, fine
    assert tiers.tier_counts(pool, layers[0])["host"] == 1
    with pytest.raises(ValueError, match=r"restore: pages \[2\] are out of range: the host "
                                         r"pages are \[6, 10\)"):
        tiers.restore(pool, layers, [2])
    with pytest.raises(ValueError, match=r"restore: pages \[10\] are out of range"):
        tiers.restore(pool, layers, [10])
    with pytest.raises(ValueError, match=r"prefetch: pages \[10, 11\] are out of range"):
        tiers.prefetch(layers, [6, 10, 11, tiers.NO_PAGE])
    staged = tiers.prefetch(layers, [6, 2, tiers.NO_PAGE, tiers.NO_PAGE])  # a device page: not staged
    assert staged[0].stage_ids.tolist() == [6, -1, -1, -1]
    pool, layers = tiers.restore(pool, layers, [6])
    assert tiers.tier_counts(pool, layers[0])["host"] == 0
