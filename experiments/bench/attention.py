"""Per-layer decode attention: full vs compressed layouts, blockwise reads vs decoding whole.

For each batch x context x method it builds one SmolLM2-shaped layer (3 KV heads
of 64, float32) holding `context` random tokens, compresses it with the method
and shrinks it (as `prefill_and_compress` leaves a decode cache), then times one
decode query (9 heads) through
  * `new`: `kvjax.attend` (blockwise, codes decoded one block at a time inside
    the loop, scores as matrix-vector products);
  * `old`: the path before issue 15 (`kvjax.view` decodes the whole layer, then
    the blockwise loop with batched-dot scores);
beside the floor: the layer's bytes / this machine's read bandwidth, measured in
the same run. Medians (and minima: the machine is shared, minima are the less
noisy estimate of uncontended time) over `--repeats` calls.

    python -m experiments.bench.attention                        # B=1,8 x ctx 1k,4k,8k
    python -m experiments.bench.attention --batches 8 --contexts 4096

`--e2e` instead times the real model's decode (ms/step) for each method, one
prefill per batch compressed by every method (the timed decode is the call of
experiments/cells.run_speed_cell), the methods' runs interleaved round by round with
wall and CPU time, ratios to the first method (put `full` first) and x floor per row,
and greedy tokens recorded to compare runs:

    python -m experiments.bench.attention --e2e --batches 8 --contexts 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import kvjax
from kvjax.core import attention
from kvjax.policies.methods import parse_method

METHODS = ["full", "random:ratio=0.75", "kivi:bits=4", "random:ratio=0.5+kivi:bits=4",
           "quantize:bits=4", "random:ratio=0.5,headwise=true"]
E2E_METHODS = ["full", "snapkv:ratio=0.75", "kivi:bits=4", "snapkv:ratio=0.5+kivi:bits=4"]
KV_HEADS, HEADS, HEAD_DIM = 3, 9, 64  # SmolLM2-135M


def make_layer(method: str, batch: int, context: int, room: int = 16, seed: int = 0, *,
               kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, dtype=jnp.float32):
    """One layer of `context` random tokens, compressed by `method`, shrunk to `room` free slots
    (the layer a decode step reads). The attention tests build theirs the same way
    (tests/random_layers.py: tests import no benchmark script).

    Eviction uses `random:` scores (same layout as SnapKV: needs no model queries).
    """
    spec = kvjax.CacheSpec(1, kv_heads, head_dim)
    cache = kvjax.init_model_cache(spec, batch, context + room, dtype)
    k, v = jax.random.normal(jax.random.key(seed), (2, batch, kv_heads, context, head_dim))
    pos = jnp.broadcast_to(jnp.arange(context)[None], (batch, context))
    cache = (kvjax.write(cache[0], k, v, pos),)
    if method != "full":
        t = parse_method(method)
        cache, _ = t.update(cache, t.init(cache), None)
        cache = kvjax.shrink(cache, room, 1)
    return cache[0]


def timings(fn, *args, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of `repeats` calls (after one untimed call)."""
    jax.block_until_ready(fn(*args))  # compile
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def old_attend(q, q_pos, layer):
    """The path before issue 15: decode the whole layer (`view`), then attend blockwise."""
    return attention.attend_blockwise(q, q_pos, kvjax.view(layer, keep_latent=True))


