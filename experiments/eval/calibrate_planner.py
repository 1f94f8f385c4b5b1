"""Measure `auto`'s per-layer damage table on calibration text; write it where `auto` reads it.

For each window of the calibration text, the model prefills the `prefix` tokens alone
(collecting its last `window` queries and, for `--score`s that read them, its query moments)
and `prefix + probe` (collecting the last `probe` queries). Per layer and candidate config
(keep share, bits, key coding) of `kvjax.policies.planner.CONFIGS`, the prefix's cache is
compressed as `auto` would, tokens ranked by `--score` from the prefix's statistics only, and
the attention output of the `probe` queries *after* it (the continuation's, never seen by
the selection) is compared with the full prefix's (`planner.config_damage`). The table is
the mean over windows.

    python experiments/eval/calibrate_planner.py --target attention   # 2 windows, 768+32

With `--target kl` (the shipped table) a layer's damage is end to end instead: the mean
KL divergence of the model's next-token distributions over the `probe` continuation tokens
when that layer alone is stored as `auto` would store it and every other layer is full
(`planner.stored_in_place`; one whole-model program, run per layer and config). It
measures what the attention-output error cannot: how much a layer's error matters to the
model's output. The planner adds the layers' damages (a first-order model).

    python experiments/eval/calibrate_planner.py --target kl   # 4 windows of 768+64 (27 min)

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

    select_spec = _select_spec(score, window)
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


def kl_table(model, tokenizer, text: Path, windows: int, prefix: int, probe: int, window: int,
             score: str = "mixed") -> np.ndarray:
    """[L, len(CONFIGS)] mean KL(full || stored) of the next-token distributions over the
    `probe` tokens after each window's `prefix`, with one layer stored as `auto` would (tokens
    ranked by `score` from the prefix's own statistics) and the others full; mean over the
    windows."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments.eval.ppl import window_ids
    from models.sampler import prefill_batch

    @nnx.jit
    def log_probs(model, tokens, positions, cache):
        return jax.nn.log_softmax(model(tokens, positions, cache)[0], axis=-1)  # [1, T, V]

    @nnx.jit
    def kl(model, tokens, positions, cache, full):
        return jnp.mean(jnp.sum(jnp.exp(full) * (full - log_probs(model, tokens, positions,
                                                                    cache)), axis=-1))

    total = 0.0
    for ids in window_ids(tokenizer, text, prefix + probe, windows):
        pre = prefill_batch(model, [ids[:prefix]], stats=_select_spec(score, window),
                            room=probe)
        tokens = jnp.asarray([ids[prefix:]], jnp.int32)
        positions = jnp.arange(prefix, prefix + probe, dtype=jnp.int32)[None]
        full = log_probs(model, tokens, positions, pre.cache)
        table = np.zeros((len(pre.cache), len(planner.CONFIGS)))
        for l, (layer, select) in enumerate(zip(pre.cache, pre.stats)):
            for j, (keep, bits, keys) in enumerate(planner.CONFIGS):
                stored = planner.stored_in_place(layer, select, keep, bits, keys, window, score)
                cache = pre.cache[:l] + (stored,) + pre.cache[l + 1:]
                table[l, j] = max(float(kl(model, tokens, positions, cache, full)), 0.0)
        total = total + table
    return total / windows


def _select_spec(score: str, window: int) -> StatsSpec:
    """What the selection reads: the last `window` queries, and for the scores that read
    them the query moments (ExpectedAttention's, its sinks skipped)."""
    moments = score != "attention"
    return StatsSpec(window=window, query_moments=moments,
                     moments_skip=ExpectedAttentionScorer.sinks if moments else 0)


def _rounded(a: np.ndarray) -> list:
    """Nested lists of `a` to 4 significant digits (KLs of 1e-7 keep their size)."""
    return np.vectorize(lambda x: float(f"{x:.4g}"))(a).tolist()


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", type=Path, default=Path("experiments/data/devils_dictionary.txt"))
    ap.add_argument("--target", choices=("kl", "attention"), default="kl",
                    help="a layer's damage: the model's KL end to end (the file's `kl` entry), "
                         "or its attention output's error (the table, signals and controller)")
    ap.add_argument("--windows", type=_positive, help="default 4 for kl, 2 for attention")
    ap.add_argument("--prefix", type=_positive, default=768)
    ap.add_argument("--probe", type=_positive, help="default 64 for kl, 32 for attention")
    ap.add_argument("--window", type=_positive, default=32)
    ap.add_argument("--score", choices=planner.SCORES,
                    help="what ranks the tokens while measuring (auto's `score`); default "
                         "mixed for kl, attention for attention")
    ap.add_argument("--out", type=Path, default=planner.CALIBRATION)
    args = ap.parse_args(argv)
    kl = args.target == "kl"
    windows = args.windows or (4 if kl else 2)
    probe = args.probe or (64 if kl else 32)
    score = args.score or ("mixed" if kl else "attention")
    out = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if kl and [tuple(c) for c in out.get("configs", planner.CONFIGS)] != list(planner.CONFIGS):
        ap.error(f"--out {args.out} holds a table for other configs; name a new file")
    from models.loading import load_model
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    source = (f"{args.model} on {args.text.name}, {windows} windows of {args.prefix}+{probe} "
              f"tokens, tokens ranked by {score}")
    if kl:
        table = kl_table(model, tokenizer, args.text, windows, args.prefix, probe,
                         args.window, score)
        out["kl"] = {"source": source, "damage": _rounded(table),
                     "seconds": round(time.perf_counter() - start, 1)}
        out.setdefault("configs", [list(c) for c in planner.CONFIGS])
    else:  # the attention-output table and the controller's signals; a kl entry stays
        table, signals = damage_table(model, tokenizer, args.text, windows, args.prefix,
                                      probe, args.window, score)
        out = {"source": source, "configs": [list(c) for c in planner.CONFIGS],
               "damage": np.round(table, 6).tolist(), "signal_names": list(planner.SIGNALS),
               "signals": np.round(signals, 6).tolist(),
               "seconds": round(time.perf_counter() - start, 1),
               **({"kl": out["kl"]} if "kl" in out else {})}
    args.out.write_text(json.dumps(out) + "\n")
    print(f"wrote {args.out} ({args.target}): {table.shape[0]} layers x {table.shape[1]} "
          f"configs in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
