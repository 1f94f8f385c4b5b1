"""Measure `auto`'s per-layer damage table on calibration text; write it where `auto` reads it.

For each window of the calibration text, the model prefills the `prefix` tokens alone
(collecting its last `window` queries and, for `--score`s that read them, its query moments)
and `prefix + probe` (collecting the last `probe` queries). Per layer and candidate config
(keep share, bits, key coding) of `kvjax.policies.planner.CONFIGS`, the prefix's cache is
compressed as `auto` would, tokens ranked by `--score` from the prefix's statistics only, and
the attention output of the `probe` queries *after* it (the continuation's, never seen by
the selection) is compared with the full prefix's (`planner.config_damage`). The table is
the mean over windows.

    python experiments/eval/calibrate_planner.py --text experiments/data/devils_dictionary.txt \\
        --windows 2 --prefix 768 --out kvjax/policies/planner_calibration.json

Calibrate on one text and evaluate on another (docs/RESULTS.md uses Genesis for evaluation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvjax.core.stats import StatsSpec
from kvjax.policies import planner
from kvjax.policies.eviction import ExpectedAttentionScorer


def damage_table(model, tokenizer, text: Path, windows: int, prefix: int, probe: int,
                 window: int, score: str = "attention") -> tuple[np.ndarray, np.ndarray]:
    """([L, len(CONFIGS)] mean relative attention-output error per layer and config,
    [L, len(CONFIGS), len(SIGNALS)] the controller's signals, mean over the windows).

    The selection sees only the prefix: its cache and statistics come from a prefill of the
    prefix alone (its last `window` queries and, for `score`s that read them, its query
    moments); the `probe` queries after it come from a prefill of prefix + probe."""
    from experiments.eval.ppl import window_ids
    from models.sampler import prefill_batch

    moments = score != "attention"
    select_spec = StatsSpec(window=window, query_moments=moments,
                            moments_skip=ExpectedAttentionScorer.sinks if moments else 0)
    total, total_signals = None, None
    for ids in window_ids(tokenizer, text, prefix + probe, windows):
        pre = prefill_batch(model, [ids[:prefix]], stats=select_spec)
        after = prefill_batch(model, [ids], stats=StatsSpec(window=probe))
        rows, signals = [], []
        for prefix_layer, select, probed in zip(pre.cache, pre.stats, after.stats):
            eval_q, eval_pos = probed.queries, probed.query_pos
            rows.append([float(planner.config_damage(prefix_layer, select, eval_q, eval_pos,
                                                     keep, bits, keys, window, score))
                         for keep, bits, keys in planner.CONFIGS])
            signals.append([np.asarray(planner.config_signals(prefix_layer, select, keep, bits,
                                                              keys, window))
                            for keep, bits, keys in planner.CONFIGS])
        table, signals = np.array(rows), np.array(signals)
        total = table if total is None else total + table
        total_signals = signals if total_signals is None else total_signals + signals
    return total / windows, total_signals / windows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", type=Path, default=Path("experiments/data/devils_dictionary.txt"))
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--probe", type=int, default=32)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--score", choices=planner.SCORES, default="attention",
                    help="what ranks the tokens while measuring (auto's `score`)")
    ap.add_argument("--out", type=Path, default=planner.CALIBRATION)
    args = ap.parse_args(argv)
    from models.loading import load_model
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    table, signals = damage_table(model, tokenizer, args.text, args.windows, args.prefix,
                                  args.probe, args.window, args.score)
    out = {"source": f"{args.model} on {args.text.name}, {args.windows} windows of "
                     f"{args.prefix}+{args.probe} tokens, tokens ranked by {args.score}",
           "configs": [list(c) for c in planner.CONFIGS],
           "damage": np.round(table, 6).tolist(),
           "signal_names": list(planner.SIGNALS),
           "signals": np.round(signals, 6).tolist(),
           "seconds": round(time.perf_counter() - start, 1)}
    args.out.write_text(json.dumps(out) + "\n")
    print(f"wrote {args.out}: {table.shape[0]} layers x {table.shape[1]} configs "
          f"in {out['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
