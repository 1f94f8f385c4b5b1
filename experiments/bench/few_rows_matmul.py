"""The few-row matmul kernel (`kvjax.core.cpu_kernel.matmul`) beside XLA's dot, one decode row.

For each SmolLM2 weight shape, `--layers` distinct float32 weights (so they are read from
memory, not the cache) multiply one row in one jitted program, compiled twice: through the
kernel and as `x @ w`. The two programs alternate for `--repeats` rounds; each row of the
output holds the minimum ms and the GB/s of the weights read, beside this machine's read
bandwidth probed in the same run, and the relative difference of the two programs' sums.

    python -m experiments.bench.few_rows_matmul --out docs/bench/few_rows_matmul.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax

from experiments.bench.decode import emit, read_bandwidth_gbs
from kvjax.core import cpu_kernel

SHAPES = [(576, 1536), (1536, 576), (576, 576)]  # MLP up/gate, MLP down, attention q/o


def chained(product):
    """One jitted program: the sum of product(x, w) over the weights (keeps every product)."""
    return jax.jit(lambda x, ws: sum(product(x, w).sum() for w in ws))


def bench_shape(k: int, n: int, layers: int, repeats: int) -> dict:
    ws = [jax.random.normal(jax.random.key(i), (k, n)) for i in range(layers)]
    x = jax.random.normal(jax.random.key(layers), (1, k))
    programs = {"kernel": chained(cpu_kernel.matmul), "xla": chained(lambda x, w: x @ w)}
    times = {name: [] for name in programs}
    sums = {name: float(f(x, ws)) for name, f in programs.items()}  # compiles
    for _ in range(repeats):
        for name, f in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(f(x, ws))
            times[name].append(time.perf_counter() - start)
    gbytes = layers * k * n * 4 / 1e9
    row = {"k": k, "n": n, "layers": layers, "mbytes": 1e3 * gbytes,  # outputs compared, so a
           "rel_diff": abs(sums["kernel"] - sums["xla"]) / abs(sums["xla"])}  # broken kernel shows
    for name, t in times.items():
        row[f"{name}_ms"] = 1e3 * min(t)
        row[f"{name}_gbs"] = gbytes / min(t)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.layers < 1 or args.repeats < 1:
        p.error(f"--layers and --repeats must be >= 1; got {args.layers}, {args.repeats}")
    rows = [bench_shape(k, n, args.layers, args.repeats) for k, n in SHAPES]
    emit({"probe_gbs": read_bandwidth_gbs(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
