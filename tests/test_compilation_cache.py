"""The library switches on jax's persistent compilation cache when `models` is imported (so a
restarted notebook kernel reuses compiled code), leaves a user's own setting alone, and can be
switched off. Each case runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = "import jax, models; print(jax.config.jax_compilation_cache_dir)"


def cache_dir_after_import(tmp_path, **env) -> str:
    base = {k: v for k, v in os.environ.items()  # the suite's own settings (conftest.py) out
            if not k.endswith("COMPILATION_CACHE") and not k.startswith(("JAX_COMPILATION_CACHE",
                                                                         "JAX_PERSISTENT_CACHE"))}
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=120, env=dict(base, KVJAX_CACHE=str(tmp_path),
                                                JAX_PLATFORMS="cpu", **env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_on_by_default_in_the_kvjax_cache(tmp_path):
    assert cache_dir_after_import(tmp_path) == str(tmp_path / "jit")


def test_opt_out_and_a_users_own_folder(tmp_path):
    assert cache_dir_after_import(tmp_path, KVJAX_COMPILATION_CACHE="0") == "None"
    own = str(tmp_path / "mine")
    assert cache_dir_after_import(tmp_path, JAX_COMPILATION_CACHE_DIR=own) == own
