"""Where a cold first `generate` spends its compile time, per jitted program.

Each (method, batch, context) cell runs in a fresh process with the persistent compilation
cache off (`KVJAX_COMPILATION_CACHE=0`), loads SmolLM2-135M-Instruct and calls `generate` once
on random prompts of `--contexts` tokens. jax's own compile events
(`jax.monitoring` duration events with the jitted function's name) give, per program
(`_prefill`, `_compress`, `_decode`, `kvjax.shrink`'s helpers, ...), the tracing, the
lowering to MLIR and the XLA backend compile seconds. The cell also records the first
call's wall and process-CPU seconds and, with `--warm`, a second call of equal shapes
(other tokens), whose difference to the first is the compile cost end to end.

    python -m experiments.bench.compile --methods full snapkv:ratio=0.5 \\
        snapkv:ratio=0.5+kivi:bits=4 --batches 1 8 --contexts 512 --warm

`--compile-only` skips the prefill's run, so a batch-8 x 8k cell takes seconds, not ten
minutes: `_prefill` is lowered and compiled on the cell's shapes, its cache is filled by
writing random keys and values at the prompt's positions (`kvjax.write`, chunk by chunk as the
prefill writes them, statistics zero), and the rest of `generate` (compression, `shrink`,
16 decode steps) runs as it is. The row's `compile_only_s` is then every program's tracing,
lowering and backend compile, one after another on an otherwise idle machine: the compile a
first `generate` of that method and shape adds to the prefill's run (at most: in `generate`
the compression compiles while the prefill runs).

    python -m experiments.bench.compile --compile-only --batches 1 8 --contexts 1024 4096 8176

`--check-layout` checks that shortcut instead of timing anything: on the tiny test model, for
each method, the filled cache compressed must have the real prefill's compressed layout (every
leaf's shape and dtype, so the decode compiled is the real one), cursors and next positions;
one JSON row per method, exit status 1 if any differs (tests/test_results_scripts.py runs it).

The machine is shared: process-CPU seconds are the work done, wall seconds include the
other processes' load (`load` in each row is the 1-minute load average at the start).
"""

from __future__ import annotations

import argparse
import collections
import itertools
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