def bench_layer(method: str, batch: int, context: int, repeats: int, bandwidth: float) -> dict:
    layer = make_layer(method, batch, context)
    q = jax.random.normal(jax.random.key(1), (batch, 1, HEADS, HEAD_DIM))
    q_pos = jnp.full((batch, 1), context, jnp.int32)
    new = jax.jit(lambda q, p, c: kvjax.attend(q, p, c))
    rows, saved = attention.MATVEC_ROWS, attention.MATVEC_ROWS
    try:
        attention.MATVEC_ROWS = 0  # traced now: batched-dot scores, as before
        old = jax.jit(old_attend).lower(q, q_pos, layer).compile()
    finally:
        attention.MATVEC_ROWS = saved
    t_new, cpu_new = timings(new, q, q_pos, layer, repeats=repeats)
    t_old, cpu_old = timings(old, q, q_pos, layer, repeats=repeats)
    nbytes = kvjax.nbytes(layer)
    return {"method": method, "batch": batch, "context": context, "layer_bytes": nbytes,
            "floor_ms": 1e3 * nbytes / (bandwidth * 1e9),
            "new_ms": 1e3 * statistics.median(t_new), "new_min_ms": 1e3 * min(t_new),
            "old_ms": 1e3 * statistics.median(t_old), "old_min_ms": 1e3 * min(t_old),
            "new_cpu_ms": 1e3 * statistics.median(cpu_new), "new_cpu_min_ms": 1e3 * min(cpu_new),
            "old_cpu_ms": 1e3 * statistics.median(cpu_old),
            "matvec_rows": rows}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['method'].replace('random', 'evict')}\nb{r['batch']} c{r['context']}"
              for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.27, [r["old_min_ms"] for r in rows], 0.27, label="before (view, then attend)")
    ax.bar(x, [r["new_min_ms"] for r in rows], 0.27, label="blockwise over codes")
    ax.bar(x + 0.27, [r["floor_ms"] for r in rows], 0.27, label="bytes / read bandwidth")
    ax.set_xticks(x, labels, fontsize=5, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer, one decode query (min of repeats)")
    ax.set_title("Decode attention per layer, SmolLM2 shapes, float32, shared 2-core CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_e2e(args, bandwidth_fn) -> list[dict]:
    """Decode ms/step of the real model per method, one prefill per batch (see module doc).

    The methods' timed decodes are interleaved (each of `--repeats` rounds runs every
    method once, in turn), so a change of machine load between methods shows in all of
    them alike and the ratios to `full` (`x_full`, `cpu_x_full`) are side by side; each
    run records wall and process CPU seconds (`decode_ms`, `decode_cpu_ms`: medians).
    The read bandwidth is probed before and after the rounds and the larger value sets
    the floor (so `x_floor` errs high under load, never low).
    """
    from flax import nnx

    from experiments.eval.cells import SPEED_TEXT
    from experiments.eval.ppl import window_ids
    from models.hub import enable_compilation_cache
    from models.loading import load_model
    from models.sampler import compress, decode, prefill_batch

    enable_compilation_cache()
    model, tokenizer = load_model("smollm2")
    weights = kvjax.nbytes(nnx.state(model, nnx.Param))
    transforms = {m: parse_method(m) for m in args.methods}
    specs = [t.stats for t in transforms.values() if t.stats.window]
    spec = max(specs, key=lambda s: s.window) if specs else kvjax.full().stats
    steps = args.new_tokens - 1  # forward steps after the prefill's logits
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            pre = prefill_batch(model, window_ids(tokenizer, SPEED_TEXT, context, batch),
                                stats=spec, room=args.new_tokens)
            caches = {m: compress(pre, t, room=args.new_tokens, keep_input=True, max_write=1)
                      for m, t in transforms.items()}
            del pre

            def run(method):  # the cache is donated: decode a fresh copy each time
                c = caches[method]
                copy = c._replace(cache=jax.tree.map(jnp.copy, c.cache))
                jax.block_until_ready(copy.cache)
                wall, cpu = time.perf_counter(), time.process_time()
                out = decode(model, copy, max_new_tokens=args.new_tokens,
                             transform=transforms[method], eos_ids=())
                tokens = jax.block_until_ready(out.tokens)
                return time.perf_counter() - wall, time.process_time() - cpu, tokens

            first, tokens = {}, {}
            for m in transforms:  # compiles (0 s more when the persistent cache has it)
                first[m], _, tokens[m] = run(m)
            bandwidth = bandwidth_fn()
            times = {m: [] for m in transforms}
            for _ in range(args.repeats):
                for m in transforms:
                    times[m].append(run(m)[:2])
            bandwidth = max(bandwidth, bandwidth_fn())
            ms = {m: 1e3 * statistics.median(w for w, _ in t) / steps for m, t in times.items()}
            cpu = {m: 1e3 * statistics.median(c for _, c in t) / steps for m, t in times.items()}
            base = args.methods[0]
            for m in transforms:
                cache_bytes = kvjax.nbytes(caches[m].cache)
                floor = 1e3 * (weights + cache_bytes) / (bandwidth * 1e9)
                rows.append({"batch": batch, "context": context, "method": m,
                             "decode_ms": ms[m], "decode_min_ms": 1e3 * min(
                                 w for w, _ in times[m]) / steps,
                             "decode_cpu_ms": cpu[m],
                             f"x_{base}": ms[m] / ms[base], f"cpu_x_{base}": cpu[m] / cpu[base],
                             "first_call_s": first[m], "cache_bytes": cache_bytes,
                             "weight_bytes": weights, "bandwidth_gbs": bandwidth,
                             "floor_ms": floor, "x_floor": ms[m] / floor,
                             "tokens": tokens[m][:, :8].tolist()})
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in rows[-1].items()}), flush=True)
            del caches
    return rows


def main(argv: list[str] | None = None) -> None:
    from experiments.eval.floor import read_bandwidth_gbs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--methods", nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--e2e", action="store_true", help="real-model decode ms/step instead")
    p.add_argument("--new-tokens", type=int, default=16, help="--e2e: tokens decoded per run")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.e2e:
        args.methods = args.methods or E2E_METHODS
        out = args.out or Path("docs/bench/attention_e2e")
        rows = run_e2e(args, read_bandwidth_gbs)
        meta = {"jax": jax.__version__, "cpus": os.cpu_count(), "repeats": args.repeats,
                "new_tokens": args.new_tokens}
    else:
        args.methods = args.methods or METHODS
        out = args.out or Path("docs/bench/attention_layer")
        bandwidth = read_bandwidth_gbs()
        print(f"read bandwidth {bandwidth:.1f} GB/s (machine shared: noisy)", flush=True)
        rows = []
        for batch in args.batches:
            for context in args.contexts:
                for method in args.methods:
                    rows.append(bench_layer(method, batch, context, args.repeats, bandwidth))
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                      for k, v in rows[-1].items()}), flush=True)
        meta = {"bandwidth_gbs": bandwidth, "jax": jax.__version__, "cpus": os.cpu_count(),
                "repeats": args.repeats}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if not args.e2e:
        plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
