"""`kvjax eval`: a grid of (task, context length, method) cells on a real model, one command.

A TOML config names the model and the grid:

    model = "smollm2"
    trials = 10            # per cell, batched
    max_rss_gb = 12        # a worker above this is killed, its cell marked failed

    [[grid]]
    tasks = ["passkey", "niah_multikey", "variable_tracking"]
    lengths = [1024, 2048]
    methods = ["full", "streaming_llm:ratio=0.5", "snapkv:ratio=0.5+kivi:bits=4"]

Tasks: `passkey` (experiments/passkey.py, depths spread over the trials) and the
RULER-style tasks of experiments/ruler.py. Each context is prefilled and compressed
by the method before the question is appended (query-agnostic, kvpress's protocol),
then the answer is decoded greedily.

Every cell runs in its own worker process (spawned, so nothing compiled or cached
accumulates across cells) while the parent watches its resident memory. A finished
cell is one JSON line in `<out>/cells.jsonl`; a rerun skips it, so an interrupted
sweep resumes. `--report` writes `<out>/tables.md` and a heatmap per task (method x
length). Seeds are fixed: the same config gives the same numbers.

    kvjax eval --config experiments/configs/smoke.toml --out docs/results/eval
    kvjax eval --config experiments/configs/smoke.toml --out docs/results/eval --report
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import queue as queue_module
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from experiments.ruler import TASKS as RULER_TASKS

TASKS = ("passkey",) + RULER_TASKS
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class Cell:
    task: str
    length: int
    method: str
    trials: int
    model: str = "smollm2"
    seed: int = 0
    batch: int = 10
    max_new_tokens: int = 24

    @property
    def key(self) -> tuple:
        return (self.model, self.task, self.length, self.method, self.trials, self.seed)


class Grid(NamedTuple):
    cells: list[Cell]  # in config order
    max_rss_gb: float  # memory bound of one worker


def load_config(path: Path) -> Grid:
    """The cells of a TOML grid config and the worker memory bound (see the module docstring)."""
    config = tomllib.loads(Path(path).read_text())
    shared = {k: config[k] for k in ("model", "trials", "seed", "batch", "max_new_tokens")
              if k in config}
    if "trials" not in shared:
        raise ValueError(f"{path}: set `trials` (per cell)")
    cells = []
    for block in config.get("grid", []):
        missing = {"tasks", "lengths", "methods"} - set(block)
        if missing:
            raise ValueError(f"{path}: a [[grid]] block lacks {sorted(missing)}")
        for task, length, method in itertools.product(block["tasks"], block["lengths"],
                                                      block["methods"]):
            if task not in TASKS:
                raise ValueError(f"{path}: unknown task {task!r}; tasks: {TASKS}")
            cells.append(Cell(task, int(length), method, **shared))
    if not cells:
        raise ValueError(f"{path}: no [[grid]] cells")
    from kvjax import parse_method
    for method in {c.method for c in cells}:
        parse_method(method)  # a bad method fails now, not in a worker an hour later
    return Grid(cells, float(config.get("max_rss_gb", 16)))


# ----------------------------------------------------------------------------- one cell


def make_prompts(cell: Cell, tokenizer):
    """(contexts, questions, scorer) of a cell's trials; scorer(i, text) -> 0..1."""
    if cell.task == "passkey":
        from experiments.passkey import make_trials, score_trials
        per_depth = -(-cell.trials // len(PASSKEY_DEPTHS))
        trials = make_trials(tokenizer, cell.length, PASSKEY_DEPTHS, per_depth, seed=cell.seed)
        trials = trials[:cell.trials]
        return ([t.context for t in trials], [t.question for t in trials],
                lambda i, text: float(score_trials([trials[i]], [text])[0]))
    from experiments.ruler import make_task_trials, score
    trials = make_task_trials(tokenizer, cell.task, cell.length, cell.trials, seed=cell.seed)
    return ([t.context for t in trials], [t.question for t in trials],
            lambda i, text: score(trials[i], text))


def run_cell(cell: Cell) -> dict:
    """Load the model, run the cell's trials in batches, score them: one result row."""
    from kvjax import nbytes, parse_method
    from models.loading import load_model
    from models.sampler import generate

    model, tokenizer = load_model(cell.model)
    contexts, questions, scorer = make_prompts(cell, tokenizer)
    transform = parse_method(cell.method)
    scores, texts, cache_bytes, start = [], [], [], time.perf_counter()
    for b in range(0, len(contexts), cell.batch):
        out = generate(model, questions[b:b + cell.batch], contexts=contexts[b:b + cell.batch],
                       transform=transform, max_new_tokens=cell.max_new_tokens)
        for i, (row, n) in enumerate(zip(out.tokens, out.num_tokens)):
            texts.append(tokenizer.decode(row[:n].tolist()))
            scores.append(scorer(b + i, texts[-1]))
        cache_bytes.append(nbytes(out.cache) / len(out.tokens))
    return dict(asdict(cell), status="ok", score=sum(scores) / len(scores), scores=scores,
                outputs=texts,
                cache_bytes_per_seq=max(cache_bytes), seconds=round(time.perf_counter() - start, 1))


# ----------------------------------------------------------------------------- the sweep


def _worker(fn, cell, queue):
    try:
        queue.put(fn(cell))
    except Exception as e:  # reported as the cell's row; the sweep goes on
        queue.put(dict(asdict(cell), status=f"error: {type(e).__name__}: {e}"))


def _rss_gb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0


def run_in_worker(fn: Callable[[Cell], dict], cell: Cell, limit_gb: float,
                  poll_s: float = 0.5) -> dict:
    """`fn(cell)` in a fresh spawned process; killed if its resident memory passes `limit_gb`."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(fn, cell, queue), daemon=True)
    proc.start()
    peak = 0.0
    while proc.is_alive() and queue.empty():
        peak = max(peak, _rss_gb(proc.pid))
        if peak > limit_gb:
            proc.kill()
            proc.join()
            return dict(asdict(cell), status=f"killed: resident memory above {limit_gb} GB")
        time.sleep(poll_s)
    try:
        row = queue.get(timeout=60 if proc.is_alive() else 5)
    except queue_module.Empty:
        row = None
    proc.join()
    if row is None:
        return dict(asdict(cell), status=f"worker died (exit code {proc.exitcode})")
    row["peak_rss_gb"] = round(peak, 2)
    return row


def cell_of(row: dict) -> Cell:
    """The cell a result row belongs to."""
    return Cell(**{k: row[k] for k in Cell.__dataclass_fields__})


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done_keys(path: Path) -> set:
    """Keys of the cells finished with status ok in a results file."""
    if not path.exists():
        return set()
    return {cell_of(r).key for r in read_rows(path) if r.get("status") == "ok"}


def sweep(cells: Iterable[Cell], out: Path, limit_gb: float,
          fn: Callable[[Cell], dict] = run_cell) -> list[dict]:
    """Run every unfinished cell in a worker, appending its row to `out/cells.jsonl`."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    path = out / "cells.jsonl"
    done = done_keys(path)
    todo = [c for c in cells if c.key not in done]
    rows = []
    for cell in tqdm(todo, desc="kvjax eval", unit="cell"):
        row = run_in_worker(fn, cell, limit_gb)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report


def report(out: Path) -> str:
    """Markdown tables (score per task: method x length) and a heatmap PNG per task."""
    latest = {cell_of(r).key: r for r in read_rows(out / "cells.jsonl")}  # a rerun's row wins
    rows = list(latest.values())
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        sub = [r for r in rows if r["task"] == task]
        lengths = sorted({r["length"] for r in sub})
        methods = list(dict.fromkeys(r["method"] for r in sub))
        cell = {(r["method"], r["length"]): r for r in sub}
        lines += [f"### {task}", "", "| method | " + " | ".join(map(str, lengths)) + " |",
                  "|---|" + "---|" * len(lengths)]
        for m in methods:
            vals = []
            for n in lengths:
                r = cell.get((m, n))
                vals.append("" if r is None else f"{r['score']:.2f}" if r["status"] == "ok"
                            else r["status"].split(":")[0])
            lines.append(f"| {m} | " + " | ".join(vals) + " |")
        lines.append("")
        _heatmap(task, methods, lengths, cell, out / f"{task}.png")
    text = "\n".join(lines)
    (out / "tables.md").write_text(text)
    return text


def _heatmap(task, methods, lengths, cell, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.full((len(methods), len(lengths)), np.nan)
    for i, m in enumerate(methods):
        for j, n in enumerate(lengths):
            r = cell.get((m, n))
            if r is not None and r["status"] == "ok":
                grid[i, j] = r["score"]
    fig, ax = plt.subplots(figsize=(2 + 1.2 * len(lengths), 1 + 0.45 * len(methods)))
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