def _filled_prefill(model, transform, prompts, new_tokens):
    """What `prefill_batch` returns for `prompts` with room for `new_tokens`, without running
    the model: `_prefill` compiled on the batch's shapes (timed by the caller's listener), then
    its cache filled by `_fill` and zero statistics of `_prefill`'s output shapes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import sampler

    args, lengths = sampler.prefill_inputs(model, prompts, stats=transform.stats,
                                           room=new_tokens)
    lowered = sampler._prefill.lower(model, *args)
    lowered.compile()
    logits, _, stats = lowered.out_info
    zeros = lambda s: jnp.asarray(np.zeros(s.shape, s.dtype))
    _, positions, cache, _, config = args
    return sampler.Prefilled(zeros(logits), _fill(cache, positions, config.chunk),
                             jax.tree.map(zeros, stats), None, lengths)


def _fill_impl(cache, positions, chunk):
    """Every layer of `cache` with random keys and values written at `positions` [B, W],
    `chunk` tokens a write: the slots, cursors and positions a prefill leaves."""
    import jax
    import jax.numpy as jnp

    import kvjax

    b, width = positions.shape
    d, kvh = cache[0].k.shape[-1], cache[0].pos.shape[1]
    kv = jax.random.normal(jax.random.key(0), (2, b, kvh, chunk, d), cache[0].k.dtype)

    def write_chunk(cache, pos):  # pos [B, chunk]
        return tuple(kvjax.write(layer, kv[0], kv[1], pos) for layer in cache), None

    chunks = positions.reshape(b, width // chunk, chunk).swapaxes(0, 1)  # [N, B, chunk]
    return jax.lax.scan(write_chunk, cache, chunks)[0]


def _fill(cache, positions, chunk):
    import jax
    return jax.jit(_fill_impl, static_argnames="chunk", donate_argnums=0)(cache, positions,
                                                                          chunk=chunk)


def check_layout(methods: list[str], new_tokens: int) -> list[dict]:
    """`--check-layout`: `_filled_prefill` compressed beside the real prefill compressed, on the
    tiny test model and two prompts of unequal length (left padding)."""
    import jax
    import numpy as np
    from flax import nnx

    import kvjax
    from models.llama import Llama, LlamaConfig
    from models.sampler import compress, prefill_and_compress

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 200, n).tolist() for n in (300, 190)]
    layout = lambda c: jax.tree.map(lambda x: (x.shape, str(x.dtype)), c)
    cursors = lambda c: [np.asarray(x).tolist() for x in jax.tree.leaves(c) if x.ndim == 0]
    rows = []
    for method in methods:
        transform = kvjax.parse_method(method)
        real = prefill_and_compress(model, prompts, transform=transform, room=new_tokens,
                                    max_write=1)
        filled = compress(_filled_prefill(model, transform, prompts, new_tokens), transform,
                          room=new_tokens, max_write=1)
        rows.append(dict(method=method, same_layout=layout(filled.cache) == layout(real.cache),
                         same_cursors=cursors(filled.cache) == cursors(real.cache),
                         same_next_pos=bool(np.array_equal(filled.next_pos, real.next_pos))))
    return rows


def _cell(method: str, batch: int, context: int, new_tokens: int, warm: bool,
          compile_only: bool = False) -> dict:
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
    from models.sampler import compress, decode, generate

    model, _ = load_model("smollm2")
    rng = np.random.default_rng(0)
    prompts = lambda: [rng.integers(3, 49000, context).tolist() for _ in range(batch)]
    transform = kvjax.parse_method(method)
    if compile_only:
        per.clear()  # not the model's loading
        pre = _filled_prefill(model, transform, prompts(), new_tokens)
        jax.block_until_ready(pre.cache)
        for name in [k for k in per if "_fill_impl" in k]:
            del per[name]
        pre = compress(pre, transform, room=new_tokens, max_write=1)  # as generate does
        out = decode(model, pre, max_new_tokens=new_tokens, transform=transform)
        np.asarray(out.tokens)
        progs = {k: {c: round(s, 3) for c, s in v.items()} for k, v in per.items()}
        total = sum(s for v in progs.values() for c, s in v.items() if c != "compiles")
        return dict(method=method, batch=batch, context=context, new_tokens=new_tokens,
                    load=round(os.getloadavg()[0], 1), compile_only_s=round(total, 2),
                    programs=progs)
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
    p.add_argument("--contexts", "--context", nargs="+", type=int, default=[512])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--warm", action="store_true", help="also time a second call, equal shapes")
    p.add_argument("--compile-only", action="store_true",
                   help="no prefill run: compile and fill its cache (see the module doc)")
    p.add_argument("--check-layout", action="store_true",
                   help="no timing: check --compile-only's filled cache against a real prefill "
                        "on the tiny test model (see the module doc)")
    p.add_argument("--out", default="docs/bench/compile.json")
    p.add_argument("--cell", help=argparse.SUPPRESS)  # internal: method|batch in this process
    args = p.parse_args(argv)
    for name in ("batches", "contexts"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < 1:
        p.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.warm and args.compile_only:
        p.error("--warm times a second generate call; --compile-only makes no first one")
    if args.check_layout:
        rows = check_layout(args.methods, args.new_tokens)
        print(json.dumps(rows, indent=1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        return int(not all(r["same_layout"] and r["same_cursors"] and r["same_next_pos"]
                           for r in rows))
    if args.cell:
        method, batch = args.cell.rsplit("|", 1)
        print(json.dumps(_cell(method, int(batch), args.contexts[0], args.new_tokens,
                               args.warm, args.compile_only)))
        return 0
    rows = []
    env = dict(os.environ, KVJAX_COMPILATION_CACHE="0", JAX_PLATFORMS="cpu")
    flags = ["--warm"] * args.warm + ["--compile-only"] * args.compile_only
    for batch, context, method in itertools.product(args.batches, args.contexts, args.methods):
        cmd = [sys.executable, "-m", "experiments.bench.compile", "--cell",
               f"{method}|{batch}", "--contexts", str(context),
               "--new-tokens", str(args.new_tokens)] + flags
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        top = sorted(row["programs"].items(), key=lambda kv: -kv[1].get("compile_s", 0))[:3]
        if args.compile_only:
            print(f"{method:40s} b={batch} ctx={context} compile only {row['compile_only_s']:5.2f}"
                  f" s | " + ", ".join(f"{k} {v.get('compile_s', 0):.2f}" for k, v in top)
                  + f" | load {row['load']}", flush=True)
            continue
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
