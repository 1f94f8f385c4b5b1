"""Batched, jit-compiled prefill and generation over an explicit cache.

Jitted functions take the model itself, a pytree of its weights (flattening it
costs ~2 ms a call where `nnx.split` cost 12-24 ms, docs/DECISIONS.md), so
every call with the same shapes reuses one compiled executable. Prompts of
different lengths are left-padded to a common length (a multiple of the
prefill chunk); padding tokens get position `EMPTY`, so their slots stay
masked, and every real token keeps its own absolute position. Decoding runs as one
`lax.while_loop` that stops when every sequence has produced an end-of-sequence token or
`max_new_tokens` is reached; its carry is a `DecodeState` (named fields) and all its static
settings are one frozen, hashable `DecodeConfig` (`_decode(model, cache, start, config)`).

A cache transform runs after prefill and, optionally, every `compress_every`
decode steps; its `after_write` (a monitor's, say) sees every decode write. The knobs of
`generate`, `decode` and the prefill functions are the fields of `RunOptions`, given as
keywords.

Example:
    >>> from models.loading import load_model
    >>> model, tok = load_model("smollm2")                   # the real SmolLM2-135M
    >>> out = generate(model, [tok.encode("The capital of France is")], max_new_tokens=2)
    >>> tok.decode(out.tokens[0])
    ' Paris.'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.core.cache import EMPTY, Cache
from kvjax.core.stats import NO_STATS, StatsSpec
from kvjax.core.transforms import CacheTransform, full

from models.llama import Llama, windowed_layers  # noqa: F401  (re-exported)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter

    def __post_init__(self):
        finite = self.temperature >= 0 and self.temperature < float("inf")  # NaN fails too
        whole = isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0
        if not finite or not whole or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling settings {self}: need temperature >= 0, "
                             f"top_k >= 0, 0 < top_p <= 1")


GREEDY = Sampling()


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a run builds its cache and draws its tokens, besides what it generates: the keyword
    options of `generate`, `decode`, `prefill_and_compress` and `prefill_batch`, described
    (and defaulted) once here. Each function takes the ones it uses
    (`RunOptions.PREFILL`, `COMPRESS`, `DECODE`) and refuses the others with a TypeError.

    Example:
        >>> RunOptions(chunk=64).chunk, RunOptions().only(RunOptions.DECODE)["compress_every"]
        (64, 0)
    """

    sampling: Sampling = GREEDY  # how the next token is drawn
    compress_every: int = 0  # also run the transform every that many decode steps (0: never)
    seed: int = 0  # of the sampler's PRNG key
    eos_ids: Sequence[int] | None = None  # end tokens (None: the model's; (): none)
    pad_id: int = 0  # the token after a sequence's end
    capacity: int | None = None  # cache slots (default: padded prompt width plus room)
    shrink: bool = True  # cut a compressed cache to its kept tokens plus room
    chunk: int = 256  # prefill chunk in tokens
    cache_dtype: Any = jnp.float32
    place_cache: Callable[[Cache], Cache] | None = None  # puts the empty cache on devices
    impl: Any = "xla"  # attention implementation (`kvjax.attend`): "xla" or "pallas"

    PREFILL: ClassVar[tuple[str, ...]] = ("capacity", "chunk", "cache_dtype", "place_cache",
                                          "impl")
    COMPRESS: ClassVar[tuple[str, ...]] = PREFILL + ("shrink",)
    SHRINK: ClassVar[tuple[str, ...]] = ("shrink", "impl")  # `compress`'s
    DECODE: ClassVar[tuple[str, ...]] = ("sampling", "compress_every", "seed", "eos_ids",
                                         "pad_id", "impl")

    def __post_init__(self):
        every = self.compress_every
        if not isinstance(every, (int, np.integer)) or every < 0:
            raise ValueError(f"compress_every must be an int >= 0 (0 = only after prefill), got "
                             f"{every!r}")

    @classmethod
    def taking(cls, options: dict, names: tuple[str, ...], where: str) -> "RunOptions":
        """`RunOptions(**options)`, a TypeError naming an option `where` does not take."""
        extra = sorted(set(options) - set(names))
        if extra:
            raise TypeError(f"{where}() got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, extra))}; its options are "
                            f"{', '.join(names)} (models.sampler.RunOptions)")
        return cls(**options)

    def only(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The options `names` as keyword arguments (for the next function down)."""
        return {name: getattr(self, name) for name in names}


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


def _prefill_chunk(model: Llama, chunk: int, prompts: Sequence[Sequence[int]]) -> int:
    """The chunk a prefill runs: at most the longest prompt; the whole prompt in one call for a
    LongRoPE model, whose factors are chosen per call by its largest position (transformers'
    rule: a prompt past `original_max_position` is rotated with the long factors throughout,
    which chunks whose positions fit would not be)."""
    longest = max(len(p) for p in prompts)
    scaling = getattr(model.config, "rope_scaling", None)  # an own decoder's config may lack it
    return longest if getattr(scaling, "rope_type", None) == "longrope" else min(chunk, longest)


def _padded_width(prompts: Sequence[Sequence[int]], chunk: int) -> int:
    """The width `pad_prompts` gives `prompts` with the chunk `generate` uses for them."""
    longest = max(len(p) for p in prompts)
    chunk = min(chunk, longest)
    return -(-longest // chunk) * chunk


class PaddedPrompts(NamedTuple):
    tokens: np.ndarray  # [B, P] int32, left-padded
    positions: np.ndarray  # [B, P] int32, EMPTY on padding
    lengths: np.ndarray  # [B] int32 real prompt lengths


def pad_prompts(prompts: Sequence[Sequence[int]], multiple: int, pad_id: int = 0) -> PaddedPrompts:
    """Left-pad token lists to a common length that is a multiple of `multiple`.

    Ids must be integers (a float id is a TypeError, never truncated; a str prompt too).
    """
    from kvjax.tools.chat import token_id_lists

    if not isinstance(prompts, (str, bytes)) and prompts is not None and not len(prompts):
        raise ValueError("every prompt needs at least one token")
    prompts = token_id_lists(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = -(-int(lengths.max()) // multiple) * multiple
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    positions = np.full((len(prompts), width), EMPTY, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
        positions[i, width - len(p):] = np.arange(len(p))
    return PaddedPrompts(tokens, positions, lengths)


def for_full_layers(model: Llama, transform: CacheTransform) -> CacheTransform:
    """`transform` on the model's full-attention layers only (`kvjax.on_layers`); a model
    whose every layer is windowed (Mistral or Phi-3 with a sliding window) keeps its
    window caches as they are (`full`). The transform sees the full-attention layers as its
    whole cache, so on such a model a method's `layers=` counts them from 0 (Gemma 3 1B:
    `layers=0-3` are its four global layers)."""
    windowed = windowed_layers(model)
    if not windowed or transform is full():
        return transform
    rest = [i for i in range(model.config.num_layers) if i not in windowed]
    return kvjax.on_layers(transform, rest) if rest else full()


def _room_checked(model: Llama, cache: Cache):
    """(index, layer) of the layers whose free tokens bound a write (not the windowed)."""
    windowed = windowed_layers(model)
    return [(i, layer) for i, layer in enumerate(cache) if i not in windowed]


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Everything static about one prefill: `_prefill`'s one static argument (frozen and
    hashable: equal configs share one compiled program)."""

    chunk: int  # tokens per forward call; the prompt width is a multiple of it
    stats: StatsSpec = NO_STATS  # what the model collects for a transform
    impl: Any = "xla"  # attention implementation (`kvjax.attend`)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _prefill(model, tokens, positions, cache, stats, config: PrefillConfig):
    """(logits [B, V] of the last token, cache, stats): `tokens` [B, P] run `config.chunk`
    at a time under one `lax.scan`."""
    b, width = tokens.shape
    chunk = config.chunk
    chunks = lambda x: x.reshape(b, width // chunk, chunk).swapaxes(0, 1)  # [N, B, chunk]

    def step(carry, xs):
        h, cache, stats = model.forward(*xs, *carry, config.stats, impl=config.impl)
        return (cache, stats), h[:, -1]

    (cache, stats), last = jax.lax.scan(step, (cache, stats), (chunks(tokens), chunks(positions)))
    return model.logits(last[-1]), cache, stats


def prefill(model: Llama, tokens: jax.Array, positions: jax.Array, cache: Cache,
            chunk: int = 256, impl: str = "xla") -> tuple[jax.Array, Cache]:
    """Run a left-padded prompt batch through the model in chunks of `chunk` tokens.

    Args:
      tokens, positions: [B, P] int32 with P a multiple of `chunk` (see `pad_prompts`).
      cache: the model cache; it is donated (do not reuse the argument).
      impl: attention implementation (`kvjax.attend`): "xla" or "pallas".
    Returns:
      logits [B, V] float32 of each sequence's last prompt token, and the cache.
    """
    b, width = tokens.shape
    if width % chunk:
        raise ValueError(f"prompt width {width} is not a multiple of the chunk size {chunk}")
    kvjax.check_cache(cache, model.config.cache_spec, b)
    for _, layer in _room_checked(model, cache)[:1]:
        if width > kvjax.free_tokens(layer):
            raise ValueError(f"prompt of {width} padded tokens does not fit the cache "
                             f"({kvjax.free_tokens(layer)} tokens free)")
    logits, cache, _ = _prefill(model, jnp.asarray(tokens), jnp.asarray(positions), cache, None,
                                PrefillConfig(chunk, impl=impl))
    return logits, cache


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Everything static about one decode loop: `_decode`'s one static argument (frozen and
    hashable: equal configs share one compiled program).

    Example:
        >>> DecodeConfig(4) == DecodeConfig(4), hash(DecodeConfig(4)) == hash(DecodeConfig(4))
        (True, True)
    """

    max_new_tokens: int  # tokens drawn per sequence, the first (from the prefill) included
    sampling: Sampling = GREEDY
    eos_ids: tuple[int, ...] = ()  # a sequence stops at any of them (none: runs to the end)
    pad_id: int = 0  # the token after a sequence's end
    impl: Any = "xla"  # attention implementation (`kvjax.attend`)
    compress_every: int = 0  # run `update` every that many steps (0: never)
    update: Callable | None = None  # the transform's update (None without compress_every)
    stats: StatsSpec = NO_STATS  # what the model collects for `update`
    after_write: Callable | None = None  # the transform's `after_write` (a monitor's)


class DecodeStart(NamedTuple):
    """What a decode loop starts from besides the cache (which `_decode` donates alone)."""

    logits: jax.Array  # [B, V] float32 at each sequence's last token
    transform_state: Any
    stats: Any  # per-layer statistics for `update` (None without compress_every)
    next_pos: jax.Array  # [B] int32 position of each sequence's next token
    key: jax.Array  # PRNG key of the sampler


class DecodeState(NamedTuple):
    """The decode loop's carry (`lax.while_loop`), as the `_SamplingState` of Flax's Gemma
    sampler: one named field per thing a step changes. The field order is the carry's
    flattening order."""

    step: jax.Array  # [] int32 tokens drawn so far (the column of the next one)
    token: jax.Array  # [B] int32 the last token drawn: the next step's input
    cache: Cache
    transform_state: Any
    stats: Any  # per-layer statistics (None without compress_every)
    positions: jax.Array  # [B] int32 position of `token`
    done: jax.Array  # [B] bool: the sequence drew an end token
    tokens: jax.Array  # [B, max_new_tokens] int32 drawn so far; pad_id elsewhere
    key: jax.Array  # PRNG key


def _draw(state: DecodeState, logits: jax.Array, column, config: DecodeConfig) -> DecodeState:
    """`state` with the next token drawn from `logits` [B, V] into `tokens[:, column]`
    (`pad_id` for a finished sequence)."""
    key, sub = jax.random.split(state.key)
    eos = jnp.asarray(config.eos_ids if config.eos_ids else (-1,), jnp.int32)
    token = jnp.where(state.done, config.pad_id, sample_tokens(logits, sub, config.sampling))
    return state._replace(token=token, key=key, done=state.done | jnp.isin(token, eos),
                          tokens=state.tokens.at[:, column].set(token))


def _running(state: DecodeState, config: DecodeConfig) -> jax.Array:
    """[] bool: some sequence is unfinished and tokens are left to draw."""
    return (state.step < config.max_new_tokens) & ~jnp.all(state.done)


def _keep(cache, tstate, stats):
    return cache, tstate


def _step(model: Llama, state: DecodeState, config: DecodeConfig) -> DecodeState:
    """One decode step: write `state.token` and attend (the model), let the transform watch
    the write, compress every `compress_every` steps, draw the next token."""
    h, cache, stats = model.forward(state.token[:, None], state.positions[:, None],
                                    state.cache, state.stats, config.stats, impl=config.impl)
    tstate = state.transform_state
    if config.after_write is not None:
        tstate = config.after_write(tstate, state.cache, cache)
    if config.compress_every:
        cache, tstate = jax.lax.cond(state.step % config.compress_every == 0, config.update,
                                     _keep, cache, tstate, stats)
    state = state._replace(cache=cache, transform_state=tstate, stats=stats)
    state = _draw(state, model.logits(h[:, 0]), state.step, config)
    return state._replace(step=state.step + 1, positions=state.positions + 1)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _decode(model: Llama, cache: Cache, start: DecodeStart,
            config: DecodeConfig) -> tuple[jax.Array, Cache, Any]:
    """(tokens [B, max_new_tokens] int32, cache, transform state) of one `lax.while_loop`
    over `_step`, starting with a token drawn from `start.logits`."""
    b = start.logits.shape[0]
    state = DecodeState(step=jnp.int32(1), token=None, cache=cache,
                        transform_state=start.transform_state, stats=start.stats,
                        positions=start.next_pos, done=jnp.zeros((b,), bool),
                        tokens=jnp.full((b, config.max_new_tokens), config.pad_id, jnp.int32),
                        key=start.key)
    state = _draw(state, start.logits, 0, config)
    state = jax.lax.while_loop(functools.partial(_running, config=config),
                               functools.partial(_step, model, config=config), state)
    return state.tokens, state.cache, state.transform_state


@functools.partial(jax.jit, static_argnames=("update",))
def _compress_stacked(update, cache: Cache, tstate,
                      stats) -> tuple[kvjax.core.layout.StackedLayers, Any]:
    """A transform update outside the decode loop (after prefill), compiled. The new cache
    comes back stacked by group of equal layers: per-layer outputs would cost the program a
    copy kernel per layer and leaf (DECISIONS "Compression compiles one layer body...").
    `cache` is not donated: no stacked output can take a layer's buffer (XLA would refuse the
    donation with a warning per call)."""
    cache, tstate = update(cache, tstate, stats)
    return kvjax.core.layout.stack_layers(cache), tstate


def _compress(update, cache: Cache, tstate, stats) -> tuple[Cache, Any]:
    """`update(cache, tstate, stats)`, compiled, as per-layer caches."""
    stacked, tstate = _compress_stacked(update, cache, tstate, stats)
    return kvjax.core.layout.unstack_layers(stacked), tstate


class Prefilled(NamedTuple):
    """A batch after prefill (and compression): what decoding continues from."""

    logits: jax.Array  # [B, V] float32 at each sequence's last token
    cache: Cache
    stats: Any  # per-layer statistics the transform asked for (or None)
    transform_state: Any
    next_pos: np.ndarray  # [B] int32 position of each sequence's next token


def _check_token_ids(tokens: np.ndarray, vocab_size: int) -> None:
    """ValueError for an id the embedding has no row for (JAX would clamp it silently)."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) (the model's vocabulary), "
                         f"got {tokens.min()}..{tokens.max()}")


