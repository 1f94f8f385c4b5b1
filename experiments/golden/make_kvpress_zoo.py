"""Goldens for the rest of kvpress's presses: ``python experiments/golden/make_kvpress_zoo.py``.

What it makes
-------------
``tests/golden/kvpress_zoo.npz``: which KV positions kvpress 0.5.5 keeps, per
layer and KV head, for the presses in ``ZOO_PRESSES`` on the real
SmolLM2-135M-Instruct (the same GGUF, transformers model, sdpa attention and
the same two passages as ``kvpress_golden.npz``: 640 and 300 tokens of The
Devil's Dictionary), at compression ratios 0.5 and 0.75, batch 1. Each press
runs as kvpress runs it: one prefill forward with ``with press(model):``.

Small on purpose: no tensors, only bit masks. Per case, key prefix
``ctx{c}_{press}_r{r:.2f}``:

* ``..._keep`` uint8: ``np.packbits`` of the bool keep mask [L, KVH, T]
  (``np.unpackbits(x, count=L*KVH*T).reshape(L, KVH, T)``). It is read off
  the cache kvpress returned: every kept key row is matched, bit for bit, to
  the row of the uncompressed keys it came from (so wrappers that do not
  select by ``topk`` of one score, ChunkKV and BlockPress, are recorded as
  they really behave). For the scorer presses the script also asserts that
  ``score(...).topk(n_kept)`` gives the same mask.
* ``..._band`` uint8 (scorer presses only): packbits of [L, KVH, T] True where
  kvpress's score lies within ``band_rtol`` (times the row's score standard
  deviation) of the row's boundary score (its smallest kept score). A
  re-implementation whose float rounding differs may swap positions only
  inside this band; exact ties (LagKV's rank scores) are inside it too.
* ``..._margin`` float32 [L, KVH] (scorer presses only): smallest kept minus
  largest evicted score (0 = an exact tie straddles the boundary, decided by
  torch's CPU ``topk``).

Randomised presses (LeverageScorePress, CompactorPress) draw a Gaussian
sketch with ``torch.randn``; to make them comparable the script replaces that
draw, per layer, by ``jax.random.normal(jax.random.fold_in(jax.random.key(0),
layer), (KVH, head_dim, 48))`` (float32) -- the sketch kvjax's scorer draws
from its policy key at ``seed=0``. kvpress still computes everything else.

``ctx2_rerotate_knorm_r0.75_keys_l{0,29}`` float32 [KVH, n_kept, D]: the keys
KeyRerotationPress left in layers 0 and 29 (re-rotated to positions 0..n_kept-1).

Metadata as in ``kvpress_golden.npz`` plus ``band_rtol`` and ``presses``.
``--only a,b`` redoes those presses and keeps the rest of an existing file.

How to run (the ``compare`` extra; about 17 minutes on 2 busy CPU cores)::

    pip install -e '.[compare]'
    python experiments/golden/make_kvpress_zoo.py [--gguf PATH] [--out PATH] [--only NAMES]
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden
from experiments.golden.make_kvpress import ATTN, CONTEXTS, PASSAGE_CHARS, REPO_ROOT, SEED, TEXT_PATH

ZOO_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_zoo.npz"
RATIOS = (0.5, 0.75)
BAND_RTOL = 1e-4
SKETCH_DIM = 48
# press name -> wrapper (None = plain ScorerPress)
ZOO_PRESSES = ["keydiff", "lagkv", "non_causal_attn", "leverage", "cur", "compactor",
               "chunkkv_snapkv", "chunkkv_knorm", "block_keydiff", "rerotate_knorm"]
# (press, context, ratio) whose re-rotated keys are stored too (float32, these layers only)
KEYS_STORED = {("rerotate_knorm", 2, 0.75): (0, 29)}


def make_zoo_press(name: str, ratio: float):
    """The kvpress press of a zoo name at `ratio`, every other argument at kvpress's default."""
    import kvpress

    scorers = {"keydiff": kvpress.KeyDiffPress, "lagkv": kvpress.LagKVPress,
               "non_causal_attn": kvpress.NonCausalAttnPress,
               "leverage": kvpress.LeverageScorePress, "cur": kvpress.CURPress,
               "compactor": kvpress.CompactorPress, "snapkv": kvpress.SnapKVPress,
               "knorm": kvpress.KnormPress}
    if name.startswith("chunkkv_"):
        return kvpress.ChunkKVPress(press=scorers[name[8:]](compression_ratio=ratio))
    if name.startswith("block_"):
        return kvpress.BlockPress(press=scorers[name[6:]](compression_ratio=ratio))
    if name.startswith("rerotate_"):
        return kvpress.KeyRerotationPress(press=scorers[name[9:]](compression_ratio=ratio))
    return scorers[name](compression_ratio=ratio)


