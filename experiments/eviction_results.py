"""Eviction policies on SmolLM2: passkey retrieval and continuation perplexity by ratio.

    python experiments/eviction_results.py                    # everything, ~1 h on 2 cores
    python experiments/eviction_results.py --lengths 1024 --trials 5 --tasks passkey

For every policy and compression ratio (fraction of the context evicted,
kvpress's convention) beside the full cache:

* passkey: a 5-digit key hidden at depths 0.1 ... 0.9 in `length` tokens of
  real prose (`experiments/passkey.py`); the context is compressed before the
  question is seen (query-agnostic, kvpress's protocol), then the question is
  appended and 8 tokens are decoded greedily. Score: the key is the first
  5-digit number of the answer. `snapkv_query_aware` instead prefills the
  question with the context, so SnapKV's window is the question.
* ppl: windows of `--ppl-context` tokens of KJV Genesis; each window's first
  `--prefix` tokens are compressed, the rest are fed on top and scored (the
  same as `kvjax ppl --prefix`).

One batched prefill per task, length and batch collects every statistic the
policies need; each policy then compresses a copy of that cache. Results
append to `<out>/eviction_passkey.jsonl` (one row per cell and batch of
trials) and `<out>/eviction_ppl.jsonl` (one row per cell); a rerun skips
what is already there (delete a file to redo it), so a sweep killed midway
(long sweeps grow in memory) loses at most one batch. `--plot-only` redraws `<out>/eviction_*.png` and the markdown tables.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from experiments.ppl import window_ids

POLICIES = ("streaming_llm", "sliding_window", "snapkv", "pyramidkv", "adakv_snapkv", "tova",
            "h2o", "expected_attention", "knorm", "random", "snapkv_query_aware")
QUERY_AWARE = "_query_aware"  # the question is prefilled with the context and scores it
RATIOS = (0.25, 0.5, 0.75, 0.9)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def make_transform(name: str, ratio: float):
    """The kvjax transform for a policy name at a compression ratio (defaults as kvpress)."""
    import kvjax

    if name == "full":
        return kvjax.full()
    if name == "sliding_window":
        return kvjax.streaming_llm(sinks=0, ratio=ratio)
    if name == "adakv_snapkv":
        return kvjax.snapkv(ratio=ratio, headwise=True)
    name = name.removesuffix(QUERY_AWARE)
    return getattr(kvjax, name)(ratio=ratio)


def all_stats(names):
    return merged_stats(make_transform(n, 0.5) for n in names)


def merged_stats(transforms):
    """The union of the statistics `transforms` need: one prefill serves them all."""
    import functools
    import kvjax
    return functools.reduce(kvjax.StatsSpec.merge, [t.stats for t in transforms],
                            kvjax.StatsSpec())


def cells(names, ratios):
    yield "full", 0.0
    for name in names:
        for ratio in ratios:
            yield name, ratio


def done_cells(path: Path) -> set:
    """(length or context, policy, ratio, first trial) of every finished batch.

    A row without `first` is a whole cell (every batch): it marks them all done.
    """
    return {(r.get("length", r.get("context")), r["policy"], r["ratio"], r.get("first", "all"))
            for r in load_rows(path)}


def is_done(done: set, length, cell, first) -> bool:
    return (length, *cell, first) in done or (length, *cell, "all") in done


def whole_cells(rows: list[dict]) -> list[dict]:
    """Passkey rows merged over their batches: one row per (length, policy, ratio)."""
    merged = {}
    for r in rows:
        key = (r["length"], r["policy"], r["ratio"])
        if key not in merged:
            merged[key] = dict(r, by_depth=dict(r.get("by_depth", {})))
            continue
        m = merged[key]
        m["trials"] += r["trials"]
        m["correct"] += r["correct"]
        for d, c in r.get("by_depth", {}).items():
            m["by_depth"][d] = m["by_depth"].get(d, 0) + c
    for m in merged.values():
        m["accuracy"] = m["correct"] / m["trials"]
        m.pop("first", None)
    return list(merged.values())


def append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def run_passkey(model, tokenizer, out: Path, lengths, trials, names, ratios, batch_size,
                max_new=8):
    import jax

    from experiments.passkey import make_trials, score_trials
    from models.sampler import compress, decode, extend, prefill_batch

    path = out / "eviction_passkey.jsonl"
    done = done_cells(path)
    per_depth = max(1, trials // len(DEPTHS))
    for length in lengths:
        all_trials = make_trials(tokenizer, length, DEPTHS, per_depth, seed=length)
        for first in range(0, len(all_trials), batch_size):
            todo = sorted((c for c in cells(names, ratios) if not is_done(done, length, c, first)),
                          key=lambda c: c[0].endswith(QUERY_AWARE))
            if not todo:
                continue
            batch = all_trials[first:first + batch_size]
            question_width = max(len(t.question) for t in batch)
            for query_aware in sorted({c[0].endswith(QUERY_AWARE) for c in todo}):
                start = time.perf_counter()
                prompts = [t.context + (t.question if query_aware else []) for t in batch]
                pre = prefill_batch(model, prompts, stats=all_stats(names),
                                    room=max_new + (0 if query_aware else question_width))
                print(f"passkey {length}: prefilled trials {first}-{first + len(batch) - 1} "
                      f"{'with' if query_aware else 'without'} the question in "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
                for name, ratio in todo:
                    if name.endswith(QUERY_AWARE) != query_aware:
                        continue
                    start = time.perf_counter()
                    small = compress(pre, make_transform(name, ratio), keep_input=True,
                                     shrink=False)
                    if not query_aware:  # the question meets the compressed context
                        small = extend(model, small, [t.question for t in batch])
                    gen = decode(model, small, max_new_tokens=max_new)
                    del small
                    texts = [tokenizer.decode(row[:n].tolist())
                             for row, n in zip(gen.tokens, gen.num_tokens)]
                    correct = score_trials(batch, texts)
                    append(path, {  # one row per batch: an interrupted sweep loses one batch
                        "task": "passkey", "length": length, "policy": name, "ratio": ratio,
                        "first": first, "trials": len(correct), "correct": int(sum(correct)),
                        "accuracy": float(np.mean(correct)),
                        "by_depth": {str(d): int(sum(c for c, t in zip(correct, batch)
                                                     if t.depth == d)) for d in DEPTHS},
                        "seconds": round(time.perf_counter() - start, 1), "example": texts[0]})
                    print(f"  {name:20s} r={ratio:.2f}  {sum(correct)}/{len(correct)}  "
                          f"{texts[0]!r}", flush=True)
                    if ratio == ratios[-1]:  # executables of a policy are done with: free them
                        jax.clear_caches()  # (the persistent compile cache makes reloads cheap)
                del pre


def run_ppl(model, tokenizer, out: Path, text_path: Path, context: int, prefix: int,
            windows: int, names, ratios):
    names = [n for n in names if not n.endswith(QUERY_AWARE)]  # no question in plain text
    from models.sampler import compress, prefill_batch
    from models.scoring import score_continuations

    path = out / "eviction_ppl.jsonl"
    done = done_cells(path)
    todo = [c for c in cells(names, ratios) if not is_done(done, context, c, "all")]
    if not todo:
        return
    wins = window_ids(tokenizer, text_path, context, windows)
    prefixes, conts = [w[:prefix] for w in wins], [w[prefix:] for w in wins]
    start = time.perf_counter()
    pre = prefill_batch(model, prefixes, stats=all_stats(names), room=context - prefix)
    print(f"ppl: prefilled {len(wins)} prefixes of {prefix} tokens in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    for name, ratio in todo:
        start = time.perf_counter()
        small = compress(pre, make_transform(name, ratio), keep_input=True, shrink=False)
        lps = score_continuations(model, small, conts)
        nll = -float(sum(np.sum(lp, dtype=np.float64) for lp in lps))
        count = sum(len(lp) for lp in lps)
        row = {"task": "ppl", "context": context, "prefix": prefix, "policy": name,
               "ratio": ratio, "windows": len(wins), "tokens_scored": count, "nll": nll,
               "ppl": float(np.exp(nll / count)), "text": text_path.name,
               "seconds": round(time.perf_counter() - start, 1)}
        append(path, row)
        print(f"  {name:20s} r={ratio:.2f}  ppl {row['ppl']:.3f} ({row['seconds']} s)", flush=True)


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_and_tables(out: Path) -> str:
    """Draw the PNGs and return the markdown tables."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    md = []
    passkey = whole_cells(load_rows(out / "eviction_passkey.jsonl"))
    if passkey:
        lengths = sorted({r["length"] for r in passkey})
        fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
        for ax, length in zip(axes[0], lengths):
            rows = [r for r in passkey if r["length"] == length]
            full = [r for r in rows if r["policy"] == "full"]
            for i, name in enumerate(POLICIES):
                pts = sorted((r["ratio"], r["accuracy"]) for r in rows if r["policy"] == name)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name, color=plt.cm.tab20(i))
            if full:
                ax.axhline(full[0]["accuracy"], color="k", ls="--", label="full cache")
            ax.set(title=f"passkey, {length} tokens", xlabel="compression ratio (fraction evicted)",
                   ylabel="accuracy", ylim=(-0.05, 1.05))
        axes[0][-1].legend(fontsize=7, loc="lower left")
        fig.tight_layout()
        fig.savefig(out / "eviction_passkey.png", dpi=120)
        plt.close(fig)
        ratios = sorted({r["ratio"] for r in passkey if r["policy"] != "full"})
        md.append("| policy | length | " + " | ".join(f"r={x}" for x in ratios) + " |")
        md.append("|---|---|" + "---|" * len(ratios))
        for length in lengths:
            full = [r for r in passkey if r["length"] == length and r["policy"] == "full"]
            if full:
                md.append(f"| **full cache** | {length} | " + " | ".join(
                    [f"{full[0]['correct']}/{full[0]['trials']}"] * len(ratios)) + " |")
            for name in POLICIES:
                cell = {r["ratio"]: r for r in passkey if r["length"] == length and r["policy"] == name}
                if cell:
                    md.append(f"| {name} | {length} | " + " | ".join(
                        f"{cell[x]['correct']}/{cell[x]['trials']}" if x in cell else "-"
                        for x in ratios) + " |")
    ppl = load_rows(out / "eviction_ppl.jsonl")
    if ppl:
        fig, ax = plt.subplots(figsize=(6, 4))
        full = [r for r in ppl if r["policy"] == "full"]
        for name in POLICIES:
            pts = sorted((r["ratio"], r["ppl"]) for r in ppl if r["policy"] == name)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        if full:
            ax.axhline(full[0]["ppl"], color="k", ls="--", label="full cache")
        ax.set(title=f"continuation perplexity ({ppl[0]['text']}, prefix {ppl[0]['prefix']} "
                     f"of {ppl[0]['context']})", xlabel="compression ratio (fraction evicted)",
               ylabel="perplexity", yscale="log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "eviction_ppl.png", dpi=120)
        plt.close(fig)
        ratios = sorted({r["ratio"] for r in ppl if r["policy"] != "full"})
        md.append("")
        md.append("| policy | " + " | ".join(f"r={x}" for x in ratios) + " |")
        md.append("|---|" + "---|" * len(ratios))
        if full:
            md.append("| **full cache** | " + " | ".join([f"{full[0]['ppl']:.2f}"] * len(ratios)) + " |")
        for name in POLICIES:
            cell = {r["ratio"]: r for r in ppl if r["policy"] == name}
            if cell:
                md.append(f"| {name} | " + " | ".join(
                    f"{cell[x]['ppl']:.2f}" if x in cell else "-" for x in ratios) + " |")
    return "\n".join(md)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tasks", nargs="+", default=["passkey", "ppl"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--trials", type=int, default=20, help="passkey trials per cell")
    parser.add_argument("--batch-size", type=int, default=10,
                        help="passkey trials per batch (a 4k batch of 10 needs about 8 GB)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--ppl-text", type=Path,
                        default=Path(__file__).parent / "data" / "kjv_genesis.txt")
    parser.add_argument("--ppl-context", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=768)
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        from models.hub import enable_compilation_cache
        from models.loading import load_model

        enable_compilation_cache()
        model, tokenizer = load_model(args.model)
        if "passkey" in args.tasks:
            run_passkey(model, tokenizer, args.out, args.lengths, args.trials, args.policies,
                        args.ratios, args.batch_size)
        if "ppl" in args.tasks:
            run_ppl(model, tokenizer, args.out, args.ppl_text, args.ppl_context, args.prefix,
                    args.ppl_windows, args.policies, args.ratios)
    tables = plot_and_tables(args.out)
    (args.out / "eviction_tables.md").write_text(tables + "\n")
    print(tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
