"""Cache transforms: pure functions of an explicit cache, in the optax pattern.

A `CacheTransform` is a pair of pure functions built by a factory that closes
over static hyperparameters:

    state = transform.init(cache)
    cache, state = transform.update(cache, state, stats)

`cache` is a model's whole cache (a tuple of per-layer `TokenCache`), `stats`
whatever statistics the decoder collected (None when a transform needs none).
Both functions must be jit-traceable and keep every shape static.

Example:
    >>> t = chain(full(), full())
    >>> state = t.init(cache)
    >>> new_cache, state = t.update(cache, state, None)   # new_cache is cache
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class CacheTransform(NamedTuple):
    """`init(cache) -> state`; `update(cache, state, stats) -> (cache, state)`."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


def _keep_all(cache, state, stats=None):
    return cache, state


_FULL = CacheTransform(init=lambda cache: (), update=_keep_all)


def full() -> CacheTransform:
    """The identity transform: keep every token at full precision.

    Always the same object, so jitted code keyed on it compiles once.
    """
    return _FULL


def chain(*transforms: CacheTransform) -> CacheTransform:
    """Apply `transforms` in order; the state is the tuple of their states."""

    def init(cache):
        return tuple(t.init(cache) for t in transforms)

    def update(cache, state, stats=None):
        new_state = []
        for t, s in zip(transforms, state):
            cache, s = t.update(cache, s, stats)
            new_state.append(s)
        return cache, tuple(new_state)

    return CacheTransform(init, update)
