"""Where a KIVI-4 layer's decode attention goes: the same compiled step with parts replaced.

One SmolLM2-shaped layer (3 KV heads of 64, float32 queries) holding `context` random
tokens, compressed by `kivi:bits=4` (`experiments.bench.attention.make_layer`), attended
by one decode query through `kvjax.attend`, compiled once per variant; the variants' calls
are interleaved round by round and timed in process CPU seconds (the machine is shared):

  * `base`: as shipped (keys: `PackedChannels.read_slots`, values: `PackedTokens.read`);
  * `keys: words only` / `values: words only` / `both: words only`: that part's block
    decode replaced by a plain uint32 -> float32 conversion of its packed words tiled to
    `[R, S, D]` (no unpack, no scale): what the loop costs without that decode;
  * `keys: unpack only`: key codes unpacked and widened, without their scale/offset;
  * `keys: aligned, no cond` / `keys: gather only`: the key table applied by a broadcast
    of aligned rows without the write-order check, or by row gathers only.

The replacements change the numbers the attention computes (except the last two, which
give the same floats): a timing ablation, not a method.

    python -m experiments.bench.kivi_parts --batch 8 --context 4096 --repeats 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import kvjax
from experiments.bench.attention import HEAD_DIM, HEADS, make_layer
from kvjax.core import attention, stores
from kvjax.core.quant import unpack


def _words(store, start, size):  # [R, size, D] float32 from the packed words, nothing decoded
    w = jax.lax.dynamic_slice_in_dim(store.words, start, size, axis=1).astype(jnp.float32)
    return jnp.tile(w, (1, 1, store.dim // w.shape[-1]))


def _keys_unpacked(self, start, size, length=None):
    w = jax.lax.dynamic_slice_in_dim(self.words, start, size, axis=1)
    return unpack(w, self.bits, self.dim).astype(jnp.float32)


def _keys_aligned(self, start, size, length=None):  # assumes slots in write order, aligned
    g = self.group
    piece = self.map_slots(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1))

    def by_group(table):
        rows = jax.lax.dynamic_slice_in_dim(table, start // g, size // g, axis=1)
        r, n, d = rows.shape
        return jnp.broadcast_to(rows[:, :, None], (r, n, g, d)).reshape(r, size, d)
    return piece._dequantize(piece.words, by_group)


def _keys_gathered(self, start, size, length=None):
    return self.map_slots(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, 1)).read()


@contextlib.contextmanager
def _patched(keys=None, values_words=False):
    """Replace the key block decode and/or the value block decode while tracing."""
    read_slots, block = stores.PackedChannels.read_slots, attention.read_block

    def value_words(store, start, size, length=None):
        if isinstance(store, stores.PackedTokens):
            return _words(store, start, size)
        return block(store, start, size, length)
    try:
        if keys is not None:
            stores.PackedChannels.read_slots = keys
        if values_words:
            attention.read_block = value_words
        yield
    finally:
        stores.PackedChannels.read_slots, attention.read_block = read_slots, block


VARIANTS = {
    "base": {},
    "keys: words only": {"keys": lambda self, s, n, length=None: _words(self, s, n)},
    "keys: unpack only": {"keys": _keys_unpacked},
    "values: words only": {"values_words": True},
    "both: words only": {"keys": lambda self, s, n, length=None: _words(self, s, n),
                         "values_words": True},
    "keys: aligned, no cond": {"keys": _keys_aligned},
    "keys: gather only": {"keys": _keys_gathered},
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--method", default="kivi:bits=4")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=Path("docs/bench/kivi_parts.json"))
    args = p.parse_args(argv)
    layer = make_layer(args.method, args.batch, args.context)
    q = jax.random.normal(jax.random.key(3), (args.batch, 1, HEADS, HEAD_DIM))
    q_pos = jnp.full((args.batch, 1), args.context + 1, jnp.int32)
    compiled = {}
    for name, kw in VARIANTS.items():
        with _patched(**kw):
            fn = jax.jit(lambda q, p, c: kvjax.attend(q, p, c))
            compiled[name] = fn.lower(q, q_pos, layer).compile()
    base = compiled["base"](q, q_pos, layer)
    same = {k: bool(jnp.all(f(q, q_pos, layer) == base)) for k, f in compiled.items()}
    cpu = {k: [] for k in compiled}
    for _ in range(args.repeats):
        for k, f in compiled.items():
            start = time.process_time()
            jax.block_until_ready(f(q, q_pos, layer))
            cpu[k].append(time.process_time() - start)
    rows = [{"variant": k, "cpu_min_ms": 1e3 * min(v), "cpu_median_ms": 1e3 * statistics.median(v),
             "same_output_as_base": same[k]} for k, v in cpu.items()]
    for r in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    meta = {"method": args.method, "batch": args.batch, "context": args.context,
            "repeats": args.repeats, "jax": jax.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
