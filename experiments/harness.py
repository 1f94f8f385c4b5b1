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

import difflib
import itertools
import json
import math
import multiprocessing as mp
import os
import queue as queue_module
import signal
import sys
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
BLOCK_KEYS = ("tasks", "lengths", "methods", "engines", "batches", "warmup", *SHARED)
TOP_KEYS = ("grid", "max_rss_gb", "workers", *SHARED)
# setting -> lowest allowed int value
INT_SETTINGS = {"trials": 1, "seed": 0, "batch": 1, "max_new_tokens": 1, "workers": 1}


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(path, where: str, table: dict, allowed) -> None:
    for key in table:
        if key not in allowed:
            raise ValueError(f"{path}: unknown {where} key {key!r}{_hint(key, allowed)}; "
                             f"allowed: {', '.join(allowed)}")


def _check_settings(path, where: str, table: dict) -> None:
    """ValueError for a setting of the wrong type or outside its range (names file and key)."""
    for key, low in INT_SETTINGS.items():
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{path}: {where}{key} = {value!r}: must be an integer >= {low}")
    if "model" in table and not (isinstance(table["model"], str) and table["model"]):
        raise ValueError(f"{path}: {where}model = {table['model']!r}: must be 'smollm2' or a path")
    if "max_rss_gb" in table:
        value = table["max_rss_gb"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{path}: max_rss_gb = {value!r}: must be a number > 0 (GB)")


def _check_list(path, key: str, value, kind, low: int | None = None) -> None:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path}: [[grid]] {key} = {value!r}: must be a non-empty list")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, kind) or \
                (low is not None and item < low):
            need = f"integers >= {low}" if low is not None else "strings"
            raise ValueError(f"{path}: [[grid]] {key} has {item!r}: must hold {need}")


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
    _check_keys(path, "[[grid]]", block, BLOCK_KEYS)
    missing = {"tasks", "lengths", "methods"} - set(block)
    if missing:
        raise ValueError(f"{path}: a [[grid]] block lacks {sorted(missing)}")
    _check_settings(path, "[[grid]] ", block)
    _check_list(path, "tasks", block["tasks"], str)
    _check_list(path, "lengths", block["lengths"], int, 2)
    _check_list(path, "methods", block["methods"], str)
    if "engines" in block:
        _check_list(path, "engines", block["engines"], str)
    if "batches" in block:
        _check_list(path, "batches", block["batches"], int, 1)
    if not isinstance(block.get("warmup", False), bool):
        raise ValueError(f"{path}: [[grid]] warmup = {block['warmup']!r}: must be true or false")
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
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a valid TOML file: {e}") from None
    _check_keys(path, "top-level", config, TOP_KEYS)
    _check_settings(path, "", config)
    blocks = config.get("grid", [])
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise ValueError(f"{path}: `grid` must be [[grid]] tables")
    shared = {k: config[k] for k in SHARED if k in config}
    cells = [c for block in blocks for c in _block_cells(path, block, shared)]
    if not cells:
        raise ValueError(f"{path}: no [[grid]] cells")
    from kvjax import parse_method
    from experiments.kvpress_engine import parse_press_spec
    for method, engine in dict.fromkeys((c.method, c.engine) for c in cells):
        try:  # a bad method fails now, not in a worker an hour later
            parse_method(method)
            if engine == "kvpress":
                parse_press_spec(method)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{path}: method {method!r}: {e}") from None
    return Grid(cells, float(config.get("max_rss_gb", 16)), int(config.get("workers", 1)))


def check_models(cells: Iterable[Cell]) -> None:
    """ValueError for a cell its model cannot run: a length past the model's positions or
    a `layers=` past its layers (read from the model's metadata, before any worker starts)."""
    from kvjax.methods import check_method
    from models.loading import model_config

    by_model: dict[str, list[Cell]] = {}
    for cell in cells:
        by_model.setdefault(cell.model, []).append(cell)
    for model, group in by_model.items():
        cfg = model_config(model)
        for cell in group:
            need = cell.length + (cell.max_new_tokens if cell.task != "ppl" else 0)
            if need > cfg.max_position:
                raise ValueError(f"cell {cell.task} length {cell.length} (+ {need - cell.length} "
                                 f"new tokens) exceeds {model}'s {cfg.max_position} positions")
        for method in {c.method for c in group if c.engine == "kvjax"}:
            check_method(method, cfg.num_layers)


# ----------------------------------------------------------------------------- the sweep


STOP = threading.Event()
"""Set on Ctrl-C: running workers are killed and no new cell starts."""


class Interrupted(Exception):
    """The sweep stopped on Ctrl-C; every finished row is in cells.jsonl."""


def _worker(fn, cell, queue):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked since the spawn
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
    # the child inherits a blocked SIGINT, so a Ctrl-C during its start-up (imports) does
    # not print its traceback; `_worker` ignores SIGINT, then unblocks it
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    peak = 0.0
    while proc.is_alive() and queue.empty():
        if STOP.is_set():
            proc.kill()
            proc.join()
            raise Interrupted(f"stopped while running {cell}")
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
    """The result rows of a cells.jsonl file; a damaged line (a truncated write, an edit)
    is skipped with a warning naming the file and line, so it never blocks a rerun."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace")
                                  .splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            cell_of(row)  # a row must name its cell
        except (ValueError, TypeError) as e:
            print(f"kvjax: warning: {path}:{number}: skipping a damaged result line "
                  f"({type(e).__name__}: {str(e)[:80]}); its cell runs again", file=sys.stderr)
            continue
        rows.append(row)
    return rows


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
    if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        with open(path, "a") as f:  # a truncated last line must not swallow the next row
            f.write("\n")
    todo = [c for c in dict.fromkeys(cells) if c.key not in done]
    rows, lock = [], threading.Lock()
    bar = tqdm(total=len(todo), desc="kvjax eval", unit="cell")

    def run(cell: Cell) -> None:
        if STOP.is_set():
            return
        row = run_in_worker(fn, cell, limit_gb)
        with lock:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            bar.update()

    STOP.clear()
    try:
        pool = ThreadPoolExecutor(max(workers, 1))
        try:
            for future in [pool.submit(run, c) for c in todo if not c.timed]:
                future.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        for cell in (c for c in todo if c.timed):
            run(cell)
    except (KeyboardInterrupt, Interrupted):
        STOP.set()  # running workers are killed; their cells run again next time
        pool.shutdown(wait=True, cancel_futures=True)
        raise Interrupted(f"interrupted: {len(rows)} finished cells kept in {path}; "
                          f"rerun the same command to resume") from None
    except BaseException:
        STOP.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        bar.close()
    return rows
