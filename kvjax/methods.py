"""Parse method specs such as ``"full"`` or ``"snapkv:ratio=0.5+kivi:bits=2"``.

A spec is one or more `NAME[:key=value,...]` parts joined by ``+``; each part
names a registered transform factory and its keyword arguments; the parts
are chained in order. Parsing the same spec twice returns the same
`CacheTransform` object, so jitted code keyed on it does not recompile.

Example:
    >>> parse_method("full")
    CacheTransform(init=..., update=...)
"""

from __future__ import annotations

import functools
from typing import Callable

from kvjax.eviction import sliding_window, streaming_llm
from kvjax.transforms import CacheTransform, chain, full

METHODS: dict[str, Callable[..., CacheTransform]] = {
    "full": full, "streaming_llm": streaming_llm, "sliding_window": sliding_window}
"""Registered method factories by CLI name; extended by `register_method`."""


def register_method(name: str, factory: Callable[..., CacheTransform]) -> None:
    """Make `factory` available to `parse_method` under `name`."""
    METHODS[name] = factory


def _parse_value(text: str) -> int | float | bool | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _parse_part(part: str) -> CacheTransform:
    name, _, args = part.partition(":")
    name = name.strip()
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    kwargs = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"method {name!r}: argument {item!r} is not key=value")
        kwargs[key.strip()] = _parse_value(value.strip())
    try:
        return METHODS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"method {name!r}: bad arguments {kwargs}: {e}") from None


@functools.lru_cache(maxsize=None)
def parse_method(spec: str) -> CacheTransform:
    """The `CacheTransform` a spec string describes (see module docstring)."""
    parts = [p for p in spec.split("+") if p.strip()]
    if not parts:
        raise ValueError("empty method spec")
    transforms = [_parse_part(p) for p in parts]
    return transforms[0] if len(transforms) == 1 else chain(*transforms)
