"""Goldens for continuation perplexity: ``python experiments/golden/make_kvpress_ppl.py``.

What it makes
-------------
``tests/golden/kvpress_ppl.json``, made by running kvpress 0.5.5 (never kvjax) on the real
SmolLM2-135M-Instruct (the same GGUF, transformers model, float32, sdpa attention), batch 1:
for each text, one window of ``WINDOW`` tokens (the text's first, tokenized by transformers'
tokenizer), its first ``PREFIX`` prefilled under the press, the other ``WINDOW - PREFIX``
scored teacher-forced on the compressed cache
(``experiments.eval.kvpress_engine.continuation_nll``: the first by the prefill's last
logit, the rest fed at their own positions after the uncompressed prefix, as kvpress's
pipeline feeds a question). One row per (text, method): the token ids of each text, and per
row the method's kvjax spec, the press kvpress built, the summed NLL in nats, the tokens
scored and the perplexity.

The methods: `full` and every method `experiments.eval.kvpress_engine.parse_press_spec`
maps to a press (the spec `kvjax methods` publishes), at ratio 0.5 on KJV Genesis and 0.75
on The Devil's Dictionary; QFilterPress, LUKVPress, KVzapPress, FastKVzipPress, DuoAttentionPress
and RestoreKVPress read the artifact kvjax calibrated or trained (`ARTIFACT_FILES`) in place of
the hub's. LeverageScorePress (and CompactorPress, which contains one) gets
kvjax's Gaussian sketch instead of its own `torch.randn` draw (`kvjax_sketches`).

How to run (the ``compare`` extra; about ten minutes on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_ppl.py [--gguf PATH] [--out PATH] [--only SPECS]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from importlib import metadata

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference
from experiments.golden.make_kvpress import ATTN, REPO_ROOT, SEED
from experiments.golden.make_kvpress_zoo import SKETCH_DIM, jax_sketch

OUT = REPO_ROOT / "tests" / "golden" / "kvpress_ppl.json"
WINDOW, PREFIX = 1024, 768  # kvjax eval's ppl cells: PPL_PREFIX = 0.75 of the window
TEXTS = {"kjv_genesis": 0.5, "devils_dictionary": 0.75}  # text -> the ratio its rows use


# the artifact files the specs of hub-artifact presses name (PATH in `kvjax methods`): made by
# kvjax (`kvjax calibrate --qfilters` / `--lukv` on SmolLM2, defaults), handed to both engines
ARTIFACT_FILES = {"qfilter": "{golden}/smollm2_qfilters.npz",
                  "lukv": "{golden}/smollm2_lukv_curve.npz",
                  "kvzap": "{repo}/experiments/data/kvzap/SmolLM2-135M-Instruct-linear",
                  "fastkvzip": "{repo}/experiments/data/fastkvzip/SmolLM2-135M-Instruct",
                  "duo_attention": "{repo}/experiments/data/duo/SmolLM2-135M-Instruct.npz",
                  "restorekv": "{repo}/experiments/data/restorekv/SmolLM2-135M-Instruct"}


# rows beyond each method's published spec: a wrapper around a scorer that reads its own
# statistics of each part (ChunkPress around SnapKV: three chunks of the 768-token prefix)
MORE_SPECS = ["chunk:inner=snapkv,ratio={r},chunk_length=256"]


def methods(ratio: float) -> list[str]:
    """`full`, each method kvpress runs here as the spec `kvjax methods` publishes (its PATH
    replaced by `ARTIFACT_FILES`'s; `resolve` makes the path real), and `MORE_SPECS`."""
    from experiments.eval.kvpress_engine import _published
    from kvjax.policies.methods import METHOD_INFO

    specs = [METHOD_INFO[m].spec.format(r=ratio).replace("PATH", ARTIFACT_FILES.get(m, "PATH"))
             .replace("DIR", ARTIFACT_FILES.get(m, "DIR"))
             for m in sorted(METHOD_INFO) if _published(m) is not None]
    return ["full"] + specs + [s.format(r=ratio) for s in MORE_SPECS]


def resolve(spec: str) -> str:
    """A golden row's spec with `{golden}` as the folder of the goldens."""
    return spec.replace("{golden}", str(REPO_ROOT / "tests" / "golden")).replace(
        "{repo}", str(REPO_ROOT))


@contextlib.contextmanager
def kvjax_sketches(press, torch, kvh: int, head_dim: int):
    """LeverageScorePress (alone or inside CompactorPress) draws its Gaussian sketch with
    `torch.randn`; inside this block it gets the draw kvjax makes for the layer instead
    (`make_kvpress_zoo.jax_sketch`, as the zoo's position goldens do), so the two compare the
    same scores rather than two random draws."""
    from kvpress import LeverageScorePress

    found = [p for p in (press, getattr(press, "_leverage_press", None))
             if isinstance(p, LeverageScorePress)]
    if not found:
        yield
        return
    layer, orig_randn, orig_score = {}, torch.randn, found[0].score

    def score(module, *args, **kwargs):
        layer["index"] = module.layer_idx
        return orig_score(module, *args, **kwargs)

    def randn(*shape, **kw):
        assert tuple(shape) == (1, kvh, head_dim, SKETCH_DIM), shape
        return jax_sketch(layer["index"], kvh, head_dim).to(kw.get("dtype", torch.float32))

    found[0].score, torch.randn = score, randn
    try:
        yield
    finally:
        found[0].score, torch.randn = orig_score, orig_randn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(OUT), help=f"output .json (default {OUT})")
    ap.add_argument("--only", help="comma-separated method names (default: all); the other "
                                   "rows of an existing --out file are kept")
    args = ap.parse_args(argv)
    import torch

    from experiments.eval.kvpress_engine import continuation_nll, press_for

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    only = set(args.only.split(",")) if args.only else None
    out_path = Path(args.out)
    old = json.loads(out_path.read_text()) if only and out_path.exists() else {"rows": []}
    rows = [r for r in old["rows"] if only and r["spec"].split(":")[0] not in only]
    ids = {}
    for text, ratio in TEXTS.items():
        path = REPO_ROOT / "experiments" / "data" / f"{text}.txt"
        ids[text] = tok(path.read_text(encoding="utf-8"), add_special_tokens=False)[
            "input_ids"][:WINDOW]
        for spec in methods(ratio):
            if only and spec.split(":")[0] not in only:
                continue
            start = time.perf_counter()
            press = press_for(resolve(spec))
            torch.manual_seed(SEED)
            cfg = model.config
            with kvjax_sketches(press, torch, cfg.num_key_value_heads, cfg.head_dim):
                nll, scored = continuation_nll(model, tok, press, ids[text], PREFIX)
            ppl = float(torch.exp(torch.tensor(nll / scored, dtype=torch.float64)))
            rows.append(dict(text=text, spec=spec, press=type(press).__name__, nll=nll,
                             tokens_scored=scored, ppl=ppl))
            print(f"{text} {spec}: ppl {ppl:.6f} ({time.perf_counter() - start:.1f} s)",
                  flush=True)
    out = dict(window=WINDOW, prefix=PREFIX, ids=ids, rows=rows,
               kvpress_version=metadata.version("kvpress"),
               transformers_version=metadata.version("transformers"),
               torch_version=torch.__version__, gguf_sha256=info["gguf_sha256"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
