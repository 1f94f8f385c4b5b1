"""Models by Hugging Face repo id: resolved through huggingface_hub's shared cache, offline, with
revision pinning; clear errors for an uncached repo, an unknown revision and a bad id. The cache
is built by hand in tmp_path from the repo's tiny checkpoints (the hub layout: refs/ and
snapshots/<commit>/), and each case runs in a fresh process with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from models.hub import is_repo_id

TINY = Path(__file__).parent / "golden" / "tiny_hf"
COMMITS = {"llama_tied": "a" * 40, "qwen2_tied": "b" * 40}

LOAD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from models.loading import load_hf_dir, load_weights, resolve_model_path
    try:
        path = resolve_model_path(sys.argv[1])
    except (FileNotFoundError, ValueError) as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        raise SystemExit
    cfg, params = load_weights(sys.argv[1])
    want_cfg, want = load_hf_dir(sys.argv[2])
    same = cfg == want_cfg and params.keys() == want.keys() and all(
        np.array_equal(params[k], want[k]) for k in want)
    print(json.dumps({"path": str(path), "same": same}))
""")


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """models--org--tiny with 'main' -> llama_tied and tag 'v2' -> qwen2_tied."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--org--tiny"
    for name, commit in COMMITS.items():
        shutil.copytree(TINY / name, repo / "snapshots" / commit,
                        ignore=shutil.ignore_patterns("logits.npz"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS["llama_tied"])
    (repo / "refs" / "v2").write_text(COMMITS["qwen2_tied"])
    return root


def load(spec: str, hub_cache: Path, reference: str = "llama_tied") -> dict:
    env = dict(os.environ, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", LOAD, spec, str(TINY / reference)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_repo_ids_are_told_apart_from_paths():
    assert is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_repo_id("org/name@v1.0") and is_repo_id(f"org/name@{'a' * 40}")
    assert not is_repo_id("smollm2") and not is_repo_id("a/b/c") and not is_repo_id("x.gguf")


def test_offline_from_the_shared_cache_with_revisions(hub_cache):
    main = load("org/tiny", hub_cache)
    assert main["same"] and main["path"].endswith(COMMITS["llama_tied"])
    tag = load("org/tiny@v2", hub_cache, reference="qwen2_tied")
    assert tag["same"] and tag["path"].endswith(COMMITS["qwen2_tied"])
    pinned = load(f"org/tiny@{COMMITS['qwen2_tied']}", hub_cache, reference="qwen2_tied")
    assert pinned["same"]


def test_uncached_repo_or_revision_is_a_clear_error(hub_cache):
    missing = load("org/absent", hub_cache)
    assert missing["error"] == "FileNotFoundError"
    assert "'org/absent' is not in the Hugging Face cache" in missing["message"]
    assert "HF_HUB_OFFLINE is set" in missing["message"]
    revision = load("org/tiny@v9", hub_cache)
    assert revision["error"] == "FileNotFoundError" and "org/tiny@v9" in revision["message"]
