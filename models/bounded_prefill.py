"""Bounded-memory long prefill: the context chunk by chunk onto the already-compressed cache.

`prefill_bounded` runs a prompt `chunk` tokens at a time; each chunk attends to the cache as
the method left it after the previous chunk, then the method's update compresses again
(kvpress's ChunkPress compresses each chunk on its own; here each chunk also sees the
compressed past, as KV cache streaming does). The cache is grown by exactly one chunk
before each forward (`kvjax.shrink(cache, room=chunk)`), so with a token budget (e.g.
`snapkv:budget=512`) it never holds more than budget + chunk tokens per head, whatever the
prompt's length: `peak_cache_bytes` (`kvjax.nbytes` after every chunk's write) is that bound.
With `full` nothing is evicted and the logits equal one-shot prefill's up to float rounding
(attention over the same keys, summed in another order).

Example:
    >>> import kvjax
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> out = prefill_bounded(model, [list(range(3, 259))], kvjax.parse_method("snapkv:budget=32"),
    ...                       chunk=64)
    >>> out.peak_cache_bytes == max(out.chunk_cache_bytes), len(out.chunk_cache_bytes)
    (True, 4)
    >>> int(out.prefilled.cache[0].counters()["tokens"].max())      # the budget per head
    32
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax.numpy as jnp

import kvjax
from kvjax.core.transforms import CacheTransform, full
from models.llama import Llama
from models.sampler import (Prefilled, PrefillConfig, RunOptions, _compress, _prefill,
                            for_full_layers, pad_prompts)


class BoundedPrefill(NamedTuple):
    prefilled: Prefilled  # logits at each sequence's last token, the compressed cache, ...
    peak_cache_bytes: int  # the most bytes the cache held (after a chunk's write)
    chunk_cache_bytes: list[int]  # kvjax.nbytes after each chunk's write, before compression


def chunk_slices(width: int, chunk: int) -> list[slice]:
    """The column slices of a [B, width] prompt, `chunk` at a time (width a multiple).

    Example:
        >>> chunk_slices(6, 2)
        [slice(0, 2, None), slice(2, 4, None), slice(4, 6, None)]
    """
    if width % chunk:
        raise ValueError(f"prompt width {width} is not a multiple of the chunk {chunk}")
    return [slice(i, i + chunk) for i in range(0, width, chunk)]


def prefill_bounded(model: Llama, prompts: Sequence[Sequence[int]],
                    transform: CacheTransform | None = None, *, chunk: int = 512,
                    **options) -> BoundedPrefill:
    """Prefill `prompts` (left-padded to a multiple of `chunk`) chunk by chunk, compressing
    with `transform` after every chunk (see the module doc). `options`: cache_dtype, impl
    (`RunOptions`). The returned cache has no free room: `kvjax.shrink` it for what follows."""
    run = RunOptions.taking(options, ("cache_dtype", "impl"), "prefill_bounded")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    transform = for_full_layers(model, transform or full())
    padded = pad_prompts(prompts, chunk)
    if padded.lengths.max() > model.config.max_position:
        raise ValueError(f"a prompt of {padded.lengths.max()} tokens exceeds the model's "
                         f"{model.config.max_position} positions")
    spec = transform.stats
    cache = kvjax.init_model_cache(model.config.cache_spec, len(padded.lengths), chunk,
                                   run.cache_dtype, track_mass=spec.attention_mass)
    stats, state = model.init_stats(spec, cache), transform.init(cache)
    config = PrefillConfig(chunk, spec, run.impl)
    written = []
    for i, cols in enumerate(chunk_slices(padded.tokens.shape[1], chunk)):
        if i:  # room for exactly one more chunk
            cache = kvjax.shrink(cache, chunk, chunk)
        logits, cache, stats = _prefill(model, jnp.asarray(padded.tokens[:, cols]),
                                        jnp.asarray(padded.positions[:, cols]), cache, stats,
                                        config)
        written.append(kvjax.nbytes(cache))
        if transform is not full():
            cache, state = _compress(transform.update, cache, state, stats)
    pre = Prefilled(logits, cache, stats, state, padded.lengths)
    return BoundedPrefill(pre, max(written), written)
