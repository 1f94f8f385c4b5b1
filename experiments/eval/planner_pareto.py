"""Continuation perplexity against cache bytes: `auto` at several budgets beside the fixed
methods and chains, on texts not used for calibrating it. Rows go to a JSONL file (one per
method and text, appended; a finished row is skipped), then `--report` writes CSV, a PNG
and a markdown table.

    python experiments/eval/planner_pareto.py --out docs/results/planner \\
        --methods full fp8 "snapkv:ratio=0.5+kivi:bits=4" auto:budget=0.125
    python experiments/eval/planner_pareto.py --out docs/results/planner --kvpress \\
        --methods kvgrad:ratio=0.5      # kvpress's own press on the same windows
    python experiments/eval/planner_pareto.py --out docs/results/planner --report

Bytes are `kvjax ppl --json`'s: `cache_bytes` is the compressed prefix as the run stores it
(a float32 cache for the fixed methods, so an eviction-only method's kept tokens are
float32), `full_bf16_bytes` the same prefix as an uncompressed bfloat16 cache. For a method
that stores dense tokens (`eviction_only`), `bf16_bytes` is what its kept tokens take in a
bfloat16 cache (`kvjax.nbytes(cache, float_dtype=bfloat16)`, pooled head-wise layouts
included): the fair comparison with a bf16 budget.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

TEXTS = ("experiments/data/kjv_genesis.txt",)
DENSE = ("full", "snapkv", "expected_attention", "h2o", "streaming_llm", "tova", "knorm",
         "pyramidkv")


def eviction_only(method: str) -> bool:
    """True if every part of `method` keeps dense tokens (eviction, a kvpress press, `full`):
    no codec, so its bytes as a bfloat16 cache would store them are its fair bytes.

    Example:
        >>> eviction_only("snapkv:ratio=0.5"), eviction_only("kvzip:ratio=0.5")
        (True, True)
        >>> eviction_only("snapkv:ratio=0.5+kivi:bits=4")
        False
    """
    from kvjax.policies.methods import METHOD_INFO
    parts = [p.split(":")[0] for p in method.split("+")]
    return all(p in DENSE or (p in METHOD_INFO and METHOD_INFO[p].kvpress is not None)
               for p in parts)


def run(out: Path, methods: list[str], texts: list[str], context: int, prefix: int,
        windows: int, offset: int = 0) -> None:
    import numpy as np

    from experiments.eval.planner_view import plan_summary
    from experiments.eval.ppl import perplexity
    from models.loading import load_model
    from models.pipeline import parsed_method

    rows_path = out / "rows.jsonl"
    done = {(r["method"], r["text"]) for r in _rows(rows_path)}
    model, tokenizer = load_model("smollm2")
    # every spec parsed before any row is written; kvzip's prompt bound to these ids
    transforms = {m: parsed_method(m, tokenizer).transform for m in methods}
    slices = [_slice(tokenizer, text, offset, context * windows) for text in texts]
    for method, transform in transforms.items():
        for name, ids in slices:
            if (method, name) in done:
                continue
            start = time.perf_counter()
            r = perplexity(model, ids, context, prefix=prefix, transform=transform,
                           batch_size=windows)
            row = {"method": method, "text": name, "ppl": r.ppl,
                   "tokens_scored": r.tokens_scored, "cache_bytes": r.cache_bytes,
                   "full_bf16_bytes": r.full_bf16_bytes, "context": context, "prefix": prefix,
                   "windows": windows, "seconds": round(time.perf_counter() - start, 1)}
            row["bf16_bytes"] = r.cache_bf16_bytes if eviction_only(method) else None
            row["plan"] = plan_summary(method, model)
            assert np.isfinite(row["ppl"])
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{method} {row['text']}: ppl {r.ppl:.4f}, "
                  f"{r.cache_bytes / r.full_bf16_bytes:.4f} of bf16, {row['seconds']} s",
                  flush=True)


def run_kvpress(out: Path, methods: list[str], texts: list[str], context: int, prefix: int,
                windows: int, offset: int = 0) -> None:
    """kvpress's own presses on the windows `run` scores (the same token ids, transformers in
    float32, batch 1): rows to `kvpress_rows.jsonl`, beside kvjax's rows of the same method
    (the presses kvjax equals; their bytes are kvjax's row's)."""
    import importlib.util
    import math

    from experiments.eval.kvpress_engine import parse_press_spec, press_for, windows_nll
    for method in methods:  # a method kvpress has no press for fails before any model loads
        parse_press_spec(method)
    if importlib.util.find_spec("kvpress") is None:
        raise SystemExit("planner_pareto --kvpress needs kvpress: pip install -e '.[compare]'")
    import torch

    from experiments.eval.hf_reference import load_hf_reference
    from experiments.eval.ppl import sliding_windows
    from models.loading import load_model, resolve_model_path

    rows_path = out / "kvpress_rows.jsonl"
    done = {(r["method"], r["text"]) for r in _rows(rows_path)}
    _, tokenizer = load_model("smollm2")  # kvjax's tokenizer: the ids `run` scored
    model, hf_tokenizer, _ = load_hf_reference(resolve_model_path("smollm2"),
                                               dtype=torch.float32, attn_implementation="sdpa")
    slices = [_slice(tokenizer, text, offset, context * windows) for text in texts]
    for method in methods:
        press = press_for(method)
        for name, ids in slices:
            if (method, name) in done:
                continue
            start = time.perf_counter()
            nll, scored = windows_nll(model, hf_tokenizer, press,
                                      (ids[w.start:w.end] for w in
                                       sliding_windows(len(ids), context, None)), prefix)
            row = {"method": method, "text": name, "ppl": math.exp(nll / scored),
                   "tokens_scored": scored, "engine": "kvpress", "context": context,
                   "prefix": prefix, "windows": windows,
                   "seconds": round(time.perf_counter() - start, 1)}
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"kvpress {method} {name}: ppl {row['ppl']:.4f}, {row['seconds']} s",
                  flush=True)


def _slice(tokenizer, text: str, offset: int, tokens: int) -> tuple[str, list[int]]:
    """(the rows' name for a slice of a text, its `tokens` token ids from `offset`)."""
    name = Path(text).name + (f" from token {offset}" if offset else "")
    ids = tokenizer.encode(Path(text).read_text(encoding="utf-8"))[offset:offset + tokens]
    return name, ids


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def fraction(row: dict) -> float:
    """The row's bytes as a fraction of the bf16 full cache (bf16 storage where dense)."""
    b = row["bf16_bytes"] if row.get("bf16_bytes") is not None else row["cache_bytes"]
    return b / row["full_bf16_bytes"]


VARIANTS = (("", "`auto`"),
            (",table=table", "attention-output table"),
            (",table=table,score=expected_attention", "expected-attention scores"),
            (",table=learned,score=expected_attention", "learned controller (EA scores)"),
            (",table=prior,score=expected_attention", "prior (EA scores)"),
            (",table=table,score=attention", "window scores"),
            (",table=learned,keys=token,score=attention", "per-token keys only"))
"""`auto` variants of the summary: spec suffix, column name. The second is the default
before 2026-12-07 (the attention-output table, mixed scores), the third the default before
2026-12-06 (expected-attention scores alone); the last the planner's choices before that
(per-token keys, window-attention scores, the controller)."""


def summary(rows: list[dict]) -> str:
    """Markdown: per text and budget, `auto` (its defaults), the best fixed method or chain
    with no more bytes, and the `auto` variants (ppl; blank where not run)."""
    texts = sorted({r["text"] for r in rows})
    budgets = sorted({float(r["method"].split(",")[0].split("=")[1]) for r in rows
                      if r["method"].startswith("auto:budget=")})
    by = {(r["text"], r["method"]): r for r in rows}
    head = ["text", "budget", "best fixed with no more bytes"] + [v for _, v in VARIANTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for text in texts:
        fixed = [r for r in rows if r["text"] == text and not r["method"].startswith("auto")]
        for b in budgets:
            rival = min((x for x in fixed if fraction(x) <= b + 1e-9), key=lambda x: x["ppl"],
                        default=None)
            cells = [f"{by[(text, f'auto:budget={b:g}{s}')]['ppl']:.3f}"
                     if (text, f"auto:budget={b:g}{s}") in by else "" for s, _ in VARIANTS]
            if cells[0] and rival:
                cells[0] = f"**{cells[0]}**" if float(cells[0]) < rival["ppl"] else cells[0]
            best = f"{rival['ppl']:.3f} `{rival['method']}` ({fraction(rival):.3f})" \
                if rival else "none"
            lines.append(f"| {text} | 1/{round(1 / b)} | {best} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def press_table(rows: list[dict], kvpress_rows: list[dict], budget: float = 0.125) -> str:
    """Markdown: per text with single presses at ratio 0.5 (half the tokens, bf16: half the
    bf16 full cache's bytes), `auto` at `budget` against each press by kvjax's perplexity,
    with kvpress's own where it ran on the same windows (`--kvpress`); "" if none."""
    from kvjax.policies.methods import split_part

    theirs = {(r["method"], r["text"]): r["ppl"] for r in kvpress_rows}
    by = {(r["text"], r["method"]): r for r in rows}
    lines = ["| text | `auto` at 1/%d | press at ratio 0.5 | kvjax ppl | kvpress ppl | "
             "`auto` / press - 1 |" % round(1 / budget), "|---|---|---|---|---|---|"]
    for text in sorted({r["text"] for r in rows}):
        ours = by.get((text, f"auto:budget={budget:g}"))
        presses = sorted((r for r in rows if r["text"] == text and "+" not in r["method"]
                          and split_part(r["method"])[1].get("ratio") == 0.5),
                         key=lambda r: r["ppl"])
        if ours is None or not presses:
            continue
        for r in presses:
            kp = theirs.get((r["method"], text))
            lines.append(f"| {text} | {ours['ppl']:.3f} | `{r['method']}` | {r['ppl']:.3f} | "
                         f"{'' if kp is None else f'{kp:.3f}'} | "
                         f"{100 * (ours['ppl'] / r['ppl'] - 1):+.1f}% |")
    return "\n".join(lines) if len(lines) > 2 else ""


def per_text_tables(rows: list[dict]) -> str:
    """A markdown table per text of every row, cheapest first, each beside the best fixed
    method or chain with no more bytes (`auto` rows in bold; RESULTS.md holds these)."""
    lines = []
    for text in sorted({r["text"] for r in rows}):
        group = sorted((r for r in rows if r["text"] == text), key=fraction)
        full = next((r["ppl"] for r in group if r["method"] == "full"), None)
        lines += [f"#### {text} ({group[0]['windows']} windows of {group[0]['context']} tokens, "
                  f"the first {group[0]['prefix']} compressed)", "",
                  "| method | ppl | vs full | of bf16 full | best fixed with no more bytes |",
                  "|---|---|---|---|---|"]
        fixed = [r for r in group if not r["method"].startswith("auto")]
        for r in group:
            f = fraction(r)
            rival = min((x for x in fixed if fraction(x) <= f + 1e-9 and x is not r),
                        key=lambda x: x["ppl"], default=None)
            vs = f"{100 * (r['ppl'] / full - 1):+.1f}%" if full else ""
            name = f"**`{r['method']}`**" if r["method"].startswith("auto") else f"`{r['method']}`"
            best = f"`{rival['method']}` {rival['ppl']:.3f}" if rival else "none"
            lines.append(f"| {name} | {r['ppl']:.3f} | {vs} | {f:.3f} | {best} |")
        lines.append("")
    return "\n".join(lines)


def report(out: Path) -> str:
    """CSV, PNG, a summary and a markdown table (returned) of every row, per text."""
    rows = _rows(out / "rows.jsonl")
    with (out / "rows.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["text", "method", "ppl", "fraction_of_bf16", "cache_bytes",
                               "bf16_bytes", "full_bf16_bytes", "seconds"])
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in w.fieldnames} | {"fraction_of_bf16": fraction(r)})
    import numpy as np
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    texts = sorted({r["text"] for r in rows})
    cols = min(2, len(texts))  # two panels a row
    rows_of_panels = -(-len(texts) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(8 * cols, 5.5 * rows_of_panels),
                             squeeze=False)
    for ax in axes.flat[len(texts):]:
        ax.set_visible(False)
    for ax, text in zip(axes.flat, texts):
        group = sorted((r for r in rows if r["text"] == text), key=fraction)
        full = next((r["ppl"] for r in group if r["method"] == "full"), None)
        for r in group:
            is_auto = r["method"].startswith("auto")
            ax.scatter(fraction(r), r["ppl"], c="C3" if is_auto else "C0",
                       marker="*" if is_auto else "o", s=90 if is_auto else 30)
            if r["ppl"] < 1.2 * (full or np.inf):
                ax.annotate(r["method"].replace("quantize:", "q:").replace(",group=32", ""),
                            (fraction(r), r["ppl"]), fontsize=5)
        if full:  # rows far above the front (int2, KIVI-2) would flatten the rest
            ax.set_ylim(0.98 * min(r["ppl"] for r in group), 1.2 * full)
        ax.set_xscale("log")
        ax.set_xlabel("cache bytes / bf16 full cache")
        ax.set_ylabel("continuation perplexity")
        ax.set_title(text)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)
    presses = press_table(rows, _rows(out / "kvpress_rows.jsonl"))
    table = "\n\n".join(t for t in (summary(rows), presses, per_text_tables(rows)) if t)
    (out / "table.md").write_text(table + "\n")
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/planner"))
    ap.add_argument("--methods", nargs="*", default=[])
    ap.add_argument("--texts", nargs="*", default=list(TEXTS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--offset", type=int, default=0, help="skip this many tokens of the text")
    ap.add_argument("--kvpress", action="store_true",
                    help="run --methods through kvpress's presses instead (kvpress_rows.jsonl)")
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.methods:
        runner = run_kvpress if args.kvpress else run
        try:
            runner(args.out, args.methods, args.texts, args.context, args.prefix,
                   args.windows, args.offset)
        except ValueError as e:  # a method spec or press refused before any row is written
            ap.error(str(e))
    if args.report:
        print(report(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
