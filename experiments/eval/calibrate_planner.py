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
The file records the model's shape (layers, KV heads, head dim). For another model, write
its own file and name it in the method (`kvjax.policies.planner.auto`'s `calibration`):

    python experiments/eval/calibrate_planner.py --model PATH --out my_model.json
    kvjax ppl --model PATH --method auto:budget=0.125,calibration=my_model.json
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


def damage_table(model, windows: list[list[int]], prefix: int, window: int,
                 score: str = "attention") -> tuple[np.ndarray, np.ndarray]:
    """([L, len(CONFIGS)] mean relative attention-output error per layer and config,
    [L, len(CONFIGS), len(SIGNALS)] the controller's signals, mean over the windows).

    The selection sees only the prefix: its cache and statistics come from a prefill of the
    prefix alone (its last `window` queries and, for `score`s that read them, its query
    moments); the queries after it (each window's tokens past `prefix`) come from a prefill
    of the whole window."""
    from models.sampler import prefill_batch

    select_spec = _select_spec(score, window)
    total, total_signals = None, None
    for ids in windows:
        pre = prefill_batch(model, [ids[:prefix]], stats=select_spec)
        after = prefill_batch(model, [ids], stats=StatsSpec(window=len(ids) - prefix))
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
    return total / len(windows), total_signals / len(windows)


def kl_table(model, windows: list[list[int]], prefix: int, window: int,
             score: str = "mixed") -> np.ndarray:
    """[L, len(CONFIGS)] mean KL(full || stored) of the next-token distributions over each
    window's tokens after its `prefix`, with one layer stored as `auto` would (tokens ranked
    by `score` from the prefix's own statistics) and the others full; mean over the
    windows."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.sampler import prefill_batch

    @nnx.jit
    def log_probs(model, tokens, positions, cache):
        return jax.nn.log_softmax(model(tokens, positions, cache)[0], axis=-1)  # [1, T, V]

    @nnx.jit
    def kl(model, tokens, positions, cache, full):
        return jnp.mean(jnp.sum(jnp.exp(full) * (full - log_probs(model, tokens, positions,
                                                                    cache)), axis=-1))

    total = 0.0
    for ids in windows:
        probe = len(ids) - prefix
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
    return total / len(windows)


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


def calibration(model, windows: list[list[int]], target: str = "kl", prefix: int = 768,
                window: int = 32, score: str | None = None, source: str = "",
                existing: dict | None = None) -> dict:
    """The calibration file's content for `model` from token `windows` (each `prefix`
    tokens, then the probe): `existing` (a file read before) with the `target` table
    ("kl" or "attention") measured anew. `auto(calibration=...)` reads what this returns.

    ValueError when `existing` holds tables of another model's shape or other configs, or
    a window does not fit the model's positions."""
    if target not in ("kl", "attention"):
        raise ValueError(f"target must be 'kl' or 'attention', got {target!r}")
    cfg = model.config
    shape = {"layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
    out = dict(existing or {})
    if [tuple(c) for c in out.get("configs", planner.CONFIGS)] != list(planner.CONFIGS):
        raise ValueError(f"the calibration to extend holds tables for other configs "
                         f"({len(out['configs'])}, not {len(planner.CONFIGS)}): write a new file")
    if out.get("shape", shape) != shape:
        raise ValueError(f"the calibration to extend holds tables of a model of shape "
                         f"{out['shape']}, this model is {shape}: write a new file")
    longest = max(len(ids) for ids in windows)
    if longest > cfg.max_position or min(len(ids) for ids in windows) <= prefix:
        raise ValueError(f"windows of {longest} tokens after a prefix of {prefix} must have a "
                         f"probe and fit the model's {cfg.max_position} positions")
    start = time.perf_counter()
    if target == "kl":
        table = kl_table(model, windows, prefix, window, score or "mixed")
        out["kl"] = {"source": source, "damage": _rounded(table),
                     "seconds": round(time.perf_counter() - start, 1)}
        out.setdefault("configs", [list(c) for c in planner.CONFIGS])
        out["shape"] = shape
        return out
    table, signals = damage_table(model, windows, prefix, window, score or "attention")
    return {"source": source, "shape": shape, "configs": [list(c) for c in planner.CONFIGS],
            "damage": np.round(table, 6).tolist(), "signal_names": list(planner.SIGNALS),
            "signals": np.round(signals, 6).tolist(),
            "seconds": round(time.perf_counter() - start, 1),
            **({"kl": out["kl"]} if "kl" in out else {})}  # a kl entry stays


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
    existing = json.loads(args.out.read_text()) if args.out.is_file() else {}
    from experiments.eval.ppl import window_ids
    from models.loading import load_model
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    source = (f"{args.model} on {args.text.name}, {windows} windows of {args.prefix}+{probe} "
              f"tokens, tokens ranked by {score}")
    try:
        out = calibration(model, window_ids(tokenizer, args.text, args.prefix + probe, windows),
                          args.target, args.prefix, args.window, score, source, existing)
    except ValueError as e:  # refused before anything is measured
        ap.error(f"{e} (--prefix {args.prefix}, --probe {probe}, --out {args.out}, "
                 f"--text {args.text})")
    args.out.write_text(json.dumps(out) + "\n")
    layers = len(out["kl"]["damage"] if kl else out["damage"])
    print(f"wrote {args.out} ({args.target}): {layers} layers x {len(planner.CONFIGS)} "
          f"configs in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
