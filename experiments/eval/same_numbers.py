"""Do two `kvjax eval` sweeps give the same numbers? Compares the cells they share.

For every cell (same fields) finished in both folders it compares the score, the
per-trial scores and the generated texts; timings are not compared. Exits 1 on any
difference, so it can gate a rerun.

    kvjax eval --config experiments/configs/repro.toml --out /tmp/rerun
    python experiments/eval/same_numbers.py docs/results/eval /tmp/rerun
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.eval.grid import cell_of
from experiments.eval.report import latest_rows

COMPARED = ("score", "scores", "outputs", "nll", "tokens_scored", "cache_bytes_per_token",
            "cache_bytes_per_token_bf16",
            "cache_bytes_per_seq")


def differences(a: Path, b: Path) -> tuple[int, list[str]]:
    """(cells compared, one line per cell whose compared fields differ)."""
    rows_a = {cell_of(r).key: r for r in latest_rows(a) if r.get("status") == "ok"}
    rows_b = {cell_of(r).key: r for r in latest_rows(b) if r.get("status") == "ok"}
    shared = [k for k in rows_a if k in rows_b and rows_a[k]["task"] != "speed"]  # timings vary
    lines = []
    for key in shared:
        ra, rb = rows_a[key], rows_b[key]
        diff = [f for f in COMPARED if ra.get(f) != rb.get(f)]
        if diff:
            lines.append(f"{ra['task']} {ra['length']} {ra['method']} ({ra.get('engine')}): "
                         f"{', '.join(diff)} differ")
    return len(shared), lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("first", type=Path)
    p.add_argument("second", type=Path)
    args = p.parse_args(argv)
    count, lines = differences(args.first, args.second)
    print("\n".join(lines) or f"{count} shared cells, identical scores and outputs")
    return 1 if lines or not count else 0


if __name__ == "__main__":
    sys.exit(main())
