"""Loading a model switches on jax's persistent compilation cache (so a restarted notebook
kernel reuses compiled code), importing `models` does not, a user's own setting is left alone,
and it can be switched off. Each case runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

from pathlib import Path

TINY_HF = Path(__file__).parent / "golden" / "tiny_hf" / "llama_tied"  # weights, no tokenizer
CODE = f"""
import os, jax, models
own = os.environ.get("JAX_COMPILATION_CACHE_DIR")
assert jax.config.jax_compilation_cache_dir == own, "changed by the import"
from models.loading import load_model
try:
    load_model({str(TINY_HF)!r})
except FileNotFoundError:  # no tokenizer.json: the weights were read, the cache switched on
    pass
print(jax.config.jax_compilation_cache_dir)
"""


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
