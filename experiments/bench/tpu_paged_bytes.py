"""Bytes one `attend(impl="pallas")` over a page pool moves on a v5e chip, against the pool's
own bytes (issue 54): paged layers by page size and codes, and a paged KIVI layer.

    pip install -e '.[tpu-compile]' && python -m experiments.bench.tpu_paged_bytes   # ~2 min

Each row compiles, deviceless, one attention call of batch 64 x 32,768 tokens x 8 KV heads
(Llama-3-8B's head dim 128, 32 query heads, one bf16 query token per sequence) over an
abstract layer with shared block tables, and reads the compiler's
`cost_analysis()['bytes accessed']` (the Mosaic call counts its `pl.CostEstimate`). `ratio` =
step / the layer's own bytes: what the call moves beyond one read of the pool. A static
count, not a timing. The layer alone, not the model step (no weights), so the ratio is
the cache path's: `tpu_step_bytes` covers whole steps of `TokenCache` methods.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

BATCH, KV_HEADS, HEADS, HEAD_DIM, CONTEXT = 64, 8, 32, 128, 32768
# (kind, page slots, bits: None = bf16 pages, the codes' scale/offset dtype) -- a KIVI page
# is one group of 32 tokens
F16, BF16 = "float16", "bfloat16"
LAYERS = (("paged", 64, None, F16), ("paged", 64, 4, F16), ("paged", 64, 4, BF16),
          ("paged", 128, None, F16), ("paged", 128, 4, F16), ("paged", 128, 4, BF16),
          ("paged", 256, None, F16), ("paged", 256, 4, F16), ("paged", 256, 4, BF16),
          ("paged_kivi", 32, 4, F16), ("paged_kivi", 32, 4, BF16))


def abstract_layer(kind: str, page: int, bits: int | None, param_dtype: str = F16,
                   batch: int = BATCH, context: int = CONTEXT):
    """The layer as `init_paged_cache(shared_tables=True)` (or, for paged KIVI,
    `from_residual(shared_tables=True)`) builds it, abstract (shapes only)."""
    import jax
    import jax.numpy as jnp
    import kvjax
    from kvjax.memory.paged_kivi import ChannelPages, PagedKivi
    from kvjax.memory.paging import TokenPages, init_paged_cache

    n_table = context // page
    n_pages = (batch * n_table + 1) * KV_HEADS

    def build():
        _, (body,) = init_paged_cache(n_pages, page, batch, KV_HEADS, n_table, HEAD_DIM, 1,
                                      dtype=jnp.bfloat16, bits=bits, group=32,
                                      shared_tables=True, param_dtype=param_dtype)
        if kind == "paged":
            return body
        body = body.replace(k=ChannelPages.empty(n_pages, page, HEAD_DIM, bits, param_dtype),
                            v=TokenPages.empty(n_pages, page, HEAD_DIM, bits, 32, False,
                                               param_dtype))
        recent = kvjax.init_cache(batch, KV_HEADS, 128 + page, HEAD_DIM, dtype=jnp.bfloat16)
        return PagedKivi(body=body, recent=recent, residual=128)

    return jax.eval_shape(build)


def row(kind: str, page: int, bits: int | None, param_dtype: str, batch: int = BATCH,
        context: int = CONTEXT) -> dict:
    """One attention call's compiled bytes against the layer's own (`batch` x `context`)."""
    import jax
    import jax.numpy as jnp
    from experiments.cli.compile_cmd import kernel_calls
    from kernels_pallas import tpu_compile as tc
    from kvjax.backends import pallas as ka

    device = tc.tpu_device("v5e")
    layer = tc.abstract_like(abstract_layer(kind, page, bits, param_dtype, batch, context),
                             device)
    own = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layer))
    q = tc.abstract((batch, 1, HEADS, HEAD_DIM), jnp.bfloat16, device)
    q_pos = tc.abstract((batch, 1), jnp.int32, device)
    compiled = tc.compile_for(device, functools.partial(ka.attend_pallas, backend="tpu"), q,
                              q_pos, layer)
    step = int(compiled.cost_analysis()["bytes accessed"])
    return dict(kind=kind, page=page, codes="bf16" if bits is None else f"int{bits}",
                param_dtype=None if bits is None else param_dtype,
                batch=batch, context=context, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                layer_bytes=own, step_bytes=step, ratio=round(step / own, 3),
                kernel_calls=kernel_calls(compiled.as_text()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/tpu_paged_bytes.json"))
    args = parser.parse_args(argv)
    rows = []
    for layer in LAYERS:
        rows.append(row(*layer))
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(chip="v5e", rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
