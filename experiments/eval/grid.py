"""The grid of `kvjax eval`: cell and grid types, the TOML config's structure, result rows.

Pure data and file I/O, the bottom of the pipeline's layering (it imports no other
pipeline module, and nothing of jax):

    grid  <-  cells (kvjax engine), kvpress_engine  <-  harness (dispatch, sweep)  <-  report, cli

`read_config(path)` checks a config's keys, types and ranges (and that `text` / `haystack`
name non-empty UTF-8 files) and expands its `[[grid]]` blocks into `Cell`s, with its
`[bases.NAME]` tables as `Basis` entries; `experiments.eval.harness.load_config` adds the checks
that need the engines (every method spec parses). A result row is one JSON object per line
of `cells.jsonl`: the cell's fields plus what the cell measured; `cell_of(row)` is its
cell, `read_rows(path)` reads a file of them (skipping damaged lines), `done_keys(path)`
the cells already finished.

Example:
    >>> cell = Cell("passkey", 1024, "snapkv:ratio=0.5", trials=10)
    >>> cell_of({"task": "passkey", "length": 1024, "method": "snapkv:ratio=0.5",
    ...          "trials": 10, "status": "ok", "score": 1.0}) == cell
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import sys
import tomllib
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import NamedTuple

from experiments.eval.ruler import TASKS as RULER_TASKS

RETRIEVAL_TASKS = ("passkey",) + RULER_TASKS
TEXT_TASKS = ("ppl", "memory")  # tasks that read plain text (`text = PATH`)
TASKS = RETRIEVAL_TASKS + TEXT_TASKS + ("speed",)
ENGINES = ("kvjax", "kvpress")
# settable at top or per block
SHARED = ("model", "trials", "seed", "batch", "max_new_tokens", "text", "haystack")
BLOCK_KEYS = ("tasks", "lengths", "methods", "engines", "batches", "warmup", "query_aware",
              *SHARED)
TOP_KEYS = ("grid", "bases", "max_rss_gb", "workers", "mesh", *SHARED)
MESH_AXES = ("data", "model")  # as models.sharding.AXES (this module imports no jax)
BASIS_KEYS = ("path", "text", "tokens", "model")
CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "devils_dictionary.txt"  # as `kvjax calibrate`
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
    for key in ("text", "haystack"):
        if key in table:
            check_text_file(path, f"{where}{key}", table[key])
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


def check_text_file(path, key: str, value) -> None:
    """ValueError unless `value` names a non-empty UTF-8 text file (relative to the working
    directory, like a method's `basis=`): `text = PATH` (ppl, memory), `haystack = PATH`."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}: {key} = {value!r}: must be the path of a UTF-8 text file")
    file = Path(value)
    if not file.is_file():
        raise ValueError(f"{path}: {key} = {value!r}: no such file (paths are relative to the "
                         f"working directory, {Path.cwd()})")
    try:
        content = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: {key} = {value!r}: not UTF-8 text ({e})") from None
    if not content.strip():
        raise ValueError(f"{path}: {key} = {value!r}: the file is empty")


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
    query_aware: bool = False  # retrieval: the question is prefilled and compressed too
    text_path: str = ""  # ppl / memory: config `text`, a text file ("" = KJV Genesis)
    haystack_path: str = ""  # retrieval: config `haystack`, a prose file ("" = built-in texts)
    mesh: str = ""  # config `[mesh]` as "data=2,model=4" ("" = one device)

    @property
    def key(self) -> tuple:
        return astuple(self)

    @property
    def timed(self) -> bool:
        """Its timings are results: it runs alone."""
        return self.task == "speed" or self.warmup


class Basis(NamedTuple):
    """A `[bases.NAME]` table: the low-rank basis file that `low_rank:...,basis=PATH` methods
    name, calibrated (`kvjax calibrate`) before the sweep when the file is missing."""

    path: str  # the .npz file (relative to the working directory)
    text: str  # calibration text (default: The Devil's Dictionary)
    tokens: int  # calibrate on the last `tokens` tokens of the text
    model: str  # the model whose keys and values are calibrated


class Grid(NamedTuple):
    cells: list[Cell]  # in config order
    max_rss_gb: float  # memory bound of one worker
    workers: int  # untimed cells run this many at a time
    bases: dict[str, Basis] = {}  # [bases.NAME] tables, by name


def _read_bases(path, config: dict) -> dict[str, Basis]:
    tables = config.get("bases", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ValueError(f"{path}: `bases` must be [bases.NAME] tables")
    out = {}
    for name, table in tables.items():
        where = f"[bases.{name}]"
        _check_keys(path, where, table, BASIS_KEYS)
        file = table.get("path")
        if not isinstance(file, str) or not file.endswith(".npz"):
            raise ValueError(f"{path}: {where} path = {file!r}: must be a .npz file path")
        text = table.get("text", str(CALIBRATION_TEXT))
        check_text_file(path, f"{where} text", text)
        tokens = table.get("tokens", 16384)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1024:
            raise ValueError(f"{path}: {where} tokens = {tokens!r}: must be an integer >= 1024 "
                             f"(one calibration window)")
        model = table.get("model", config.get("model", Cell.model))
        _check_settings(path, f"{where} ", {"model": model})
        out[name] = Basis(file, text, tokens, model)
    return out


def read_mesh(path, config: dict) -> str:
    """The `[mesh]` table of a config as "data=D,model=M" ("" without one).

    Keys are the axis names `data` (splits sequences) and `model` (splits weights and KV
    heads); sizes are integers >= 1, a missing axis is 1. Whether the sizes multiply to the
    device count is `check_mesh_devices`' (it needs jax).

    Example:
        >>> read_mesh("c.toml", {"mesh": {"data": 2, "model": 4}})
        'data=2,model=4'
        >>> read_mesh("c.toml", {"mesh": {"modle": 4}})
        Traceback (most recent call last):
        ...
        ValueError: c.toml: unknown [mesh] key 'modle' (did you mean 'model'?); allowed: data, model
    """
    if "mesh" not in config:
        return ""
    table = config["mesh"]
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: mesh = {table!r}: must be a [mesh] table such as "
                         f"data = 2 and model = 4")
    _check_keys(path, "[mesh]", table, MESH_AXES)
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: [mesh] {key} = {value!r}: must be an integer >= 1")
    return ",".join(f"{axis}={table.get(axis, 1)}" for axis in MESH_AXES)


def check_mesh_devices(path, mesh: str, device_count: int) -> None:
    """ValueError unless the `[mesh]` sizes multiply to `device_count` (every device is used
    once; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N for N fake devices).

    Example:
        >>> check_mesh_devices("c.toml", "data=2,model=4", 8)
        >>> check_mesh_devices("c.toml", "data=2,model=3", 8)
        Traceback (most recent call last):
        ...
        ValueError: c.toml: [mesh] data=2,model=3 needs 6 devices, 8 available: the sizes must multiply to the device count
    """
    if not mesh:
        return
    need = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    if need != device_count:
        raise ValueError(f"{path}: [mesh] {mesh} needs {need} devices, {device_count} "
                         f"available: the sizes must multiply to the device count")


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
    for flag in ("warmup", "query_aware"):
        if not isinstance(block.get(flag, False), bool):
            raise ValueError(f"{path}: [[grid]] {flag} = {block[flag]!r}: must be true or false")
    settings = dict(shared, **{k: block[k] for k in SHARED if k in block})
    if "trials" not in settings:
        raise ValueError(f"{path}: set `trials` (per cell)")
    batch = settings.pop("batch", Cell.batch)
    text, haystack = settings.pop("text", ""), settings.pop("haystack", "")
    query_aware = block.get("query_aware", False)
    engines = block.get("engines", ["kvjax"])
    batches = block.get("batches", [batch])
    cells = []
    for task, length, method, engine, batch in itertools.product(
            block["tasks"], block["lengths"], block["methods"], engines, batches):
        if task not in TASKS:
            raise ValueError(f"{path}: unknown task {task!r}; tasks: {TASKS}")
        if engine not in ENGINES:
            raise ValueError(f"{path}: unknown engine {engine!r}; engines: {ENGINES}")
        if engine == "kvpress" and task not in RETRIEVAL_TASKS + ("ppl",):
            raise ValueError(f"{path}: the kvpress engine runs ppl and retrieval tasks, not "
                             f"{task!r}")
        if engine == "kvpress" and query_aware:
            raise ValueError(f"{path}: query_aware cells run on the kvjax engine only")
        if query_aware and task not in RETRIEVAL_TASKS:
            raise ValueError(f"{path}: query_aware applies to retrieval tasks, not {task!r}")
        cells.append(Cell(task, int(length), method, batch=int(batch),
                          engine=engine, warmup=block.get("warmup", len(engines) > 1),
                          query_aware=query_aware,
                          text_path=text if task in TEXT_TASKS else "",
                          haystack_path=haystack if task in RETRIEVAL_TASKS else "", **settings))
    return cells


def read_config(path: Path) -> Grid:
    """The cells of a TOML grid config, the worker memory bound and the worker count
    (structure only: method specs are checked by `experiments.eval.harness.load_config`)."""
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
    mesh = read_mesh(path, config)
    cells = [c for block in blocks for c in _block_cells(path, block, shared)]
    if not cells:
        raise ValueError(f"{path}: no [[grid]] cells")
    if mesh:
        if any(c.engine == "kvpress" for c in cells):
            raise ValueError(f"{path}: [mesh] runs kvjax cells only; a [[grid]] block has "
                             f"engine 'kvpress' (it runs on one device)")
        cells = [dataclasses.replace(c, mesh=mesh) for c in cells]  # every cell: one mesh
    return Grid(cells, float(config.get("max_rss_gb", 16)), int(config.get("workers", 1)),
                _read_bases(path, config))


# ----------------------------------------------------------------------------- result rows


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


def read_text(path: Path) -> str:
    """The UTF-8 text of `path`; FileNotFoundError or ValueError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}" if not path.is_dir()
                                else f"{path} is a directory: need a text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text
