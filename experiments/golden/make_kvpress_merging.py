"""Goldens for MergingPress: ``python experiments/golden/make_kvpress_merging.py``.

What it makes
-------------
``tests/golden/kvpress_merging.npz``, made by running kvpress 0.5.5 (never
kvjax) on the real SmolLM2-135M-Instruct in float32, the same GGUF,
transformers model, sdpa attention and the same two passages as
``kvpress_zoo.npz`` (640 and 300 tokens of The Devil's Dictionary), batch 1,
one prefill forward with ``with press(model):`` per case:
``MergingPress(press=SnapKVPress(compression_ratio=r))`` at kvpress's defaults
(similarity_threshold 0, merge_fraction 1), r in 0.5, 0.75. Key prefix
``ctx{c}_merging_snapkv_r{r:.2f}``:

* ``..._keep``: packbits of the bool [L, KVH, T] keep mask, read off the cache
  kvpress returned (every kept key row matched bit for bit to its input row:
  MergingPress never changes keys, so this also checks that).
* ``..._values_l{layer}`` float32 [KVH, n_kept, D] for layers ``VALUE_LAYERS``:
  the merged values kvpress left, in position order (kvpress stores them in
  ``topk`` order; kvjax compacts in position order).
* ``..._merged`` int16 [L, KVH]: how many kept values received a merge.

The merge alone, on identical inputs (for a float32-tolerance comparison free of
the two prefills' rounding): ``ctx2_l{MERGE_LAYER}_keys`` / ``_values`` float32
[KVH, T, D], the keys and values kvpress's press received in that layer, and
``ctx2_merging_snapkv_r{r}_t{t:.2f}_f{f:.2f}_merge`` float32 [KVH, n_kept, D]:
``MergingPress(SnapKVPress(r), similarity_threshold=t, merge_fraction=f).merge``
of those inputs at the kept positions of the ``..._keep`` mask, in position
order, for the (t, f) in ``MERGE_ARGS`` (the defaults and three gated settings; at
(0.8, 0.5) the quantile falls among the tokens the threshold failed, which kvpress
counts as -inf).

How to run (the ``compare`` extra; about 2 minutes on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_merging.py [--gguf PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden
from experiments.golden.make_kvpress import (ATTN, CONTEXTS, PASSAGE_CHARS, REPO_ROOT, SEED,
                                             TEXT_PATH)
from experiments.golden.make_kvpress_zoo import kept_from_cache, provenance

MERGING_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_merging.npz"
RATIOS = (0.5, 0.75)
VALUE_LAYERS = (0, 29)
MERGE_LAYER, MERGE_CTX = 14, 2
MERGE_ARGS = ((0.0, 1.0), (0.8, 1.0), (0.0, 0.75), (0.8, 0.5))


def by_position(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """[KVH, n_kept, D] rows of `x` in topk order `idx` [KVH, n_kept] -> in position order."""
    return np.take_along_axis(x, np.argsort(idx, axis=-1)[..., None], axis=1)


def run_merging(model, torch, ids: np.ndarray, ratio: float, n_layers: int, kvh: int,
                merge_inputs: dict | None) -> dict[str, np.ndarray]:
    """One prefill under MergingPress(SnapKVPress(ratio)) -> the arrays this case stores."""
    import kvpress
    from transformers import DynamicCache

    press = kvpress.MergingPress(press=kvpress.SnapKVPress(compression_ratio=ratio))
    t = len(ids)
    keep = np.zeros((n_layers, kvh, t), bool)
    merged = np.zeros((n_layers, kvh), np.int16)
    out: dict[str, np.ndarray] = {}
    orig_compress, orig_merge = press.compress, press.merge
    seen = {}

    def merge(keys, values, indices):
        seen["indices"] = indices.clone()
        return orig_merge(keys, values, indices)

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        original_k, original_v = keys.clone(), values.clone()
        new_k, new_v = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        keep[layer] = kept_from_cache(original_k, new_k)
        idx = seen.pop("indices")[0].numpy()  # [KVH, n_kept] topk order = new_v's row order
        kept = np.zeros((kvh, t), bool)
        np.put_along_axis(kept, idx, True, axis=-1)
        assert (kept == keep[layer]).all(), f"layer {layer}: merge indices and cache disagree"
        before = np.take_along_axis(original_v[0].numpy(), idx[..., None], axis=1)
        merged[layer] = (before != new_v[0].numpy()).any(-1).sum(-1)
        if layer in VALUE_LAYERS:
            out[f"values_l{layer}"] = by_position(new_v[0].numpy(), idx)
        if merge_inputs is not None and layer == MERGE_LAYER:
            merge_inputs.update(keys=original_k, values=original_v, indices=idx)
        return new_k, new_v

    press.merge, press.compress = merge, compress
    inp = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad(), press(model):
        model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
    out.update(keep=keep, merged=merged)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(MERGING_OUT), help=f"output .npz (default {MERGING_OUT})")
    args = ap.parse_args(argv)
    import torch

    import kvpress

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    out: dict[str, np.ndarray] = {}
    full = TEXT_PATH.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    for c, (offset, n) in CONTEXTS.items():
        start = full.index("\n\n", offset) + 2
        text = full[start: start + PASSAGE_CHARS]
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n], np.int32)
        out[f"ctx{c}_ids"] = ids
        for ratio in RATIOS:
            t1 = time.perf_counter()
            torch.manual_seed(SEED)
            inputs = {} if c == MERGE_CTX else None
            arrays = run_merging(model, torch, ids, ratio, n_layers, kvh, inputs)
            prefix = f"ctx{c}_merging_snapkv_r{ratio:.2f}"
            kept_rows = arrays["keep"].sum(-1)
            out[f"{prefix}_keep"] = np.packbits(arrays.pop("keep").ravel())
            for key, value in arrays.items():
                out[f"{prefix}_{key}"] = value
            if inputs:
                out[f"ctx{c}_l{MERGE_LAYER}_keys"] = inputs["keys"][0].numpy()
                out[f"ctx{c}_l{MERGE_LAYER}_values"] = inputs["values"][0].numpy()
                idx = torch.from_numpy(inputs["indices"])[None]
                for thr, frac in MERGE_ARGS:
                    p = kvpress.MergingPress(press=kvpress.SnapKVPress(compression_ratio=ratio),
                                             similarity_threshold=thr, merge_fraction=frac)
                    _, v = p.merge(inputs["keys"], inputs["values"], idx)
                    kept = v[0].numpy()[np.arange(kvh)[:, None], inputs["indices"]]
                    out[f"{prefix}_t{thr:.2f}_f{frac:.2f}_merge"] = by_position(
                        kept, inputs["indices"])
            print(f"{prefix}: kept/row {kept_rows.min()}-{kept_rows.max()} of {len(ids)}, merged "
                  f"into {arrays['merged'].min()}-{arrays['merged'].max()} kept values per row "
                  f"({time.perf_counter() - t1:.1f}s)", flush=True)
    timings["presses"] = time.perf_counter() - t0
    out.update(provenance(info, n_layers, kvh))
    out["head_dim"] = np.int32(head_dim)
    out["value_layers"] = np.asarray(VALUE_LAYERS, np.int32)
    out["merge_layer"] = np.int32(MERGE_LAYER)
    out["merge_args"] = np.asarray(MERGE_ARGS, np.float64)
    save_golden(args.out, out, timings, max_bytes=2 * 1024 * 1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