def prefill_batch(model: Llama, prompts: Sequence[Sequence[int]], *,
                  stats: StatsSpec = NO_STATS, room: int = 0, **options) -> Prefilled:
    """Prefill `prompts` (left-padded, batched) into a fresh cache, collecting `stats`.

    The cache has `capacity` slots (default: padded prompt width + `room`).
    One prefill can serve several policies: collect the union of their
    `transform.stats` and `compress` it once per policy with `keep_input=True`.
    `options`: capacity, chunk, cache_dtype, place_cache, impl (`RunOptions`).
    """
    run = RunOptions.taking(options, RunOptions.PREFILL, "prefill_batch")
    args, lengths = prefill_inputs(model, prompts, stats=stats, room=room,
                                   **run.only(RunOptions.PREFILL))
    logits, cache, layer_stats = _prefill(model, *args)
    return Prefilled(logits, cache, layer_stats, None, lengths)


def prefill_inputs(model: Llama, prompts: Sequence[Sequence[int]], *,
                   stats: StatsSpec = NO_STATS, room: int = 0,
                   **options) -> tuple[tuple, np.ndarray]:
    """`prefill_batch`'s checked inputs: ((tokens, positions, cache, stats, PrefillConfig),
    prompt lengths [B]), the prompts left-padded to a multiple of the chunk actually used and
    an empty cache of `capacity` slots. `_prefill(model, *inputs)` runs them; their
    shapes are what a prefill compiles for (`experiments/bench/compile.py --compile-only`).
    `options`: capacity, chunk, cache_dtype, place_cache, impl (`RunOptions`)."""
    run = RunOptions.taking(options, RunOptions.PREFILL, "prefill_inputs")
    chunk, capacity = run.chunk, run.capacity
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    chunk = _prefill_chunk(model, chunk, prompts) if prompts else chunk
    padded = pad_prompts(prompts, chunk, 0)
    width = padded.tokens.shape[1]
    _check_token_ids(padded.tokens, model.config.vocab_size)
    if padded.lengths.max() > model.config.max_position:
        raise ValueError(f"a prompt of {padded.lengths.max()} tokens exceeds the model's "
                         f"{model.config.max_position} positions")
    capacity = width + room if capacity is None else capacity
    if width + room > capacity:
        raise ValueError(f"prompt ({padded.lengths.max()} tokens, {width} padded) plus {room} "
                         f"more tokens does not fit the cache capacity {capacity}")
    cache = kvjax.init_model_cache(model.config.cache_spec, len(prompts), capacity,
                                   run.cache_dtype, track_mass=stats.attention_mass)
    if run.place_cache is not None:
        cache = run.place_cache(cache)
    return ((jnp.asarray(padded.tokens), jnp.asarray(padded.positions), cache,
             model.init_stats(stats, cache), PrefillConfig(chunk, stats, run.impl)),
            padded.lengths)


