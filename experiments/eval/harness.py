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

    [[grid]]               # your own text: perplexity on it, passkey needles hidden in it
    tasks = ["ppl", "memory", "passkey"]
    lengths = [1024]
    methods = ["full", "low_rank:rank=32,basis=results/basis.npz"]
    text = "my_corpus.txt"          # ppl and memory cells (default: KJV Genesis)
    haystack = "my_corpus.txt"      # retrieval cells (default: the built-in prose)
    query_aware = false             # true: the question is compressed with the context

    [bases.mine]           # a low-rank basis calibrated before the sweep if the file is missing
    path = "results/basis.npz"      # (text = "...", tokens = 16384, model = ... optional)

    [mesh]                 # optional: every kvjax cell's weights and caches on a device mesh,
    data = 2               # placed as `kvjax generate --mesh data=2,model=4` places them
    model = 4              # (models/sharding.py); the sizes multiply to the device count

Paths are relative to the working directory; a missing, empty or non-UTF-8 `text` or
`haystack` file is refused when the config loads. Task `memory` measures bytes per
context token of a bfloat16 cache beside the formats' arithmetic.

Tasks (what each measures: experiments/eval/cells.py): `passkey` and the RULER-style tasks of
experiments/eval/ruler.py (retrieval accuracy), `ppl` (continuation perplexity), `memory` and `speed`
(prefill tokens/s, decode ms/step, cache bytes). Engine `kvpress` runs a retrieval cell
through kvpress at batch 1 (experiments/eval/kvpress_engine.py); a block with both engines
times both warm (after one untimed batch).

Prefill once, compress many: kvjax retrieval cells that differ only in method (query-agnostic,
untimed, one device) run together in one worker (`prefill_once_units`): each batch of
contexts is prefilled once per group of methods asking for the same statistics and every
method compresses a copy (experiments/eval/cells.py `run_retrieval_group`; its rows equal
separate cells exactly). Methods that compress during prefill (`chunk`) are the exception
and run as their own cells. `kvjax eval --no-shared-prefill` runs one worker per cell.

Every cell (or such a group) runs in its own worker process (spawned, so nothing compiled or cached
accumulates across cells) while the parent watches its resident memory. Untimed cells
run `workers` at a time; timed cells (speed, and warm comparison cells) run after them,
one at a time. A finished cell is one JSON line in `<out>/cells.jsonl`; a rerun skips
it, so an interrupted sweep resumes. Seeds are fixed: the same config gives the same
numbers. The report (experiments/eval/report.py) writes tables and plots.

Layering (no import circle; tests/test_import_layers.py): the cell and grid types, the
config's structure and the row files are experiments/eval/grid.py; the engines
(experiments/eval/cells.py, experiments/eval/kvpress_engine.py) import only it; this module picks
the engine (`run_cell`) and runs the sweep; report and CLI sit on top.

    kvjax eval --config experiments/configs/smoke.toml --out docs/results/eval_smoke
    kvjax bench --config experiments/configs/compare.toml --out results/bench  # speed cells only
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue as queue_module
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable

from experiments.eval.grid import Cell, Grid, check_mesh_devices, done_keys, read_config


def load_config(path: Path) -> Grid:
    """The cells of a TOML grid config, the worker memory bound and the worker count;
    every method spec is parsed here (for its engine), so a bad one fails before a sweep."""
    grid = read_config(path)
    path, cells = Path(path), grid.cells
    if cells[0].mesh:  # `[mesh]`, the same in every cell; workers see the parent's devices
        import jax
        check_mesh_devices(path, cells[0].mesh, jax.device_count())
    from kvjax import parse_method
    from experiments.eval.kvpress_engine import parse_press_spec
    pending = [b.path for b in grid.bases.values() if not Path(b.path).exists()]
    for method, engine in dict.fromkeys((c.method, c.engine) for c in cells):
        try:  # a bad method fails now, not in a worker an hour later
            parse_method(method)
            if engine == "kvpress":
                parse_press_spec(method)
        except FileNotFoundError as e:
            if not any(f"basis={p}" in method for p in pending):  # else prepare_bases makes it
                raise ValueError(f"{path}: method {method!r}: {e}") from None
        except ValueError as e:
            raise ValueError(f"{path}: method {method!r}: {e}") from None
    return grid


