"""KVzap on SmolLM2 beside its neighbours: continuation perplexity and the fraction of tokens
each method keeps, on text the surrogate never saw.

    python experiments/eval/kvzap_ppl.py --out docs/results/kvzap \\
        --weights experiments/data/kvzap/SmolLM2-135M-Instruct-linear

`kvjax ppl`'s measure (`experiments.eval.ppl.perplexity`): 4 windows of KJV Genesis, 1,024
tokens each, the first 768 compressed, the last 256 scored. `kept` is the mean over windows,
layers and KV heads of the tokens a method keeps of the 768 (kvpress's compression ratio is
1 - kept); a threshold's count follows the text, so it is measured, not chosen.
`cache_bytes` is the compressed prefix as the run stores it (float32), `full_bf16_bytes` the
uncompressed one in bfloat16 (`kvjax ppl --json`'s fields). `{W}` in a method is replaced by
`--weights`. Rows go to `ppl.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

TEXT = Path("experiments/data/kjv_genesis.txt")
METHODS = ["full", "expected_attention:ratio=0.5", "expected_attention:ratio=0.75",
           "kvzip:ratio=0.5", "kvzip:ratio=0.75", "kvzip:ratio=0.5,plus=true",
           "kvzip:ratio=0.75,plus=true", "kvzap:ratio=0.5,weights={W}",
           "kvzap:ratio=0.75,weights={W}"] + \
    [f"kvzap:threshold={t},weights={{W}}" for t in (-6, -5, -4.5, -4, -3.5)]


def kept_fraction(model, windows: list[list[int]], transform) -> float:
    """Mean over windows, layers and KV heads of the tokens `transform` keeps of each window."""
    import kvjax
    from models.sampler import prefill_and_compress
    pre = prefill_and_compress(model, windows, transform=transform, shrink=False)
    valid = np.stack([np.asarray(kvjax.num_valid(layer)) for layer in pre.cache])  # [L, B, KVH]
    return float(valid.mean() / len(windows[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/kvzap"))
    ap.add_argument("--weights", required=True, help="a KVzap surrogate (orbax directory)")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--windows", type=int, default=4)
    args = ap.parse_args(argv)

    from experiments.eval.ppl import perplexity
    from kvjax import parse_method
    from models.loading import load_model
    from models.reconstruction import with_tokenizer

    model, tokenizer = load_model("smollm2")
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:args.context * args.windows]
    prefixes = [ids[i:i + args.prefix] for i in range(0, len(ids), args.context)]
    rows = []
    for spec in args.methods:
        method = spec.replace("{W}", args.weights)
        transform = with_tokenizer(parse_method(method), tokenizer)
        start = time.perf_counter()
        r = perplexity(model, ids, args.context, prefix=args.prefix, transform=transform,
                       batch_size=args.windows)
        kept = 1.0 if method == "full" else kept_fraction(model, prefixes, transform)
        rows.append({"method": spec.replace("{W}", "W"), "ppl": round(r.ppl, 4),
                     "kept": round(kept, 4), "cache_bytes": r.cache_bytes,
                     "full_bf16_bytes": r.full_bf16_bytes,
                     "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ppl.json").write_text(json.dumps({
        "command": " ".join(["python experiments/eval/kvzap_ppl.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "text": f"{TEXT.name}, {args.windows} windows of {args.context}, the first "
                f"{args.prefix} compressed", "weights": args.weights, "rows": rows},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