def compress(pre: Prefilled, transform: CacheTransform, *, room: int = 0,
             keep_input: bool = False, max_write: int | None = None, **options) -> Prefilled:
    """Apply `transform`'s first update to a prefilled batch (prompt compression).

    With the `shrink` option (default; and a transform other than `full`), every layer is
    then cut to its kept slots plus room for `room` more tokens, so the cache really holds
    only the budget (`max_write`: the most tokens one later call adds, see `kvjax.shrink`),
    its capacities a multiple of the kernel's tile when the `impl` option is a compiled
    Pallas kernel (`kvjax.tile_slots`: read in place, not padded per call). A compression
    makes new arrays and leaves `pre.cache` as it was; `full` hands on `pre.cache` itself,
    which decoding then donates: `keep_input` gives it a copy instead, so `pre` can serve
    another policy. `options`: shrink, impl (`RunOptions`).
    """
    run = RunOptions.taking(options, RunOptions.SHRINK, "compress")
    cache = pre.cache
    tstate = transform.init(cache)
    if transform is full():
        cache = jax.tree_util.tree_map(jnp.copy, cache) if keep_input else cache
    else:
        stacked, tstate = _compress_stacked(transform.update, cache, tstate, pre.stats)
        cache = kvjax.shrink(stacked, room, max_write, kvjax.tile_slots(run.impl)) \
            if run.shrink else kvjax.core.layout.unstack_layers(stacked)
    return pre._replace(cache=cache, transform_state=tstate)


