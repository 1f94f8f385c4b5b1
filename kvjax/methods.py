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

import difflib
import functools
import inspect
from pathlib import Path
from typing import Callable

from kvjax import codecs, eviction
from kvjax.low_rank import LowRankBasis, low_rank
from kvjax.transforms import CacheTransform, chain, full, on_layers


def _low_rank_from_file(rank: int, basis: str, key_rank: int | None = None,
                        value_rank: int | None = None) -> CacheTransform:
    """`low_rank` with its basis read from an .npz file (`kvjax calibrate --out FILE`)."""
    if Path(str(basis)).is_dir():
        raise ValueError(f"low_rank: basis={basis} is a directory; pass the .npz file that "
                         f"`kvjax calibrate --out FILE` wrote")
    try:
        loaded = LowRankBasis.load(basis)
    except FileNotFoundError:
        raise
    except Exception as e:  # numpy and zipfile errors on a file that is not a basis
        raise ValueError(f"low_rank: basis={basis} is not a basis written by `kvjax calibrate` "
                         f"({type(e).__name__}: {e})") from None
    return low_rank(loaded, rank, key_rank, value_rank)


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


PLUGINS_ENV = "KVJAX_PLUGINS"
_loaded_plugins: set[str] = set()


def load_plugins(spec: str | None = None) -> None:
    """Import the plugin files or modules in `spec` (default `$KVJAX_PLUGINS`), once each.

    `spec` is `os.pathsep`-separated: `.py` files or importable module names
    whose import calls `register_method`. `parse_method` calls this when it
    meets an unknown name, so the command line and every `kvjax eval` worker
    (which inherit the environment) find methods defined outside kvjax.
    """
    import importlib
    import importlib.util
    import os
    import sys

    for item in filter(None, (spec if spec is not None else
                              os.environ.get(PLUGINS_ENV, "")).split(os.pathsep)):
        if item in _loaded_plugins:
            continue
        if item.endswith(".py"):
            path = Path(item).expanduser()
            if not path.is_file():
                raise ValueError(f"{PLUGINS_ENV}: plugin file {item} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules.setdefault(path.stem, module)
            module_spec.loader.exec_module(module)
        else:
            try:
                importlib.import_module(item)
            except ImportError as e:
                raise ValueError(f"{PLUGINS_ENV}: cannot import plugin module {item!r} "
                                 f"({e})") from None
        _loaded_plugins.add(item)


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
        if key.strip() in kwargs:
            raise ValueError(f"method {name!r}: argument {key.strip()!r} is given twice")
        kwargs[key.strip()] = _parse_value(value.strip())
    return name, kwargs


def did_you_mean(word: str, choices) -> str:
    """" (did you mean 'x'?)" for the closest of `choices`, or ""."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keywords(name: str, factory: Callable, kwargs: dict) -> None:
    """ValueError naming an argument the factory does not take (with a did-you-mean)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    known = [k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    if len(known) < len(params):  # **options: a scored policy passes them to scored_policy
        known += [k for k in inspect.signature(eviction.scored_policy).parameters
                  if k not in ("name", "scorer", "stats")]
        known = list(dict.fromkeys(known))
    for key in kwargs:
        if key not in known:
            raise ValueError(f"method {name!r}: bad arguments: unknown argument {key!r}"
                             f"{did_you_mean(key, known)}; it takes "
                             f"{', '.join(known) or 'no arguments'} (and layers)")


def _parse_part(part: str) -> CacheTransform:
    name, kwargs = split_part(part)
    if name not in METHODS:
        load_plugins()
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}{did_you_mean(name, METHODS)}; "
                         f"available: {', '.join(sorted(METHODS))}")
    layers = kwargs.pop("layers", None)
    if layers is not None and "layers" in inspect.signature(METHODS[name]).parameters:
        kwargs["layers"], layers = tuple(_parse_layers(str(layers))), None  # absolute indices
    _check_keywords(name, METHODS[name], kwargs)
    try:
        transform = METHODS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"method {name!r}: bad arguments {kwargs}: {e}") from None
    return transform if layers is None else on_layers(transform, _parse_layers(str(layers)))


def _parse_layers(text: str) -> list[int]:
    """"3-5" -> [3, 4, 5]; "0;2;7" -> [0, 2, 7]; ValueError for negative or reversed ranges."""
    try:
        if "-" in text:
            first, last = (int(x) for x in text.split("-"))
            layers = list(range(first, last + 1))
        else:
            layers = [int(x) for x in text.split(";")]
    except ValueError:
        raise ValueError(f"layers={text!r}: expected A-B or A;B;C with layer indices >= 0") \
            from None
    if not layers or min(layers) < 0:
        raise ValueError(f"layers={text!r}: expected A-B (A <= B) or A;B;C with layer "
                         f"indices >= 0")
    return layers


def method_layers(spec: str) -> list[tuple[str, list[int]]]:
    """(part name, layers it names) for every part of `spec` with a `layers=` argument."""
    out = []
    for part in (p for p in spec.split("+") if p.strip()):
        name, kwargs = split_part(part)
        if "layers" in kwargs:
            out.append((name, _parse_layers(str(kwargs["layers"]))))
    return out


def check_method(spec: str, num_layers: int) -> CacheTransform:
    """`parse_method(spec)`, also checking every `layers=` against a model of `num_layers`.

    Example:
        >>> check_method("snapkv:ratio=0.5,layers=0-99", 30)
        Traceback (most recent call last):
        ...
        ValueError: method 'snapkv': layers names layer 99; the model has 30 layers, 0-29
    """
    transform = parse_method(spec)
    for name, layers in method_layers(spec):
        if max(layers) >= num_layers:
            raise ValueError(f"method {name!r}: layers names layer {max(layers)}; the model "
                             f"has {num_layers} layers, 0-{num_layers - 1}")
    return transform


def parse_method(spec: str) -> CacheTransform:
    """The `CacheTransform` a spec string describes (see module docstring).

    Policies built under `kvjax.debug_checks()` check their scores
    for NaN; the flag is part of the cache key.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a method spec is a string such as 'snapkv:ratio=0.5', got {spec!r}")
    return _parse_method(spec, eviction.debug_checks_enabled())


@functools.lru_cache(maxsize=None)
def _parse_method(spec: str, debug: bool) -> CacheTransform:
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
