"""docs/RESULTS.md's RULER tables from the long grid's rows, one pair of tables per length.

For each context length of `ruler_long.toml` (3840 and 7936 tokens: RULER's 4k and 8k), a
score table (a method per row, a task per column, kvjax's cells at RULER's answer budget) and
a table of kvjax beside kvpress (both scores and the count of identical answers, special tokens
and spacing aside, as `experiments/eval/report.py` counts them), and a summary plot (each
method's mean score over the tasks, at both lengths: `docs/results/ruler_long/summary.png`).
The prose around them is written by hand; this rewrites the tables in place:

    PYTHONPATH=. python -m experiments.eval.ruler_tables        # after `kvjax eval --config ruler_long`

`tests/test_ruler_set.py::test_results_ruler_tables_are_the_committed_rows` checks RESULTS
against the rows independently of this code.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from experiments.eval import ruler
from experiments.eval.grid import read_config
from experiments.eval.report import _pairs, _table, same_answers

ROOT = Path(__file__).resolve().parents[2]
ROWS = ROOT / "docs/results/ruler_long/cells.jsonl"
CONFIG = ROOT / "experiments/configs/ruler_long.toml"
RESULTS = ROOT / "docs/RESULTS.md"
SECTION = "## RULER's task set (issue 52)"
LENGTHS = {3840: "4k", 7936: "8k"}
"""Context tokens -> RULER's name for the length (question and answer fill the rest)."""


def score_header(length: int) -> str:
    return f"| method ({LENGTHS[length]}) |"


def beside_header(length: int) -> str:
    return f"| task ({LENGTHS[length]}, kvjax beside kvpress) |"


@functools.cache
def _config_order() -> tuple[list[str], list[str]]:
    """(methods, tasks) in the order `ruler_long.toml` lists them."""
    methods, tasks = [], []
    for cell in read_config(CONFIG).cells:
        methods += [cell.method] if cell.method not in methods else []
        tasks += [cell.task] if cell.task not in tasks else []
    return methods, [t for t in ruler.RULER_TASKS if t in tasks]


def _finished(rows: list[dict], length: int) -> list[dict]:
    return [r for r in rows if r["status"] == "ok" and r["length"] == length]


def _score_grid(rows: list[dict], length: int) -> dict[tuple[str, str], float]:
    """{(task, method): score} of kvjax's finished cells at `length` at RULER's answer budget."""
    return {(r["task"], r["method"]): r["score"] for r in _finished(rows, length)
            if r["engine"] == "kvjax" and r["max_new_tokens"] == ruler.TOKENS_TO_GENERATE[r["task"]]}


def score_table(rows: list[dict], length: int) -> list[str]:
    """Markdown lines: kvjax's score per method (row) and task (column) at `length`, for the
    cells run at the task's RULER answer budget; a blank where a cell has not run."""
    grid = _score_grid(rows, length)
    methods, tasks = _config_order()
    tasks = [t for t in tasks if any((t, m) in grid for m in methods)]
    methods = [m for m in methods if any((t, m) in grid for t in tasks)]
    body = [[f"`{m}`"] + [f"{grid[t, m]:.2f}" if (t, m) in grid else "" for t in tasks]
            for m in methods]
    return _table([f"method ({LENGTHS[length]})"] + tasks, body)[:-1]


def beside_table(rows: list[dict], length: int) -> list[str]:
    """Markdown lines: every kvjax/kvpress pair at `length`, by task and method order."""
    methods, tasks = _config_order()
    pairs = sorted(_pairs(_finished(rows, length), ppl=False),
                   key=lambda p: (tasks.index(p[1]["task"]), methods.index(p[1]["method"])))
    body = [[theirs["task"], f"`{theirs['method']}`", f"{ours['score']:.2f}",
             f"{theirs['score']:.2f}", f"{same_answers(ours, theirs)}/{theirs['trials']}"]
            for ours, theirs in pairs]
    return _table([f"task ({LENGTHS[length]}, kvjax beside kvpress)", "method", "kvjax score",
                   "kvpress score", "same answer"], body)[:-1]


def rewrite(text: str, rows: list[dict]) -> str:
    """`text` (RESULTS.md) with every RULER table of a length that has finished rows replaced
    by the rows' table. A length with rows needs its table headers in the text already (the
    prose around a table is written by hand): a missing one raises."""
    head, section = text.split(SECTION, 1)
    for length in LENGTHS:
        finished = _finished(rows, length)
        tables = [(score_header(length), score_table(rows, length))]
        if any(r["engine"] == "kvpress" for r in finished):
            tables.append((beside_header(length), beside_table(rows, length)))
        for header, lines in tables if finished else ():
            if header not in section:
                raise ValueError(f"docs/RESULTS.md has no table starting {header!r} in "
                                 f"{SECTION!r}: write its prose and header first")
            start = section.index(header)
            end = section.index("\n\n", start)
            section = section[:start] + "\n".join(lines) + section[end:]
    return head + SECTION + section


PLOT = ROWS.with_name("summary.png")


def mean_scores(rows: list[dict], length: int) -> dict[str, float]:
    """{method: its mean score over every task of the config} at `length`, for the methods
    that have run them all, in the config's method order (the score table's rows, averaged)."""
    grid = _score_grid(rows, length)
    methods, tasks = _config_order()
    return {m: sum(grid[t, m] for t in tasks) / len(tasks) for m in methods
            if all((t, m) in grid for t in tasks)}


def plot(rows: list[dict], path: Path = PLOT) -> None:
    """A bar per method and length: its mean score over the tasks (RESULTS' summary plot)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    means = {length: mean_scores(rows, length) for length in LENGTHS}
    methods = [m for m in _config_order()[0] if all(m in means[n] for n in LENGTHS)]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(LENGTHS)
    for i, length in enumerate(LENGTHS):
        ax.bar([j + i * width for j in range(len(methods))],
               [means[length][m] for m in methods], width, label=f"{LENGTHS[length]} tokens")
    ax.set_xticks([j + width * (len(LENGTHS) - 1) / 2 for j in range(len(methods))])
    ax.set_xticklabels(methods, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(f"mean score over RULER's {len(_config_order()[1])} tasks")
    ax.set_title("RULER (SmolLM2-135M-Instruct, 5 trials a cell): kvjax's methods at 4k and 8k")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    RESULTS.write_text(rewrite(RESULTS.read_text(), rows))
    plot(rows)
    print(f"rewrote the RULER tables of {RESULTS.relative_to(ROOT)} from {len(rows)} rows, "
          f"and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
