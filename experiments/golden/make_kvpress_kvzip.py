"""Goldens for KVzipPress: ``python experiments/golden/make_kvpress_kvzip.py``.

What it makes
-------------
``tests/golden/kvpress_kvzip.npz``, made by running kvpress 0.5.5 (never kvjax)
on the real SmolLM2-135M-Instruct, the same GGUF, transformers model, sdpa
attention (float32) and the same two passages as ``kvpress_zoo.npz`` (640 and
300 tokens of The Devil's Dictionary), batch 1. Each passage is fed as
kvpress's pipeline feeds a context: behind the chat template's opening (the
system turn and ``<|im_start|>user\\n``: ``KVzipPress.prefix_length`` tokens,
which KVzip does not reconstruct), so the prefill sees ``template prefix +
passage``. KVzip then runs its own reconstruction passes ("Repeat the previous
context exactly." + the template's closing + the passage, chunk by chunk) over
that cache and masks its lowest scores across every layer and KV head.

KVzipPress builds its tokenizer with ``AutoTokenizer.from_pretrained(
model.config.name_or_path)``, which cannot find a GGUF's tokenizer; the script
hands it the tokenizer transformers loaded from the GGUF instead (the same
object, so the same ids). Everything else is kvpress's code.

Per text ``c``:

* ``ctx{c}_ids`` int32 [T]: template prefix + passage (what the model prefilled,
  what kvjax prefills); ``ctx{c}_prefix`` int32: the prefix's token count
  (``KVzipPress.prefix_length``).

Once: ``prompt_first`` / ``prompt_next`` / ``suffix`` int32: the ids kvpress's
``prepare`` put before each chunk (first chunk; later chunks, which also get
the previous chunk's last 8 ids) and after the instruction (the template's
closing, ``KVzipPress._suffix_ids``), read off kvpress's own chunk pairs.

Per case, key prefix ``ctx{c}_{press}_r{r:.2f}``, r in 0.5 and 0.75:

* ``kvzip``: ``KVzipPress(compression_ratio=r)`` (layerwise=False, n_sink=4,
  chunk_size=2048: one chunk); ``kvzip_chunk256``: ``chunk_size=256`` (3 and 2
  chunks); ``kvzip_layerwise``: ``layerwise=True``.
* ``..._keep`` uint8: packbits of the bool [L, KVH, T] keep mask, the
  complement of ``module.masked_key_indices`` (KVzip masks, it does not shrink).
* ``..._band`` uint8: packbits of [L, KVH, T] True where kvpress's score lies
  within ``band_rtol`` (times the standard deviation of the scores ranked
  together: every layer's, or the layer's with ``layerwise``) of the boundary
  (the smallest kept score); ``..._margin`` float32 [L]: per layer, smallest
  kept minus largest evicted score (over the layer's KV heads).
* ``ctx2_kvzip_r0.50_scores_l{0,29}`` float32 [KVH, T]: kvpress's
  ``score_val`` of those layers (the 4 sinks at the global max + 1).

Metadata as in ``kvpress_zoo.npz`` (versions, GGUF hash, shape, ``band_rtol``).

How to run (the ``compare`` extra; about 4 minutes on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_kvzip.py [--gguf PATH] [--out PATH]
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

KVZIP_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_kvzip.npz"
RATIOS = (0.5, 0.75)
PRESSES = {"kvzip": {}, "kvzip_chunk256": {"chunk_size": 256},
           "kvzip_layerwise": {"layerwise": True}}  # name -> KVzipPress arguments
SCORES_STORED = {("kvzip", 2, 0.5): (0, 29)}


def template_prefix(tok) -> list[int]:
    """The chat template's opening ids, split off as KVzipPress (and kvpress's pipeline) do."""
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tok.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                   add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False)
    return tok.encode(text.split(separator)[0].split(dummy)[0], add_special_tokens=False)


def run_kvzip(model, tok, torch, ids: np.ndarray, kwargs: dict, ratio: float,
              n_layers: int, kvh: int, press_class: str = "KVzipPress") -> dict:
    """One prefill under KVzipPress (or its subclass `press_class`), then its reconstruction
    and masking -> arrays."""
    import kvpress
    from kvpress.presses import kvzip_press
    from transformers import DynamicCache

    class GivenTokenizer:  # KVzipPress's AutoTokenizer.from_pretrained(name_or_path)
        @staticmethod
        def from_pretrained(*args, **kw):
            return tok

    kwargs = dict(kwargs)
    adapter = kwargs.pop("adapter", None)
    press = getattr(kvpress, press_class)(compression_ratio=ratio, **kwargs)
    if adapter is not None:  # RestoreKVPress: kvjax's restore tokens in place of the hub's
        from experiments.eval.kvpress_engine import kvpress_restorekv
        press.post_init_from_model = kvpress_restorekv(press, adapter)
    stash = {}
    orig_post, orig_prepare = press.compress_post, press.prepare

    def prepare(model_, tokenizer_, *a, **kw):
        pairs = orig_prepare(model_, tokenizer_, *a, **kw)
        stash["pairs"] = [(p.numpy().copy(), r.numpy().copy()) for p, r in pairs]
        stash["prefix"], stash["suffix"] = press.prefix_length, press._suffix_ids.numpy().copy()
        return pairs

    def compress_post(model_):
        orig_post(model_)
        stash["scores"] = press.score_val[:, 0].detach().clone().numpy()  # [L, KVH, T]

    press.prepare, press.compress_post = prepare, compress_post
    saved = kvzip_press.AutoTokenizer
    kvzip_press.AutoTokenizer = GivenTokenizer
    try:
        with torch.no_grad(), press(model):
            model(input_ids=torch.from_numpy(ids.astype(np.int64))[None],
                  past_key_values=DynamicCache(), use_cache=True)
    finally:
        kvzip_press.AutoTokenizer = saved
    t = len(ids)
    keep = np.ones((n_layers, kvh, t), bool)
    for i, layer in enumerate(model.model.layers):
        b, h, s = (x.numpy() for x in layer.self_attn.masked_key_indices)
        assert (b == 0).all()
        keep[i, h, s] = False
        layer.self_attn.masked_key_indices = None
    scores = stash["scores"].astype(np.float64)
    restore = getattr(press, "num_restore_tokens", 0)  # RestoreKV's: budget-matched
    ratio = min(1.0, ratio + restore / t) if restore else ratio
    n_pruned = int(scores.size * ratio) if not kwargs.get("layerwise") else \
        int(kvh * t * ratio) * n_layers
    assert (~keep).sum() == n_pruned, ((~keep).sum(), n_pruned)
    band = np.zeros_like(keep)
    margin = np.full(n_layers, np.inf, np.float32)
    groups = [range(n_layers)] if not kwargs.get("layerwise") else [[i] for i in range(n_layers)]
    for group in groups:
        s, k = scores[list(group)], keep[list(group)]
        boundary = s[k].min()
        band[list(group)] = np.abs(s - boundary) <= BAND_RTOL * s.std()
    for i in range(n_layers):
        if (~keep[i]).any():
            margin[i] = scores[i][keep[i]].min() - scores[i][~keep[i]].max()
    return {"keep": keep, "band": band, "margin": margin, "scores": stash["scores"],
            "pairs": stash["pairs"], "prefix": stash["prefix"], "suffix": stash["suffix"]}


def main(argv=None, presses: dict = PRESSES, default_out=KVZIP_OUT,
         press_class: str = "KVzipPress", scores_stored: dict = SCORES_STORED,
         description: str = __doc__) -> int:
    ap = argparse.ArgumentParser(description=description.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(default_out),
                    help=f"output .npz (default {default_out})")
    args = ap.parse_args(argv)
    import torch

    import kvpress  # noqa: F401  (patches the attention functions, as kvpress always does)

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    out: dict[str, np.ndarray] = {}
    full = TEXT_PATH.read_text(encoding="utf-8")
    prefix = template_prefix(tok)
    texts = {}
    for c, (offset, n) in CONTEXTS.items():
        start = full.index("\n\n", offset) + 2
        text = full[start: start + PASSAGE_CHARS]
        ids = tok(text, add_special_tokens=False)["input_ids"][:n]
        texts[c] = np.asarray(prefix + ids, np.int32)
        out[f"ctx{c}_ids"] = texts[c]
        out[f"ctx{c}_prefix"] = np.int32(len(prefix))
    t0 = time.perf_counter()
    for name, kwargs in presses.items():
        for c, ids in texts.items():
            for ratio in RATIOS:
                t1 = time.perf_counter()
                torch.manual_seed(SEED)
                arrays = run_kvzip(model, tok, torch, ids, kwargs, ratio, n_layers, kvh,
                                   press_class)
                assert arrays["prefix"] == len(prefix), (arrays["prefix"], len(prefix))
                pairs = arrays["pairs"]
                ctx = ids[len(prefix):]
                size = kwargs.get("chunk_size", getattr(kvpress, press_class).chunk_size)
                assert len(pairs) == -(-len(ctx) // size)
                for i, (chunk, repeat) in enumerate(pairs):
                    assert (chunk[0] == ctx[i * size:(i + 1) * size]).all()
                    assert (repeat[0, -len(chunk[0]):] == chunk[0]).all()
                    head = repeat[0, :-len(chunk[0]) - arrays["suffix"].shape[1]]
                    if i == 0:
                        out["prompt_first"] = head.astype(np.int32)
                    else:
                        assert (head[-8:] == pairs[i - 1][0][0, -8:]).all()
                        out["prompt_next"] = head[:-8].astype(np.int32)
                out["suffix"] = arrays["suffix"][0].astype(np.int32)
                prefix_key = f"ctx{c}_{name}_r{ratio:.2f}"
                out[f"{prefix_key}_keep"] = np.packbits(arrays["keep"].ravel())
                out[f"{prefix_key}_band"] = np.packbits(arrays["band"].ravel())
                out[f"{prefix_key}_margin"] = arrays["margin"]
                for layer in scores_stored.get((name, c, ratio), ()):
                    out[f"{prefix_key}_scores_l{layer}"] = arrays["scores"][layer].astype(
                        np.float32)
                m = arrays["margin"]
                kept = arrays["keep"].sum(-1)
                print(f"{prefix_key}: {len(pairs)} chunk(s), kept/head {kept.min()}..{kept.max()}"
                      f" of {len(ids)}, min layer margin {m.min():.3g}, band "
                      f"{int(arrays['band'].sum())} ({time.perf_counter() - t1:.1f}s)",
                      flush=True)
    timings["presses"] = time.perf_counter() - t0
    out.update(provenance(info, n_layers, kvh))
    out["presses"] = np.asarray(list(presses))
    save_golden(args.out, out, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
