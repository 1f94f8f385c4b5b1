"""One cache layer of random tokens compressed by a method: the layers the attention tests read.

`experiments/bench/attention.py` builds its timed layers the same way (its own `make_layer`):
tests import no benchmark script (tests/test_import_layers.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import kvjax
from kvjax.policies.methods import parse_method

KV_HEADS, HEAD_DIM = 3, 64  # SmolLM2-135M


def make_layer(method: str, batch: int, context: int, room: int = 16, seed: int = 0, *,
               kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, dtype=jnp.float32):
    """One layer of `context` random tokens, compressed by `method`, shrunk to `room` free slots
    (the layer a decode step reads).

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
