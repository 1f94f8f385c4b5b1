"""An exported SmolLM2 artifact generates the live model's tokens, in a process without Flax.

One artifact per method is exported once for the module (`full`, and
`snapkv:ratio=0.5+kivi:bits=4`); a fresh Python subprocess that imports only `kvjax.tools.exported`
(it asserts that neither `flax` nor `models` was imported) generates greedily for batches of
1, 3 and 8 real-text prompts from each, and the tokens must equal the live model's
`models.sampler.generate` with the same method and prefill chunk, element for element.

The prompts are slices of The Devil's Dictionary: 65-120 tokens for `full` (two prefill
chunks of 64), 330-400 tokens for SnapKV + KIVI-4, so that SnapKV keeps more than KIVI's
128 exact tokens plus a group and quantized keys really reach the decode (the subprocess
reports each batch's quantized token count, which must be positive). The compressed cache
is decoded in a smaller capacity bucket (256) than the one it was prefilled in (512).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvjax
from models.export import export_artifact
from models.sampler import generate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "experiments" / "data" / "devils_dictionary.txt"
METHODS = {"full": dict(buckets=(256,), lengths=(65, 120)),
           "snapkv:ratio=0.5+kivi:bits=4": dict(buckets=(256, 512), lengths=(330, 400))}
BATCHES = (1, 3, 8)
NEW = 4
CHUNK = 64

RUNNER = r"""
import json, sys
from kvjax.tools import exported
jobs = json.loads(sys.stdin.read())
out = []
for job in jobs:
    decoder = exported.load(job["artifact"])
    g = decoder.generate(job["prompts"], max_new_tokens=job["new"])
    body = [int(layer.body.length) for layer in g.cache if hasattr(layer, "body")]
    out.append({"tokens": g.tokens.tolist(), "num": g.num_tokens.tolist(),
                "texts": g.texts, "buckets": [g.prefill_bucket, g.decode_bucket],
                "quantized": min(body) if body else 0})
assert "flax" not in sys.modules and "models" not in sys.modules, sorted(
    m for m in sys.modules if m.split(".")[0] in ("flax", "models"))
print(json.dumps(out))
"""


def prompts_for(tokenizer, lengths: tuple[int, int], batch: int) -> list[list[int]]:
    """`batch` slices of real text, lengths spread over `lengths` (inclusive)."""
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8")[:40_000])
    sizes = np.linspace(*lengths, batch).astype(int) if batch > 1 else [lengths[1]]
    return [ids[500 * i: 500 * i + int(n)] for i, n in enumerate(sizes)]


@pytest.fixture(scope="module")
def artifacts(smollm2, tmp_path_factory):
    model, tokenizer = smollm2
    return {method: export_artifact(model, tokenizer, tmp_path_factory.mktemp("artifact"),
                                    method=method, chunk=CHUNK, max_len=max(o["buckets"]),
                                    buckets=o["buckets"], source="smollm2")
            for method, o in METHODS.items()}


@pytest.fixture(scope="module")
def runs(smollm2, artifacts):
    """(jobs, results of the subprocess): every method x batch size, one fresh process."""
    _, tokenizer = smollm2
    jobs = [{"method": m, "artifact": str(artifacts[m]), "new": NEW,
             "prompts": prompts_for(tokenizer, METHODS[m]["lengths"], b)}
            for m in METHODS for b in BATCHES]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(jobs), env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return jobs, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", list(METHODS))
def test_artifact_tokens_equal_the_live_model_for_batches_1_3_8(smollm2, runs, method):
    model, tokenizer = smollm2
    jobs, results = runs
    for job, got in zip(jobs, results):
        if job["method"] != method:
            continue
        live = generate(model, job["prompts"], max_new_tokens=NEW, chunk=CHUNK,
                        transform=kvjax.parse_method(method))
        np.testing.assert_array_equal(np.asarray(got["tokens"]), live.tokens,
                                      err_msg=f"{method}, batch {len(job['prompts'])}")
        np.testing.assert_array_equal(got["num"], live.num_tokens)
        assert got["texts"] == [tokenizer.decode(row[:n])
                                for row, n in zip(live.tokens, live.num_tokens)]
        if method == "full":
            assert got["buckets"] == [256, 256] and got["quantized"] == 0
        else:  # prefilled in 512 slots, decoded from the compressed cache in 256
            assert got["buckets"] == [512, 256] and got["quantized"] > 0


def test_artifact_manifest_and_files(artifacts):
    path = artifacts["snapkv:ratio=0.5+kivi:bits=4"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["method"] == "snapkv:ratio=0.5+kivi:bits=4"
    assert manifest["model"]["num_layers"] == 30 and manifest["cache_spec"]["kv_heads"] == 3
    assert manifest["buckets"] == [256, 512] and manifest["platforms"] == ["cpu"]
    assert manifest["stats"]["window"] == 64  # SnapKV's query window, collected in prefill
    assert set(manifest["functions"]["512"]) == {"prefill", "compress", "decode"}
    assert all((path / f).is_file() for fns in manifest["functions"].values()
               for f in fns.values())
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    # the prefill's batch is symbolic: one module serves every batch size
    assert any("b" in shape for shape in manifest["shapes"]["512"]["prefill"]["in"])


def test_run_exported_command_matches_the_live_model(smollm2, artifacts):
    """`kvjax run-exported DIR --prompt ... --chat`: the chat template rendered by the
    artifact's tokenizer, and the same tokens as the live model with the same method."""
    model, tokenizer = smollm2
    method = "snapkv:ratio=0.5+kivi:bits=4"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "experiments.cli.main", "run-exported", str(artifacts[method]),
         "--prompt", "What is a cynic?", "--chat", "--max-new-tokens", "3", "--json"],
        env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is a cynic?"}])
    live = generate(model, [ids], max_new_tokens=3, chunk=CHUNK,
                    transform=kvjax.parse_method(method))
    assert result["tokens"] == [live.tokens[0, :live.num_tokens[0]].tolist()]
    assert result["texts"] == [tokenizer.decode(result["tokens"][0])]
    assert result["method"] == method and result["prefill_bucket"] == 256
