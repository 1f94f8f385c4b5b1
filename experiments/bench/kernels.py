"""Decode attention time of kvjax's paged kernel per page format, beside jax's own GPU kernel.

One prepared script for one GPU (sized for an H200, < 10 minutes with the
default `--budget-s`): for each attention shape (SmolLM2-135M: 9 query / 3
KV heads of 64; Llama-3-8B: 32 / 8 of 128), batch (8, 32, 64) and context
(4k, 8k, 32k tokens per sequence, every sequence full) it times one decode
attention call (one query token per sequence, all heads) over a paged pool:

  * kvjax's kernel (`paged_attention`, the device's backend) over pages in
    each format: dense bf16 and fp8 (e4m3), int8 / int4 per-token (groups of
    32, float16 scale and offset), KIVI-4 / KIVI-2 (per-channel keys, per-token
    values of the same bits); random codes and parameters of the exact layout
    (time does not depend on the values);
  * on a GPU, kvjax's Mosaic GPU kernel (`paged_attention_mgpu`: TMA pipeline,
    wgmma) on the same bf16 pages ("kvjax mosaic"; its packed formats do not
    lower for CUDA yet, see docs/drafts/mgpu.md);
  * on a GPU, `jax.experimental.pallas.ops.gpu.paged_attention` (Triton) on
    the same bf16 pages: both read one `[KVH, P, S, D]` pool with `[B, NP]`
    block tables shared by a sequence's KV heads (kvjax: `head_stride = P`);
  * the XLA path (`kvjax.attend(impl="xla")`) over the same bf16 tokens as a
    contiguous `TokenCache` (batch 8 only: it needs a second copy of the pool).

Timing: every call is dispatched asynchronously `--repeats` times back to back
and synchronised once; the median over `--rounds` such runs, per call. Bytes
= what the call must read (every listed page of each format array and the
slot positions, the queries); GB/s = bytes / time. Beside jax's kernel and
the XLA path, `max_diff_vs_kvjax` is their largest difference from kvjax's
bf16 output on the same inputs (bf16 outputs: ~1e-2). The device's copy
bandwidth is measured in the same run (a jitted `x + 1` over 2 GiB: read +
write) and each row reports `of_copy` = GB/s / copy GB/s. Cells run largest
first; cells left when `--budget-s` is spent are listed as not run. The
machine may be shared: say so beside the numbers.

    python experiments/bench/kernels.py --out docs/bench/bench_kernels     # on the GPU
    python experiments/bench/kernels.py --smoke                            # CPU: tiny, interpret

`--smoke` runs every code path on tiny shapes in interpret mode (timings
meaningless, nothing written unless `--out` is given); tests run it.
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

from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import paged_attention
from kvjax.backends.pallas import pallas_backend

SHAPES = {
    "smollm2": dict(kv_heads=3, heads=9, head_dim=64),  # SmolLM2-135M
    "llama3-8b": dict(kv_heads=8, heads=32, head_dim=128),  # Llama-3-8B
}
GROUP = 32  # per-token quantization group; KIVI group (tokens per key table row)
FORMATS = ("bf16", "fp8", "int8", "int4", "kivi4", "kivi2")


def formats(name: str, page_size: int, head_dim: int):
    """(k_format, v_format) of a format name."""
    if name in ("bf16", "fp8"):
        return pf.DENSE, pf.DENSE
    if name.startswith("int"):
        fmt = pf.PackedTokens(int(name[3:]), GROUP)
        return fmt, fmt
    bits = int(name[4:])
    window = pf.window_for(page_size, GROUP, 1 << 30)
    return pf.PackedChannels(bits, window), pf.PackedTokens(bits, GROUP)


def random_pages(key, fmt, name: str, n_pages: int, page_size: int, head_dim: int):
    """Random arrays of `fmt`'s exact layout for n_pages pages (valid parameters and ids)."""
    if isinstance(fmt, pf.Dense):
        dtype = jnp.bfloat16 if name == "bf16" else jnp.float8_e4m3fn
        return jax.random.normal(key, (n_pages, page_size, head_dim), jnp.float32).astype(dtype)
    kc, kp = jax.random.split(key)
    words = head_dim * fmt.bits // 32
    codes = jax.random.bits(kc, (n_pages, words, page_size), jnp.uint32)
    if isinstance(fmt, pf.PackedTokens):
        params = jax.random.uniform(kp, (n_pages, fmt.n_params(head_dim), page_size),
                                    jnp.float32, 0.01, 0.1)
        return pf.lane_flat(jnp.concatenate([codes, pf.pack_rows(params, fmt.param_dtype)], 1))
    ids = jnp.minimum(jnp.arange(page_size, dtype=jnp.uint32) // GROUP, fmt.window - 1)
    ids = jnp.broadcast_to(ids, (n_pages, 1, page_size))
    table = jax.random.uniform(kp, (n_pages, fmt.n_params(), head_dim), jnp.float32, 0.01, 0.1)
    return (pf.lane_flat(jnp.concatenate([codes, ids], 1)),
            pf.lane_flat(pf.pack_rows(table, fmt.param_dtype)))


def make_layout(key, batch: int, context: int, page_size: int, shape: dict):
    """Queries, positions and shared block tables of full rows: a [KVH * P] pool in head planes.

    Sequence b's page i of KV head h is page `h * P + tables[b, i]` (P = pages
    per head plane, one spare); tables shuffled within the plane.
    """
    kvh, h, d = shape["kv_heads"], shape["heads"], shape["head_dim"]
    per_row = context // page_size
    plane = batch * per_row + 1
    kq, kt = jax.random.split(key)
    tables = (jax.random.permutation(kt, plane - 1)[: batch * per_row] + 1)
    tables = tables.reshape(batch, per_row).astype(jnp.int32)
    order = jnp.arange(context, dtype=jnp.int32).reshape(per_row, page_size)
    plane_pos = jnp.full((plane, 1, page_size), -1, jnp.int32).at[tables].set(
        jnp.broadcast_to(order[None, :, None, :], (batch, per_row, 1, page_size)))
    pos = jnp.tile(plane_pos, (kvh, 1, 1))  # [KVH * P, 1, S]
    q = jax.random.normal(kq, (batch, 1, h, d), jnp.float32).astype(jnp.bfloat16)
    q_pos = jnp.full((batch, 1), context - 1, jnp.int32)
    counts = jnp.full((batch, kvh), per_row, jnp.int32)
    return q, q_pos, pos, tables, counts, plane


def per_page_bytes(arrays) -> int:
    return sum(x.size // x.shape[0] * x.dtype.itemsize for x in jax.tree_util.tree_leaves(arrays))


def time_ms(fn, *args, repeats: int, rounds: int) -> float:
    """Median over `rounds` of (`repeats` calls dispatched back to back, one sync) / repeats."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) * 1e3 / repeats)
    return statistics.median(per_call)


def copy_gbs(n_bytes: int, repeats: int, rounds: int) -> float:
    """Measured device copy bandwidth: a jitted x + 1 over n_bytes of float32 (read + write)."""
    x = jnp.zeros((n_bytes // 4,), jnp.float32)
    ms = time_ms(jax.jit(lambda x: x + 1), x, repeats=repeats, rounds=rounds)
    return 2 * x.size * 4 / ms / 1e6


def bench_cell(shape_name, batch, context, args, backend, interpret, copy_bw):
    shape = SHAPES[shape_name]
    kvh, d, s = shape["kv_heads"], shape["head_dim"], args.page_size
    q, q_pos, pos, tables, counts, plane = make_layout(jax.random.key(0), batch, context, s, shape)
    pages_read = batch * kvh * (context // s)
    q_bytes = q.size * q.dtype.itemsize
    time_it = functools.partial(time_ms, repeats=args.repeats, rounds=args.rounds)
    rows = []

    def record(method, fmt_name, ms, per_page, diff=None, error=None):
        moved = pages_read * per_page + q_bytes
        gbs = moved / ms / 1e6 if ms else None
        rows.append(dict(shape=shape_name, method=method, format=fmt_name, batch=batch,
                         context=context, page_size=s, ms=ms and round(ms, 4), bytes=int(moved),
                         gbs=gbs and float(f"{gbs:.4g}"),
                         of_copy=gbs and float(f"{gbs / copy_bw:.3g}"),
                         max_diff_vs_kvjax=diff, error=error))
        print(rows[-1], flush=True)

    def measure(method, fmt_name, per_page, make_run, *call_args, compare=None, fallbacks=()):
        """Time one method; a failure (lowering, compile, launch) is a row with its error, so
        one method that fails on this device does not lose the cells after it. `fallbacks`:
        (label, make_run) tried in order after a failure, e.g. smaller blocks where the first
        exceeds shared memory; the row names the one that ran."""
        errors = []
        for label, make in (("", make_run), *fallbacks):
            try:
                run = make()
                ms = time_it(run, *call_args)
                diff = compare(run(*call_args)) if compare else None
            except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
                errors.append(f"{label or 'default'}: {type(e).__name__}: {e}"[:300])
                continue
            record(method + (f" {label}" if label else ""), fmt_name, ms, per_page, diff,
                   error="; ".join(errors) or None)
            return
        record(method, fmt_name, None, per_page, error="; ".join(errors))

    splits = max(1, context // s // args.pages_per_split)
    kernel = functools.partial(paged_attention, backend=backend, interpret=interpret,
                               pages_per_split=args.pages_per_split, head_stride=plane)
    for i, name in enumerate(args.formats):
        kf, vf = formats(name, s, d)
        kk, kv = jax.random.split(jax.random.key(i + 1))
        k = random_pages(kk, kf, name, kvh * plane, s, d)
        v = random_pages(kv, vf, name if isinstance(vf, pf.Dense) else "v", kvh * plane, s, d)
        per_page = per_page_bytes((k, v)) + pos.shape[-1] * 4
        for npb in args.pages_per_block:  # 0: the kernel's default step
            for launch in args.launch:  # None: the kernel's default warps and stages
                label = (f" ppb={npb}" if npb else "") + (
                    f" warps={launch[0]} stages={launch[1]}" if launch else "")
                measure("kvjax paged" + label, name, per_page,
                        lambda: jax.jit(functools.partial(kernel, k_format=kf, v_format=vf,
                                                          pages_per_block=npb or None,
                                                          launch=launch)),
                        q, q_pos, k, v, pos, tables, counts)
        try:
            ours = jax.jit(functools.partial(kernel, k_format=kf, v_format=vf))(
                q, q_pos, k, v, pos, tables, counts)[:, 0]  # [B, H, D] f32
        except Exception:  # noqa: BLE001 - its failure is already a row above
            ours = None
        diff = lambda other: (None if ours is None else
                              round(float(jnp.abs(other.astype(jnp.float32) - ours).max()), 4))
        if name == "bf16" and backend == "gpu":
            from jax.experimental.pallas.ops.gpu.paged_attention import (
                paged_attention as jax_paged)
            kj, vj = (x.reshape(kvh, plane, s, d) for x in (k, v))
            lengths = jnp.full((batch,), context, jnp.int32)
            qj = (q[:, 0] * d ** -0.5).astype(q.dtype)  # its kernel applies no softmax scale
            jax_run = lambda ppcb: lambda: jax.jit(functools.partial(
                jax_paged, k_splits=splits, pages_per_compute_block=ppcb, interpret=interpret))
            measure("jax.experimental gpu paged_attention", name, per_page_bytes((k, v)),
                    jax_run(8), qj, kj, vj, tables, lengths, compare=diff,
                    fallbacks=[(f"ppcb={n}", jax_run(n)) for n in (4, 2, 1)])
        if name == "bf16" and backend == "gpu":  # the Mosaic GPU kernel (TMA, wgmma) beside it
            from kernels_pallas import paged_attention_mgpu as mgpu
            if interpret:
                mgpu.interpret_transposed_wgmma()
            mosaic_run = lambda step: lambda: jax.jit(functools.partial(
                mgpu.paged_attention_mgpu, k_format=kf, v_format=vf, head_stride=plane,
                pages_per_split=args.pages_per_split, pages_per_step=step,
                interpret=mgpu.INTERPRET if interpret else False))
            steps = range(args.mosaic_pages_per_step - 1, 0, -1)
            measure("kvjax mosaic", name, per_page, mosaic_run(args.mosaic_pages_per_step),
                    q, q_pos, k, v, pos, tables, counts, compare=lambda out: diff(out[:, 0]),
                    fallbacks=[(f"pages_per_step={n}", mosaic_run(n)) for n in steps])
        if name == "bf16" and batch == min(args.batches):
            import kvjax
            from kvjax.core.cache import TokenCache
            rows_of = lambda x: (x.reshape(kvh, plane, s, d)[:, tables]  # [KVH, B, NP, S, D]
                                 .transpose(1, 0, 2, 3, 4).reshape(batch * kvh, context, d))
            cache = TokenCache(k=rows_of(k), v=rows_of(v),
                               pos=jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32),
                                                    (batch, kvh, context)),
                               length=jnp.int32(context))
            measure("kvjax xla (contiguous)", name, s * d * 2 * 2 + s * 4,
                    lambda: jax.jit(lambda q, p, c: kvjax.attend(q, p, c, impl="xla")),
                    q, q_pos, cache, compare=lambda out: diff(out[:, 0]))
            del cache
        del k, v
    return rows


def plot(rows, path, copy_bw):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sel = [r for r in rows if r["shape"] == shape and r["ms"]]
        for key in dict.fromkeys((r["method"], r["format"]) for r in sel):
            for batch in sorted({r["batch"] for r in sel}):
                pts = sorted((r["context"], r["ms"]) for r in sel
                             if (r["method"], r["format"]) == key and r["batch"] == batch)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{key[0]} {key[1]}, b={batch}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens per sequence)")
        ax.set_ylabel("ms per decode attention call")
        ax.set_title(f"{shape} (copy bandwidth {copy_bw:.0f} GB/s)")
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launch_arg(text: str):
    """'0' -> None (the kernel's default); 'WxS' -> (num_warps, num_stages)."""
    if text == "0":
        return None
    try:
        warps, stages = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--launch takes 0 or WARPSxSTAGES (e.g. 4x2), got "
                                         f"{text!r}") from None
    if warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 8:
        raise argparse.ArgumentTypeError(f"--launch {text!r}: warps must be 1, 2, 4, 8 or 16 "
                                         f"and stages 1-8")
    return warps, stages


def environment() -> dict:
    """What produced the numbers: device, driver, jax version, the command line."""
    import subprocess
    import sys
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return dict(device=str(jax.devices()[0]), driver=driver, jax=jax.__version__,
                command=" ".join(["python", *sys.argv]),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 32, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 8192, 4096])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--pages-per-split", type=int, default=64,
                        help="flash-decoding split (pages); 32k / 64-token pages -> 8 splits")
    parser.add_argument("--pages-per-block", type=int, nargs="+", default=[0],
                        help="kvjax pages per step to try (0: the default); e.g. 0 1 2 4 to tune")
    parser.add_argument("--launch", type=launch_arg, nargs="+", default=[None],
                        help="GPU (num_warps x num_stages) to try, e.g. 0 4x2 8x2 4x3 (0: the "
                             "kernel's default)")
    parser.add_argument("--mosaic-pages-per-step", type=int, default=2,
                        help="pages per pipeline step of the Mosaic GPU kernel (bf16 pages)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copy-bytes", type=int, default=2 << 30)
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no new cell after this many seconds")
    parser.add_argument("--out", default=None, help="path prefix for .json/.csv/.png")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in interpret mode (CPU): checks every code path")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    backend, interpret = pallas_backend(), False
    if args.smoke:
        backend, interpret = backend or "gpu", True
        args.shapes, args.batches, args.contexts = ["smollm2"], [2], [128]
        # 64-slot pages: the Mosaic GPU kernel's smallest (one 128-byte swizzled bf16 row)
        args.page_size, args.pages_per_split, args.repeats, args.rounds = 64, 2, 1, 1
        args.copy_bytes = 1 << 20
    elif backend is None:
        raise SystemExit("experiments.bench.kernels: no GPU or TPU here (compiled Pallas needs one); "
                         "use --smoke to check the script on CPU")
    began = time.perf_counter()
    copy_bw = copy_gbs(args.copy_bytes, args.repeats, args.rounds)
    print(f"device {jax.devices()[0]}: copy bandwidth {copy_bw:.1f} GB/s", flush=True)
    cells = [(sh, b, c) for c in sorted(args.contexts, reverse=True)
             for b in sorted(args.batches, reverse=True) for sh in args.shapes]
    rows, not_run = [], []
    for shape_name, batch, context in cells:
        if time.perf_counter() - began > args.budget_s:
            not_run.append(dict(shape=shape_name, batch=batch, context=context))
            continue
        rows += bench_cell(shape_name, batch, context, args, backend, interpret, copy_bw)
    print("| shape | method | format | batch | context | ms | GB/s | of copy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        timing = (f"{r['ms']:.3f} | {r['gbs']} | {r['of_copy']:.2f}" if r["ms"] else
                  f"failed: {r['error'][:80]} | | ")
        print(f"| {r['shape']} | {r['method']} | {r['format']} | {r['batch']} | {r['context']} "
              f"| {timing} |")
    if not_run:
        print(f"not run (budget {args.budget_s:.0f} s spent): {not_run}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(**environment(), backend=backend, interpret=bool(interpret),
                    copy_gbs=round(copy_bw, 1), page_size=args.page_size,
                    pages_per_split=args.pages_per_split, repeats=args.repeats,
                    rounds=args.rounds, seconds=round(time.perf_counter() - began, 1),
                    not_run=not_run, shapes={k: SHAPES[k] for k in args.shapes})
        out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        with open(out.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, out.with_suffix(".png"), copy_bw)
    return rows, copy_bw


if __name__ == "__main__":
    main()
