"""Per-chip HBM of a Llama-3-8B-shaped decoder on v5e-8 / v6e-8, from deviceless TPU compiles.

    python -m experiments.hbm_plan --out docs/bench/hbm_plan      # resumable; ~1 h on 2 cores

For each chip (v5e:2x4, v6e:2x4; mesh data=2,model=4), context (32k, 128k), batch
(8, 32) and method (`full`, `snapkv:ratio=0.5+kivi:bits=4`, `kivi:bits=2`) the
prefill, compression and decode steps of `models.sampler` are compiled by XLA:TPU
on this CPU host (`experiments.compile_cmd.compile_steps`, bf16 weights and cache)
and `memory_analysis()` gives each step's per-chip peak (arguments + outputs -
donated + temporaries + code).

Compiling 32 unrolled layers at 128k tokens takes minutes per step on 2 shared
cores, so every configuration is compiled with 2 and with 4 layers and the peak is
extrapolated linearly to 32 layers: weights and caches are per layer, and the
temporaries of one step do not grow with depth. One configuration is also
compiled at the full 32 layers to check the extrapolation (`check` in the JSON).
Writes `<out>/rows.jsonl` (one line per compile, reused by a rerun) and
`<out>/table.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

CHIPS = {"v5e": ("v5e:2x4", 16), "v6e": ("v6e:2x4", 32)}  # topology, GiB of HBM per chip
CONTEXTS = (32768, 131072)
BATCHES = (8, 32)
METHODS = ("full", "snapkv:ratio=0.5+kivi:bits=4", "kivi:bits=2")
MESH = "data=2,model=4"
LAYERS = (2, 4)
FULL_LAYERS = 32
NEW_TOKENS = 16


def compile_row(chip: str, context: int, batch: int, method: str, layers: int) -> dict:
    from experiments.compile_cmd import compile_steps, llama3_shape, topology_devices
    from models.sharding import make_mesh

    cfg = dataclasses.replace(llama3_shape("8b"), num_layers=layers)
    mesh = make_mesh(MESH, topology_devices(CHIPS[chip][0]))
    start = time.perf_counter()
    steps = compile_steps(cfg, mesh, method, context, batch, new_tokens=NEW_TOKENS,
                          chunk=1024)
    return dict(chip=chip, context=context, batch=batch, method=method, layers=layers,
                seconds=round(time.perf_counter() - start, 1), **steps)


def extrapolate(rows: dict, key: tuple, step: str, layers: int = FULL_LAYERS) -> float | None:
    """Peak bytes of `step` at `layers` layers from the 2- and 4-layer compiles (linear)."""
    a, b = rows.get(key + (LAYERS[0],)), rows.get(key + (LAYERS[1],))
    if a is None or b is None or step not in a:
        return None
    slope = (b[step]["peak"] - a[step]["peak"]) / (LAYERS[1] - LAYERS[0])
    return a[step]["peak"] + slope * (layers - LAYERS[0])


def table(rows: dict) -> str:
    gib = lambda n: "-" if n is None else f"{n / 2**30:.1f}"
    lines = ["| chip (HBM/chip) | context | batch | method | prefill | compress | decode | "
             "peak | fits |", "|---|---|---|---|---|---|---|---|---|"]
    for chip, (_, hbm) in CHIPS.items():
        for context in CONTEXTS:
            for batch in BATCHES:
                for method in METHODS:
                    key = (chip, context, batch, method)
                    steps = [extrapolate(rows, key, s) for s in ("prefill", "compress", "decode")]
                    known = [s for s in steps if s is not None]
                    peak = max(known) if len(known) >= 2 else None
                    decode_fits = steps[2] is not None and steps[2] <= hbm * 2**30
                    fits = "-" if peak is None else ("yes" if peak <= hbm * 2**30 else
                                                     "decode only" if decode_fits else "no")
                    lines.append(f"| {chip}-8 ({hbm} GiB) | {context // 1024}k | {batch} | "
                                 f"`{method}` | {gib(steps[0])} | {gib(steps[1])} | "
                                 f"{gib(steps[2])} | {gib(peak)} | {fits} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/hbm_plan"))
    parser.add_argument("--check", action="store_true",
                        help="also compile one configuration at the full 32 layers")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rows.jsonl"
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            rows[(r["chip"], r["context"], r["batch"], r["method"], r["layers"])] = r
    todo = [(chip, context, batch, method, layers) for layers in LAYERS for chip in CHIPS
            for context in CONTEXTS for batch in BATCHES for method in METHODS]
    if args.check:
        todo.append(("v5e", 32768, 8, "snapkv:ratio=0.5+kivi:bits=4", FULL_LAYERS))
    for key in todo:
        if key in rows:
            continue
        row = compile_row(*key)
        rows[key] = row
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in ("chip", "context", "batch", "method", "layers",
                                               "seconds")}), flush=True)
        (args.out / "table.md").write_text(table(rows))
    (args.out / "table.md").write_text(table(rows))
    check = rows.get(("v5e", 32768, 8, "snapkv:ratio=0.5+kivi:bits=4", FULL_LAYERS))
    if check:
        key = ("v5e", 32768, 8, "snapkv:ratio=0.5+kivi:bits=4")
        print("check at 32 layers (compiled vs extrapolated GiB):",
              {s: (round(check[s]["peak"] / 2**30, 2), round(extrapolate(rows, key, s) / 2**30, 2))
               for s in ("prefill", "compress", "decode") if s in check})
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
