"""Batched, jit-compiled prefill and generation over an explicit cache.

The model is split once (`nnx.split`); jitted functions take `(graphdef,
state, ...)` and merge inside, so every call with the same shapes reuses one
compiled executable. Prompts of different lengths are left-padded to a common
length (a multiple of the prefill chunk); padding tokens get position `EMPTY`,
so their slots stay masked, and every real token keeps its own absolute
position. Decoding runs as one `lax.while_loop` that stops when every
sequence has produced an end-of-sequence token or `max_new_tokens` is reached.

A cache transform runs after prefill and, optionally, every `compress_every`
decode steps.

Example:
    >>> model, tok = load_model("smollm2")
    >>> out = generate(model, [tok.encode("The capital of France is")], max_new_tokens=8)
    >>> tok.decode(out.tokens[0])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.cache import EMPTY, Cache
from kvjax.transforms import CacheTransform, full

from models.llama import Llama


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling settings {self}: need temperature >= 0, "
                             f"top_k >= 0, 0 < top_p <= 1")


GREEDY = Sampling()


def sample_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] float32 -> [B] int32 tokens."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    neg = jnp.finfo(logits.dtype).min
    if sampling.top_k:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # drop a token when the tokens ranked above it already cover top_p
        drop_sorted = (jnp.cumsum(probs, axis=-1) - probs) >= sampling.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, neg, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class PaddedPrompts(NamedTuple):
    tokens: np.ndarray  # [B, P] int32, left-padded
    positions: np.ndarray  # [B, P] int32, EMPTY on padding
    lengths: np.ndarray  # [B] int32 real prompt lengths


def pad_prompts(prompts: Sequence[Sequence[int]], multiple: int, pad_id: int = 0) -> PaddedPrompts:
    """Left-pad token lists to a common length that is a multiple of `multiple`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = -(-int(lengths.max()) // multiple) * multiple
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    positions = np.full((len(prompts), width), EMPTY, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
        positions[i, width - len(p):] = np.arange(len(p))
    return PaddedPrompts(tokens, positions, lengths)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"), donate_argnames=("cache",))
def _prefill(graphdef, state, tokens, positions, cache, chunk):
    model = nnx.merge(graphdef, state)
    b, width = tokens.shape
    chunks = lambda x: x.reshape(b, width // chunk, chunk).swapaxes(0, 1)  # [N, B, chunk]

    def step(cache, xs):
        h, cache = model.hidden(*xs, cache)
        return cache, h[:, -1]

    cache, last = jax.lax.scan(step, cache, (chunks(tokens), chunks(positions)))
    return model.logits(last[-1]), cache


def prefill(model: Llama, tokens: jax.Array, positions: jax.Array, cache: Cache,
            chunk: int = 256) -> tuple[jax.Array, Cache]:
    """Run a left-padded prompt batch through the model in chunks of `chunk` tokens.

    Args:
      tokens, positions: [B, P] int32 with P a multiple of `chunk` (see `pad_prompts`).
      cache: the model cache; it is donated (do not reuse the argument).
    Returns:
      logits [B, V] float32 of each sequence's last prompt token, and the cache.
    """
    b, width = tokens.shape
    if width % chunk:
        raise ValueError(f"prompt width {width} is not a multiple of the chunk size {chunk}")
    kvjax.check_cache(cache, model.config.cache_spec, b)
    if width > cache[0].capacity:
        raise ValueError(f"prompt of {width} padded tokens does not fit the cache capacity "
                         f"{cache[0].capacity}")
    graphdef, state = nnx.split(model)
    return _prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), cache, chunk)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "sampling", "transform",
                                             "every", "eos_ids", "pad_id"),
                   donate_argnames=("cache",))
