"""Teacher-forced log-probabilities of target tokens, computed chunk by chunk.

Only `[B, chunk, vocab]` logits exist at a time, so long windows never hold a
`[B, T, vocab]` tensor nor a `T x T` score matrix.

Example:
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))   # random weights, vocab 256
    >>> tokens = jnp.arange(3, 11)[None]; positions = jnp.arange(8)[None]
    >>> lp = token_logprobs(model, tokens, positions, jnp.roll(tokens, -1, axis=1))  # [B, T]
    >>> nll = -lp[:, :-1].sum()      # the last target wrapped around: left out
    >>> lp.shape, round(float(nll), 1)   # random weights: about 7 x log(256) = 38.8
    ((1, 8), 38.9)
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.core.transforms import CacheTransform
from models.llama import Llama


@functools.partial(jax.jit, static_argnames=("chunk",), donate_argnames=("cache",))
def _token_logprobs(model, tokens, positions, targets, cache, chunk):
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
                   *, chunk: int = 256, cache_dtype: Any = jnp.float32,
                   place_cache=None) -> jax.Array:
    """log p(targets[b, t] | tokens[b, :t+1]) as [B, T] float32, in a fresh cache.

    Args:
      tokens, positions: [B, T] int32; negative positions mark padding.
      targets: [B, T] int32, usually `tokens` shifted left by one.
      chunk: tokens per forward call; T is padded up to a multiple on the left.
      place_cache: puts the fresh cache on devices (`models.sharding.cache_placer(mesh)`),
        as `models.sampler.generate`'s does; None leaves it where it is made.
    """
    b, t = tokens.shape
    if positions.shape != (b, t) or targets.shape != (b, t):
        raise ValueError(f"tokens {tokens.shape}, positions {positions.shape} and targets "
                         f"{targets.shape} must have the same [B, T] shape")
    check_ids(model.config, tokens, positions)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    chunk = min(chunk, t)
    pad = -t % chunk
    left = lambda x, value: jnp.pad(jnp.asarray(x, jnp.int32), ((0, 0), (pad, 0)),
                                    constant_values=value)
    cache = kvjax.init_model_cache(model.config.cache_spec, b, t + pad, cache_dtype)
    if place_cache is not None:
        cache = place_cache(cache)
    lp, _ = _token_logprobs(model, left(tokens, 0), left(positions, kvjax.EMPTY),
                            left(targets, 0), cache, chunk)
    return lp[:, pad:]


def check_ids(cfg, tokens, positions=None) -> None:
    """ValueError for a token id outside the vocabulary or a position past the model's
    positions (JAX would clamp them silently). Skipped for traced arrays."""
    if isinstance(tokens, jax.core.Tracer) or isinstance(positions, jax.core.Tracer):
        return
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size}) (the model's vocabulary),"
                         f" got {tokens.min()}..{tokens.max()}")
    if positions is not None:
        positions = np.asarray(positions)
        if positions.size and positions.max() >= cfg.max_position:
            raise ValueError(f"position {positions.max()} is past the model's "
                             f"{cfg.max_position} positions")


def continuation_logprobs(model: Llama, prefixes: Sequence[Sequence[int]],
                          continuations: Sequence[Sequence[int]], *,
                          transform: CacheTransform | None = None, chunk: int = 256,
                          cache_dtype: Any = jnp.float32, place_cache=None) -> list[np.ndarray]:
    """`log p(cont[b][j] | prefix[b], cont[b][:j])` with the prefix's cache compressed first.

    Each prefix is prefilled (batched, collecting what `transform` needs),
    compressed by `transform` and shrunk to its budget; the continuation is
    then fed on top of the compressed cache. The first continuation token is
    scored from the prefix's last logits. With `full()` this is ordinary
    teacher forcing of the continuation. `place_cache` places the prefix's
    fresh cache (as in `token_logprobs`).

    Returns:
      one float32 array of len(cont[b]) per sequence.

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> ids = list(range(3, 67))
        >>> lp = continuation_logprobs(model, [ids[:48]], [ids[48:]],
        ...                            transform=kvjax.snapkv(ratio=0.5, window=8))
        >>> [x.shape for x in lp], bool((lp[0] < 0).all())
        ([(16,)], True)
    """
    from models.sampler import prefill_and_compress

    if len(prefixes) != len(continuations) or any(len(c) == 0 for c in continuations):
        raise ValueError("need one non-empty continuation per prefix")
    pre = prefill_and_compress(model, prefixes, transform=transform,
                               room=_padded(continuations, chunk)[0].tokens.shape[1],
                               chunk=chunk, cache_dtype=cache_dtype, place_cache=place_cache)
    return score_continuations(model, pre, continuations, chunk=chunk)


def _padded(continuations, chunk):
    from models.sampler import pad_prompts

    chunk = min(chunk, max(len(c) for c in continuations))
    return pad_prompts([list(c) for c in continuations], chunk, 0), chunk


def score_continuations(model: Llama, pre, continuations: Sequence[Sequence[int]], *,
                        chunk: int = 256) -> list[np.ndarray]:
    """Teacher-forced log-probabilities of `continuations` fed on top of a prefilled
    (possibly compressed) batch `pre` (a `models.sampler.Prefilled`); its cache
    must have room for them. See `continuation_logprobs`."""
    if len(continuations) != len(pre.next_pos):
        raise ValueError(f"{len(continuations)} continuations for a batch of {len(pre.next_pos)}")
    padded, chunk = _padded(continuations, chunk)  # [B, W] left-padded
    end = int(np.max(np.asarray(pre.next_pos) + np.array([len(c) for c in continuations])))
    if end > model.config.max_position:
        raise ValueError(f"prefix plus continuation reach position {end - 1}, past the "
                         f"model's {model.config.max_position} positions")
    check_ids(model.config, padded.tokens)
    width = padded.tokens.shape[1]
    for i, layer in enumerate(pre.cache):
        if width > kvjax.free_tokens(layer):
            raise ValueError(f"{width} continuation tokens do not fit layer {i} of the cache")
    positions = np.where(padded.positions < 0, kvjax.EMPTY,
                         padded.positions + pre.next_pos[:, None]).astype(np.int32)
    targets = np.concatenate([padded.tokens[:, 1:], np.zeros((len(continuations), 1), np.int32)], 1)
    lp, _ = _token_logprobs(model, jnp.asarray(padded.tokens), jnp.asarray(positions),
                            jnp.asarray(targets), pre.cache, chunk)
    first = jax.nn.log_softmax(pre.logits, axis=-1)  # [B, V]: predicts each cont[b][0]
    lp, first = np.asarray(lp), np.asarray(first)
    out = []
    for b, cont in enumerate(continuations):
        n = len(cont)
        # token j > 0 of the continuation is predicted at padded column width - n + j - 1
        out.append(np.concatenate([[first[b, cont[0]]], lp[b, width - n:width - 1]]).astype(np.float32))
    return out
