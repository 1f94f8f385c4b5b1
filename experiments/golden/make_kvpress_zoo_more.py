"""Goldens for CriticalKV, CriticalAdaKV, SimLayerKV, ThinK, CAPKV: ``make_kvpress_zoo_more.py``.

What it makes
-------------
``tests/golden/kvpress_zoo_more.npz``, made by running kvpress 0.5.5 (never
kvjax) on the real SmolLM2-135M-Instruct, the same GGUF, transformers model,
sdpa attention and the same two passages as ``kvpress_zoo.npz`` (640 and 300
tokens of The Devil's Dictionary), batch 1, one prefill forward with
``with press(model):`` per case. Key prefix ``ctx{c}_{press}_r{r:.2f}``:

* ``critical_snapkv``: ``CriticalKVPress(SnapKVPress(compression_ratio=r))``
  (epsilon 1e-4, first_stage_ratio 0.5), r in 0.5, 0.75. ``..._keep`` packbits
  of the bool [L, KVH, T] keep mask, read off the cache kvpress returned (every
  kept key row matched bit for bit to its input row); ``..._band`` packbits
  [L, KVH, T]: positions whose final CriticalKV score lies within
  ``band_rtol`` row standard deviations (of the finite, non-stage-1 scores) of
  the row's boundary score; ``..._margin`` float32 [L, KVH].
* ``critical_ada_snapkv``: ``CriticalAdaKVPress(SnapKVPress(compression_ratio=r))``
  (alpha_safeguard 0.2). It masks instead of shrinking: ``..._keep`` is the
  complement of ``module.masked_key_indices``; ``..._head_budgets`` int16
  [L, KVH] the per-head budgets its allocation gave; ``..._band`` packbits
  [L, KVH, T]: positions whose stage-2 score ``(inner + eps) * ||v W_o||_1``
  lies within ``band_rtol`` row standard deviations of the smallest stage-2
  score kvpress kept outside stage 1.
* ``simlayerkv``: ``SimLayerKVPress(lazy_threshold=r, n_recent=128)`` (n_last 1,
  n_initial 4) at thresholds r in 0.5, 0.75 (at kvpress's defaults,
  threshold 1.0 and n_recent 1024, it never compresses: both texts are shorter
  than 4 + 1024 + 1 tokens). ``..._keep`` as above; ``..._lazy_score`` float32
  [L]: the attention the last query pays the first 4 and the last 128 keys
  (mean over heads), which kvpress compares with the threshold.
* ``cap``: ``CapPress(compression_ratio=r)`` (tau 5, n_future_positions 512,
  n_sink 4, epsilon 1e-6), r in 0.5, 0.75: ``..._keep``, ``..._band`` and
  ``..._margin`` as for ``critical_snapkv``.
* ``per_layer_keydiff``: ``PerLayerCompressionPress(KeyDiffPress(), [r] * 15 + [1 - r] *
  15)`` at r in 0.25, 0.75 (the key's ``r`` is the first half's ratio): ``..._keep``.
* ``think``: ``ThinKPress(key_channel_compression_ratio=r)`` (window 32), r in
  0.5, 0.75. ``..._channels`` packbits of the bool [L, KVH, D] kept-channel
  mask: the channels kvpress did not zero; ``..._channel_margin`` float32
  [L, KVH]: smallest kept minus largest pruned channel score, relative to the
  largest channel score.

How to run (the ``compare`` extra; about 5 minutes on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_zoo_more.py [--gguf PATH] [--out PATH] [--only NAMES]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden
from experiments.golden.make_kvpress import (ATTN, CONTEXTS, PASSAGE_CHARS, REPO_ROOT, SEED,
                                             TEXT_PATH)
from experiments.golden.make_kvpress_zoo import BAND_RTOL, kept_from_cache, provenance


def compute_n_kept(t: int, ratio: float) -> int:
    from kvpress.utils import compute_n_kept as n_kept
    return n_kept(t, ratio)

MORE_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_zoo_more.npz"
RATIOS = {"critical_snapkv": (0.5, 0.75), "critical_ada_snapkv": (0.5, 0.75),
          "simlayerkv": (0.5, 0.75), "think": (0.5, 0.75), "cap": (0.5, 0.75),
          "per_layer_keydiff": (0.25, 0.75)}
SIMLAYER_RECENT = 128
MORE_PRESSES = list(RATIOS)


def make_more_press(name: str, ratio: float):
    """The kvpress press of `name` at `ratio` (SimLayerKV: the lazy threshold)."""
    import kvpress

    if name == "critical_snapkv":
        return kvpress.CriticalKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    if name == "critical_ada_snapkv":
        return kvpress.CriticalAdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    if name == "simlayerkv":
        return kvpress.SimLayerKVPress(lazy_threshold=ratio, n_recent=SIMLAYER_RECENT)
    if name == "think":
        return kvpress.ThinKPress(key_channel_compression_ratio=ratio)
    if name == "cap":
        return kvpress.CapPress(compression_ratio=ratio)
    if name == "per_layer_keydiff":  # ratio r on layers 0-14, 1 - r on 15-29
        ratios = [ratio] * 15 + [1 - ratio] * 15
        return kvpress.PerLayerCompressionPress(kvpress.KeyDiffPress(), ratios)
    raise ValueError(name)


def run_more_press(model, torch, ids: np.ndarray, name: str, ratio: float, n_layers: int,
                   kvh: int, head_dim: int) -> dict[str, np.ndarray]:
    """One prefill with the press active -> the arrays this case stores (unpacked)."""
    from kvpress.presses.snapkv_press import SnapKVPress
    from transformers import DynamicCache

    press = make_more_press(name, ratio)
    t = len(ids)
    keep = np.zeros((n_layers, kvh, t), bool)
    out: dict[str, np.ndarray] = {}
    orig_compress = press.compress
    scorer_press = name in ("critical_snapkv", "cap")
    if scorer_press:
        band = np.zeros((n_layers, kvh, t), bool)
        margin = np.full((n_layers, kvh), np.nan, np.float32)
        stash = {}
        orig_score = press.score

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            stash[module.layer_idx] = s.detach().clone()
            return s

        press.score = score
    if name == "critical_ada_snapkv":
        budgets = np.zeros((n_layers, kvh), np.int16)
        band = np.zeros((n_layers, kvh, t), bool)
        inner = {}
        orig_inner_score = press.press.score

        def inner_score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_inner_score(module, hidden_states, keys, values, attentions, kwargs)
            inner[module.layer_idx] = s.detach().clone()  # before the in-place safeguard
            return s

        press.press.score = inner_score
    if name == "simlayerkv":
        lazy_score = np.full(n_layers, np.nan, np.float32)
        orig_is_lazy = press.is_lazy

        def is_lazy(module, hidden_states, keys, position_embeddings):
            w = SnapKVPress.compute_window_attention(module, hidden_states, keys, press.n_last,
                                                     position_embeddings).mean((0, 1, 2))
            s = w[: press.n_initial].sum() + w[-press.n_recent:].sum()
            lazy_score[module.layer_idx] = s.item()
            return orig_is_lazy(module, hidden_states, keys, position_embeddings)

        press.is_lazy = is_lazy
    if name == "think":
        channels = np.zeros((n_layers, kvh, head_dim), bool)
        channel_margin = np.full((n_layers, kvh), np.nan, np.float32)

    if name == "per_layer_keydiff":  # the wrapper calls its press's forward hook
        press, outer = press.press, press
        orig_compress = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        original_keys = keys.clone()
        new_k, new_v = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        if scorer_press:
            keep[layer] = kept_from_cache(original_keys, new_k)
            s = stash[layer][0].numpy().astype(np.float64)  # [KVH, T]
            top = np.finfo(np.float32).max
            for h in range(kvh):
                kept, scored = keep[layer, h], s[h] < top  # stage-1 picks hold float32 max
                boundary = s[h][kept & scored].min() if (kept & scored).any() else top
                finite = s[h][scored]
                band[layer, h] = scored & (np.abs(s[h] - boundary) <= BAND_RTOL * finite.std())
                evicted = s[h][~kept]
                margin[layer, h] = boundary - evicted.max() if evicted.size else np.inf
        elif name == "critical_ada_snapkv":
            assert new_k is keys  # masks, does not shrink
            b_idx, h_idx, s_idx = (x.numpy() for x in module.masked_key_indices)
            assert (b_idx == 0).all()
            m = np.ones((kvh, t), bool)
            m[h_idx, s_idx] = False
            keep[layer] = m
            budgets[layer] = m.sum(-1)
            # stage-2 scores, as kvpress weighs them: (inner + eps) * ||v W_o||_1
            from kvpress.presses.criticalkv_press import CriticalKVPress
            s = inner[layer]
            w = ((s + press.epsilon) * CriticalKVPress.vwl1norm(values, module))[0].numpy()
            n_safe = max(1, int(compute_n_kept(t, ratio) * press.alpha_safeguard))
            order = np.argsort(-s[0].numpy(), axis=-1, kind="stable")
            for h in range(kvh):
                first = order[h, :max(n_safe, int(budgets[layer, h] * press.first_stage_ratio))]
                second = m[h].copy()
                second[first] = False
                if second.any():
                    boundary = w[h][second].min()
                    band[layer, h] = np.abs(w[h] - boundary) <= BAND_RTOL * w[h].std()
        elif name in ("simlayerkv", "per_layer_keydiff"):
            keep[layer] = kept_from_cache(original_keys, new_k)
        elif name == "think":
            zeroed = (new_k[0] == 0).all(dim=1).numpy()  # [KVH, D] channels zeroed for every token
            channels[layer] = ~zeroed
            # ThinK's channel scores, recomputed as kvpress computes them (for the margin)
            q = press.compute_window_queries(module, kwargs["hidden_states"],
                                             kwargs["position_embeddings"])
            qn = q.pow(2).mean(dim=2).view(1, kvh, -1, head_dim).mean(2)
            sc = (qn * original_keys.pow(2).mean(dim=2))[0].numpy()  # [KVH, D]
            for h in range(kvh):
                kept_s, pruned_s = sc[h][~zeroed[h]], sc[h][zeroed[h]]
                channel_margin[layer, h] = (kept_s.min() - pruned_s.max()) / sc[h].max()
        return new_k, new_v

    press.compress = compress
    inp = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad(), (outer if name == "per_layer_keydiff" else press)(model):
        model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
    if name == "think":
        return {"channels": channels, "channel_margin": channel_margin}
    out["keep"] = keep
    if scorer_press:
        out.update(band=band, margin=margin)
    if name == "critical_ada_snapkv":
        out.update(head_budgets=budgets, band=band)
    if name == "simlayerkv":
        out["lazy_score"] = lazy_score
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(MORE_OUT), help=f"output .npz (default {MORE_OUT})")
    ap.add_argument("--only", help="comma-separated names of MORE_PRESSES (default: all); the "
                                   "rest of an existing --out file is kept")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else MORE_PRESSES
    unknown = set(names) - set(MORE_PRESSES)
    if unknown:
        ap.error(f"--only: unknown press {sorted(unknown)}; choose from {', '.join(MORE_PRESSES)}")
    import torch

    import kvpress  # noqa: F401  (patches the attention functions, as kvpress always does)

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    out: dict[str, np.ndarray] = {}
    if args.only and Path(args.out).exists():
        with np.load(args.out) as old:
            out.update({k: old[k] for k in old.files})
    full = TEXT_PATH.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    for c, (offset, n) in CONTEXTS.items():
        start = full.index("\n\n", offset) + 2
        text = full[start: start + PASSAGE_CHARS]
        out[f"ctx{c}_ids"] = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n],
                                        np.int32)
    for name in names:
        for c in CONTEXTS:
            ids = out[f"ctx{c}_ids"]
            for ratio in RATIOS[name]:
                t1 = time.perf_counter()
                torch.manual_seed(SEED)
                arrays = run_more_press(model, torch, ids, name, ratio, n_layers, kvh, head_dim)
                prefix = f"ctx{c}_{name}_r{ratio:.2f}"
                for key, value in arrays.items():
                    packed = value.dtype == bool
                    out[f"{prefix}_{key}"] = np.packbits(value.ravel()) if packed else value
                summary = ""
                if "keep" in arrays:
                    kept = arrays["keep"].sum(-1)
                    summary = f"kept/row {kept.min()}-{kept.max()} of {len(ids)}"
                if "lazy_score" in arrays:
                    summary += f", lazy scores {np.round(arrays['lazy_score'], 3).tolist()}"
                if "margin" in arrays:
                    summary += f", min margin {arrays['margin'].min():.3g}"
                if "channels" in arrays:
                    summary = (f"channels kept/row {arrays['channels'].sum(-1).min()}, min "
                               f"margin {arrays['channel_margin'].min():.3g}")
                print(f"{prefix}: {summary} ({time.perf_counter() - t1:.1f}s)", flush=True)
    timings["presses"] = time.perf_counter() - t0
    out.update(provenance(info, n_layers, kvh))
    out["head_dim"] = np.int32(head_dim)
    out["simlayer_recent"] = np.int32(SIMLAYER_RECENT)
    old = [str(p) for p in out.get("presses", [])]
    out["presses"] = np.asarray(list(dict.fromkeys(old + names)))
    save_golden(args.out, out, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
