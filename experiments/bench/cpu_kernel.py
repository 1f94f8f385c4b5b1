"""The CPU decode-attention kernel beside the XLA loop it replaces, side by side in one run.

30 SmolLM2-shaped layers (3 KV heads of 64; `experiments.bench.attention.make_layer`: random
tokens, compressed by the method) attended by one decode query per row in one jitted
program, compiled twice: as shipped (the kernel) and under `kvjax.core.cpu_kernel.disabled()`
(the blockwise XLA loop). The two programs' calls alternate, `--repeats` rounds; rows hold
median wall ms, the cache bytes read and the kernel's GB/s. Outputs are compared (max abs
difference of the summed outputs) so a broken kernel cannot look fast.

    python -m experiments.bench.cpu_kernel --batch 1 --context 4096 \
        --methods full kivi:bits=4 --out docs/bench/cpu_kernel_b1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import kvjax
from experiments.bench.attention import make_layer
from kvjax.core import cpu_kernel

LAYERS, HEADS, HEAD_DIM = 30, 9, 64


def measure(method: str, batch: int, context: int, repeats: int, n_layers: int = LAYERS) -> dict:
    layers = [make_layer(method, batch, context, seed=i) for i in range(n_layers)]
    q = jax.random.normal(jax.random.key(1), (batch, 1, HEADS, HEAD_DIM))
    q_pos = jnp.full((batch, 1), context, jnp.int32)

    def run(q, layers):  # [B, 1, H, D] per layer, stacked
        return jnp.stack([kvjax.attend(q, q_pos, c) for c in layers])

    kernel = jax.jit(run).lower(q, layers).compile()
    with cpu_kernel.disabled():
        loop = jax.jit(lambda q, layers: run(q, layers)).lower(q, layers).compile()
    gap = float(jnp.max(jnp.abs(kernel(q, layers) - loop(q, layers))))
    times = {"kernel": [], "xla_loop": []}
    for _ in range(repeats):
        for name, fn in (("kernel", kernel), ("xla_loop", loop)):
            start = time.perf_counter()
            jax.block_until_ready(fn(q, layers))
            times[name].append(time.perf_counter() - start)
    nbytes = sum(kvjax.nbytes(c) for c in layers)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"method": method, "batch": batch, "context": context, "layers": n_layers,
            "cache_mb": nbytes / 1e6, "kernel_ms": ms["kernel"], "xla_loop_ms": ms["xla_loop"],
            "speedup": ms["xla_loop"] / ms["kernel"],
            "kernel_gbs": nbytes / 1e9 / (ms["kernel"] / 1e3), "max_abs_diff": gap}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--methods", nargs="+", default=["full", "kivi:bits=4"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=LAYERS, help=f"layers attended (default {LAYERS})")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.batch, args.context, args.repeats, args.layers) < 1:
        p.error(f"--batch, --context, --repeats and --layers must be >= 1, got {args.batch}, "
                f"{args.context}, {args.repeats}, {args.layers}")
    rows = []
    for method in args.methods:
        rows.append(measure(method, args.batch, args.context, args.repeats, args.layers))
        print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v
                          for k, v in rows[-1].items()}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
