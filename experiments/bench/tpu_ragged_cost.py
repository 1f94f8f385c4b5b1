"""What a serving step costs on a v5e chip with packed (ragged) queries against the padded form
(issue 54): one prefill chunk beside many decode tokens in one attention call.

    pip install -e '.[tpu-compile]' && python -m experiments.bench.tpu_ragged_cost   # ~1 min

Each row compiles, deviceless, one attention call over 64 sequences' int4 pages (Llama-3-8B's
head dim 128, 8 KV heads, 32 query heads, bf16 queries, pages of 128 slots, 4,096 tokens a
sequence): one sequence brings a prefill chunk of `chunk` tokens, the other 63 one decode
token each. "padded" is `paged_attention` over queries [64, chunk] (every decode row padded to
the chunk with q_pos = -1, one query block per sequence); "ragged" is `ragged_paged_attention`
over the chunk + 63 packed tokens in blocks of 16 tokens of one sequence. Columns: the
compiler's `cost_analysis()` flops and bytes accessed (the Mosaic call counts its
`pl.CostEstimate`: both dots for every query row of every page it reads, and the pages). A
static count, not a timing.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

SEQS, KV_HEADS, HEADS, HEAD_DIM, PAGE, TOKENS = 64, 8, 32, 128, 128, 4096


def row(form: str, chunk: int, chip: str = "v5e") -> dict:
    import jax.numpy as jnp
    from kernels_pallas import page_formats as pf
    from kernels_pallas import tpu_compile as tc
    from kernels_pallas.paged_attention import paged_attention, ragged_paged_attention

    device = tc.tpu_device(chip)
    a = lambda shape, dtype: tc.abstract(shape, dtype, device)
    fmt = pf.PackedTokens(4, 32)
    table = TOKENS // PAGE
    n_pages = SEQS * KV_HEADS * table + 1
    pool = tuple(a(x.shape, x.dtype) for x in fmt.shapes(n_pages, PAGE, HEAD_DIM))
    cache = (pool, pool, a((n_pages, 1, PAGE), jnp.int32),
             a((SEQS, KV_HEADS, table), jnp.int32), a((SEQS, KV_HEADS), jnp.int32))
    kw = dict(k_format=fmt, v_format=fmt, backend="tpu")
    if form == "padded":
        args = (a((SEQS, chunk, HEADS, HEAD_DIM), jnp.bfloat16), a((SEQS, chunk), jnp.int32))
        fn = functools.partial(paged_attention, **kw)
    else:
        n = chunk + SEQS - 1
        args = (a((n, HEADS, HEAD_DIM), jnp.bfloat16), a((n,), jnp.int32),
                a((SEQS + 1,), jnp.int32))
        fn = functools.partial(ragged_paged_attention, block_tokens=16, **kw)
    cost = tc.compile_for(device, fn, *args, *cache).cost_analysis()
    return dict(form=form, chunk=chunk, chip=chip, flops=int(cost["flops"]),
                bytes_accessed=int(cost["bytes accessed"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/tpu_ragged_cost.json"))
    args = parser.parse_args(argv)
    rows = []
    for chunk in (16, 64):
        pair = [row(form, chunk) for form in ("padded", "ragged")]
        for r in pair:
            r["flops_vs_padded"] = round(r["flops"] / pair[0]["flops"], 3)
            r["bytes_vs_padded"] = round(r["bytes_accessed"] / pair[0]["bytes_accessed"], 3)
            print(json.dumps(r), flush=True)
        rows += pair
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(command="python -m experiments.bench.tpu_ragged_cost",
                                        rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
