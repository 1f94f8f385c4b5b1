"""Goldens for DuoAttentionPress (on-the-fly scoring): ``make_kvpress_duo.py``.

What it makes
-------------
``tests/golden/kvpress_duo.npz``, made by running kvpress 0.5.5 (never kvjax) on the real
SmolLM2-135M-Instruct in float32 (the same GGUF, transformers model and sdpa attention as
the other kvpress goldens), batch 1.

``DuoAttentionPress(head_compression_ratio=r, on_the_fly_scoring=True)`` scores every
(layer, KV head) with kvpress's ``duo_attention_on_the_fly``: the mean pre-RoPE query and key
of each head over 50 calibration texts, repeated over 500 positions and rotated, and the area
under the last query's cumulated attention. kvpress draws the 50 texts from the hub's BookSum
(``load_dataset("kmfoda/booksum")``) and loads the tokenizer by the model's hub name; neither
is reachable here, so the generator hands kvpress's own function 50 passages of The Devil's
Dictionary (``N_TEXTS`` passages of ``TEXT_CHARS`` characters from offset ``TEXT_OFFSET``, one
every ``TEXT_STRIDE``) through a stand-in ``load_dataset`` and the GGUF's tokenizer through a
stand-in ``AutoTokenizer.from_pretrained``. Everything else is kvpress's code.

Arrays: ``texts_ids`` int32 [N_TEXTS, W] (the calibration texts' ids as kvpress's tokenizer
call gave them, padded with -1, in kvpress's sample order), ``head_scores`` float32 [L, KVH];
per r in ``RATIOS``: ``r{r:.2f}_streaming`` bool [L, KVH] (kvpress's ``streaming_mask``);
per text c of the two zoo passages (640 and 300 ids) and r: ``ctx{c}_r{r:.2f}_masked``
packbits of the bool [L, KVH, T] mask of the positions kvpress masks in its attention
(``module.masked_key_indices`` after one prefill under the press). ``ctx{c}_ids`` as the zoo.

How to run (the ``compare`` extra; a couple of minutes on 2 CPU cores)::

    python experiments/golden/make_kvpress_duo.py [--gguf PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden
from experiments.golden.make_kvpress import (ATTN, CONTEXTS, PASSAGE_CHARS, REPO_ROOT, SEED,
                                             TEXT_PATH)
from experiments.golden.make_kvpress_zoo import provenance

DUO_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_duo.npz"
RATIOS = (0.5, 0.75)
N_TEXTS = 50  # kvpress's num_samples default
TEXT_OFFSET, TEXT_STRIDE, TEXT_CHARS = 100_000, 5_000, 600


def calibration_texts() -> list[str]:
    """The 50 passages of The Devil's Dictionary that stand in for BookSum's chapters."""
    full = TEXT_PATH.read_text(encoding="utf-8")
    return [full[TEXT_OFFSET + i * TEXT_STRIDE: TEXT_OFFSET + i * TEXT_STRIDE + TEXT_CHARS]
            for i in range(N_TEXTS)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(DUO_OUT), help=f"output .npz (default {DUO_OUT})")
    args = ap.parse_args(argv)
    import pandas as pd
    import torch

    import kvpress
    from kvpress.presses import duo_attention_press as duo
    from transformers import DynamicCache

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    texts = calibration_texts()
    seen_ids = []

    class Dataset:  # load_dataset(...)'s stand-in: the passages as BookSum's "chapter" column
        def to_pandas(self):
            return pd.DataFrame({"chapter": texts})

    class Tokenizer:  # AutoTokenizer.from_pretrained(...)'s stand-in: the GGUF's tokenizer
        def __call__(self, text, return_tensors=None):
            out = tok(text, return_tensors=return_tensors)
            seen_ids.append(out["input_ids"][0].numpy().astype(np.int32))
            return out

    duo.load_dataset = lambda *a, **k: Dataset()
    duo.AutoTokenizer = type("AutoTokenizer", (), {"from_pretrained": staticmethod(
        lambda *a, **k: Tokenizer())})
    t0 = time.perf_counter()
    scores = duo.duo_attention_on_the_fly(model)  # [L, KVH]
    timings["scores"] = time.perf_counter() - t0
    width = max(len(x) for x in seen_ids)
    out: dict[str, np.ndarray] = {
        "texts_ids": np.stack([np.pad(x, (0, width - len(x)), constant_values=-1)
                               for x in seen_ids]),
        "head_scores": np.asarray(scores, np.float32)}
    print(f"head scores {scores.shape}: {scores.min():.4f}..{scores.max():.4f}, "
          f"{len(seen_ids)} texts of {min(map(len, seen_ids))}-{width} ids "
          f"({timings['scores']:.1f}s)", flush=True)
    full = TEXT_PATH.read_text(encoding="utf-8")
    for ratio in RATIOS:
        press = kvpress.DuoAttentionPress(head_compression_ratio=ratio, on_the_fly_scoring=True)
        press.post_init_from_model(model)
        assert (press.sink_size, press.recent_size) == (128, 256)
        out[f"r{ratio:.2f}_streaming"] = press.streaming_mask.numpy()
        for c, (offset, n) in CONTEXTS.items():
            start = full.index("\n\n", offset) + 2
            text = full[start: start + PASSAGE_CHARS]
            ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n], np.int32)
            out[f"ctx{c}_ids"] = ids
            for layer in model.model.layers:
                layer.self_attn.masked_key_indices = None
            inp = torch.from_numpy(ids.astype(np.int64))[None]
            with torch.no_grad(), press(model):
                model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
            masked = np.zeros((n_layers, kvh, len(ids)), bool)
            for i, layer in enumerate(model.model.layers):
                idx = getattr(layer.self_attn, "masked_key_indices", None)
                if idx is not None:
                    b, h, s = (x.numpy() for x in idx)
                    assert (b == 0).all()
                    masked[i, h, s] = True
                    layer.self_attn.masked_key_indices = None
            out[f"ctx{c}_r{ratio:.2f}_masked"] = np.packbits(masked.ravel())
            print(f"r={ratio} ctx{c}: {int(press.streaming_mask.sum())} streaming heads, "
                  f"{int(masked.sum())} masked (layer, head, position) entries", flush=True)
    out.update(provenance(info, n_layers, kvh))
    out["sink_size"], out["recent_size"] = np.int32(128), np.int32(256)
    save_golden(args.out, out, timings, max_bytes=300 * 1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