def jax_sketch(layer: int, kvh: int, head_dim: int):
    """[1, KVH, D, 48] float32 torch tensor: the Gaussian sketch kvjax draws for `layer`."""
    import jax
    import torch

    key = jax.random.fold_in(jax.random.key(SEED), layer)
    draw = np.asarray(jax.random.normal(key, (kvh, head_dim, SKETCH_DIM), dtype=np.float32))
    return torch.from_numpy(draw.copy())[None]


def kept_from_cache(keys, new_keys) -> np.ndarray:
    """[KVH, T] bool: which input rows of `keys` [1, KVH, T, D] the output rows came from."""
    keys, new_keys = keys[0].numpy(), new_keys[0].numpy()
    kvh, t, _ = keys.shape
    keep = np.zeros((kvh, t), bool)
    for h in range(kvh):
        rows = {keys[h, i].tobytes(): i for i in range(t)}
        assert len(rows) == t, "two equal key rows: cannot tell which one was kept"
        for row in new_keys[h]:
            keep[h, rows[row.tobytes()]] = True
        assert keep[h].sum() == len(new_keys[h]), "a kept row is not among the input rows"
    return keep


def run_zoo_press(model, torch, ids: np.ndarray, name: str, ratio: float, n_layers: int,
                  kvh: int, head_dim: int, keys_out: dict | None = None):
    """One prefill with the press active -> (keep [L, KVH, T], band, margin or None).

    KeyRerotationPress changes the keys, so its keep mask comes from `topk` of the inner
    score (checked against the values kvpress kept); `keys_out[layer]` receives its keys.
    """
    from kvpress.utils import compute_n_kept

    press = make_zoo_press(name, ratio)
    scorer = getattr(press, "press", press)
    wrapped = scorer is not press
    t = len(ids)
    keep = np.zeros((n_layers, kvh, t), bool)
    band = np.zeros((n_layers, kvh, t), bool)
    margin = np.full((n_layers, kvh), np.nan, np.float32)
    stash = {}
    orig_score, orig_compress, orig_randn = scorer.score, press.compress, torch.randn
    current = {}

    def randn(*shape, **kw):  # LeverageScorePress's sketch: kvjax's draw instead
        assert tuple(shape) == (1, kvh, head_dim, SKETCH_DIM), shape
        return jax_sketch(current["layer"], kvh, head_dim).to(kw.get("dtype", torch.float32))

    def score(module, hidden_states, keys, values, attentions, kwargs):
        current["layer"] = module.layer_idx
        s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
        if keys.shape[2] == t:  # BlockPress also scores partial blocks
            stash[module.layer_idx] = s.detach().clone()
        return s

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        new_k, new_v = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        if name.startswith("rerotate_"):
            idx = stash[layer].topk(compute_n_kept(t, ratio), dim=-1).indices.sort(-1).values
            gathered = values.gather(2, idx[..., None].expand(-1, -1, -1, head_dim))
            assert torch.equal(gathered, new_v), f"{name} layer {layer}: values differ"
            np.put_along_axis(keep[layer], idx[0].numpy(), True, axis=-1)
            if keys_out is not None:
                keys_out[layer] = new_k[0].numpy().copy()  # [KVH, n_kept, D]
            return new_k, new_v
        keep[layer] = kept_from_cache(keys, new_k)
        if not wrapped:
            s = stash[layer][0].numpy().astype(np.float64)  # [KVH, T]
            n_kept = compute_n_kept(t, ratio)
            idx = stash[layer].topk(n_kept, dim=-1).indices[0].numpy()
            m = np.zeros((kvh, t), bool)
            np.put_along_axis(m, idx, True, axis=-1)
            assert (m == keep[layer]).all(), f"{name} layer {layer}: topk and cache disagree"
            for h in range(kvh):
                boundary = s[h][m[h]].min()
                finite = s[h][np.isfinite(s[h])]
                band[layer, h] = np.abs(s[h] - boundary) <= BAND_RTOL * finite.std()
                evicted = s[h][~m[h]]
                margin[layer, h] = boundary - evicted.max() if evicted.size else np.inf
        return new_k, new_v

    scorer.score, press.compress = score, compress
    torch.randn = randn
    try:
        from transformers import DynamicCache
        inp = torch.from_numpy(ids.astype(np.int64))[None]
        with torch.no_grad(), press(model):
            out = model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
    finally:
        torch.randn = orig_randn
    cache = out.past_key_values
    lens = np.asarray([cache.layers[i].keys.shape[2] for i in range(n_layers)])
    assert (lens == keep.sum(-1)[:, 0]).all(), (lens, keep.sum(-1))
    return keep, (None if wrapped else band), (None if wrapped else margin)


