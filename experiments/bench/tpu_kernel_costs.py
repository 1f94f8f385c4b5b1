"""What the compiled TPU paged attention kernel moves and computes per decode step, per format.

Compiles `kernels_pallas.paged_attention` deviceless for a TPU (libtpu, the
`tpu-compile` extra; nothing runs) at batch 8 and 64, contexts 4k and 32k,
for the attention shapes of SmolLM2-135M (3 KV heads, 9 query heads, D = 64)
and Llama-3-8B (8 KV heads, 32 query heads, D = 128), one layer, pages of
256 slots, full block tables, bf16 queries. Per row:

- `store_mb`: bytes kvjax's cache stores for these slots (`kvjax.core.stores`
  layout: codes, 16-bit parameters, KIVI's int16 group ids and per-row
  tables, int32 positions);
- `kernel_args_mb`: `memory_analysis().argument_size_in_bytes` of the
  compiled program (the pool in the kernel's page layout, tables, queries);
- `kernel_mb`, `kernel_gflop`: the kernel's `pl.CostEstimate` (every listed
  page's blocks once, both dots and the format's decode), which the
  compiled program's `cost_analysis()` includes for the Mosaic call (XLA
  cannot look inside a custom call);
- `program_mb`, `program_gflop`: `cost_analysis()` of the whole compiled
  program (kernel estimate + XLA ops around it, including any layout copies
  XLA inserts to hand the pool to Mosaic in row-major tiles);
- `pool_copies`: copies of the key/value pool XLA inserted (`copy` ops on
  them in the compiled HLO);
- `x_bf16`: kernel_mb over the bf16 kernel's at the same shape.

Run: python -m experiments.bench.tpu_kernel_costs  (about 2 minutes on 2 cores)
Writes docs/bench/tpu_kernel_costs.json and .csv.

`--table steps` compiles instead the whole `attend_pallas` step over one
abstract `TokenCache` layer (batch 64, 32k slots, both models' shapes) in
each store kvjax holds, and reports its `cost_analysis()` bytes now
(`step_mb`) and with the cache converted to a kernel page pool every call
(`before_mb`: the conversion this session replaced, reproduced by turning
the in-place row pools off), beside the kernel's own estimate (`kernel_mb`).
Writes docs/bench/tpu_step_costs.json and .csv (about 5 minutes).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp

from kernels_pallas import page_formats as pf
from kernels_pallas import tpu_compile as tc
from kernels_pallas.paged_attention import cost_estimate, paged_attention

PAGE = 256
GROUP = 32  # KIVI's token groups and the per-token channel groups
MODELS = {"SmolLM2-135M": dict(kv_heads=3, heads=9, head_dim=64),
          "Llama-3-8B": dict(kv_heads=8, heads=32, head_dim=128)}
MiB = 2 ** 20


def formats(ctx: int, head_dim: int):
    """name -> (k_format, v_format, dense dtype, store bytes per slot for k and v at head_dim d).

    Dense pages are read slot-last below 128 lanes, as `kvjax.backends.pallas` does on TPU.
    """
    ng = ctx // GROUP
    dense = pf.DENSE_T if head_dim % 128 else pf.DENSE
    win = pf.window_for(PAGE, GROUP, ng)
    tok = lambda bits, g, sym=False: pf.PackedTokens(bits, g, sym)
    tok_bytes = lambda bits, g, sym=False: lambda d: d * bits / 8 + (d // g) * (1 if sym else 2) * 2
    kivi_bytes = lambda bits: lambda d: d * bits / 8 + 2 + 2 * d * 2 / GROUP
    return {
        "bf16": (dense, dense, jnp.bfloat16, lambda d: 2 * d, lambda d: 2 * d),
        "fp8-e4m3": (dense, dense, jnp.float8_e4m3fn, lambda d: d, lambda d: d),
        "int8 g64": (tok(8, 64), tok(8, 64), None, tok_bytes(8, 64), tok_bytes(8, 64)),
        "int4 g32": (tok(4, 32), tok(4, 32), None, tok_bytes(4, 32), tok_bytes(4, 32)),
        "int4 g64": (tok(4, 64), tok(4, 64), None, tok_bytes(4, 64), tok_bytes(4, 64)),
        "int4-sym g32": (tok(4, 32, True), tok(4, 32, True), None, tok_bytes(4, 32, True),
                         tok_bytes(4, 32, True)),
        "int2 g32": (tok(2, 32), tok(2, 32), None, tok_bytes(2, 32), tok_bytes(2, 32)),
        "kivi4 (keys/ch g32, values int4 g32)": (pf.PackedChannels(4, win), tok(4, 32), None,
                                                  kivi_bytes(4), tok_bytes(4, 32)),
        "kivi2 (keys/ch g32, values int2 g32)": (pf.PackedChannels(2, win), tok(2, 32), None,
                                                  kivi_bytes(2), tok_bytes(2, 32)),
    }


def abstract_args(device, k_fmt, v_fmt, dense_dtype, *, batch, ctx, kv_heads, heads, head_dim):
    table = ctx // PAGE
    n_pages = batch * kv_heads * table
    a = lambda s: tc.abstract(s.shape, s.dtype, device)
    pool = lambda fmt: tuple(a(x) for x in fmt.shapes(n_pages, PAGE, head_dim, dense_dtype))
    ab = lambda shape, dtype: tc.abstract(shape, dtype, device)
    return (ab((batch, 1, heads, head_dim), jnp.bfloat16), ab((batch, 1), jnp.int32),
            pool(k_fmt), pool(v_fmt), ab((n_pages, 1, PAGE), jnp.int32),
            ab((batch, kv_heads, table), jnp.int32), ab((batch, kv_heads), jnp.int32))


def pool_copies(hlo: str) -> int:
    return sum(1 for line in hlo.splitlines()
               if ("copy(" in line or "copy-start(" in line)
               and ('op_name="k_pages' in line or 'op_name="v_pages' in line))


def measure(chip: str, model: str, name: str, batch: int, ctx: int, pages_per_split: int = 8):
    device = tc.tpu_device(chip)
    shape = MODELS[model]
    k_fmt, v_fmt, dense_dtype, k_bytes, v_bytes = formats(ctx, shape["head_dim"])[name]
    args = abstract_args(device, k_fmt, v_fmt, dense_dtype, batch=batch, ctx=ctx, **shape)
    fn = functools.partial(paged_attention, k_format=k_fmt, v_format=v_fmt, backend="tpu",
                           pages_per_split=pages_per_split)
    compiled = tc.compile_for(device, fn, *args)
    cost, mem = compiled.cost_analysis(), compiled.memory_analysis()
    d, kvh = shape["head_dim"], shape["kv_heads"]
    rows = shape["heads"] // kvh
    qg = jax.ShapeDtypeStruct((batch, kvh, rows, d), jnp.bfloat16)
    splits = -(-(ctx // PAGE) // pages_per_split)
    est = cost_estimate(qg, k_fmt, args[2], v_fmt, args[3], args[4], args[5], splits)
    slots = batch * kvh * ctx
    return dict(chip=chip, model=model, format=name, batch=batch, context=ctx,
                store_mb=round(slots * (k_bytes(d) + v_bytes(d) + 4) / MiB, 2),
                kernel_args_mb=round(mem.argument_size_in_bytes / MiB, 2),
                kernel_mb=round(est.bytes_accessed / MiB, 2),
                kernel_gflop=round(est.flops / 1e9, 4),
                program_mb=round(cost["bytes accessed"] / MiB, 2),
                program_gflop=round(cost["flops"] / 1e9, 4),
                pool_copies=pool_copies(compiled.as_text()))


def step_stores(batch: int, kv_heads: int, ctx: int, head_dim: int):
    """name -> a function building one abstract layer's (k, v) stores in kvjax's layout."""
    from kvjax.core import stores

    r = batch * kv_heads
    dense = lambda dtype: lambda: (jnp.zeros((r, ctx, head_dim), dtype),) * 2
    tok = lambda bits, g, sym=False: lambda: (stores.PackedTokens.empty(
        r, ctx, head_dim, bits, g, symmetric=sym),) * 2
    kivi = lambda bits: lambda: (stores.PackedChannels.empty(r, ctx, head_dim, bits, GROUP),
                                 stores.PackedTokens.empty(r, ctx, head_dim, bits, GROUP))
    return {"bf16": dense(jnp.bfloat16), "fp8-e4m3": dense(jnp.float8_e4m3fn),
            "int8 g64": tok(8, 64), "int4 g32": tok(4, 32), "int4-sym g32": tok(4, 32, True),
            "int2 g32": tok(2, 32), "kivi4 (keys/ch g32, values int4 g32)": kivi(4)}


def measure_step(chip: str, model: str, name: str, batch: int, ctx: int) -> dict:
    """Whole attend_pallas step over one TokenCache layer: bytes now, before, and the kernel's."""
    from kernels_pallas.paged_attention import block_sizes, rows_as_pages
    from kvjax.backends import pallas as ka
    from kvjax.core.cache import EMPTY, TokenCache

    device = tc.tpu_device(chip)
    shape = MODELS[model]
    kvh, heads, d = shape["kv_heads"], shape["heads"], shape["head_dim"]
    build = step_stores(batch, kvh, ctx, d)[name]

    def layer():
        k, v = build()
        return TokenCache(k=k, v=v, pos=jnp.full((batch, kvh, ctx), EMPTY, jnp.int32),
                          length=jnp.zeros((), jnp.int32), mass=None)

    layer = jax.eval_shape(layer)
    q = jax.ShapeDtypeStruct((batch, 1, heads, d), jnp.bfloat16)
    q_pos = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    args = tc.abstract_like((q, q_pos, layer), device)
    step = functools.partial(ka.attend_pallas, backend="tpu")
    in_place = ka.row_pool

    def bytes_of(fn):
        """Compiled bytes accessed, or the compiler's out-of-memory message (temporaries)."""
        try:
            return tc.compile_for(device, fn, *args).cost_analysis()["bytes accessed"]
        except Exception as e:  # noqa: BLE001 - XLA:TPU reports HBM overflow at compile time
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return str(e).split("RESOURCE_EXHAUSTED: ")[-1].splitlines()[0][:160]

    step_b = bytes_of(step)
    try:  # the page-pool conversion every call, as before row pools
        ka.row_pool = lambda store: None
        # a new function object: jit would reuse the first trace of `step`
        before_b = bytes_of(functools.partial(ka.attend_pallas, backend="tpu"))
    finally:
        ka.row_pool = in_place
    statics = {}

    def inputs(layer):
        kin = ka.kernel_inputs(layer, backend="tpu")
        statics.update({k: kin.pop(k, None) for k in ("k_format", "v_format", "row_pages",
                                                       "head_stride")})
        return kin

    kin = jax.eval_shape(inputs, layer)
    tup = lambda x: x if isinstance(x, tuple) else (x,)
    kf, vf, n = statics["k_format"], statics["v_format"], statics["row_pages"]
    pos, k, v = kin["pos_pages"], tup(kin["k_pages"]), tup(kin["v_pages"])
    if n is not None:
        pos, k, v = jax.eval_shape(lambda p, k, v: rows_as_pages(p, k, v, kf, vf, n), pos, k, v)
    qg = jax.ShapeDtypeStruct((batch, kvh, heads // kvh, d), jnp.bfloat16)
    page = pos.shape[-1]
    splits = block_sizes(ctx // page, page, 8, None)[2]
    est = cost_estimate(qg, kf, k, vf, v, pos, kin["block_tables"], splits)
    mb = lambda b: round(b / MiB, 1) if isinstance(b, float) else b
    ratio = lambda b: round(b / est.bytes_accessed, 2) if isinstance(b, float) else None
    return dict(chip=chip, model=model, format=name, batch=batch, context=ctx,
                in_place=n is not None, kernel_mb=round(est.bytes_accessed / MiB, 1),
                step_mb=mb(step_b), before_mb=mb(before_b), step_x_kernel=ratio(step_b),
                before_x_kernel=ratio(before_b))


def write_table(rows: list, meta: dict, out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    with out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}.json/.csv ({len(rows)} rows, {meta['seconds']} s)")


def main_steps(chip: str, out: str) -> None:
    rows, start = [], time.time()
    for model in MODELS:
        d = MODELS[model]["head_dim"]
        for name in step_stores(1, 1, 256, d):
            row = measure_step(chip, model, name, 64, 32768)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(command="python -m experiments.bench.tpu_kernel_costs --table steps", chip=chip,
                jax=jax.__version__, seconds=round(time.time() - start))
    write_table(rows, meta, pathlib.Path(out))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="v5e", choices=tc.CHIPS)
    parser.add_argument("--table", default="kernels", choices=("kernels", "steps"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.table == "steps":
        return main_steps(args.chip, args.out or "docs/bench/tpu_step_costs")
    args.out = args.out or "docs/bench/tpu_kernel_costs"
    rows, start = [], time.time()
    for model in MODELS:
        for batch in (8, 64):
            for ctx in (4096, 32768):
                base = None
                for name in formats(ctx, MODELS[model]["head_dim"]):
                    row = measure(args.chip, model, name, batch, ctx)
                    base = base or row["kernel_mb"]
                    row["x_bf16"] = round(row["kernel_mb"] / base, 3)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    meta = dict(command="python -m experiments.bench.tpu_kernel_costs", chip=args.chip,
                jax=jax.__version__, page_size=PAGE, group=GROUP, seconds=round(time.time() - start))
    write_table(rows, meta, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
