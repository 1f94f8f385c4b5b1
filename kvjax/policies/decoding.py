"""`decoding_ratio`: a scored method whose budget is a fraction of every token seen so far.

kvpress 0.5.5's `CompressionRatioDecodingPress(press, target_compression_ratio=r,
compression_interval=N)` keeps, at every compression during decoding, `max(1, int(seen * (1 -
r)))` tokens, `seen` being every token of the sequence so far (its largest position + 1), so
its cache grows by `1 - r` of a token per step. A scored method's own `ratio` is fixed at the
first compression (the prompt's `n * (1 - r)`, held by `compress_every`). `decoding_ratio`
re-derives the budget from the sequence's latest position before every update of its inner
method: `decoding_ratio:inner=knorm,ratio=0.5` with `compress_every=N` equals
`CompressionRatioDecodingPress(KnormPress(), 0.5, N)` when kvpress compresses right after the
prompt (tests/test_kvpress_decoding.py; docs/DECISIONS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from kvjax.core.selection import BudgetState
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import ScoredUpdate, knorm


@dataclasses.dataclass(frozen=True)
class SeenRatioUpdate:
    """The inner update, each row's budget set to `max(1, floor(seen * (1 - ratio)))` first."""

    inner: Callable

    def __call__(self, cache, state: BudgetState, stats=None):
        pos = cache[0].pos
        seen = jnp.max(pos.reshape(pos.shape[0], -1), -1).astype(jnp.float32) + 1  # [B]
        budget = jnp.maximum(1, jnp.floor(seen * (1 - state.ratio))).astype(jnp.int32)
        state = state._replace(layer_budget=jnp.broadcast_to(budget, state.layer_budget.shape))
        return self.inner(cache, state, stats)


def decoding_ratio(inner=knorm, ratio: float = 0.5, **options) -> CacheTransform:
    """Keep `1 - ratio` of every token seen so far, by the inner method's scores; with
    `--compress-every N` it is kvpress CompressionRatioDecodingPress (interval N): the budget
    grows while decoding.

    `inner` is a scored method (knorm, keydiff, snapkv, ...) with one budget for every layer;
    `options` go to it.

    Example (10 tokens seen: 5 kept per KV head, the smallest keys as Knorm keeps them):
        >>> import jax, jax.numpy as jnp, kvjax
        >>> t = kvjax.parse_method("decoding_ratio:inner=knorm,ratio=0.5")
        >>> k = jax.random.normal(jax.random.key(0), (1, 2, 10, 8))  # [B, KVH, T, D]
        >>> layer = kvjax.write(kvjax.init_cache(1, 2, 16, 8), k, k, jnp.arange(10)[None])
        >>> (out,), _ = t.update((layer,), t.init((layer,)), None)
        >>> (out.pos != kvjax.EMPTY).sum(-1).tolist()
        [[5, 5]]
    """
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio < 1:
        raise ValueError(f"decoding_ratio: ratio is the fraction of tokens evicted, in [0, 1); "
                         f"got {ratio!r}")
    try:
        t = inner(ratio=ratio, **options)
    except TypeError:
        t = None
    if t is None or not isinstance(t.update, ScoredUpdate) or t.update.schedule != "uniform":
        raise ValueError(f"decoding_ratio: inner={getattr(inner, '__name__', inner)} is not a "
                         "scored method with one budget for every layer")
    return t._replace(update=SeenRatioUpdate(t.update))
