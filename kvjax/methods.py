"""Parse method specs such as ``"full"`` or ``"snapkv:ratio=0.5+kivi:bits=2"``.

A spec is one or more `NAME[:key=value,...]` parts joined by ``+``; each part
names a registered transform factory and its keyword arguments; the parts
are chained in order. Every part also accepts ``layers=A-B`` (inclusive) or
``layers=A;B;C``: the transform then acts on those layers only, so
``snapkv:ratio=0.5,layers=0-14+knorm:ratio=0.5,layers=15-29`` gives each half
of the model its own policy. Parsing the same spec twice returns the same
`CacheTransform` object, so jitted code keyed on it does not recompile.

Example:
    >>> parse_method("full")
    CacheTransform(init=..., update=...)
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from kvjax import codecs, eviction
from kvjax.low_rank import LowRankBasis, low_rank
from kvjax.transforms import CacheTransform, chain, full, on_layers


def _low_rank_from_file(rank: int, basis: str, key_rank: int | None = None,
                        value_rank: int | None = None) -> CacheTransform:
    """`low_rank` with its basis read from an .npz file (`kvjax calibrate --out FILE`)."""
    return low_rank(LowRankBasis.load(basis), rank, key_rank, value_rank)


METHODS: dict[str, Callable[..., CacheTransform]] = {
    "full": full,
    "streaming_llm": eviction.streaming_llm,
    "sliding_window": eviction.sliding_window,
    "snapkv": eviction.snapkv,
    "pyramidkv": eviction.pyramidkv,
    "tova": eviction.tova,
    "h2o": eviction.h2o,
    "knorm": eviction.knorm,
    "random": eviction.random,
    "expected_attention": eviction.expected_attention,
    "quantize": codecs.quantize,
    "kivi": codecs.kivi,
    "fp8": codecs.fp8,
    "low_rank": _low_rank_from_file,
}
"""Registered method factories by CLI name; extended by `register_method`."""

from kvjax import recurrent  # noqa: E402  (after METHODS: registers itself below)


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


def split_part(part: str) -> tuple[str, dict]:
    """"snapkv:ratio=0.5,window=32" -> ("snapkv", {"ratio": 0.5, "window": 32})."""
    name, _, args = part.partition(":")
    name = name.strip()
    kwargs = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"method {name!r}: argument {item!r} is not key=value")
        kwargs[key.strip()] = _parse_value(value.strip())
    return name, kwargs


def _parse_part(part: str) -> CacheTransform:
    name, kwargs = split_part(part)
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    layers = kwargs.pop("layers", None)
    if layers is not None and "layers" in inspect.signature(METHODS[name]).parameters:
        kwargs["layers"], layers = tuple(_parse_layers(str(layers))), None  # absolute indices
    try:
        transform = METHODS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"method {name!r}: bad arguments {kwargs}: {e}") from None
    return transform if layers is None else on_layers(transform, _parse_layers(str(layers)))


def _parse_layers(text: str) -> list[int]:
    """"3-5" -> [3, 4, 5]; "0;2;7" -> [0, 2, 7]."""
    try:
        if "-" in text:
            first, last = (int(x) for x in text.split("-"))
            return list(range(first, last + 1))
        return [int(x) for x in text.split(";")]
    except ValueError:
        raise ValueError(f"layers={text!r}: expected A-B or A;B;C") from None


@functools.lru_cache(maxsize=None)
def parse_method(spec: str) -> CacheTransform:
    """The `CacheTransform` a spec string describes (see module docstring)."""
    parts = [p for p in spec.split("+") if p.strip()]
    if not parts:
        raise ValueError("empty method spec")
    transforms = []
    for part in parts:
        t = _parse_part(part)
        if hasattr(t, "wrap"):  # fold: wraps the parts before it (kvjax.recurrent.Fold)
            if not transforms:
                raise ValueError(f"method part {part!r} folds what the parts before it evict; "
                                 f"put an eviction policy first, e.g. 'snapkv:ratio=0.75+{part}'")
            t = t.wrap(transforms[0] if len(transforms) == 1 else chain(*transforms))
            transforms = []
        transforms.append(t)
    return transforms[0] if len(transforms) == 1 else chain(*transforms)


register_method("linear_state", recurrent.linear_state)
register_method("fold", recurrent.fold)
