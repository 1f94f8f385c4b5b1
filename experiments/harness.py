"""`kvjax eval` / `kvjax bench`: grids of (task, length, method) cells on a real model.

A TOML config names the model, shared settings and one or more grid blocks:

    model = "smollm2"
    trials = 10            # per cell, run in batches of `batch`
    batch = 10
    max_rss_gb = 12        # a worker above this is killed, its cell marked failed
    workers = 2            # untimed cells run this many at a time

    [[grid]]               # any shared setting may be overridden per block
    tasks = ["passkey", "niah_multikey"]
    lengths = [1024, 2048]
    methods = ["full", "streaming_llm:ratio=0.5", "snapkv:ratio=0.5+kivi:bits=4"]

    [[grid]]               # kvjax beside kvpress on the same prompts, both timed warm
    tasks = ["passkey"]
    lengths = [1024]
    methods = ["full", "snapkv:ratio=0.5"]
    engines = ["kvjax", "kvpress"]
    batch = 8

    [[grid]]               # memory and speed
    tasks = ["speed"]
    lengths = [512, 2048]
    batches = [1, 8]
    methods = ["full", "snapkv:ratio=0.5+kivi:bits=4"]
    trials = 3             # timed repeats

Tasks (what each measures: experiments/cells.py): `passkey` and the RULER-style tasks of
experiments/ruler.py (retrieval accuracy), `ppl` (continuation perplexity) and `speed`
(prefill tokens/s, decode ms/step, cache bytes). Engine `kvpress` runs a retrieval cell
through kvpress at batch 1 (experiments/kvpress_engine.py); a block with both engines
times both warm (after one untimed batch).

Every cell runs in its own worker process (spawned, so nothing compiled or cached
accumulates across cells) while the parent watches its resident memory. Untimed cells
run `workers` at a time; timed cells (speed, and warm comparison cells) run after them,
one at a time. A finished cell is one JSON line in `<out>/cells.jsonl`; a rerun skips
it, so an interrupted sweep resumes. Seeds are fixed: the same config gives the same
numbers. The report (experiments/report.py) writes tables and plots.

    kvjax eval --config experiments/configs/smoke.toml --out docs/results/eval_smoke
    kvjax bench --config experiments/configs/compare.toml --out results/bench  # speed cells only
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import queue as queue_module
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from experiments.ruler import TASKS as RULER_TASKS

RETRIEVAL_TASKS = ("passkey",) + RULER_TASKS
TASKS = RETRIEVAL_TASKS + ("ppl", "speed")
ENGINES = ("kvjax", "kvpress")
SHARED = ("model", "trials", "seed", "batch", "max_new_tokens")  # settable at top or per block


@dataclass(frozen=True)
class Cell:
    task: str
    length: int  # context tokens (ppl: window tokens)
    method: str  # a kvjax method spec, e.g. "snapkv:ratio=0.5+kivi:bits=4"
    trials: int  # prompts (ppl: windows; speed: timed repeats)
    model: str = "smollm2"
    seed: int = 0
    batch: int = 10
    max_new_tokens: int = 24
    engine: str = "kvjax"
    warmup: bool = False  # time a warm run (one untimed batch first)

    @property
    def key(self) -> tuple:
        return astuple(self)

    @property
    def timed(self) -> bool:
        """Its timings are results: it runs alone."""
        return self.task == "speed" or self.warmup


class Grid(NamedTuple):
    cells: list[Cell]  # in config order
    max_rss_gb: float  # memory bound of one worker
    workers: int  # untimed cells run this many at a time


def _block_cells(path, block: dict, shared: dict) -> list[Cell]:
    missing = {"tasks", "lengths", "methods"} - set(block)
    if missing:
        raise ValueError(f"{path}: a [[grid]] block lacks {sorted(missing)}")
    unknown = set(block) - {"tasks", "lengths", "methods", "engines", "batches", "warmup",
                            *SHARED}
    if unknown:
        raise ValueError(f"{path}: unknown [[grid]] keys {sorted(unknown)}")
    settings = dict(shared, **{k: block[k] for k in SHARED if k in block})
    if "trials" not in settings:
        raise ValueError(f"{path}: set `trials` (per cell)")
    batch = settings.pop("batch", Cell.batch)
    engines = block.get("engines", ["kvjax"])
    batches = block.get("batches", [batch])
    cells = []
    for task, length, method, engine, batch in itertools.product(
            block["tasks"], block["lengths"], block["methods"], engines, batches):
        if task not in TASKS:
            raise ValueError(f"{path}: unknown task {task!r}; tasks: {TASKS}")
        if engine not in ENGINES:
            raise ValueError(f"{path}: unknown engine {engine!r}; engines: {ENGINES}")
        if engine == "kvpress" and task not in RETRIEVAL_TASKS:
            raise ValueError(f"{path}: the kvpress engine runs retrieval tasks, not {task!r}")
        cells.append(Cell(task, int(length), method, batch=int(batch),
                          engine=engine, warmup=block.get("warmup", len(engines) > 1),
                          **settings))
    return cells


def load_config(path: Path) -> Grid:
    """The cells of a TOML grid config, the worker memory bound and the worker count."""
    config = tomllib.loads(Path(path).read_text())
    shared = {k: config[k] for k in SHARED if k in config}
    cells = [c for block in config.get("grid", []) for c in _block_cells(path, block, shared)]
    if not cells:
        raise ValueError(f"{path}: no [[grid]] cells")
    from kvjax import parse_method
    for method in {c.method for c in cells}:
        parse_method(method)  # a bad method fails now, not in a worker an hour later
    from experiments.kvpress_engine import parse_press_spec
    for method in {c.method for c in cells if c.engine == "kvpress"}:
        parse_press_spec(method)
    return Grid(cells, float(config.get("max_rss_gb", 16)), int(config.get("workers", 1)))


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
    """The cell a result row belongs to (fields a row lacks take their defaults)."""
    return Cell(**{f.name: row[f.name] for f in fields(Cell) if f.name in row})


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done_keys(path: Path) -> set:
    """Keys of the cells finished with status ok in a results file."""
    if not path.exists():
        return set()
    return {cell_of(r).key for r in read_rows(path) if r.get("status") == "ok"}


def sweep(cells: Iterable[Cell], out: Path, limit_gb: float,
          fn: Callable[[Cell], dict] | None = None, workers: int = 1) -> list[dict]:
    """Run every unfinished cell in a worker, appending its row to `out/cells.jsonl`.

    Untimed cells run `workers` at a time, then timed cells one at a time; rows are
    appended as cells finish, so the file's order may differ from the config's.
    """
    from tqdm import tqdm

    if fn is None:
        from experiments.cells import run_cell as fn
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cells.jsonl"
    done = done_keys(path)
    todo = [c for c in dict.fromkeys(cells) if c.key not in done]
    rows, lock = [], threading.Lock()
    bar = tqdm(total=len(todo), desc="kvjax eval", unit="cell")

    def run(cell: Cell) -> None:
        row = run_in_worker(fn, cell, limit_gb)
        with lock:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            bar.update()

    with ThreadPoolExecutor(max(workers, 1)) as pool:
        list(pool.map(run, [c for c in todo if not c.timed]))
    for cell in (c for c in todo if c.timed):
        run(cell)
    bar.close()
    return rows
