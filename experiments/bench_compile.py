"""Where a cold first `generate` spends its compile time, per jitted program.

Each (method, batch) cell runs in a fresh process with the persistent compilation cache off
(`KVJAX_COMPILATION_CACHE=0`), loads SmolLM2-135M-Instruct and calls `generate` once on
random prompts of `--context` tokens. jax's own compile events
(`jax.monitoring` duration events with the jitted function's name) give, per program
(`_prefill`, `_compress`, `_decode`, `kvjax.shrink`'s helpers, ...), the tracing, the
lowering to MLIR and the XLA backend compile seconds. The cell also records the first
call's wall and process-CPU seconds and, with `--warm`, a second call of equal shapes
(other tokens), whose difference to the first is the compile cost end to end.

    python -m experiments.bench_compile --methods full snapkv:ratio=0.5 \\
        snapkv:ratio=0.5+kivi:bits=4 --batches 1 8 --context 512 --warm

The machine is shared: process-CPU seconds are the work done, wall seconds include the
other processes' load (`load` in each row is the 1-minute load average at the start).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

EVENTS = {  # jax.monitoring event -> column
    "/jax/core/compile/tracing_duration": "trace_s",
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}


def _cell(method: str, batch: int, context: int, new_tokens: int, warm: bool) -> dict:
    """One cell, in this (fresh) process."""
    import jax
    import numpy as np

    per = collections.defaultdict(lambda: collections.defaultdict(float))

    def listen(event, duration, **kw):
        col = EVENTS.get(event)
        if col is not None:
            per[kw.get("fun_name", "?")][col] += duration
            if col == "compile_s":
                per[kw.get("fun_name", "?")]["compiles"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    import kvjax
    from models.loading import load_model
    from models.sampler import generate

    model, _ = load_model("smollm2")
    rng = np.random.default_rng(0)
    prompts = lambda: [rng.integers(3, 49000, context).tolist() for _ in range(batch)]
    transform = kvjax.parse_method(method)
    runs, seen = [], []
    for _ in range(2 if warm else 1):
        per.clear()
        w0, c0 = time.perf_counter(), time.process_time()
        out = generate(model, prompts(), max_new_tokens=new_tokens, transform=transform)
        np.asarray(out.tokens)
        runs.append((time.perf_counter() - w0, time.process_time() - c0))
        seen.append({k: dict(v) for k, v in per.items()})
    first = seen[0]
    row = dict(method=method, batch=batch, context=context, new_tokens=new_tokens,
               load=round(os.getloadavg()[0], 1),
               first_wall_s=round(runs[0][0], 2), first_cpu_s=round(runs[0][1], 2))
    if warm:
        row.update(warm_wall_s=round(runs[1][0], 2), warm_cpu_s=round(runs[1][1], 2),
                   compile_wall_s=round(runs[0][0] - runs[1][0], 2),
                   compile_cpu_s=round(runs[0][1] - runs[1][1], 2),
                   recompiled=sorted(k for k, v in seen[1].items() if v.get("compile_s")))
    progs = {k: {c: round(s, 3) for c, s in v.items()} for k, v in first.items()}
    row["programs"] = progs
    for col in ("trace_s", "lower_s", "compile_s"):
        row["total_" + col] = round(sum(v.get(col, 0) for v in progs.values()), 2)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+",
                   default=["full", "snapkv:ratio=0.5", "snapkv:ratio=0.5+kivi:bits=4"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--warm", action="store_true", help="also time a second call, equal shapes")
    p.add_argument("--out", default="docs/bench/compile.json")
    p.add_argument("--cell", help=argparse.SUPPRESS)  # internal: method|batch in this process
    args = p.parse_args(argv)
    if args.cell:
        method, batch = args.cell.rsplit("|", 1)
        print(json.dumps(_cell(method, int(batch), args.context, args.new_tokens, args.warm)))
        return 0
    rows = []
    env = dict(os.environ, KVJAX_COMPILATION_CACHE="0", JAX_PLATFORMS="cpu")
    for batch in args.batches:
        for method in args.methods:
            cmd = [sys.executable, "-m", "experiments.bench_compile", "--cell",
                   f"{method}|{batch}", "--context", str(args.context),
                   "--new-tokens", str(args.new_tokens)] + (["--warm"] if args.warm else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            top = sorted(row["programs"].items(), key=lambda kv: -kv[1].get("compile_s", 0))[:3]
            print(f"{method:32s} b={batch} first {row['first_wall_s']:6.2f} s wall "
                  f"{row['first_cpu_s']:6.2f} s CPU | trace {row['total_trace_s']:.2f} lower "
                  f"{row['total_lower_s']:.2f} compile {row['total_compile_s']:.2f} | "
                  + ", ".join(f"{k} {v.get('compile_s', 0):.2f}" for k, v in top)
                  + (f" | warm {row['warm_wall_s']:.2f} s" if args.warm else "")
                  + f" | load {row['load']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
