"""How well KVzap's surrogates predict KVzip+ on text they never saw, and the surrogate kvjax
ships for SmolLM2.

    python experiments/eval/kvzap_fit.py --out docs/results/kvzap \\
        --save experiments/data/kvzap/SmolLM2-135M-Instruct-linear

Training data as `kvjax calibrate --kvzap` makes it (`models.calibration.kvzap_training_data`:
each layer's attention input of 512 tokens drawn from every 1,024-token window, and the log of
their KVzip+ scores behind kvpress's chat prompt): The Devil's Dictionary's last 32,768 tokens
to train, KJV Genesis's first 8,192 to score. Fits the linear surrogate (ridge) and MLPs of
several widths (optax); writes `fit.json` (held-out R^2 and Spearman rank correlation, the mean
over layers and KV heads, per surrogate) and saves the `--kind` surrogate (default: linear, the
better held-out fit at this amount of data) with orbax at `--save`. The data is cached in
`--cache` (an .npz; ~9 minutes to make on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

TRAIN_TEXT = Path("experiments/data/devils_dictionary.txt")
EVAL_TEXT = Path("experiments/data/kjv_genesis.txt")


def windows(tokenizer, path: Path, tokens: int, window: int, last: bool) -> list[list[int]]:
    ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    ids = ids[-tokens:] if last else ids[:tokens]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def main(argv=None) -> int:
    from kvjax.policies.eviction_kvzap import KINDS, fit_linear, fit_mlp, fit_quality

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/kvzap"))
    ap.add_argument("--save", type=Path, help="orbax directory for the --kind surrogate")
    ap.add_argument("--kind", choices=KINDS, default="linear")
    ap.add_argument("--hidden", type=int, default=64, help="a saved MLP's hidden units")
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 64],
                    help="MLP widths compared in fit.json")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--train-tokens", type=int, default=32768)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/kvzap_data_32k.npz"))
    args = ap.parse_args(argv)

    if args.cache.is_file():
        with np.load(args.cache) as f:
            data = dict(f)
    else:
        from models.calibration import kvzap_training_data
        from models.loading import load_model
        from models.reconstruction import chat_prompt

        model, tokenizer = load_model("smollm2")
        prompt = chat_prompt(tokenizer)
        start = time.perf_counter()
        data = {}
        for split, path, tokens, last in (("train", TRAIN_TEXT, args.train_tokens, True),
                                          ("eval", EVAL_TEXT, args.eval_tokens, False)):
            x, y = kvzap_training_data(model, windows(tokenizer, path, tokens, args.window, last),
                                       prompt, samples=args.samples)
            data |= {f"{split}_x": x, f"{split}_y": y}
        data["seconds"] = np.float64(time.perf_counter() - start)
        np.savez(args.cache, **data)
    x, y, ex, ey = data["train_x"], data["train_y"], data["eval_x"], data["eval_y"]
    rows = []
    fits = [("linear", None)] + [("mlp", w) for w in args.widths]
    chosen = None
    for kind, width in fits:
        start = time.perf_counter()
        surrogate = fit_linear(x, y) if kind == "linear" else fit_mlp(x, y, hidden=width)
        seconds = time.perf_counter() - start
        held = fit_quality(surrogate, ex, ey)
        rows.append({"kind": kind, "hidden": width, "fit_seconds": round(seconds, 2),
                     "parameters": int(sum(getattr(surrogate, n).size for n in ("w1", "b1", "w2", "b2")
                                           if getattr(surrogate, n) is not None)),
                     "held_out_r2": held["r2"], "held_out_spearman": held["spearman"],
                     "train_spearman": fit_quality(surrogate, x, y)["spearman"]})
        print(json.dumps(rows[-1]), flush=True)
        if kind == args.kind and (kind == "linear" or width == args.hidden):
            chosen = surrogate
    if chosen is None:
        chosen = fit_linear(x, y) if args.kind == "linear" else fit_mlp(x, y, hidden=args.hidden)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"command": " ".join(["python experiments/eval/kvzap_fit.py",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "train": f"{TRAIN_TEXT.name}, last {args.train_tokens} tokens",
               "eval": f"{EVAL_TEXT.name}, first {args.eval_tokens} tokens",
               "window": args.window, "samples_per_window": args.samples,
               "train_tokens_sampled": int(len(x)), "eval_tokens_sampled": int(len(ex)),
               "collect_seconds": round(float(data.get("seconds", 0.0)), 1), "fits": rows}
    (args.out / "fit.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.save is not None:
        import shutil
        if args.save.exists():
            shutil.rmtree(args.save)
        chosen.save(args.save)
        print(f"saved the {chosen.kind} surrogate -> {args.save}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