def main_zoo(args) -> int:
    import torch

    import kvpress  # noqa: F401  (patches the attention functions, as kvpress always does)

    names = args.only.split(",") if args.only else ZOO_PRESSES
    out_path = args.out or str(ZOO_OUT)
    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    out: dict[str, np.ndarray] = {}
    if args.only and Path(out_path).exists():  # add to (or redo part of) an existing file
        with np.load(out_path) as old:
            out.update({k: old[k] for k in old.files})
        names_all = list(dict.fromkeys([str(p) for p in out["presses"]] + names))
    else:
        names_all = names
    full = TEXT_PATH.read_text(encoding="utf-8")
    ctx_ids = {}
    for c, (offset, n) in CONTEXTS.items():
        start = full.index("\n\n", offset) + 2
        text = full[start: start + PASSAGE_CHARS]
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n], np.int32)
        ctx_ids[c] = out[f"ctx{c}_ids"] = ids
    t0 = time.perf_counter()
    for name in names:
        for c, ids in ctx_ids.items():
            for ratio in RATIOS:
                t1 = time.perf_counter()
                torch.manual_seed(SEED)
                keys_out = {}
                keep, band, margin = run_zoo_press(model, torch, ids, name, ratio, n_layers,
                                                   kvh, head_dim, keys_out)
                prefix = f"ctx{c}_{name}_r{ratio:.2f}"
                for layer in KEYS_STORED.get((name, c, ratio), ()):
                    out[f"{prefix}_keys_l{layer}"] = keys_out[layer]
                out[f"{prefix}_keep"] = np.packbits(keep.ravel())
                extra = ""
                if band is not None:
                    out[f"{prefix}_band"] = np.packbits(band.ravel())
                    out[f"{prefix}_margin"] = margin
                    extra = (f", min margin {margin.min():.3g}, {int((margin == 0).sum())} "
                             f"rows tied, band {int(band.sum(-1).max())} max/row")
                print(f"{prefix}: kept/row {keep.sum(-1).min()}-{keep.sum(-1).max()} of "
                      f"{len(ids)}{extra} ({time.perf_counter() - t1:.1f}s)", flush=True)
    timings["presses"] = time.perf_counter() - t0
    out.update(provenance(info, n_layers, kvh))
    out["presses"] = np.asarray(names_all)
    save_golden(out_path, out, timings)
    return 0



def provenance(info: dict, n_layers: int, kv_heads: int) -> dict:
    """What made a zoo golden: the library versions, the GGUF's hash, the model's shape and the
    tie band's tolerance (stored beside the kept positions)."""
    import torch
    import transformers
    return {"kvpress_version": np.asarray(metadata.version("kvpress")),
            "transformers_version": np.asarray(transformers.__version__),
            "torch_version": np.asarray(torch.__version__),
            "gguf_sha256": np.asarray(info["gguf_sha256"]),
            "num_layers": np.int32(n_layers), "kv_heads": np.int32(kv_heads),
            "band_rtol": np.float64(BAND_RTOL)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=None, help=f"output .npz path (default {ZOO_OUT})")
    ap.add_argument("--only", help="comma-separated press names of ZOO_PRESSES (default: all); "
                                   "the rest of an existing --out file is kept")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(ZOO_PRESSES) if args.only else set()
    if unknown:
        ap.error(f"--only: unknown press {sorted(unknown)}; choose from {', '.join(ZOO_PRESSES)}")
    return main_zoo(args)


if __name__ == "__main__":
    sys.exit(main())
