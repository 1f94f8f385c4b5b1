"""Teacher-forced log-probabilities of target tokens, computed chunk by chunk.

Only `[B, chunk, vocab]` logits exist at a time, so long windows never hold a
`[B, T, vocab]` tensor nor a `T x T` score matrix.

Example:
    >>> lp = token_logprobs(model, tokens, positions, targets)   # [B, T]
    >>> nll = -lp[:, :-1].sum()
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import kvjax
from models.llama import Llama


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"), donate_argnames=("cache",))
def _token_logprobs(graphdef, state, tokens, positions, targets, cache, chunk):
    model = nnx.merge(graphdef, state)
    b, width = tokens.shape
    chunks = lambda x: x.reshape(b, width // chunk, chunk).swapaxes(0, 1)  # [N, B, chunk]

    def step(cache, xs):
        tok, pos, tgt = xs
        h, cache = model.hidden(tok, pos, cache)
        logp = jax.nn.log_softmax(model.logits(h), axis=-1)  # [B, chunk, V]
        return cache, jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]

    cache, lp = jax.lax.scan(step, cache, (chunks(tokens), chunks(positions), chunks(targets)))
    return lp.swapaxes(0, 1).reshape(b, width), cache


def token_logprobs(model: Llama, tokens: jax.Array, positions: jax.Array, targets: jax.Array,
                   *, chunk: int = 256, cache_dtype: Any = jnp.float32) -> jax.Array:
    """log p(targets[b, t] | tokens[b, :t+1]) as [B, T] float32, in a fresh cache.

    Args:
      tokens, positions: [B, T] int32; negative positions mark padding.
      targets: [B, T] int32, usually `tokens` shifted left by one.
      chunk: tokens per forward call; T is padded up to a multiple on the left.
    """
    b, t = tokens.shape
    if positions.shape != (b, t) or targets.shape != (b, t):
        raise ValueError(f"tokens {tokens.shape}, positions {positions.shape} and targets "
                         f"{targets.shape} must have the same [B, T] shape")
    chunk = min(chunk, t)
    pad = -t % chunk
    left = lambda x, value: jnp.pad(jnp.asarray(x, jnp.int32), ((0, 0), (pad, 0)),
                                    constant_values=value)
    cache = kvjax.init_model_cache(model.config.cache_spec, b, t + pad, cache_dtype)
    graphdef, state = nnx.split(model)
    lp, _ = _token_logprobs(graphdef, state, left(tokens, 0), left(positions, kvjax.EMPTY),
                            left(targets, 0), cache, chunk)
    return lp[:, pad:]
