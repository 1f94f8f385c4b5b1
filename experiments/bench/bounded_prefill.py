"""Bounded-memory long prefill at length: a random-weight model of SmolLM2-135M's shape
(30 layers, positions extended) prefills N tokens chunk by chunk with a budgeted method
(models/bounded_prefill.py); prints one JSON line: peak cache bytes (kvjax.nbytes after each
chunk's write), the bytes a full float32 cache of N tokens would take, tokens per head kept,
wall time and tokens/s.

    python experiments/bench/bounded_prefill.py --tokens 32768 --chunk 1024 \\
        --method snapkv:budget=1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--method", default="snapkv:budget=1024")
    p.add_argument("--layers", type=int, default=30, help="SmolLM2-135M has 30")
    args = p.parse_args(argv)

    import kvjax
    from flax import nnx
    from models.bounded_prefill import prefill_bounded
    from models.llama import Llama, LlamaConfig

    cfg = dataclasses.replace(LlamaConfig.smollm2_135m(), num_layers=args.layers,
                              max_position=max(args.tokens, 8192))
    model = Llama(cfg, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, args.tokens).tolist()
    start = time.perf_counter()
    out = prefill_bounded(model, [ids], kvjax.parse_method(args.method), chunk=args.chunk)
    seconds = time.perf_counter() - start
    full_bytes = cfg.num_layers * (cfg.num_kv_heads * args.tokens * (2 * cfg.head_dim * 4 + 4)
                                   + 4)
    kept = [int(layer.counters()["tokens"].max()) for layer in out.prefilled.cache]
    row = dict(tokens=args.tokens, chunk=args.chunk, method=args.method, layers=args.layers,
               peak_cache_bytes=out.peak_cache_bytes,
               final_cache_bytes=kvjax.nbytes(out.prefilled.cache),
               first_chunk_bytes=out.chunk_cache_bytes[0],
               full_float32_cache_bytes=full_bytes, kept_tokens_per_head=max(kept),
               seconds=round(seconds, 1), tokens_per_s=round(args.tokens / seconds, 1),
               logits_finite=bool(np.isfinite(np.asarray(out.prefilled.logits)).all()))
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
