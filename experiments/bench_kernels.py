"""Decode attention time of kvjax's paged kernel against the XLA path and jax's own GPU kernel.

For each batch x context it times one decode-attention call (one query token
per sequence, all heads) over a cache of `context` tokens per sequence:

  * kvjax kernel over dense bf16 pages, and over int8 / int4 per-token pages
    (keys and values dequantized in the kernel), shuffled block tables;
  * the XLA path: `kvjax.attend(impl="xla")` over a contiguous bf16 `TokenCache`;
  * on GPU, `jax.experimental.pallas.ops.gpu.paged_attention` (Triton) on the
    same bf16 pages in its own `[KVH, P, S, D]` layout.

Achieved bandwidth = bytes the call must read (keys, values, their scales and
slot positions, for the valid tokens) / median time; the floor is those bytes
over the device's peak bandwidth (`--peak-gbs`, default H200: 4800 GB/s).
Writes JSON, CSV and a PNG, and prints a Markdown table.

    python experiments/bench_kernels.py --out docs/bench/bench_kernels      # on a GPU or TPU, < 5 min
    python experiments/bench_kernels.py --smoke                             # CPU: tiny shapes, interpret mode

On CPU there is no compiled Pallas; `--smoke` only checks the script runs
(kernels in interpret mode, timings meaningless and not written as results).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import paged_attention
from kvjax.kernel_attention import pallas_backend
from kvjax.quant import pack, quantize

SHAPE = dict(kv_heads=8, heads=32, head_dim=128)  # a Llama-3-8B layer
SMOKE_SHAPE = dict(kv_heads=2, heads=4, head_dim=64)


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_inputs(key, batch, context, page_size, shape):
    """bf16 pages in shuffled order, every row full to `context`; queries at position `context`."""
    kvh, h, d = shape["kv_heads"], shape["heads"], shape["head_dim"]
    per_row = context // page_size
    n_pages = batch * kvh * per_row + 1
    kq, kk, kv, kp = jax.random.split(key, 4)
    k = jax.random.normal(kk, (n_pages, page_size, d), jnp.bfloat16)
    v = jax.random.normal(kv, (n_pages, page_size, d), jnp.bfloat16)
    perm = jax.random.permutation(kp, n_pages - 1)[: batch * kvh * per_row] + 1
    tables = perm.reshape(batch, kvh, per_row).astype(jnp.int32)
    pos = jnp.zeros((n_pages, 1, page_size), jnp.int32)
    order = jnp.arange(per_row * page_size, dtype=jnp.int32).reshape(per_row, 1, page_size)
    pos = pos.at[tables].set(jnp.broadcast_to(order, (*tables.shape, 1, page_size)))
    counts = jnp.full((batch, kvh), per_row, jnp.int32)
    q = jax.random.normal(kq, (batch, 1, h, d), jnp.bfloat16)
    q_pos = jnp.full((batch, 1), context, jnp.int32)
    return q, q_pos, k, v, pos, tables, counts


def packed(x, bits):
    """x [P, S, D] quantized per token (groups of 32, float16 parameters), in the kernel layout."""
    qz = quantize(x.astype(jnp.float32), bits, 32, axis=-1, param_dtype=jnp.float16)
    return pf.PackedTokens(bits, 32).from_store(pack(qz.codes, bits), qz.scale, qz.offset)


def nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(arrays))


def bench_cell(batch, context, page_size, backend, interpret, repeats, shape, peak_gbs):
    q, q_pos, k, v, pos, tables, counts = make_inputs(jax.random.key(0), batch, context,
                                                      page_size, shape)
    kernel = functools.partial(paged_attention, backend=backend, interpret=interpret,
                               pages_per_split=max(1, context // page_size // 8))
    rows = []

    def record(name, ms, moved):
        rows.append(dict(method=name, batch=batch, context=context, page_size=page_size,
                         ms=round(ms, 4), bytes=moved, gbs=round(moved / ms / 1e6, 1),
                         floor_ms=round(moved / peak_gbs / 1e6, 4)))

    used = lambda *a: nbytes(*a) * (k.shape[0] - 1) / k.shape[0]  # the null page is never read
    run = jax.jit(kernel)
    record("kvjax paged bf16", median_ms(run, q, q_pos, k, v, pos, tables, counts,
                                         repeats=repeats), used(k, v, pos))
    for bits in (8, 4):
        fmt = pf.PackedTokens(bits, 32)
        kp, vp = packed(k, bits), packed(v, bits)
        run = jax.jit(functools.partial(kernel, k_format=fmt, v_format=fmt))
        record(f"kvjax paged int{bits}", median_ms(run, q, q_pos, kp, vp, pos, tables, counts,
                                                   repeats=repeats), used(kp, vp, pos))
    # the XLA path on a contiguous cache of the same tokens
    import kvjax
    from kvjax.cache import TokenCache
    kvh, d = shape["kv_heads"], shape["head_dim"]
    gather = lambda x: x[tables].reshape(batch * kvh, context, d)
    cache = TokenCache(k=gather(k), v=gather(v), pos=pos[tables, 0].reshape(batch, kvh, context),
                       length=jnp.int32(context))
    run = jax.jit(lambda q, p, c: kvjax.attend(q, p, c, impl="xla"))
    record("kvjax xla (contiguous)", median_ms(run, q, q_pos, cache, repeats=repeats),
           nbytes(cache.k, cache.v, cache.pos))
    if backend == "gpu" and not interpret:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged
        n_per_head = batch * context // page_size
        kj = k[1:].reshape(kvh, n_per_head, page_size, d)  # its layout: [KVH, P, S, D]
        vj = v[1:].reshape(kvh, n_per_head, page_size, d)
        tj = jnp.arange(n_per_head, dtype=jnp.int32).reshape(batch, context // page_size)
        lengths = jnp.full((batch,), context, jnp.int32)
        run = jax.jit(lambda q, k, v, t, n: jax_paged(q, k, v, t, n, k_splits=16))
        record("jax.experimental gpu paged_attention",
               median_ms(run, q[:, 0], kj, vj, tj, lengths, repeats=repeats), nbytes(kj, vj))
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        for batch in sorted({r["batch"] for r in rows}):
            pts = sorted((r["context"], r["gbs"]) for r in rows
                         if r["method"] == method and r["batch"] == batch)
            ax.plot(*zip(*pts), marker="o", label=f"{method}, b={batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("achieved GB/s")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="device peak (H200: 4800)")
    parser.add_argument("--out", default=None, help="path prefix for .json/.csv/.png")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in interpret mode (CPU); checks the script, no results")
    args = parser.parse_args(argv)
    backend, interpret, shape = pallas_backend(), False, SHAPE
    if args.smoke:
        backend, interpret, shape = backend or "tpu", True, SMOKE_SHAPE
        args.batches, args.contexts, args.page_size, args.repeats = [2], [64], 16, 1
    elif backend is None:
        raise SystemExit("bench_kernels: no GPU or TPU here (compiled Pallas needs one); "
                         "use --smoke to check the script on CPU")
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            rows += bench_cell(batch, context, args.page_size, backend, interpret, args.repeats,
                               shape, args.peak_gbs)
            for r in rows[-4:]:
                print(r, flush=True)
    print("| method | batch | context | ms | GB/s | floor ms | ms / floor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['gbs']} | "
              f"{r['floor_ms']:.3f} | {r['ms'] / max(r['floor_ms'], 1e-9):.2f} |")
    if args.out and not args.smoke:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(device=str(jax.devices()[0]), backend=backend, shape=shape,
                    page_size=args.page_size, repeats=args.repeats, peak_gbs=args.peak_gbs)
        out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        with open(out.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
