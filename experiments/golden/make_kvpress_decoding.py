"""Goldens for kvpress's decoding presses: ``make_kvpress_decoding.py``.

What it makes
-------------
``tests/golden/kvpress_decoding.npz``, made by running kvpress 0.5.5's own pipeline code
(never kvjax) on the real SmolLM2-135M-Instruct: the same GGUF, transformers model (float32,
sdpa) and the 300-token passage of The Devil's Dictionary (``ctx2``) the other kvpress
goldens use, batch 1, greedy. ``KVPressTextGenerationPipeline._forward`` runs exactly as
``pipeline(context, question, press=...)`` runs it after tokenizing (the chat template is
skipped: the context ids are the passage's first ``C`` ids and the "question" ids its other
ids, so the whole passage is the prompt): the context is prefilled (through the prefill press
only for ``PrefillDecodingPress``), then ``generate_answer`` feeds the question in one forward
and the new tokens one by one, with the press's forward hooks active. A decoding press counts
forwards per layer (the question's forward is the first), compresses after every
``compression_interval`` of them, or at once when a forward brings at least ``target_size``
tokens (the question here, so the first compression is right after the question, as kvjax
compresses right after the prompt), keeping ``target_size`` tokens.

Cases (scorer ``KnormPress``, interval 4, ``MAX_NEW`` = 25 tokens, so that the last forward,
the 25th, compresses), key prefix ``{case}``:

* ``decoding``: ``DecodingPress(KnormPress(), compression_interval=4, target_size=128)``,
  context 44 ids, question 256 ids;
* ``prefill_decoding``: ``PrefillDecodingPress(KnormPress(0.5), DecodingPress(KnormPress(),
  compression_interval=4, target_size=64))``, context 128 ids (kept: 64), question 172 ids;
* ``ratio_decoding``: ``CompressionRatioDecodingPress(KnormPress(), target_compression_ratio=0.5,
  compression_interval=4)``, context 44 ids, question 256 ids (the target is half of every
  token seen so far: 150 after the question, 152, 154, ... later).

Per case: ``..._context`` int32 (C), ``..._tokens`` int32 [MAX_NEW] (the generated ids: the
argmax of every forward's last logits, read off the ``lm_head``), ``..._keep`` packbits of the
bool [L, KVH, P] mask of the absolute positions (P = 300 + MAX_NEW - 1) each layer and KV head
holds after its last compression (the positions are tracked through every compression by
matching each kept key row bit for bit to an input row), ``..._kept`` int32 [n_compressions]
the cache length after each compression of layer 0, ``..._margin`` float32 [L, KVH]: over every
compression, the smallest gap between the smallest kept and the largest evicted knorm score (0:
a tie that torch's top-k broke).

How to run (the ``compare`` extra; a couple of minutes on 2 CPU cores)::

    python experiments/golden/make_kvpress_decoding.py [--gguf PATH] [--out PATH]
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

DECODING_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_decoding.npz"
MAX_NEW = 25
INTERVAL = 4
# case -> context ids (the rest of ctx2's 300 ids is the question)
CASES = {"decoding": 44, "prefill_decoding": 128, "ratio_decoding": 44}
TARGET = {"decoding": 128, "prefill_decoding": 64}
RATIO = {"prefill_decoding": 0.5, "ratio_decoding": 0.5}


def make_decoding_press(case: str):
    import kvpress

    if case == "decoding":
        return kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=INTERVAL,
                                     target_size=TARGET[case])
    if case == "prefill_decoding":
        return kvpress.PrefillDecodingPress(
            prefilling_press=kvpress.KnormPress(RATIO[case]),
            decoding_press=kvpress.DecodingPress(kvpress.KnormPress(),
                                                 compression_interval=INTERVAL,
                                                 target_size=TARGET[case]))
    if case == "ratio_decoding":
        return kvpress.CompressionRatioDecodingPress(kvpress.KnormPress(),
                                                     target_compression_ratio=RATIO[case],
                                                     compression_interval=INTERVAL)
    raise ValueError(case)


def _rows(keys, new_keys):
    """[KVH, n] int: the row of `keys` [1, KVH, m, D] each row of `new_keys` [1, KVH, n, D] is."""
    keys, new_keys = keys[0].numpy(), new_keys[0].numpy()
    out = np.zeros(new_keys.shape[:2], np.int64)
    for h in range(keys.shape[0]):
        rows = {keys[h, i].tobytes(): i for i in range(keys.shape[1])}
        assert len(rows) == keys.shape[1], "two equal key rows: cannot tell which one was kept"
        out[h] = [rows[r.tobytes()] for r in new_keys[h]]
    return out


def run_case(pipe, model, torch, ids: np.ndarray, case: str, n_layers: int, kvh: int) -> dict:
    press = make_decoding_press(case)
    c = CASES[case]
    total = len(ids) + MAX_NEW - 1  # positions ever written (the last token is never fed)
    pos: dict[int, np.ndarray] = {}  # layer -> [KVH, cache len] absolute position of each row
    margin = np.full((n_layers, kvh), np.inf, np.float32)
    kept0: list[int] = []

    def tracked(obj):
        orig = obj.compress

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            layer, m = module.layer_idx, keys.shape[2]
            new_k, new_v = orig(module, hidden_states, keys, values, attentions, kwargs)
            cur = pos.get(layer, np.zeros((kvh, 0), np.int64))
            if kwargs.get("position_ids") is not None:  # a decoding forward: rows appended since
                seen = int(kwargs["position_ids"].max()) + 1
            else:  # the prefill: the context
                assert cur.shape[1] == 0
                seen = m
            fresh = m - cur.shape[1]
            cur = np.concatenate([cur, np.tile(np.arange(seen - fresh, seen), (kvh, 1))], 1)
            if new_k.shape[2] < m:
                rows = _rows(keys, new_k)
                score = -torch.linalg.vector_norm(keys, dim=-1)[0].numpy()  # knorm's score
                for h in range(kvh):
                    gone = np.setdiff1d(np.arange(m), rows[h])
                    gap = score[h][rows[h]].min() - score[h][gone].max()
                    margin[layer, h] = min(margin[layer, h], gap)
                cur = np.take_along_axis(cur, rows, 1)
                if layer == 0:
                    kept0.append(new_k.shape[2])
            pos[layer] = cur
            return new_k, new_v

        obj.compress = compress

    if case == "prefill_decoding":
        tracked(press.prefilling_press)
        tracked(press.decoding_press)
    else:
        tracked(press)

    drawn: list[int] = []
    hook = model.lm_head.register_forward_hook(
        lambda mod, inp, out: drawn.append(int(out[0, -1].argmax())))
    try:
        inputs = {"context_ids": torch.from_numpy(ids[:c].astype(np.int64))[None],
                  "questions_ids": [torch.from_numpy(ids[c:].astype(np.int64))[None]]}
        with torch.no_grad():
            pipe._forward(inputs, max_new_tokens=MAX_NEW, press=press)
    finally:
        hook.remove()
    assert len(drawn) == MAX_NEW, len(drawn)  # no end token drawn on the way
    keep = np.zeros((n_layers, kvh, total), bool)
    for layer in range(n_layers):
        assert pos[layer].shape[1] == kept0[-1]  # every layer compressed last at the same forward
        np.put_along_axis(keep[layer], pos[layer], True, axis=1)
    return {"context": np.int32(c), "tokens": np.asarray(drawn, np.int32), "keep": keep,
            "kept": np.asarray(kept0, np.int32), "margin": margin}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(DECODING_OUT),
                    help=f"output .npz (default {DECODING_OUT})")
    args = ap.parse_args(argv)
    import torch
    from kvpress.pipeline import KVPressTextGenerationPipeline

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    full = TEXT_PATH.read_text(encoding="utf-8")
    offset, n = CONTEXTS[2]
    start = full.index("\n\n", offset) + 2
    text = full[start: start + PASSAGE_CHARS]
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n], np.int32)
    out: dict[str, np.ndarray] = {"ids": ids, "max_new": np.int32(MAX_NEW),
                                  "interval": np.int32(INTERVAL)}
    t0 = time.perf_counter()
    for case in CASES:
        t1 = time.perf_counter()
        torch.manual_seed(SEED)
        arrays = run_case(pipe, model, torch, ids, case, n_layers, kvh)
        for key, value in arrays.items():
            out[f"{case}_{key}"] = np.packbits(value.ravel()) if value.dtype == bool else value
        print(f"{case}: tokens {arrays['tokens'].tolist()}, cache after each compression "
              f"{arrays['kept'].tolist()}, min margin {arrays['margin'].min():.3g} "
              f"({time.perf_counter() - t1:.1f}s)", flush=True)
    timings["presses"] = time.perf_counter() - t0
    out.update(provenance(info, n_layers, kvh))
    out["cases"] = np.asarray(list(CASES))
    save_golden(args.out, out, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