def prefill_and_compress(model: Llama, prompts: Sequence[Sequence[int]], *,
                         transform: CacheTransform | None = None, room: int = 0,
                         max_write: int | None = None, **options) -> Prefilled:
    """`prefill_batch` collecting what `transform` needs, then `compress`.

    `options`: capacity, chunk, cache_dtype, place_cache, impl, shrink (`RunOptions`).

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> ids = list(range(3, 67))                                     # 64 tokens
        >>> half = prefill_and_compress(model, [ids], transform=kvjax.snapkv(ratio=0.5), room=8)
        >>> full = prefill_and_compress(model, [ids], room=8)
        >>> kvjax.nbytes(half.cache), kvjax.nbytes(full.cache)   # 32 + 8 slots vs 64 + 8
        (21128, 38024)
    """
    run = RunOptions.taking(options, RunOptions.COMPRESS, "prefill_and_compress")
    transform = for_full_layers(model, transform or full())
    rec = transform.stats.reconstruction
    restore = None if rec is None else rec.restore  # RestoreKV's tokens, written before eviction
    try:
        pre = prefill_batch(model, prompts, stats=transform.stats,
                            room=room + (0 if restore is None else restore.n),
                            **run.only(RunOptions.PREFILL))
    except ValueError as e:
        if restore is None:
            raise
        raise ValueError(f"{e} (restorekv writes {restore.n} restore tokens after each prompt, "
                         f"counted in them)") from None
    if rec is not None:  # KVzip: its pass over the prefilled cache
        from models.reconstruction import reconstruct
        pre = pre._replace(stats=reconstruct(model, pre.cache, pre.stats, pre.next_pos, prompts,
                                             rec, run.impl))
    if restore is not None:
        from models.restorekv import restore_pass
        pre = pre._replace(cache=restore_pass(model, pre.cache, pre.next_pos, restore, run.impl),
                           next_pos=pre.next_pos + restore.n)
    out = compress(pre, transform, room=room, max_write=max_write,
                   **run.only(RunOptions.SHRINK))
    return out._replace(cache=keep_window_layers(model, out.cache, pre.cache))


