"""Tables and plots of a `kvjax eval` sweep, and the generated section of docs/RESULTS.md.

`report(out)` reads `<out>/cells.jsonl` (the newest row of each cell wins) and writes
`<out>/tables.md`, `<out>/cells.csv` (scalar fields) and PNGs beside it:

* per retrieval task, score by method x length (`<task>.png`, a heatmap);
* `passkey_depth.png`: needle depth x context length per method, the NIAH-style map;
* `ppl.png`: continuation perplexity against cache bytes per token, every method;
* `speed.png`: decode ms/step against context, a colour per method and a line style per batch
  (the floor is in the table beside it);
* `memory_pareto.png` and a table: measured bytes per token (memory cells) beside the
  formats' arithmetic, the same methods' perplexity and retrieval scores, the Pareto front;
* `ratio_<task>_<length>.png` and a policy x ratio table wherever eviction policies ran at
  several compression ratios (the eviction sweep);
* a kvjax-vs-kvpress table when the sweep has kvpress cells.

`write_results(out, results_md)` puts the same text between the markers
`<!-- kvjax eval: begin -->` and `<!-- kvjax eval: end -->` of a Markdown file (they are
appended if absent); everything outside them is left as it is.

Example:
    >>> print(report(Path("docs/results/eval")))
    >>> write_results(Path("docs/results/eval"), Path("docs/RESULTS.md"))
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from experiments.eval.grid import RETRIEVAL_TASKS, cell_of, read_rows

BEGIN, END = "<!-- kvjax eval: begin -->", "<!-- kvjax eval: end -->"


def latest_rows(out: Path) -> list[dict]:
    """One row per cell, the newest (a rerun's row replaces an earlier failure)."""
    return list({cell_of(r).key: r for r in read_rows(out / "cells.jsonl")}.values())


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


def label(row) -> str:
    """How a row's method is shown: the spec, marked when the question was compressed too."""
    return row["method"] + (" (query-aware)" if row.get("query_aware") else "")


def _plain(row) -> bool:
    """A kvjax row of the quality grid (side-by-side cells have their own table)."""
    return row.get("engine", "kvjax") == "kvjax" and not row.get("warmup")


def _table(header: list[str], body: list[list]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(x) for x in row) + " |" for row in body] + [""])


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ----------------------------------------------------------------------------- retrieval


def retrieval_section(rows: list[dict], out: Path, images: str) -> list[str]:
    """Score tables (method x length) and a heatmap per retrieval task, kvjax engine."""
    lines = []
    mine = [r for r in rows if r["task"] in RETRIEVAL_TASKS and _plain(r)]
    budgets = {}  # task -> its answer budgets (a grid may ask one task for 128 and 32 tokens)
    for r in mine:
        budgets.setdefault(r["task"], {})[r.get("max_new_tokens")] = None
    for task, new in dict.fromkeys((r["task"], r.get("max_new_tokens")) for r in mine):
        sub = [r for r in mine if r["task"] == task and r.get("max_new_tokens") == new]
        lengths = sorted({r["length"] for r in sub})
        methods = list(dict.fromkeys(label(r) for r in sub))
        cell = {(label(r), r["length"]): r for r in sub}  # a later batch size wins
        body = [[f"`{m}`"] + [_score_text(cell.get((m, n))) for n in lengths] for m in methods]
        trials = sorted({r["trials"] for r in sub})
        several = len(budgets[task]) > 1
        name = f"{task}_{new}_tokens" if several else task
        lines += [f"#### {task} (score, {'/'.join(map(str, trials))} trials per cell"
                  + (f", {new} new tokens)" if several else ")"), ""]
        lines += _table(["method"] + [str(n) for n in lengths], body)
        _score_heatmap(task, methods, lengths, cell, out / f"{name}.png")
        lines += [f"![{task}]({images}{name}.png)", ""]
    return lines


