"""Cache transforms: pure functions of an explicit cache, in the optax pattern.

A `CacheTransform` is a pair of pure functions built by a factory that closes
over static hyperparameters:

    state = transform.init(cache)
    cache, state = transform.update(cache, state, stats)

`cache` is a model's whole cache (a tuple of per-layer `TokenCache`), `stats`
whatever statistics the decoder collected (None when a transform needs none).
Both functions must be jit-traceable and keep every shape static.

Example:
    >>> import kvjax
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=8)
    >>> t = chain(full(), full())
    >>> state = t.init(cache)
    >>> new_cache, state = t.update(cache, state, None)
    >>> new_cache is cache          # full() keeps every token: the very same cache
    True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

from kvjax.core.stats import NO_STATS, StatsSpec


class CacheTransform(NamedTuple):
    """`init(cache) -> state`; `update(cache, state, stats) -> (cache, state)`.

    `stats` declares what the model must collect for `update` (see
    `kvjax.core.stats`). Numeric hyperparameters that may change between runs (a
    compression ratio, a token budget) belong in the state that `init`
    builds, not in `update`'s closure: jitted code is keyed on `update` and
    `stats` only, so changing them does not recompile.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]
    stats: StatsSpec = NO_STATS
    after_write: Callable[[Any, Any, Any], Any] | None = None
    """`(state, cache_before, cache_after) -> state` after each decode step's own write (the
    model's, before any `update`), or None: nothing to watch. A decode loop calls it
    (`models.sampler`); the monitor measures there the error of the tokens a KIVI write
    flushed into its quantized body (`kvjax.tools.monitor.monitored`)."""


class EmptyState(NamedTuple):
    """The state of a transform that keeps none (`full`): a named pytree with no leaves.

    Example:
        >>> import jax
        >>> jax.tree_util.tree_leaves(full().init(None)), full().init(None)
        ([], EmptyState())
    """


def _keep_all(cache, state, stats=None):
    return cache, state


_FULL = CacheTransform(init=lambda cache: EmptyState(), update=_keep_all)


def full() -> CacheTransform:
    """The identity transform: keep every token at full precision.

    Always the same object, so jitted code keyed on it compiles once.
    """
    return _FULL


@dataclasses.dataclass(frozen=True)
class ChainedUpdate:
    """`chain`'s update: equal parts (compared by value) make an equal update, so jitted
    code keyed on it compiles once however often the chain is rebuilt."""

    updates: tuple[Callable, ...]

    def __call__(self, cache, state, stats=None):
        new_state = []
        for u, s in zip(self.updates, state):
            cache, s = u(cache, s, stats)
            new_state.append(s)
        return cache, tuple(new_state)


@dataclasses.dataclass(frozen=True)
class ChainedAfterWrite:
    """`chain`'s `after_write`: each part's own (None: that part watches nothing) on its
    own state."""

    after_writes: tuple[Callable | None, ...]

    def __call__(self, state, before, after):
        return tuple(s if f is None else f(s, before, after)
                     for f, s in zip(self.after_writes, state))


def chain(*transforms: CacheTransform) -> CacheTransform:
    """Apply `transforms` in order; the state is the tuple of their states."""
    inits = tuple(t.init for t in transforms)
    spec = functools.reduce(StatsSpec.merge, (t.stats for t in transforms), NO_STATS)
    watch = tuple(t.after_write for t in transforms)
    return CacheTransform(lambda cache: tuple(i(cache) for i in inits),
                          ChainedUpdate(tuple(t.update for t in transforms)), spec,
                          ChainedAfterWrite(watch) if any(watch) else None)


@dataclasses.dataclass(frozen=True)
class LayersUpdate:
    """`on_layers`'s update: `update` on the chosen layers, the others passed through."""

    update: Callable
    layers: tuple[int, ...]

    def __call__(self, cache, state, stats=None):
        layers = self.layers
        if max(layers) >= len(cache):
            raise ValueError(f"on_layers: layer {max(layers)} does not exist; the cache has "
                             f"{len(cache)} layers")
        pick = lambda xs: None if xs is None else tuple(xs[i] for i in layers)
        part, state = self.update(pick(cache), state, pick(stats))
        out = list(cache)
        for i, layer in zip(layers, part):
            out[i] = layer
        return tuple(out), state


@dataclasses.dataclass(frozen=True)
class LayersAfterWrite:
    """`on_layers`'s `after_write`: the inner one watching the chosen layers only (frozen,
    compared by value: a rebuilt `on_layers` keys jitted code the same)."""

    after_write: Callable
    layers: tuple[int, ...]

    def __call__(self, state, before, after):
        pick = lambda cache: tuple(cache[i] for i in self.layers)
        return self.after_write(state, pick(before), pick(after))


def on_layers(transform: CacheTransform, layers: Sequence[int]) -> CacheTransform:
    """Apply `transform` to the given layers only; the others pass through.

    The per-layer combinator: a different policy for different layers is a
    `chain` of `on_layers`. The inner transform sees the chosen layers as its
    whole cache (a per-layer budget schedule counts them from 0).

    Example:
        >>> from kvjax import snapkv, streaming_llm
        >>> t = chain(on_layers(snapkv(ratio=0.5), range(0, 15)),
        ...           on_layers(streaming_llm(ratio=0.5), range(15, 30)))
        >>> t.stats.window      # the chain collects what snapkv needs: its 64 latest queries
        64
    """
    layers = tuple(sorted(set(int(i) for i in layers)))
    if not layers or layers[0] < 0:
        raise ValueError(f"on_layers: need non-negative layer indices, got {layers}")
    init = transform.init

    def init_some(cache):
        if layers[-1] >= len(cache):
            raise ValueError(f"on_layers: layer {layers[-1]} does not exist; the cache has "
                             f"{len(cache)} layers, 0-{len(cache) - 1}")
        return init(tuple(cache[i] for i in layers))
    after_write = None if transform.after_write is None else \
        LayersAfterWrite(transform.after_write, layers)
    return CacheTransform(init_some, LayersUpdate(transform.update, layers), transform.stats,
                          after_write)
