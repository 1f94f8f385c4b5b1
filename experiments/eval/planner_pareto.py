"""Continuation perplexity against cache bytes: `auto` at several budgets beside the fixed
methods and chains, on texts not used for calibrating it. Rows go to a JSONL file (one per
method and text, appended; a finished row is skipped), then `--report` writes CSV, a PNG
and a markdown table.

    python experiments/eval/planner_pareto.py --out docs/results/planner \\
        --methods full fp8 "snapkv:ratio=0.5+kivi:bits=4" auto:budget=0.125
    python experiments/eval/planner_pareto.py --out docs/results/planner --report

Bytes are `kvjax ppl --json`'s: `cache_bytes` is the compressed prefix as the run stores it
(a float32 cache for the fixed methods, so an eviction-only method's kept tokens are
float32), `full_bf16_bytes` the same prefix as an uncompressed bfloat16 cache. For a method
that stores dense tokens, `bf16_bytes` is what its kept tokens take in a bfloat16 cache
(each head-slot 4 D + 4 bytes instead of 8 D + 4): the fair comparison with a bf16 budget.
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


def dense_bf16_bytes(row: dict, num_layers: int, head_dim: int) -> float | None:
    """The kept tokens' bytes in a bfloat16 cache, for a method storing dense per-head slots
    (no codec, no head-wise pooling); None for others."""
    parts = [p.split(":")[0] for p in row["method"].split("+")]
    if any(p not in DENSE for p in parts) or "headwise" in row["method"]:
        return None
    cursors = num_layers * 4
    head_slots = (row["cache_bytes"] - cursors) / (8 * head_dim + 4)
    return head_slots * (4 * head_dim + 4) + cursors


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
    for method in methods:
        transform = parsed_method(method, tokenizer).transform  # kvzip's prompt: these ids
        for text in texts:
            name = Path(text).name + (f" from token {offset}" if offset else "")
            if (method, name) in done:
                continue
            ids = tokenizer.encode(Path(text).read_text(encoding="utf-8"))[
                offset:offset + context * windows]
            start = time.perf_counter()
            r = perplexity(model, ids, context, prefix=prefix, transform=transform,
                           batch_size=windows)
            row = {"method": method, "text": name, "ppl": r.ppl,
                   "tokens_scored": r.tokens_scored, "cache_bytes": r.cache_bytes,
                   "full_bf16_bytes": r.full_bf16_bytes, "context": context, "prefix": prefix,
                   "windows": windows, "seconds": round(time.perf_counter() - start, 1)}
            row["bf16_bytes"] = dense_bf16_bytes(row, model.config.num_layers,
                                                 model.config.head_dim)
            row["plan"] = plan_summary(method, model)
            assert np.isfinite(row["ppl"])
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{method} {row['text']}: ppl {r.ppl:.4f}, "
                  f"{r.cache_bytes / r.full_bf16_bytes:.4f} of bf16, {row['seconds']} s",
                  flush=True)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def fraction(row: dict) -> float:
    """The row's bytes as a fraction of the bf16 full cache (bf16 storage where dense)."""
    b = row["bf16_bytes"] if row.get("bf16_bytes") is not None else row["cache_bytes"]
    return b / row["full_bf16_bytes"]


VARIANTS = (("", "`auto`"), (",table=learned", "learned controller"),
            (",table=prior", "prior"), (",score=attention", "window scores"),
            (",table=learned,keys=token,score=attention", "per-token keys only"))
"""`auto` variants of the summary: spec suffix, column name (the last: the planner's previous
choices, per-token keys and window-attention scores)."""


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


def report(out: Path) -> str:
    """CSV, PNG, a summary and a markdown table (returned) of every row, per text."""
    rows = _rows(out / "rows.jsonl")
    with (out / "rows.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["text", "method", "ppl", "fraction_of_bf16", "cache_bytes",
                               "bf16_bytes", "full_bf16_bytes", "seconds"])
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in w.fieldnames} | {"fraction_of_bf16": fraction(r)})
    lines = []
    import numpy as np
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    texts = sorted({r["text"] for r in rows})
    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4.5), squeeze=False)
    for ax, text in zip(axes[0], texts):
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
    table = summary(rows) + "\n\n" + "\n".join(lines)
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
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.methods:
        run(args.out, args.methods, args.texts, args.context, args.prefix, args.windows,
            args.offset)
    if args.report:
        print(report(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
