"""Goldens for FinchPress: ``python experiments/golden/make_kvpress_finch.py``.

What it makes
-------------
``tests/golden/kvpress_finch.npz``, made by running kvpress 0.5.5 (never kvjax)
on the real SmolLM2-135M-Instruct, the same GGUF, transformers model, sdpa
attention and the same two passages as ``kvpress_zoo.npz`` (640 and 300 tokens
of The Devil's Dictionary), each followed by a question (``QUESTIONS``), batch
1. FinchPress reads its window off a delimiter token: the script calls
``FinchPress.update_model_and_tokenizer`` (adds ``<|finch_sep|>`` to the
tokenizer and resizes the embeddings) and feeds ``context + [delimiter] +
question``; kvpress's embedding hook drops the delimiter, so the model sees
``context + question`` at positions 0..T-1, and the window is the question.

Per text ``c``:

* ``ctx{c}_ids`` int32 [T]: context + question ids, the delimiter left out (what
  the model saw, what kvjax prefills); ``ctx{c}_window`` int32: the question's
  token count (FinchPress's ``window_size``, checked against the press).

Per case, key prefix ``ctx{c}_{press}_r{r:.2f}``, r in 0.5 and 0.75:

* ``finch``: ``FinchPress(compression_ratio=r)`` (normalize_scores=True,
  rerotate_keys=True, chunk_length=None); ``finch_raw``: the same with
  ``normalize_scores=False``.
* ``..._keep`` uint8: packbits of the bool [L, KVH, T] keep mask: the
  ``score(...).topk(n_kept)`` indices, checked against the cache kvpress returned
  (its values, which re-rotation leaves alone, equal the gathered input values).
* ``..._band`` uint8: packbits of [L, KVH, T] True where kvpress's score lies
  within ``band_rtol`` (times the row's score standard deviation) of the row's
  boundary score (its smallest kept score); ``..._margin`` float32 [L, KVH]:
  smallest kept minus largest evicted score (0 = an exact tie at the boundary).
* ``ctx2_finch_r0.75_keys_l{0,29}`` float32 [KVH, n_kept, D]: the re-rotated
  keys kvpress left in layers 0 and 29.

Metadata as in ``kvpress_zoo.npz`` (versions, GGUF hash, shape, ``band_rtol``).

How to run (the ``compare`` extra; about a minute on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_finch.py [--gguf PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden
from experiments.golden.make_kvpress import (ATTN, CONTEXTS, PASSAGE_CHARS, REPO_ROOT, SEED,
                                             TEXT_PATH)
from experiments.golden.make_kvpress_zoo import BAND_RTOL, provenance

FINCH_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_finch.npz"
RATIOS = (0.5, 0.75)
PRESSES = {"finch": True, "finch_raw": False}  # name -> normalize_scores
QUESTIONS = {1: "\nWhich words does the passage above define, and what does it say about them?",
             2: "\nWho is mocked most sharply in these definitions, and why?"}
KEYS_STORED = {("finch", 2, 0.75): (0, 29)}


def run_finch(model, tok, torch, ids: np.ndarray, question: np.ndarray, normalize: bool,
              ratio: float, n_layers: int, kvh: int, head_dim: int) -> dict[str, np.ndarray]:
    """One prefill of context + delimiter + question with FinchPress active -> arrays (unpacked)."""
    import kvpress
    from kvpress.utils import compute_n_kept
    from transformers import DynamicCache

    press = kvpress.FinchPress(compression_ratio=ratio, normalize_scores=normalize)
    press.update_model_and_tokenizer(model, tok)
    t, window = len(ids) + len(question), len(question)
    n_kept = compute_n_kept(t, ratio)
    keep = np.zeros((n_layers, kvh, t), bool)
    band = np.zeros((n_layers, kvh, t), bool)
    margin = np.full((n_layers, kvh), np.nan, np.float32)
    keys_out = {}
    orig_score, orig_compress = press.score, press.compress
    stash = {}

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
        stash[module.layer_idx] = s.detach().clone()
        return s

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        assert keys.shape[2] == t and press.window_size == window, (keys.shape, press.window_size)
        new_k, new_v = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        idx = stash[layer].topk(n_kept, dim=-1).indices.sort(-1).values  # [1, KVH, n_kept]
        gathered = values.gather(2, idx[..., None].expand(-1, -1, -1, head_dim))
        assert torch.equal(gathered, new_v), f"layer {layer}: values differ from topk's"
        np.put_along_axis(keep[layer], idx[0].numpy(), True, axis=-1)
        keys_out[layer] = new_k[0].numpy().copy()
        s = stash[layer][0].numpy().astype(np.float64)  # [KVH, T]
        for h in range(kvh):
            boundary = s[h][keep[layer, h]].min()
            band[layer, h] = np.abs(s[h] - boundary) <= BAND_RTOL * s[h][:t - window].std()
            evicted = s[h][~keep[layer, h]]
            margin[layer, h] = boundary - evicted.max() if evicted.size else np.inf
        return new_k, new_v

    press.score, press.compress = score, compress
    full = np.concatenate([ids, [press.delimiter_token_id], question]).astype(np.int64)
    with torch.no_grad(), press(model):
        out = model(input_ids=torch.from_numpy(full)[None], past_key_values=DynamicCache(),
                    use_cache=True)
    lens = np.asarray([out.past_key_values.layers[i].keys.shape[2] for i in range(n_layers)])
    assert (lens == keep.sum(-1)[:, 0]).all() and (lens == n_kept).all(), lens
    assert keep[:, :, t - window:].all(), "the question window was evicted"
    return {"keep": keep, "band": band, "margin": margin, "keys": keys_out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(FINCH_OUT), help=f"output .npz (default {FINCH_OUT})")
    args = ap.parse_args(argv)
    import torch

    import kvpress  # noqa: F401  (patches the attention functions, as kvpress always does)

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    out: dict[str, np.ndarray] = {}
    full = TEXT_PATH.read_text(encoding="utf-8")
    texts = {}
    for c, (offset, n) in CONTEXTS.items():
        start = full.index("\n\n", offset) + 2
        text = full[start: start + PASSAGE_CHARS]
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n], np.int32)
        question = np.asarray(tok(QUESTIONS[c], add_special_tokens=False)["input_ids"], np.int32)
        texts[c] = (ids, question)
        out[f"ctx{c}_ids"] = np.concatenate([ids, question]).astype(np.int32)
        out[f"ctx{c}_window"] = np.int32(len(question))
    t0 = time.perf_counter()
    for name, normalize in PRESSES.items():
        for c, (ids, question) in texts.items():
            for ratio in RATIOS:
                t1 = time.perf_counter()
                torch.manual_seed(SEED)
                arrays = run_finch(model, tok, torch, ids, question, normalize, ratio, n_layers,
                                   kvh, head_dim)
                prefix = f"ctx{c}_{name}_r{ratio:.2f}"
                out[f"{prefix}_keep"] = np.packbits(arrays["keep"].ravel())
                out[f"{prefix}_band"] = np.packbits(arrays["band"].ravel())
                out[f"{prefix}_margin"] = arrays["margin"]
                for layer in KEYS_STORED.get((name, c, ratio), ()):
                    out[f"{prefix}_keys_l{layer}"] = arrays["keys"][layer]
                m = arrays["margin"]
                print(f"{prefix}: kept/row {arrays['keep'].sum(-1).min()} of "
                      f"{len(ids) + len(question)} (window {len(question)}), min margin "
                      f"{m.min():.3g}, {int((m == 0).sum())} rows tied, band "
                      f"{int(arrays['band'].sum(-1).max())} max/row "
                      f"({time.perf_counter() - t1:.1f}s)", flush=True)
    timings["presses"] = time.perf_counter() - t0
    out.update(provenance(info, n_layers, kvh))
    out["presses"] = np.asarray(list(PRESSES))
    save_golden(args.out, out, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