def keep_window_layers(model: Llama, compressed: Cache, prefilled: Cache,
                       copy: bool = False) -> Cache:
    """`compressed` with the model's sliding-window layers as `prefilled` holds them: `shrink`
    cuts every layer, and a window layer's cache is its window, never compressed. `copy`
    gives them buffers of their own (decoding donates its cache; a prefill that serves
    another method must keep its own)."""
    windowed = windowed_layers(model)
    if not windowed or compressed is prefilled:
        return compressed
    take = (lambda layer: jax.tree_util.tree_map(jnp.copy, layer)) if copy else (lambda x: x)
    return tuple(take(prefilled[i]) if i in windowed else layer
                 for i, layer in enumerate(compressed))


def extend(model: Llama, pre: Prefilled, suffixes: Sequence[Sequence[int]], *,
           transform: CacheTransform | None = None, chunk: int = 256,
           impl: str = "xla") -> Prefilled:
    """Prefill more tokens of every sequence on top of its (compressed) cache.

    `suffixes[b]` continues sequence `b` at position `pre.next_pos[b]`. This is
    how a question meets a context compressed without it (query-agnostic).
    """
    spec = for_full_layers(model, transform or full()).stats
    if len(suffixes) != len(pre.next_pos):
        raise ValueError(f"{len(suffixes)} suffixes for a batch of {len(pre.next_pos)}")
    chunk = _prefill_chunk(model, chunk, suffixes)
    padded = pad_prompts(suffixes, chunk, 0)
    width = padded.tokens.shape[1]
    _check_token_ids(padded.tokens, model.config.vocab_size)
    if (pre.next_pos + padded.lengths).max() > model.config.max_position:
        raise ValueError(f"the extended sequences reach {(pre.next_pos + padded.lengths).max()}"
                         f" tokens, past the model's {model.config.max_position} positions")
    for i, layer in _room_checked(model, pre.cache):
        free = kvjax.free_tokens(layer)
        if width > free:
            raise ValueError(f"{width} more (padded) tokens do not fit layer {i}: {free} free "
                             f"tokens; leave room for them when prefilling")
    positions = np.where(padded.positions == EMPTY, EMPTY,
                         padded.positions + pre.next_pos[:, None]).astype(np.int32)
    logits, cache, stats = _prefill(model, jnp.asarray(padded.tokens),
                                    jnp.asarray(positions), pre.cache, pre.stats,
                                    PrefillConfig(chunk, spec, impl))
    return Prefilled(logits, cache, stats, pre.transform_state, pre.next_pos + padded.lengths)