def _decode(graphdef, state, logits, cache, tstate, next_pos, key, max_new, sampling,
            transform, every, eos_ids, pad_id):
    model = nnx.merge(graphdef, state)
    b = logits.shape[0]
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def emit(step, logits, key, done, out):
        key, sub = jax.random.split(key)
        token = jnp.where(done, pad_id, sample_tokens(logits, sub, sampling))
        return token, key, done | jnp.isin(token, eos), out.at[:, step].set(token)

    out = jnp.full((b, max_new), pad_id, jnp.int32)
    token, key, done, out = emit(0, logits, key, jnp.zeros((b,), bool), out)

    def cond(carry):
        step, _, _, _, _, done, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, token, cache, tstate, pos, done, out, key = carry
        logits, cache = model(token[:, None], pos[:, None], cache)
        if every:
            cache, tstate = jax.lax.cond(step % every == 0, transform.update,
                                         lambda c, s, _: (c, s), cache, tstate, None)
        token, key, done, out = emit(step, logits[:, 0], key, done, out)
        return step + 1, token, cache, tstate, pos + 1, done, out, key

    carry = (jnp.int32(1), token, cache, tstate, next_pos, done, out, key)
    _, _, cache, tstate, _, done, out, _ = jax.lax.while_loop(cond, body, carry)
    return out, cache, tstate


@functools.partial(jax.jit, static_argnames=("transform",), donate_argnames=("cache",))
def _compress(transform: CacheTransform, cache: Cache) -> tuple[Cache, Any]:
    """The transform's first update, right after prefill, compiled."""
    return transform.update(cache, transform.init(cache), None)


class Generation(NamedTuple):
    tokens: np.ndarray  # [B, max_new_tokens] int32; pad_id after a sequence's end
    num_tokens: np.ndarray  # [B] int32 generated tokens per sequence, end token included
    cache: Cache  # the cache after generation
    transform_state: Any  # the cache transform's final state


def generate(model: Llama, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             sampling: Sampling = GREEDY, transform: CacheTransform | None = None,
             compress_every: int = 0, capacity: int | None = None, chunk: int = 256,
             seed: int = 0, eos_ids: Sequence[int] | None = None, pad_id: int = 0,
             cache_dtype: Any = jnp.float32,
             place_cache: Callable[[Cache], Cache] | None = None) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (token-id lists), batched.

    `transform` (default: full cache) compresses the cache after prefill and,
    if `compress_every > 0`, every that many decode steps. `capacity`
    defaults to the padded prompt width plus `max_new_tokens`.
    `place_cache` puts the empty cache on devices, e.g.
    `functools.partial(kvjax.shard_cache, mesh=mesh)`; jit follows its sharding.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cfg = model.config
    chunk = min(chunk, max(len(p) for p in prompts)) if prompts else chunk
    padded = pad_prompts(prompts, chunk, pad_id)
    width = padded.tokens.shape[1]
    capacity = width + max_new_tokens if capacity is None else capacity
    if width + max_new_tokens > capacity:
        raise ValueError(f"prompt ({padded.lengths.max()} tokens, {width} padded) plus "
                         f"{max_new_tokens} new tokens does not fit the cache capacity {capacity}")
    if int(padded.lengths.max()) + max_new_tokens > cfg.max_position:
        raise ValueError(f"prompt plus new tokens exceed the model's context "
                         f"{cfg.max_position} tokens")
    transform = transform or full()
    eos_ids = tuple(cfg.eos_ids if eos_ids is None else eos_ids)
    cache = kvjax.init_model_cache(cfg.cache_spec, len(prompts), capacity, cache_dtype)
    if place_cache is not None:
        cache = place_cache(cache)
    graphdef, state = nnx.split(model)  # once for prefill and decode
    logits, cache = _prefill(graphdef, state, jnp.asarray(padded.tokens),
                             jnp.asarray(padded.positions), cache, chunk)
    cache, tstate = _compress(transform, cache)
    out, cache, tstate = _decode(graphdef, state, logits, cache, tstate,
                                 jnp.asarray(padded.lengths), jax.random.key(seed),
                                 max_new_tokens, sampling, transform, compress_every, eos_ids,
                                 pad_id)
    out = np.asarray(out)
    return Generation(out, _num_generated(out, eos_ids, max_new_tokens), cache, tstate)


def _num_generated(out: np.ndarray, eos_ids: tuple[int, ...], max_new: int) -> np.ndarray:
    is_end = np.isin(out, eos_ids) if eos_ids else np.zeros_like(out, bool)
    first_end = np.where(is_end.any(1), is_end.argmax(1) + 1, max_new)
    return first_end.astype(np.int32)
