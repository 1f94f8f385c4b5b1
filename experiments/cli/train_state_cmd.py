"""`kvjax train-state`: train feature maps for `linear_state` / `fold` (`models.train_state`).

The arguments live here, not in `models`, so that building the `kvjax` parser imports neither
Flax nor the model code (`kvjax run-exported` runs without them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_TEXT = Path(__file__).parents[1] / "data" / "devils_dictionary.txt"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `kvjax train-state`."""
    p.add_argument("--out", required=True, help="directory for the maps (orbax), the loss "
                   "curve PNG and a JSON summary")
    p.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    p.add_argument("--data", nargs="+", default=[str(DEFAULT_TEXT)],
                   help="text files to train on (default: The Devil's Dictionary; the "
                   "perplexity eval reads KJV Genesis, so the two do not overlap)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per window")
    p.add_argument("--queries", type=int, default=128, help="continuation queries scored "
                   "per window (the rest is the compressed prefix)")
    p.add_argument("--windows", type=int, default=16, help="training windows")
    p.add_argument("--heldout", type=int, default=4, help="held-out windows (after the "
                   "training ones) for the error report")
    p.add_argument("--features", type=int, default=64, help="features per map (even)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--keep", type=float, default=0.25, help="fraction of tokens kept exact "
                   "in the training eviction pattern")
    p.add_argument("--batch", type=int, default=2, help="windows per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def run(args: argparse.Namespace) -> int:
    """Train, save the maps, the curve and a summary; print the summary's headline (one JSON
    object with `--json`: out, seconds, first_loss, last_loss, heldout_mean)."""
    from models.train_state import run as train

    summary = train(args)
    head = {"out": str(args.out), **{k: summary[k] for k in ("seconds", "first_loss",
                                                             "last_loss", "heldout_mean")}}
    if args.json:
        print(json.dumps(head, allow_nan=False))
    else:
        held = ", ".join(f"{name} {value:.4g}" for name, value in head["heldout_mean"].items())
        print(f"wrote maps to {args.out} in {head['seconds']:.1f} s: loss "
              f"{head['first_loss']:.4g} -> {head['last_loss']:.4g}; held-out mean {held}")
    return 0
