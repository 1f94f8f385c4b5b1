"""The HBM plan checked against XLA:TPU: 1- and 2-layer Llama-3-8B-shaped decoders compiled
for v5e:2x4 (deviceless), `memory_analysis()` per chip beside `hbm_plan.shard_plan`.

    python -m experiments.bench.hbm_check --out docs/bench/hbm_plan/check.json   # ~minutes per step

A whole 32-layer 8B compile took more than 15 minutes on the loaded 2-core host, so the
check compiles the same shape cut to 1 and 2 layers (every layer is the same program:
per-layer bytes are the difference of the two, the embedding, vocabulary head and norms the
rest). For each (layers, method) at context 32k, batch 8, mesh data=2 x model=4 it records:

- `plan`: `hbm_plan.shard_plan` for the same layer count (weights + decode cache, or + the
  prefill cache and statistics): the arrays' bytes per chip from their shardings alone;
- `compiled`: the compiled step's `memory_analysis()` per chip: argument, output, alias,
  temp and peak (arguments + outputs - aliased + temporaries + code);
- `argument_over_plan`: compiled argument bytes / planned bytes (1.0 = the plan is exactly
  what the compiler reserves for the inputs; > 1 = TPU tile padding and small inputs).

Writes one JSON object (`rows`, one per compiled step) to `--out`, rewritten after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

CONTEXT, BATCH = 32768, 8
LAYERS = (1, 2)


def check_row(mesh, layers: int, method: str, step: str, context: int = CONTEXT,
              batch: int = BATCH) -> dict:
    """One compiled step of an `layers`-layer 8B-shaped decoder beside its shard plan."""
    from experiments.cli.compile_cmd import compile_steps, llama3_shape
    from experiments.bench.hbm_plan import NEW_TOKENS, shard_plan

    cfg = dataclasses.replace(llama3_shape("8b"), num_layers=layers)
    plan = shard_plan(mesh, cfg, method, context, batch)
    planned = plan["weights"] + (plan["decode_cache"] if step == "decode"
                                 else plan["prefill_cache"] + plan["stats"])
    start = time.perf_counter()
    compiled = compile_steps(cfg, mesh, method, context, batch, steps=(step,),
                             new_tokens=NEW_TOKENS, chunk=1024)[step]
    return {"layers": layers, "method": method, "step": step, "context": context,
            "batch": batch, "plan": plan, "planned_bytes": planned,
            "compiled": {k: v for k, v in compiled.items() if k != "seconds"},
            "argument_over_plan": round(compiled["argument"] / planned, 4),
            "compile_seconds": round(time.perf_counter() - start, 1)}


def main(argv=None) -> int:
    from experiments.cli.compile_cmd import topology_devices
    from experiments.bench.hbm_plan import MESH, METHODS
    from models.sharding import make_mesh

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/hbm_plan/check.json"))
    parser.add_argument("--steps", default="decode,prefill",
                        help="comma-separated steps to compile: decode, prefill")
    parser.add_argument("--methods", default=";".join(METHODS),
                        help="semicolon-separated method specs")
    parser.add_argument("--layers", default=",".join(map(str, LAYERS)),
                        help="comma-separated layer counts (32 = the whole 8B decoder)")
    args = parser.parse_args(argv)
    try:
        layer_counts = [int(n) for n in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers {args.layers!r}: expected integers such as 1,2")
    if not all(1 <= n <= 32 for n in layer_counts):
        parser.error(f"--layers {args.layers!r}: each count must be in [1, 32]")
    steps = [s for s in args.steps.split(",") if s]
    for s in steps:
        if s not in ("decode", "prefill"):
            parser.error(f"--steps: {s!r} is not decode or prefill")
    mesh = make_mesh(MESH, topology_devices("v5e:2x4"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"model": "llama3-8b shape", "topology": "v5e:2x4", "mesh": MESH,
              "dtype": "bfloat16", "rows": []}
    for step in steps:
        for method in args.methods.split(";"):
            for layers in layer_counts:
                row = check_row(mesh, layers, method, step)
                result["rows"].append(row)
                print(json.dumps({k: row[k] for k in ("layers", "method", "step",
                                                      "planned_bytes", "argument_over_plan",
                                                      "compile_seconds")}), flush=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
