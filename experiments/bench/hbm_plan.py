"""Per-chip HBM of a Llama-3-8B-shaped decoder on v5e-8 / v6e-8 (data=2 x model=4).

    python -m experiments.bench.hbm_plan --out docs/bench/hbm_plan            # shard bytes, ~10 min
    python -m experiments.bench.hbm_plan --out docs/bench/hbm_plan --compile  # + XLA:TPU check

For context 32k / 128k, batch 8 / 32 and the methods `full`,
`snapkv:ratio=0.5+kivi:bits=4` and `kivi:bits=2` (bf16 weights and cache, 16 new
tokens), every chip's bytes come from the shardings `kvjax compile` gives the
arrays (`models.sharding`, `kvjax.core.cache.cache_axes`), summed over the shards one
chip holds, with no weight materialized:

- weights: the Llama-3-8B shape split over `model` (heads, MLP, vocabulary);
- prefill: weights + the full cache of context + 16 slots (+ the statistics the
  method collects) -- kvjax compresses after prefill, as kvpress does, so this is
  the whole cache;
- decode: weights + the compressed cache `generate` decodes from, planned by
  running the method on one sequence (`experiments.cli.compile_cmd.planned_cache`).

These are the arrays' bytes, a floor: the compiler adds temporaries and TPU tile
padding. `--compile` compiles the decode step of three configurations with XLA:TPU
(deviceless, 2 of the 32 layers, which bounds the compile time on a CPU host) and
records `memory_analysis()` beside the shard bytes of the same arrays, so the floor
can be checked against the compiler. Writes `<out>/plan.json` and `<out>/table.md`.
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
NEW_TOKENS = 16
GIB = 2 ** 30


def shard_plan(mesh, cfg, method: str, context: int, batch: int) -> dict:
    """Per-chip bytes of weights, the prefill cache (+ statistics) and the decode cache."""
    import jax
    import jax.numpy as jnp
    import kvjax
    from kvjax.core.stats import init_stats
    from experiments.cli.compile_cmd import _abstract, _by_batch, planned_cache, shard_bytes
    from models.llama import fixed_rope_frequencies
    from models.sharding import abstract_model, cache_shardings

    transform = kvjax.parse_method(method)
    _, state = abstract_model(cfg, mesh, jnp.bfloat16)
    dense = jax.eval_shape(lambda: kvjax.init_model_cache(
        cfg.cache_spec, batch, context + NEW_TOKENS, jnp.bfloat16,
        track_mass=transform.stats.attention_mass))
    stats = 0
    if transform.stats.window or transform.stats.query_moments:
        stats = shard_bytes(_by_batch(jax.eval_shape(lambda c: init_stats(
            transform.stats, c, cfg.num_heads, fixed_rope_frequencies(cfg)), dense), batch, mesh))
    small = planned_cache(cfg, transform, method, batch, context, NEW_TOKENS, jnp.bfloat16)
    return {"weights": shard_bytes(state),
            "prefill_cache": shard_bytes(_abstract(dense, cache_shardings(dense, mesh))),
            "stats": stats,
            "decode_cache": shard_bytes(_abstract(small, cache_shardings(small, mesh))),
            "decode_cache_total": kvjax.nbytes(small)}


def table(plan: dict) -> str:
    gib = lambda n: f"{n / GIB:.1f}"
    lines = ["| context | batch | method | weights | prefill: weights + cache | "
             "decode: weights + cache | v5e-8 (16 GiB) | v6e-8 (32 GiB) |",
             "|---|---|---|---|---|---|---|---|"]
    fit = lambda n, hbm: "fits" if n <= hbm * GIB else "no"
    for row in plan["rows"]:
        pre = row["weights"] + row["prefill_cache"] + row["stats"]
        dec = row["weights"] + row["decode_cache"]
        fits = lambda hbm: (f"prefill {fit(pre, hbm)}, decode {fit(dec, hbm)}")
        lines.append(f"| {row['context'] // 1024}k | {row['batch']} | `{row['method']}` | "
                     f"{gib(row['weights'])} | {gib(pre)} | {gib(dec)} | {fits(16)} | "
                     f"{fits(32)} |")
    return "\n".join(lines) + "\n"


def compile_check(mesh_by_chip: dict) -> list[dict]:
    """Decode steps of three configurations at 2 layers, compiled for v5e:2x4: the compiler's
    per-chip arguments and temporaries beside the shard bytes of the same arrays."""
    from experiments.cli.compile_cmd import compile_steps, llama3_shape

    cfg = dataclasses.replace(llama3_shape("8b"), num_layers=2)
    rows = []
    for method in METHODS:
        start = time.perf_counter()
        steps = compile_steps(cfg, mesh_by_chip["v5e"], method, 32768, 8, steps=("decode",),
                              new_tokens=NEW_TOKENS, chunk=1024)
        d = steps["decode"]
        rows.append({"chip": "v5e", "layers": 2, "context": 32768, "batch": 8, "method": method,
                     "compiled_argument": d["argument"], "compiled_temp": d["temp"],
                     "compiled_peak": d["peak"],
                     "shard_bytes": steps["weight_bytes_per_chip"] + d["cache_bytes_per_chip"],
                     "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    from experiments.cli.compile_cmd import llama3_shape, topology_devices
    from models.sharding import make_mesh

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/hbm_plan"))
    parser.add_argument("--compile", action="store_true",
                        help="also compile three decode steps with XLA:TPU (2 layers)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meshes = {chip: make_mesh(MESH, topology_devices(topo)) for chip, (topo, _) in CHIPS.items()}
    cfg = llama3_shape("8b")
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            for method in METHODS:
                start = time.perf_counter()
                row = dict(context=context, batch=batch, method=method,
                           **shard_plan(meshes["v5e"], cfg, method, context, batch))
                row["seconds"] = round(time.perf_counter() - start, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    plan = {"model": "llama3-8b shape", "mesh": MESH, "dtype": "bfloat16",
            "new_tokens": NEW_TOKENS, "rows": rows}
    if args.compile:
        plan["compile_check"] = compile_check(meshes)
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    (args.out / "table.md").write_text(table(plan))
    print(table(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