def prepare_bases(grid: Grid, cells: Iterable[Cell], out: Path,
                  progress: bool | None = None) -> list[str]:
    """Calibrate every `[bases.NAME]` basis whose file is missing and that an unfinished
    cell of `cells` names (as `kvjax calibrate`: the last `tokens` tokens of `text`, windows
    of 1024); returns the paths written. Runs before the sweep, so `low_rank` cells work
    from a fresh clone; progress on stderr (a bar when it is a terminal)."""
    import sys

    done = done_keys(Path(out) / "cells.jsonl")
    todo = [c.method for c in cells if c.key not in done]
    made = []
    for name, basis in grid.bases.items():
        if Path(basis.path).exists() or not any(f"basis={basis.path}" in m for m in todo):
            continue
        from models.calibration import calibrate_low_rank
        from models.hub import enable_compilation_cache
        from models.loading import load_model

        enable_compilation_cache()
        print(f"kvjax eval: calibrating the low-rank basis {name!r} -> {basis.path} (once)",
              file=sys.stderr, flush=True)
        model, tokenizer = load_model(basis.model)
        ids = tokenizer.encode(Path(basis.text).read_text(encoding="utf-8"))[-basis.tokens:]
        Path(basis.path).parent.mkdir(parents=True, exist_ok=True)
        show = sys.stderr.isatty() if progress is None else progress
        calibrate_low_rank(model, ids, progress=show).save(basis.path)
        made.append(basis.path)
    return made


def check_models(cells: Iterable[Cell]) -> None:
    """ValueError for a cell its model cannot run: a length past the model's positions or
    a `layers=` past its layers (read from the model's metadata, before any worker starts)."""
    from kvjax.policies.methods import check_method
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


def run_cells(cells: tuple[Cell, ...]) -> list[dict]:
    """The rows of cells that share their contexts' prefill (`prefill_once_units`), in one
    worker: experiments/eval/cells.py `run_retrieval_group`."""
    from experiments.eval.cells import run_retrieval_group
    return run_retrieval_group(list(cells))


def prefill_once_units(cells: Iterable[Cell]) -> list[Cell | tuple[Cell, ...]]:
    """`cells` as the units the sweep runs: a tuple of the cells that can share a prefill
    (`cells.shares_prefill`, equal but for the method), in first-seen order, else the cell.

    Example:
        >>> a, b = Cell("qa", 1024, "full", 2), Cell("qa", 1024, "snapkv:ratio=0.5", 2)
        >>> prefill_once_units([a, Cell("ppl", 1024, "full", 2), b])[0] == (a, b)
        True
    """
    from dataclasses import replace

    from experiments.eval.cells import shares_prefill
    units: dict[object, list[Cell]] = {}
    for cell in cells:
        key = replace(cell, method="") if shares_prefill(cell) else cell
        units.setdefault(key, []).append(cell)
    return [group[0] if len(group) == 1 else tuple(group) for group in units.values()]


def _failed(unit: Cell | tuple[Cell, ...], status: str) -> dict | list[dict]:
    """The row (a cell) or rows (a group of cells) of a unit that did not finish."""
    if isinstance(unit, tuple):
        return [dict(asdict(c), status=status) for c in unit]
    return dict(asdict(unit), status=status)


def run_cell(cell: Cell) -> dict:
    """The cell's row from its engine: kvjax (experiments/eval/cells.py) or kvpress
    (experiments/eval/kvpress_engine.py). Runs in a worker process."""
    if cell.engine == "kvpress":
        from experiments.eval.kvpress_engine import run_kvpress_cell
        return run_kvpress_cell(cell)
    from experiments.eval.cells import run_kvjax_cell
    return run_kvjax_cell(cell)


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
        queue.put(_failed(cell, f"error: {type(e).__name__}: {e}"))


