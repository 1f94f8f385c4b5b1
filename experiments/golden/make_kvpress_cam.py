"""Goldens for CAMPress: ``python experiments/golden/make_kvpress_cam.py``.

What it makes
-------------
``tests/golden/kvpress_cam.npz``, made by running kvpress 0.5.5 (never kvjax) on the real
SmolLM2-135M-Instruct in float32, the same GGUF, transformers model, sdpa attention and the
same two passages as ``kvpress_zoo.npz`` (640 and 300 tokens of The Devil's Dictionary),
batch 1. CAMPress is a decoding press: per passage of T ids the first ``T - NEW`` are
prefilled in one forward (CAMPress leaves the prefill alone), then the last ``NEW`` = 16 ids
are fed one per forward (teacher forcing, position ids as kvpress's pipeline passes them),
with ``CAMPress(KnormPress(), compression_interval=8, target_size=K)`` active
(merge_budget 32, kvpress's default), ``K = int((T - NEW) * (1 - r))`` for r in 0.5, 0.75. So
every layer compresses twice: after forward 8 (the prefill's tokens plus 8, down to K: more
evicted tokens than merge candidates) and after forward 16 (K + 8 down to K: every evicted
token a candidate).

kvpress draws its merge mask with ``torch.bernoulli(p)``; here that call is replaced by
``u < p`` with ``u = torch.rand`` (seeded): the same distribution, and ``u`` is stored, so
that kvjax's merge can be given kvpress's draw. Key prefix ``ctx{c}_cam_r{r:.2f}``, per
compression ``j`` in 0, 1:

* ``..._c{j}_keep``: packbits of the bool [L, T] mask of the absolute positions kept (CAMPress
  keeps the same positions in every KV head: the knorm scores are averaged over KV heads),
  read off ``searchsorted``'s first argument and checked against the keys the cache holds
  after (kept rows are the input rows bit for bit);
* ``..._c{j}_merge`` int32 [L, 8]: the absolute positions of the merge candidates;
* ``..._c{j}_prob`` / ``..._c{j}_u`` float32 [L, KVH, 8]: the merge probability
  ``clamp(A_i / mean A_window, 0, 1)`` and the uniform draw (merge where ``u < p``);
* ``..._c{j}_margin`` float32 [L]: the smallest kept minus the largest evicted mean score (a
  near-tie where tiny).

End to end values (``ctx2`` at r = 0.75): ``..._c0_values_l{layer}`` float32 [KVH, K, D], the
values kvpress's cache holds after the first compression, layers ``VALUE_LAYERS``.

The merge alone on kvpress's own inputs (``ctx2``, r = 0.75, layer ``MERGE_LAYER``, the second
compression): ``..._c1_l{layer}_in_values`` float32 [KVH, K + 8, D], ``..._in_attn`` float32
[KVH, K + 8] (the running attention sum), ``..._in_scores`` float32 [K + 8] (KnormPress's
scores averaged over KV heads, as CAMPress averages them), ``..._in_pos`` int32 [K + 8] (the
slots' absolute positions) and ``..._out_values`` float32 [KVH, K, D].

How to run (the ``compare`` extra; about a minute on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_cam.py [--gguf PATH] [--out PATH]
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

CAM_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_cam.npz"
RATIOS = (0.5, 0.75)
NEW = 16  # ids fed one per forward after the prefill
INTERVAL = 8  # compression_interval: two compressions per layer
VALUE_CTX, VALUE_RATIO, VALUE_LAYERS = 2, 0.75, (0, 29)
MERGE_CTX, MERGE_RATIO, MERGE_LAYER = 2, 0.75, 14


def run_cam(model, torch, ids: np.ndarray, ratio: float, n_layers: int, kvh: int,
            want_values: bool, want_inputs: bool) -> tuple[int, dict[str, np.ndarray]]:
    """Prefill `ids[:-NEW]`, feed `ids[-NEW:]` one per forward under CAMPress -> (K, arrays)."""
    import kvpress
    from transformers import DynamicCache

    t = len(ids)
    n_ctx = t - NEW
    target = int(n_ctx * (1 - ratio))
    press = kvpress.CAMPress(kvpress.KnormPress(), compression_interval=INTERVAL,
                             target_size=target)
    positions = {layer: list(range(n_ctx)) for layer in range(n_layers)}  # slot -> position
    count = {layer: 0 for layer in range(n_layers)}
    out: dict[str, np.ndarray] = {}
    for j in range(2):
        out[f"c{j}_keep"] = np.zeros((n_layers, t), bool)
        out[f"c{j}_merge"] = np.zeros((n_layers, INTERVAL), np.int32)
        out[f"c{j}_prob"] = np.zeros((n_layers, kvh, INTERVAL), np.float32)
        out[f"c{j}_u"] = np.zeros((n_layers, kvh, INTERVAL), np.float32)
        out[f"c{j}_margin"] = np.zeros(n_layers, np.float32)
    seen: dict = {}
    gen = torch.Generator().manual_seed(SEED)
    orig_searchsorted, orig_bernoulli = torch.searchsorted, torch.bernoulli
    orig_compress = press.compress

    def searchsorted(sorted_seq, values, *args, **kwargs):
        seen["kept"], seen["merge"] = sorted_seq.clone(), values.clone()
        return orig_searchsorted(sorted_seq, values, *args, **kwargs)

    def bernoulli(p, *args, **kwargs):
        assert not args and not kwargs
        u = torch.rand(p.shape, generator=gen, dtype=p.dtype)
        seen["prob"], seen["u"] = p.clone(), u
        return (u < p).to(p.dtype)

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        j = count[layer]
        in_k, in_v, in_a = keys.clone(), values.clone(), attentions.clone()
        pos = np.asarray(positions[layer])
        assert len(pos) == keys.shape[2]
        old = press.base_press.compression_ratio
        press.base_press.compression_ratio = press._find_target_compression_ratio(
            keys.shape[2], target)
        mean_scores = press.base_press.score(module, hidden_states, keys, values, None,
                                             kwargs).mean(dim=1)[0]  # as CAMPress averages
        press.base_press.compression_ratio = old
        new_k, new_v = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        kept = seen.pop("kept")[0].numpy()
        merge = seen.pop("merge")[0].numpy()
        keep = kept_from_cache(in_k, new_k)
        assert (keep == keep[:1]).all(), "CAMPress keeps the same slots in every KV head"
        slots = np.zeros(len(pos), bool)
        slots[kept] = True
        assert (slots == keep[0]).all(), f"layer {layer}: kept indices and cache disagree"
        out[f"c{j}_keep"][layer, pos[kept]] = True
        out[f"c{j}_merge"][layer] = pos[merge]
        out[f"c{j}_prob"][layer] = seen.pop("prob")[0].numpy()
        out[f"c{j}_u"][layer] = seen.pop("u")[0].numpy()
        ms = mean_scores.numpy()
        out[f"c{j}_margin"][layer] = ms[slots].min() - ms[~slots].max()
        if want_values and j == 0 and layer in VALUE_LAYERS:
            out[f"c0_values_l{layer}"] = new_v[0].numpy().copy()
        if want_inputs and j == 1 and layer == MERGE_LAYER:
            pre = f"c1_l{layer}"
            out[f"{pre}_in_values"] = in_v[0].numpy()
            out[f"{pre}_in_attn"] = in_a[0].numpy()
            out[f"{pre}_in_scores"] = ms
            out[f"{pre}_in_pos"] = pos.astype(np.int32)
            out[f"{pre}_out_values"] = new_v[0].numpy().copy()
        positions[layer] = pos[kept].tolist()
        count[layer] += 1
        return new_k, new_v

    press.compress = compress
    torch.searchsorted, torch.bernoulli = searchsorted, bernoulli
    try:
        cache = DynamicCache()
        ctx = torch.from_numpy(ids[:n_ctx].astype(np.int64))[None]
        with torch.no_grad(), press(model):
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
            for i, tok in enumerate(ids[n_ctx:]):
                for layer in positions:
                    positions[layer].append(n_ctx + i)
                model(input_ids=torch.tensor([[int(tok)]]), past_key_values=cache,
                      position_ids=torch.tensor([[n_ctx + i]]), use_cache=True)
    finally:
        torch.searchsorted, torch.bernoulli = orig_searchsorted, orig_bernoulli
    assert all(c == 2 for c in count.values()), count
    return target, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(CAM_OUT), help=f"output .npz (default {CAM_OUT})")
    args = ap.parse_args(argv)
    import torch

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
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
            target, arrays = run_cam(model, torch, ids, ratio, n_layers, kvh,
                                     (c, ratio) == (VALUE_CTX, VALUE_RATIO),
                                     (c, ratio) == (MERGE_CTX, MERGE_RATIO))
            prefix = f"ctx{c}_cam_r{ratio:.2f}"
            out[f"{prefix}_target"] = np.int32(target)
            for key, value in arrays.items():
                out[f"{prefix}_{key}"] = np.packbits(value.ravel()) if key.endswith("_keep") \
                    else value
            merged = {j: int((arrays[f"c{j}_u"] < arrays[f"c{j}_prob"]).sum()) for j in (0, 1)}
            strict = {j: int(((arrays[f"c{j}_prob"] > 0) & (arrays[f"c{j}_prob"] < 1)).sum())
                      for j in (0, 1)}
            print(f"{prefix}: K={target}, merges drawn {merged} of {n_layers * kvh * INTERVAL} "
                  f"per compression, p strictly in (0, 1): {strict}, smallest margin "
                  f"{min(arrays['c0_margin'].min(), arrays['c1_margin'].min()):.3g} "
                  f"({time.perf_counter() - t1:.1f}s)", flush=True)
    timings["presses"] = time.perf_counter() - t0
    out.update(provenance(info, n_layers, kvh))
    out["new"] = np.int32(NEW)
    out["interval"] = np.int32(INTERVAL)
    out["value_layers"] = np.asarray(VALUE_LAYERS, np.int32)
    out["merge_layer"] = np.int32(MERGE_LAYER)
    save_golden(args.out, out, timings, max_bytes=300 * 1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