class Generation(NamedTuple):
    tokens: np.ndarray  # [B, max_new_tokens] int32; pad_id after a sequence's end
    num_tokens: np.ndarray  # [B] int32 generated tokens per sequence, end token included
    cache: Cache  # the cache after generation
    transform_state: Any  # the cache transform's final state


def generate(model: Llama, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             transform: CacheTransform | None = None,
             contexts: Sequence[Sequence[int]] | None = None, **options) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (token-id lists), batched.

    `transform` (default: full cache) compresses the cache after prefill and,
    if `compress_every > 0`, every that many decode steps. With `contexts`,
    each context is prefilled and compressed first and its prompt appended
    after (query-agnostic compression, kvpress's protocol); without, the
    whole prompt is compressed, and a window-based policy sees the end of the
    prompt (query-aware when the prompt ends with the question).

    `options` are the fields of `RunOptions`: `sampling`, `compress_every`, `seed`, `eos_ids`,
    `pad_id` (how tokens are drawn), `capacity`, `shrink`, `chunk`, `cache_dtype`,
    `place_cache`, `impl` (how the cache is built). `shrink` cuts the compressed cache to its
    kept tokens plus the room the rest of the run needs. `capacity` (only without
    compression) defaults to the padded prompt width plus `max_new_tokens`.
    `place_cache` puts the empty cache on devices, e.g.
    `functools.partial(kvjax.shard_cache, mesh=mesh)`; jit follows its sharding.
    `impl="pallas"` runs attention in the Pallas kernels on TPU/GPU (`kvjax.attend`).
    """
    run = RunOptions.taking(options, tuple(f.name for f in dataclasses.fields(RunOptions)),
                            "generate")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    from kvjax.tools.chat import token_id_lists

    if not isinstance(prompts, (str, bytes)) and prompts is not None and not len(prompts):
        raise ValueError("every prompt needs at least one token")
    prompts = token_id_lists(prompts)  # TypeError for a str, None or float ids
    contexts = None if contexts is None else token_id_lists(contexts, "contexts")
    cfg = model.config
    transform = transform or full()
    first = prompts if contexts is None else contexts
    if contexts is not None and len(contexts) != len(prompts):
        raise ValueError(f"{len(contexts)} contexts for {len(prompts)} prompts")
    total = max(len(p) + (0 if contexts is None else len(c))
                for p, c in zip(prompts, contexts or [()] * len(prompts)))
    if total + max_new_tokens > cfg.max_position:
        raise ValueError(f"prompt plus new tokens exceed the model's context "
                         f"{cfg.max_position} tokens")
    suffix_room = 0 if contexts is None else _padded_width(prompts, run.chunk)
    pre = prefill_and_compress(model, first, transform=transform,
                               room=suffix_room + max_new_tokens,
                               max_write=max(suffix_room, 1), **run.only(RunOptions.COMPRESS))
    if contexts is not None:
        pre = extend(model, pre, prompts, transform=transform, chunk=run.chunk, impl=run.impl)
    return decode(model, pre, max_new_tokens=max_new_tokens, transform=transform,
                  **run.only(RunOptions.DECODE))


def decode(model: Llama, pre: Prefilled, *, max_new_tokens: int = 32,
           transform: CacheTransform | None = None, **options) -> Generation:
    """Generate from a prefilled (and possibly compressed) batch; see `generate`.

    The cache needs room for `max_new_tokens - 1` more tokens (the last token
    drawn is never written). Without `compress_every` the loop collects no
    statistics and compiles once per cache shape, whatever the transform.
    `options`: sampling, compress_every, seed, eos_ids, pad_id, impl (`RunOptions`).
    """
    run = RunOptions.taking(options, RunOptions.DECODE, "decode")
    transform = for_full_layers(model, transform or full())
    for i, layer in _room_checked(model, pre.cache):
        free = kvjax.free_tokens(layer)
        if max_new_tokens - 1 > free:
            raise ValueError(f"{max_new_tokens} new tokens do not fit layer {i} of the cache "
                             f"({free} free tokens)")
    eos_ids = tuple(model.config.eos_ids if run.eos_ids is None else run.eos_ids)
    config = DecodeConfig(max_new_tokens, run.sampling, eos_ids, run.pad_id, run.impl,
                          after_write=transform.after_write)
    stats = None
    if run.compress_every and transform.stats.reconstruction is not None:
        raise ValueError(f"compress_every={run.compress_every}: this method scores by a "
                         f"reconstruction pass after prefill (kvzip) and compresses the prompt "
                         f"only; use compress_every=0")
    if run.compress_every:
        config = dataclasses.replace(config, compress_every=run.compress_every,
                                     update=transform.update, stats=transform.stats)
        stats = pre.stats
    start = DecodeStart(pre.logits, pre.transform_state, stats, jnp.asarray(pre.next_pos),
                        jax.random.key(run.seed))
    out, cache, tstate = _decode(model, pre.cache, start, config)
    if not out.is_fully_addressable:  # a multi-process run: every process gets every row
        from jax.experimental import multihost_utils
        out = multihost_utils.process_allgather(out, tiled=True)
    out = np.asarray(out)
    return Generation(out, _num_generated(out, eos_ids, max_new_tokens), cache, tstate)


def _num_generated(out: np.ndarray, eos_ids: tuple[int, ...], max_new: int) -> np.ndarray:
    is_end = np.isin(out, eos_ids) if eos_ids else np.zeros_like(out, bool)
    first_end = np.where(is_end.any(1), is_end.argmax(1) + 1, max_new)
    return first_end.astype(np.int32)