def _rss_gb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0


# glibc serves blocks under its (adaptive, up to 32 MB) mmap threshold from heaps it seldom
# returns: a prefill-once group of eleven methods over 5 x 4k contexts peaked at 13.8 GB
# resident, 9.8 GB with every block over 1 MB mapped and unmapped on its own. Not for timed
# cells, where a mapping per buffer per step could move the numbers.
UNTIMED_WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """os.environ with `values` set (a spawned child reads them at its start), then restored;
    a value the user already set stays theirs."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def run_in_worker(fn: Callable[[Cell], dict], cell: Cell, limit_gb: float,
                  poll_s: float = 0.5) -> dict:
    """`fn(cell)` in a fresh spawned process; killed if its resident memory passes `limit_gb`.
    `cell` may be a tuple of cells (`run_cells`): then a list of rows comes back."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(fn, cell, queue), daemon=True)
    # the child inherits a blocked SIGINT, so a Ctrl-C during its start-up (imports) does
    # not print its traceback; `_worker` ignores SIGINT, then unblocks it
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    timed = any(c.timed for c in (cell if isinstance(cell, tuple) else (cell,)))
    try:
        with _environment({} if timed else UNTIMED_WORKER_ENV):
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
            return _failed(cell, f"killed: resident memory above {limit_gb} GB")
        time.sleep(poll_s)
    try:
        row = queue.get(timeout=60 if proc.is_alive() else 5)
    except queue_module.Empty:
        row = None
    proc.join()
    if row is None:
        return _failed(cell, f"worker died (exit code {proc.exitcode})")
    for one in row if isinstance(row, list) else [row]:
        one["peak_rss_gb"] = round(peak, 2)
    return row


def sweep(cells: Iterable[Cell], out: Path, limit_gb: float,
          fn: Callable[[Cell], dict] | None = None, workers: int = 1,
          share_prefill: bool = True) -> list[dict]:
    """Run every unfinished cell in a worker, appending its row to `out/cells.jsonl`.

    Untimed cells run `workers` at a time, then timed cells one at a time; rows are
    appended as cells finish, so the file's order may differ from the config's. With the
    default engine (`fn` None) and `share_prefill`, cells that can share their contexts'
    prefill run as one unit (`prefill_once_units`, `run_cells`).
    """
    from tqdm import tqdm

    if fn is None:
        fn = run_cell
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cells.jsonl"
    done = done_keys(path)
    if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        with open(path, "a") as f:  # a truncated last line must not swallow the next row
            f.write("\n")
    todo = [c for c in dict.fromkeys(cells) if c.key not in done]
    units = prefill_once_units(todo) if share_prefill and fn is run_cell else todo
    rows, lock = [], threading.Lock()
    bar = tqdm(total=len(todo), desc="kvjax eval", unit="cell")

    def run(unit: Cell | tuple[Cell, ...]) -> None:
        if STOP.is_set():
            return
        got = run_in_worker(run_cells if isinstance(unit, tuple) else fn, unit, limit_gb)
        with lock:
            with open(path, "a") as f:
                for row in got if isinstance(got, list) else [got]:
                    f.write(json.dumps(row) + "\n")
                    rows.append(row)
                    bar.update()

    STOP.clear()
    try:
        # pool threads block SIGINT: a process-directed Ctrl-C goes to any thread that does not
        # block it, and one taken by a pool thread would leave the main thread waiting
        pool = ThreadPoolExecutor(max(workers, 1), initializer=signal.pthread_sigmask,
                                  initargs=(signal.SIG_BLOCK, {signal.SIGINT}))
        try:
            for future in [pool.submit(run, u) for u in units
                           if isinstance(u, tuple) or not u.timed]:
                future.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        for cell in (u for u in units if not isinstance(u, tuple) and u.timed):
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
