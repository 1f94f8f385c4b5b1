"""kvpress's kept positions on the tiny Qwen3 and Gemma 3 checkpoints equal kvjax's.

Golden: ``tests/golden/families_kvpress.npz`` (``experiments/golden/make_families_kvpress.py``:
kvpress's SnapKV and Knorm at ratio 0.5 on the 272 golden ids of
``tests/golden/families/{qwen3,gemma3}``). kvjax prefills the same ids collecting the
statistics, then compresses with `models.sampler.for_full_layers` as `generate` does: every
layer of Qwen3, Gemma 3's global layer only (kvpress skips Gemma 3's sliding layers too, for
the multimodal class; for `Gemma3ForCausalLM` it compresses them as well, and those rows are
not compared). Qwen3's queries go through its q norm before the statistics, as in kvpress.

Gemma 3's scale: kvpress's SnapKV scores the window's attention with `1 / sqrt(head_dim)`,
not the model's `query_pre_attn_scalar ** -0.5` (24 ** -0.5 here, head_dim 32; the released
1B/4B/12B have both 256, the 27B 168 and 128). kvjax scores with the attention the model
computes. With the window's queries rescaled to kvpress's convention kvjax keeps exactly
kvpress's positions; with the model's own scale 3 of the 136 kept positions differ.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvjax
from models.loading import build_model, load_hf_dir
from models.sampler import _compress, for_full_layers, prefill_and_compress
from tests.test_kvpress_parity import keep_by_position

GOLDEN = Path(__file__).parent / "golden"
STATS = kvjax.StatsSpec(window=64)
POLICIES = {"snapkv": kvjax.snapkv, "knorm": kvjax.knorm}
CASES = [(m, p) for m in ("qwen3", "gemma3") for p in POLICIES]


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN / "families_kvpress.npz")


@pytest.mark.parametrize("model_name, press", CASES)
def test_kept_positions_equal_kvpress(golden, model_name, press):
    model = build_model(*load_hf_dir(GOLDEN / "families" / model_name))
    ids = golden[f"{model_name}_ids"].tolist()
    probe = kvjax.CacheTransform(lambda cache: (), lambda c, s, st=None: (c, s), STATS)
    pre = prefill_and_compress(model, [ids], transform=probe, shrink=False)
    transform = for_full_layers(model, POLICIES[press](ratio=0.5))
    stats = pre.stats
    cfg = model.config
    if cfg.query_scale is not None:  # kvpress's 1 / sqrt(head_dim) (see the module docstring)
        to_kvpress = 1.0 / (cfg.query_scale * cfg.head_dim ** 0.5)
        stats = tuple(s._replace(queries=s.queries * to_kvpress) for s in stats)
        own, _ = _compress(transform.update, pre.cache, transform.init(pre.cache), pre.stats)
        swapped = (keep_by_position(own, len(ids))[1]
                   != golden[f"{model_name}_{press}_r0.50_keep"][1]).sum() // 2
        assert swapped == (3 if press == "snapkv" else 0)  # knorm reads no queries
    out, _ = _compress(transform.update, pre.cache, transform.init(pre.cache), stats)
    theirs = golden[f"{model_name}_{press}_r0.50_keep"]  # [L, KVH, T]
    kept, compared = keep_by_position(out, len(ids)), 0
    for i, window in enumerate(model.config.layer_windows):
        if window is not None:  # kvjax leaves a sliding layer's window cache as it is
            assert np.asarray(out[i].pos).shape[-1] == window
            continue
        np.testing.assert_array_equal(kept[i], theirs[i],
                                      err_msg=f"{model_name} {press} layer {i}")
        compared += 1
    assert compared == (2 if model_name == "qwen3" else 1)