def _score_text(r) -> str:
    if r is None:
        return ""
    return f"{r['score']:.2f}" if r["status"] == "ok" else r["status"].split(":")[0]


def _score_heatmap(task, methods, lengths, cell, path):
    import numpy as np
    plt = _plt()
    grid = np.full((len(methods), len(lengths)), np.nan)
    for i, m in enumerate(methods):
        for j, n in enumerate(lengths):
            r = cell.get((m, n))
            if r is not None and r["status"] == "ok":
                grid[i, j] = r["score"]
    fig, ax = plt.subplots(figsize=(2.5 + 1.2 * len(lengths), 1 + 0.45 * len(methods)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(methods)), methods, fontsize=7)
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("context tokens")
    ax.set_title(task)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def depth_section(rows: list[dict], out: Path, images: str) -> list[str]:
    """NIAH-style passkey maps: accuracy by needle depth x context length, per method."""
    import numpy as np
    sub = [r for r in _ok(rows) if r["task"] == "passkey" and r.get("depths") and _plain(r)]
    methods = list(dict.fromkeys(label(r) for r in sub))
    lengths = sorted({r["length"] for r in sub})
    if len(lengths) < 2:
        return []
    depths = sorted({d for r in sub for d in r["depths"]})
    plt = _plt()
    cols = min(len(methods), 3)
    nrows = -(-len(methods) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.9 * nrows), squeeze=False)
    for ax, method in zip(axes.flat, methods):
        acc = np.full((len(depths), len(lengths)), np.nan)
        for r in (r for r in sub if label(r) == method):
            for i, d in enumerate(depths):
                hits = [s for s, dd in zip(r["scores"], r["depths"]) if dd == d]
                if hits:
                    acc[i, lengths.index(r["length"])] = sum(hits) / len(hits)
        ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (i, j), v in np.ndenumerate(acc):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(method, fontsize=8)
        ax.set_xlabel("context tokens", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    fig.suptitle("passkey accuracy by needle depth and context length")
    fig.tight_layout()
    fig.savefig(out / "passkey_depth.png", dpi=110)
    plt.close(fig)
    return [f"![passkey depth maps]({images}passkey_depth.png)", ""]


# ----------------------------------------------------------------------------- ppl


def ppl_section(rows: list[dict], out: Path, images: str) -> list[str]:
    """Perplexity and cache bytes per method, sorted by bytes, with the Pareto front marked."""
    sub = [r for r in _ok(rows) if r["task"] == "ppl" and _plain(r)]
    if not sub:
        return []
    lines = []
    for length in sorted({r["length"] for r in sub}):
        every = [r for r in sub if r["length"] == length]
        key, caption = _bytes_key(every)
        group = sorted((r for r in every if key in r), key=lambda r: (r[key], r["score"]))
        unsized = [r for r in every if key not in r]  # converted rows
        full = next((r for r in every if r["method"] == "full"), None)
        front = set(pareto_front([(r[key], r["score"], r["method"]) for r in group]))
        body = []
        for r in group + unsized:
            vs = "" if full is None else f"{100 * (r['score'] / full['score'] - 1):+.1f}%"
            size = r.get(key)
            frac = "" if full is None or size is None or key not in full \
                else f"{size / full[key]:.3f}"
            body.append([f"`{r['method']}`" + (" *" if r["method"] in front else ""),
                         f"{r['score']:.3f}", vs, "" if size is None else f"{size:.0f}", frac])
        r0 = every[0]
        lines += [f"#### Continuation perplexity ({r0['text']}, {r0['trials']} windows of "
                  f"{length} tokens: the first {r0['prefix']} compressed, "
                  f"{r0['tokens_scored']} scored)", "",
                  "`*`: on the Pareto front (no method with a smaller cache has a lower "
                  f"perplexity). {caption}", ""]
        lines += _table(["method", "ppl", "vs full", "bytes/token", "of full"], body)
        if group:
            _ppl_plot(group, full, front, key, out / f"ppl_{length}.png")
            lines += [f"![ppl]({images}ppl_{length}.png)", ""]
    return lines


BF16_BYTES, RUN_BYTES = "cache_bytes_per_token_bf16", "cache_bytes_per_token"


def _bytes_key(rows: list[dict]) -> tuple[str, str]:
    """The bytes field a table ranks by, and its caption: bfloat16 storage when every sized row
    has it (rows of runs before it was recorded have only the run's float32 bytes)."""
    if all(BF16_BYTES in r for r in rows if RUN_BYTES in r):
        return BF16_BYTES, ("Bytes are per compressed context token as a bfloat16 cache stores "
                            "them (the run's cache is float32; float leaves counted at 2 "
                            "bytes, codes as they are), so \"of full\" is a fraction of the "
                            "bfloat16 full cache.")
    return RUN_BYTES, "Bytes are per compressed context token, float32 cache."


def pareto_front(points) -> list[str]:
    """Names of the points (size, loss, name) no smaller point beats on loss, smallest first.

    Example:
        >>> pareto_front([(100, 5.0, "a"), (50, 6.0, "b"), (60, 7.0, "c"), (200, 4.0, "d")])
        ['b', 'a', 'd']
    """
    front, best = [], float("inf")
    for size, loss, name in sorted(points):
        if loss < best:
            front.append(name)
            best = loss
    return front


def _ppl_plot(group, full, front, key, path):
    """Perplexity against the cache fraction: all methods (log), and a zoom on the good ones."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=[1, 1.4])
    base = full.get(key, 1.0) if full else 1.0
    best = min(r["score"] for r in group)
    cmap = plt.get_cmap("tab20")
    on_front = [r for r in group if r["method"] in front]
    for ax, zoom in zip(axes, (False, True)):
        for i, r in enumerate(group):
            ax.scatter(r[key] / base, r["score"], color=cmap(i % 20),
                       label=r["method"] if zoom else None, s=30, marker="os^Dv<>p"[i // 20 % 8])
        ax.plot([r[key] / base for r in on_front],
                [r["score"] for r in on_front], "k--", lw=0.8,
                label="Pareto front" if zoom else None)
        ax.set_xlabel("cache bytes per token (fraction of the full cache, "
                      + ("bfloat16)" if key == BF16_BYTES else "float32)"))
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set(ylabel="continuation perplexity (log)", title="every method")
    axes[1].set_ylim(best * 0.99, best * 1.12)
    axes[1].set(ylabel="continuation perplexity", title="within 12 % of the best")
    axes[1].legend(fontsize=6, ncol=1, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- by ratio


def policy_and_ratio(row) -> tuple[str, float] | None:
    """("snapkv:headwise=true", 0.5) for a one-part method with a `ratio=`; ("full", 0.0)
    for the full cache; None otherwise (chains, codecs, token budgets)."""
    method = row["method"]
    if method == "full":
        return "full", 0.0
    name, _, args = method.partition(":")
    if "+" in method or not args:
        return None
    parts = [a for a in args.split(",") if a]
    ratio = [a for a in parts if a.startswith("ratio=")]
    if len(ratio) != 1:
        return None
    rest = ",".join(a for a in parts if not a.startswith("ratio="))
    policy = f"{name}:{rest}" if rest else name
    return policy + (" (query-aware)" if row.get("query_aware") else ""), \
        float(ratio[0].removeprefix("ratio="))


def ratio_section(rows: list[dict], out: Path, images: str) -> list[str]:
    """Eviction policies by compression ratio (the fraction evicted): a policy x ratio table
    and a plot per task and length, when the sweep has a policy at two ratios or more."""
    sub = [r for r in _ok(rows) if _plain(r) and r["task"] in RETRIEVAL_TASKS + ("ppl",)
           and policy_and_ratio(r)]
    lines = []
    for task, length in dict.fromkeys((r["task"], r["length"]) for r in sub):
        group = [r for r in sub if (r["task"], r["length"]) == (task, length)]
        cell = {policy_and_ratio(r): r for r in group}
        ratios = sorted({ratio for _, ratio in cell if ratio > 0})
        policies = [p for p in dict.fromkeys(p for p, _ in cell) if p != "full"]
        if len(ratios) < 2 or not policies:
            continue
        full = cell.get(("full", 0.0))
        text = (lambda r: f"{r['score']:.2f}") if task == "ppl" else \
            (lambda r: f"{round(r['score'] * r['trials'])}/{r['trials']}")
        body = ([["**full cache**"] + [text(full)] * len(ratios)] if full else []) + [
            [f"`{p}`"] + [text(cell[p, x]) if (p, x) in cell else "-" for x in ratios]
            for p in policies]
        what = "perplexity" if task == "ppl" else "correct answers"
        lines += [f"#### {task} at {length} tokens by compression ratio ({what})", ""]
        lines += _table(["policy"] + [f"r={x}" for x in ratios], body)
        plt = _plt()
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, p in enumerate(policies):
            pts = sorted((x, cell[p, x]["score"]) for x in ratios if (p, x) in cell)
            ax.plot(*zip(*pts), marker="o", label=p, color=plt.cm.tab20(i % 20))
        if full:
            ax.axhline(full["score"], color="k", ls="--", label="full cache")
        ax.set(title=f"{task}, {length} tokens", xlabel="compression ratio (fraction evicted)",
               ylabel="perplexity (log)" if task == "ppl" else "score")
        if task == "ppl":
            ax.set_yscale("log")
        else:
            ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=6)
        fig.tight_layout()
        name = f"ratio_{task}_{length}.png"
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        lines += [f"![{task} by ratio]({images}{name})", ""]
    return lines


# ----------------------------------------------------------------------------- memory


def memory_section(rows: list[dict], out: Path, images: str) -> list[str]:
    """Measured bytes per token beside the formats' arithmetic, with the same methods'
    perplexity and retrieval scores from the sweep, and the perplexity Pareto front."""
    memory = {r["method"]: r for r in _ok(rows) if r["task"] == "memory"}
    if not memory:
        return []
    ppl = {r["method"]: r for r in _ok(rows) if r["task"] == "ppl" and _plain(r)}
    found = {(r["task"], r["length"]) for r in _ok(rows)
             if r["task"] in RETRIEVAL_TASKS and _plain(r)}
    retrieval = {(r["task"], r["length"], r["method"]): r for r in _ok(rows)
                 if r["task"] in RETRIEVAL_TASKS and _plain(r) and not r.get("query_aware")}
    full = memory.get("full")
    body = []
    for m, r in memory.items():
        row = [f"`{m}`", f"{r['bytes_per_token']:.0f}", f"{r['theoretical']:.0f}",
               f"{r['bytes_per_token'] / full['bytes_per_token']:.3f}" if full else "",
               f"{ppl[m]['score']:.3f}" if m in ppl else "-"]
        for task, length in sorted(found):
            hit = retrieval.get((task, length, m))
            row.append(f"{round(hit['score'] * hit['trials'])}/{hit['trials']}" if hit else "-")
        body.append(row)
    r0 = next(iter(memory.values()))
    lines = [f"#### Cache bytes per context token ({r0['length']} tokens, bfloat16 storage, "
             "all layers and KV heads) beside the formats' arithmetic", ""]
    lines += _table(["method", "bytes/token", "theoretical", "of full", "ppl"]
                    + [f"{task} {length}" for task, length in sorted(found)], body)
    points = [(memory[m]["bytes_per_token"], ppl[m]["score"], m) for m in memory if m in ppl]
    if points:
        by = {m: (b, y) for b, y, m in points}
        lines += ["Perplexity Pareto front (bytes/token, ppl): " + ", ".join(
            f"`{m}` ({by[m][0]:.0f}, {by[m][1]:.2f})" for m in pareto_front(points)), ""]
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.scatter([p[0] for p in points], [p[1] for p in points])
        for b, y, m in points:
            ax.annotate(m, (b, y), fontsize=5, xytext=(3, 3), textcoords="offset points")
        front = pareto_front(points)
        ax.step([by[m][0] for m in front], [by[m][1] for m in front], where="post", color="k",
                lw=1, label="Pareto front")
        ax.set(xscale="log", yscale="log", xlabel="cache bytes per context token (bf16, log)",
               ylabel="continuation perplexity (log)", title="quality against memory")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "memory_pareto.png", dpi=120)
        plt.close(fig)
        lines += [f"![memory]({images}memory_pareto.png)", ""]
    return lines


# ----------------------------------------------------------------------------- speed


def speed_section(rows: list[dict], out: Path, images: str) -> list[str]:
    sub = sorted((r for r in _ok(rows) if r["task"] == "speed"),
                 key=lambda r: (r["batch"], r["length"]))
    if not sub:
        return []
    body = [[f"`{r['method']}`", r["batch"], r["length"], f"{r['prefill_tok_s']:.0f}",
             f"{r['decode_ms']:.1f}", f"{r['floor_ms']:.1f}",
             f"{r['decode_ms'] / r['floor_ms']:.2f}", f"{r['cache_bytes_per_seq'] / 2**20:.1f}",
             f"{r['compile_s']:.1f}" if "compile_s" in r else "",
             r.get("peak_rss_gb", "")] for r in sub]
    span = lambda key, fmt: "-".join(dict.fromkeys(  # "2" or "1-2": the values in the rows
        format(v, fmt) for v in (min(r[key] for r in sub), max(r[key] for r in sub))))
    lines = [f"#### Memory and speed ({span('max_new_tokens', 'd')} decode steps, medians of "
             f"{span('trials', 'd')} timed runs after a compiling one; floor = (weights + whole "
             f"cache) bytes / read bandwidth measured beside each cell, "
             f"{span('bandwidth_gbs', '.1f')} GB/s)", ""]
    lines += _table(["method", "batch", "context", "prefill+compress tok/s", "decode ms/step",
                     "floor ms", "x floor", "cache MiB/seq", "compile s", "peak RSS GB"], body)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in sub))  # a colour per method,
    batches = sorted({r["batch"] for r in sub})                # a line style per batch
    for (method, batch) in dict.fromkeys((r["method"], r["batch"]) for r in sub):
        pts = [r for r in sub if (r["method"], r["batch"]) == (method, batch)]
        ax.plot([r["length"] for r in pts], [r["decode_ms"] for r in pts],
                marker="o", color=f"C{methods.index(method) % 10}",
                linestyle=("-", "--", ":", "-.")[batches.index(batch) % 4],
                label=f"{method}, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("decode ms / step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=120)
    plt.close(fig)
    return lines + [f"![speed]({images}speed.png)", ""]


# ----------------------------------------------------------------------------- kvpress


def _normalized(text: str) -> str:
    return " ".join(re.sub(r"<\|[^|]*\|>", " ", text).split())


def _pairs(rows: list[dict], ppl: bool) -> list[tuple[dict, dict]]:
    """(kvjax row, kvpress row) of the same cell (the same prompts or windows)."""
    ok = _ok(rows)
    mine = {cell_of(r).key: r for r in ok if r.get("engine", "kvjax") == "kvjax"}
    pairs = [(mine.get(dataclasses.replace(cell_of(t), engine="kvjax").key), t) for t in ok
             if t.get("engine") == "kvpress" and (t["task"] == "ppl") == ppl]
    return [(m, t) for m, t in pairs if m is not None]


def compare_ppl_section(rows: list[dict]) -> list[str]:
    """kvjax's continuation perplexity beside kvpress's on the same windows, with kvjax's
    cache bytes (kvpress keeps or masks tokens in a torch cache, not measured)."""
    pairs = sorted(_pairs(rows, ppl=True), key=lambda p: (p[0]["length"], p[0]["method"]))
    if not pairs:
        return []
    body = []
    for m, t in pairs:
        key = BF16_BYTES if BF16_BYTES in m else RUN_BYTES
        body.append([m["text"], m["length"], f"`{m['method']}`", f"{m['score']:.4f}",
                     f"{t['score']:.4f}", f"{m['score'] / t['score'] - 1:+.1e}",
                     f"{m[key]:.0f}" if key in m else ""])
    m0 = pairs[0][0]
    return ([f"#### Continuation perplexity beside kvpress ({m0['trials']} windows per cell, "
             f"the first {m0['prefix']} tokens of each compressed, the rest scored; kvpress "
             f"through its press on transformers, float32, batch 1)", ""]
            + _table(["text", "length", "method", "kvjax ppl", "kvpress ppl",
                      "kvjax / kvpress - 1", "kvjax bytes/token (bf16)"], body))


def same_answers(ours: dict, theirs: dict) -> int:
    """Trials of a kvjax/kvpress pair whose outputs are identical, special tokens and spacing
    aside."""
    return sum(_normalized(a) == _normalized(b) for a, b in zip(ours["outputs"], theirs["outputs"]))


def compare_section(rows: list[dict]) -> list[str]:
    """kvjax beside kvpress on the same cells: scores, same answers, seconds per trial."""
    body = []
    for m, t in _pairs(rows, ppl=False):
        same = same_answers(m, t)
        body.append([t["task"], t["length"], f"`{t['method']}`", f"{m['score']:.2f}",
                     f"{t['score']:.2f}", f"{same}/{t['trials']}",
                     f"{m['seconds_per_trial']:.2f} (batch {m['batch']})",
                     f"{t['seconds_per_trial']:.2f} (batch 1)",
                     f"{t['seconds_per_trial'] / m['seconds_per_trial']:.1f}x"])
    if not body:
        return []
    return (["#### kvjax beside kvpress (same token ids, greedy, both warm; seconds per trial "
             "are prefill + compression + answer, wall clock)", ""]
            + _table(["task", "length", "method", "kvjax score", "kvpress score",
                      "same answer", "kvjax s/trial", "kvpress s/trial", "kvjax speed-up"], body))


# ----------------------------------------------------------------------------- all


def report(out: Path, images: str = "") -> str:
    """Every section's Markdown (image links prefixed by `images`); writes `<out>/tables.md`."""
    rows = latest_rows(out)
    failed = [r for r in rows if r.get("status") != "ok"]
    lines = (compare_section(rows) + compare_ppl_section(rows)
             + memory_section(rows, out, images)
             + ppl_section(rows, out, images) + ratio_section(rows, out, images)
             + depth_section(rows, out, images) + retrieval_section(rows, out, images)
             + speed_section(rows, out, images))
    if failed:
        lines += ["#### Cells that did not finish", ""] + [
            f"- {r['task']} {r['length']} `{r['method']}` ({r.get('engine', 'kvjax')}): "
            f"{r['status']}" for r in failed] + [""]
    text = "\n".join(lines)
    (out / "tables.md").write_text(text)
    write_csv(rows, out / "cells.csv")
    return text


def write_csv(rows: list[dict], path: Path) -> None:
    """The rows' scalar fields (per-trial lists stay in cells.jsonl), one line per cell."""
    import csv
    names = list(dict.fromkeys(k for r in rows for k, v in r.items()
                               if not isinstance(v, (list, dict))))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_results(out: Path, results_md: Path, header: str = "") -> None:
    """Replace the generated section of `results_md` with `header` + this sweep's report."""
    images = os.path.relpath(out, results_md.parent).replace(os.sep, "/") + "/"
    body = f"{BEGIN}\n{header}{report(out, images)}\n{END}"
    text = results_md.read_text() if results_md.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + body + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    results_md.write_text(text)
