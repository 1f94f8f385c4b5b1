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
import os
import re
from pathlib import Path
from typing import Callable, NamedTuple

from kvjax.policies import (codecs, eviction, eviction_compactor, eviction_geometry,
                            eviction_wrappers)
from kvjax.policies.low_rank import LowRankBasis, low_rank
from kvjax.policies import eviction_cap, eviction_critical, eviction_simlayer, eviction_think
from kvjax.policies import eviction_entropy_chunk
from kvjax.policies import eviction_cam
from kvjax.policies import eviction_duo
from kvjax.policies import eviction_fastkvzip
from kvjax.policies import eviction_finch
from kvjax.policies import eviction_kvzap
from kvjax.policies import eviction_kvzip
from kvjax.policies import eviction_lukv
from kvjax.policies import eviction_compose
from kvjax.policies import eviction_merging
from kvjax.policies import eviction_restorekv
from kvjax.policies import decoding
from kvjax.core.transforms import CacheTransform, chain, full, on_layers


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


def _inner_by_name(wrapper: Callable[..., CacheTransform]) -> Callable[..., CacheTransform]:
    """`wrapper` taking its `inner` method by registered name, as a spec string gives it."""

    @functools.wraps(wrapper)
    def factory(*args, inner=None, **kwargs):
        if inner is not None:
            if not isinstance(inner, str) or inner not in METHODS:
                raise ValueError(f"{wrapper.__name__}: inner={inner!r} is not a registered "
                                 f"method{did_you_mean(str(inner), METHODS)}; give a scored "
                                 f"policy such as inner=keydiff")
            kwargs["inner"] = METHODS[inner]
        return wrapper(*args, **kwargs)

    return factory


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
    "keydiff": eviction_geometry.keydiff,
    "lagkv": eviction_geometry.lagkv,
    "cur": eviction_geometry.cur,
    "leverage": eviction_compactor.leverage,
    "non_causal_attn": eviction_compactor.non_causal_attn,
    "compactor": eviction_compactor.compactor,
    "critical": _inner_by_name(eviction_critical.critical),
    "critical_ada": _inner_by_name(eviction_critical.critical_ada),
    "simlayerkv": eviction_simlayer.simlayerkv,
    "think": eviction_think.think,
    "cap": eviction_cap.cap,
    "block": _inner_by_name(eviction_wrappers.block),
    "chunkkv": _inner_by_name(eviction_wrappers.chunkkv),
    "dms": _inner_by_name(eviction_wrappers.dms),
    "chunk": _inner_by_name(eviction_wrappers.chunk),
    "entropy_chunkkv": _inner_by_name(eviction_entropy_chunk.entropy_chunkkv),
    "finch": eviction_finch.finch,
    "kvzip": eviction_kvzip.kvzip,
    "kvgrad": eviction_kvzip.kvgrad,
    "kvzap": eviction_kvzap.kvzap,
    "fastkvzip": eviction_fastkvzip.fastkvzip,
    "restorekv": eviction_restorekv.restorekv,
    "merging": _inner_by_name(eviction_merging.merging),
    "cam": _inner_by_name(eviction_cam.cam),
    "duo_attention": eviction_duo.duo_attention,
    "qfilter": eviction_geometry.qfilter,
    "expected_attention_stats": eviction_geometry.expected_attention_stats,
    "lukv": _inner_by_name(eviction_lukv.lukv),
    "kvcompose": eviction_compose.kvcompose,
    "decoding_ratio": _inner_by_name(decoding.decoding_ratio),
    "rerotate": eviction_wrappers.rerotate,
    "quantize": codecs.quantize,
    "kivi": codecs.kivi,
    "fp8": codecs.fp8,
    "low_rank": _low_rank_from_file,
}
"""Registered method factories by CLI name; extended by `register_method`."""

from kvjax.policies import recurrent  # noqa: E402  (after METHODS: registers itself below)
from kvjax.policies import planner  # noqa: E402  (registered below)


class MethodInfo(NamedTuple):
    """What `kvjax methods` publishes about a method besides its signature."""

    paper: str | None = None  # authors year, link
    kvpress: str | None = None  # the kvpress 0.5.5 press it equals, at kvpress's defaults
    spec: str | None = None  # the kvjax spec that equals it; {r} = kvpress's compression_ratio
    proof: str | None = None  # the test that compares kept positions with kvpress's


_PARITY = "tests/test_kvpress_parity.py"
_ZOO = "tests/test_kvpress_zoo_parity.py"
_COMPACTOR = "Chari & Van Durme 2025, https://arxiv.org/abs/2507.08143"
_ZOO_MORE = "tests/test_kvpress_zoo_more.py"
_CRITICAL = "Feng et al. 2025, https://arxiv.org/abs/2502.03805"
_ZOO_THIRD = "tests/test_kvpress_zoo_third.py"
_MERGING = "tests/test_kvpress_merging.py"
_FINCH = "tests/test_kvpress_finch.py"
_CAM = "tests/test_kvpress_cam.py"
_DUO = "tests/test_kvpress_duo.py"
_KVZIP = "tests/test_kvpress_kvzip.py"
METHOD_INFO: dict[str, MethodInfo] = {
    "streaming_llm": MethodInfo("Xiao et al. 2023, https://arxiv.org/abs/2309.17453",
                                "StreamingLLMPress", "streaming_llm:ratio={r}", _PARITY),
    "snapkv": MethodInfo("Li et al. 2024, https://arxiv.org/abs/2404.14469", "SnapKVPress",
                         "snapkv:ratio={r}", _PARITY),
    "pyramidkv": MethodInfo("Cai et al. 2024, https://arxiv.org/abs/2406.02069",
                            "PyramidKVPress", "pyramidkv:ratio={r}", _PARITY),
    "tova": MethodInfo("Oren et al. 2024, https://arxiv.org/abs/2401.06104", "TOVAPress",
                       "tova:ratio={r}", _PARITY),
    "h2o": MethodInfo("Zhang et al. 2023, https://arxiv.org/abs/2306.14048"),
    "knorm": MethodInfo("Devoto et al. 2024, https://arxiv.org/abs/2406.11430", "KnormPress",
                        "knorm:ratio={r}", _PARITY),
    "expected_attention": MethodInfo("Devoto et al. 2025 (kvpress)", "ExpectedAttentionPress",
                                     "expected_attention:ratio={r}", _PARITY),
    "keydiff": MethodInfo("Park et al. 2025, https://arxiv.org/abs/2504.15364", "KeyDiffPress",
                          "keydiff:ratio={r}", _ZOO),
    "lagkv": MethodInfo("Liang et al. 2025, https://arxiv.org/abs/2504.04704", "LagKVPress",
                        "lagkv:ratio={r}", _ZOO),
    "cur": MethodInfo("Sengupta et al. 2025, https://arxiv.org/abs/2509.15038", "CURPress",
                      "cur:ratio={r}", _ZOO),
    "leverage": MethodInfo(_COMPACTOR, "LeverageScorePress", "leverage:ratio={r}", _ZOO),
    "non_causal_attn": MethodInfo(_COMPACTOR, "NonCausalAttnPress", "non_causal_attn:ratio={r}",
                                  _ZOO),
    "compactor": MethodInfo(_COMPACTOR, "CompactorPress", "compactor:ratio={r}", _ZOO),
    "block": MethodInfo("Park et al. 2025, https://arxiv.org/abs/2504.15364", "BlockPress",
                        "block:inner=keydiff,ratio={r}", _ZOO),
    "chunkkv": MethodInfo("Liu et al. 2025, https://arxiv.org/abs/2502.00299", "ChunkKVPress",
                          "chunkkv:inner=snapkv,ratio={r}", _ZOO),
    "rerotate": MethodInfo("SinkCache / FINCH (Corallo & Papotti 2024)", "KeyRerotationPress",
                           "knorm:ratio={r}+rerotate", _ZOO),
    "critical": MethodInfo(_CRITICAL, "CriticalKVPress",
                           "critical:inner=snapkv,ratio={r}", _ZOO_MORE),
    "critical_ada": MethodInfo(_CRITICAL, "CriticalAdaKVPress",
                               "critical_ada:inner=snapkv,ratio={r}", _ZOO_MORE),
    "simlayerkv": MethodInfo("Zhang et al. 2024, https://arxiv.org/abs/2410.13846",
                             "SimLayerKVPress", "simlayerkv", _ZOO_MORE),
    "think": MethodInfo("Xu et al. 2024, https://arxiv.org/abs/2407.21018", "ThinKPress",
                        "think:ratio={r}", _ZOO_MORE),
    "cap": MethodInfo("CAPKV, https://arxiv.org/abs/2604.25975 (kvpress's citation)", "CapPress",
                      "cap:ratio={r}", _ZOO_MORE),
    "entropy_chunkkv": MethodInfo("ChunkKV, Liu et al. 2025, https://arxiv.org/abs/2502.00299 "
                                  "(kvpress's citation; the entropy gate is kvpress's own)",
                                  "EntropyGatedChunkKVPress",
                                  "entropy_chunkkv:inner=snapkv,ratio={r}", _ZOO_THIRD),
    # window=W: the question's token count (kvpress reads it off its delimiter token)
    "finch": MethodInfo("Corallo & Papotti 2024, "
                        "https://direct.mit.edu/tacl/article/doi/10.1162/tacl_a_00716/125280",
                        "FinchPress", "finch:ratio={r},window=W", _FINCH),
    # the prompt's ids come from the tokenizer (models.reconstruction.with_tokenizer)
    "kvzip": MethodInfo("Kim et al. 2025, https://arxiv.org/abs/2505.23416", "KVzipPress",
                        "kvzip:ratio={r}", _KVZIP),
    "kvgrad": MethodInfo("KVgrad, https://openreview.net/forum?id=cg1wTCJjjk", "KVgradPress",
                         "kvgrad:ratio={r}", "tests/test_kvpress_kvgrad.py"),
    "merging": MethodInfo("kvpress; after ToMe (Bolya et al. 2023, "
                          "https://arxiv.org/abs/2210.09461) and D2O (Wan et al. 2024, "
                          "https://arxiv.org/abs/2406.13035)",
                          "MergingPress", "merging:inner=snapkv,ratio={r}", _MERGING),
    # with --compress-every N = its compression_interval (512 by default); K = target_size
    "cam": MethodInfo("Zhang et al. 2024, https://openreview.net/forum?id=LCTmppB165",
                      "CAMPress", "cam:inner=knorm,budget=K", _CAM),
    # {r} here is kvpress's head_compression_ratio (its compression_ratio is an output);
    # PATH: head scores, trained (`kvjax calibrate --duo-train`, kvpress's loaded pattern) or
    # kvpress's on-the-fly rule (`--duo`, models.calibration.calibrate_duo_attention)
    "duo_attention": MethodInfo("Xiao et al. 2024, https://arxiv.org/abs/2410.10819",
                                "DuoAttentionPress",
                                "duo_attention:head_ratio={r},scores=PATH", _DUO),
    # with --compress-every N = its compression_interval (512 by default)
    "decoding_ratio": MethodInfo("kvpress (decoding-time compression)",
                                 "CompressionRatioDecodingPress",
                                 "decoding_ratio:inner=knorm,ratio={r}",
                                 "tests/test_kvpress_decoding.py"),
    "kivi": MethodInfo("Liu et al. 2024, https://arxiv.org/abs/2402.02750"),
    # PATH: filters from `kvjax calibrate --qfilters` (kvpress downloads them from the hub);
    # equal given the same filters (kvpress run with the golden's); the filters' rule is
    # checked against numpy in tests/test_qfilter.py
    "qfilter": MethodInfo("Godey et al. 2025, https://arxiv.org/abs/2503.02812", "QFilterPress",
                          "qfilter:ratio={r},filters=PATH", "tests/test_kvpress_zoo_third.py"),
    # PATH: a [99, L, KVH] curve (`kvjax calibrate --lukv`); kvpress publishes one, for
    # Llama-3.1-8B; equal given the same curve (kvpress run with the golden's)
    "lukv": MethodInfo("Tang et al. 2026, https://arxiv.org/abs/2602.08585", "LUKVPress",
                       "lukv:ratio={r},curve=PATH", "tests/test_kvpress_zoo_third.py"),
    # PATH: `kvjax calibrate --query-stats` (kvpress downloads statistics from the hub)
    "expected_attention_stats": MethodInfo(
        "Devoto et al. 2025 (kvpress)", "ExpectedAttentionStatsPress",
        "expected_attention_stats:ratio={r},stats=PATH", "tests/test_kvpress_zoo_third.py"),
    # T: a threshold on the inner method's raw scores (no ratio); equal for knorm and snapkv
    # kvpress's default chunk_length is 1,024: the zoo's 1,024-token windows are one chunk
    "chunk": MethodInfo("FINCH's chunking (Corallo & Papotti 2024), kvpress ChunkPress",
                        "ChunkPress", "chunk:inner=knorm,ratio={r}",
                        "tests/test_kvpress_zoo_third.py"),
    "dms": MethodInfo("Lancucki et al. 2025, https://arxiv.org/abs/2506.05345", "DMSPress",
                      "dms:inner=knorm,threshold=T", "tests/test_kvpress_zoo_third.py"),
    # DIR: a surrogate from `kvjax calibrate --kvzap` (kvpress downloads NVIDIA's, for a few
    # large models); equal given the same weights (kvpress run with the golden's)
    "kvzap": MethodInfo("Jegou et al. 2026, https://arxiv.org/abs/2601.07891", "KVzapPress",
                        "kvzap:ratio={r},weights=DIR", "tests/test_kvpress_zoo_third.py"),
    # DIR: gates from `kvjax calibrate --fastkvzip` (kvpress downloads the paper's, for a few
    # large models); equal given the same gates (kvpress run with the golden's)
    "fastkvzip": MethodInfo("Kim et al. 2026, https://arxiv.org/abs/2601.17668",
                            "FastKVzipPress", "fastkvzip:ratio={r},gates=DIR",
                            "tests/test_kvpress_zoo_third.py"),
    # DIR: restore embeddings and LoRA from `kvjax calibrate --restorekv` (kvpress downloads
    # the paper's, for two 8B models); equal given the same adapter (kvpress run with the
    # golden's, written in PEFT's format)
    "restorekv": MethodInfo("RestoreKV 2026, https://arxiv.org/abs/2608.01247",
                            "RestoreKVPress", "restorekv:ratio={r},adapter=DIR",
                            "tests/test_restorekv.py"),
    "kvcompose": MethodInfo("Akulov et al. 2025, https://arxiv.org/abs/2509.05165",
                            "KVComposePress", "kvcompose:ratio={r}",
                            "tests/test_kvpress_zoo_third.py"),
}
"""Paper and kvpress equivalence per method name (absent: none known)."""


def _signature_arguments(factory: Callable) -> list[dict]:
    """[{name, default}] of a factory's keyword arguments (**options: scored_policy's)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []
    out = []
    for name, p in params.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            extra = inspect.signature(eviction.scored_policy).parameters
            out += [{"name": k, "default": _json_default(q.default)} for k, q in extra.items()
                    if k not in ("name", "scorer", "stats", "ratio", "budget") and k not in params]
            continue
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        default = None if p.default is inspect.Parameter.empty else _json_default(p.default)
        out.append({"name": name, "default": default,
                    **({"required": True} if p.default is inspect.Parameter.empty else {})})
    return out


def _json_default(value):
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return getattr(value, "__name__", None) or repr(value)  # a wrapper's inner method


def describe_methods() -> list[dict]:
    """Every registered method: name, arguments with defaults, one-line description, paper,
    the kvpress press it equals with the kvjax spec that equals it, and the test proving it.

    Example:
        >>> [m for m in describe_methods() if m["name"] == "keydiff"][0]["kvpress"]
        'KeyDiffPress'
    """
    out = []
    for name in sorted(METHODS):
        factory = METHODS[name]
        doc = " ".join((inspect.getdoc(factory) or "").strip().split("\n\n")[0].split())
        info = METHOD_INFO.get(name, MethodInfo())
        out.append({"name": name, "description": doc, "arguments": _signature_arguments(factory),
                    **info._asdict()})
    return out


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
        path = Path(item).expanduser()
        if item.endswith(".py") or os.sep in item or path.exists():
            if not path.is_file():
                raise ValueError(f"plugin {item}: " + ("is a directory: need a .py file"
                                 if path.is_dir() else f"no such file (from ${PLUGINS_ENV})"))
            try:
                module_spec = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules.setdefault(path.stem, module)
                module_spec.loader.exec_module(module)
            except (Exception, SystemExit) as e:  # a syntax error, the plugin raising/exiting
                raise ValueError(f"plugin {item}: {_plugin_error(e)}") from None
        else:
            try:
                importlib.import_module(item)
            except ImportError as e:
                raise ValueError(f"plugin {item}: cannot import this module ({e}; from "
                                 f"${PLUGINS_ENV})") from None
            except (Exception, SystemExit) as e:
                raise ValueError(f"plugin {item}: {_plugin_error(e)}") from None
        _loaded_plugins.add(item)


def _plugin_error(e: Exception) -> str:
    """One line for an exception raised while importing a plugin (with its line for a
    syntax error)."""
    where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}{where}: {first}"


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
        plugins = (f" (plugins loaded: {', '.join(sorted(_loaded_plugins))}; none registered "
                   f"it)" if _loaded_plugins else "")
        raise ValueError(f"unknown method {name!r}{did_you_mean(name, METHODS)}; "
                         f"available: {', '.join(sorted(METHODS))}{plugins}")
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


class Method(NamedTuple):
    """A method spec parsed once, into what the command line, the eval cells and the sampler
    carry: the spec string (what rows, checkpoints and artifacts record), the transform it
    built, and the layers its parts name (checked once the model is known).

    `Method.parse` takes a spec or a `Method` (returned as it is), so a function that accepts
    either never parses twice; `with_transform` wraps the transform (a monitor, a mesh) and
    keeps the spec.

    Example:
        >>> m = Method.parse("snapkv:ratio=0.5,layers=0-3+kivi:bits=2")
        >>> m.spec, m.layers, Method.parse(m) is m
        ('snapkv:ratio=0.5,layers=0-3+kivi:bits=2', (('snapkv', (0, 1, 2, 3)),), True)
        >>> m.check(num_layers=2)
        Traceback (most recent call last):
        ...
        ValueError: method 'snapkv': layers names layer 3; the model has 2 layers, 0-1
    """

    spec: str
    transform: CacheTransform
    layers: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (part name, layers it names)

    @staticmethod
    def parse(spec: "str | Method") -> "Method":
        """The parsed `spec` (a ValueError for a bad one); a `Method` is returned unchanged."""
        if isinstance(spec, Method):
            return spec
        transform = parse_method(spec)
        return Method(spec, transform, tuple((name, tuple(layers))
                                             for name, layers in method_layers(spec)))

    def check(self, num_layers: int) -> "Method":
        """`self`, after checking every `layers=` against a model of `num_layers` layers."""
        for name, layers in self.layers:
            if max(layers) >= num_layers:
                raise ValueError(f"method {name!r}: layers names layer {max(layers)}; the "
                                 f"model has {num_layers} layers, 0-{num_layers - 1}")
        return self

    def with_transform(self, transform: CacheTransform) -> "Method":
        """The same spec running `transform` (the parsed one wrapped: monitored, on a mesh)."""
        return self._replace(transform=transform)


def check_method(spec: "str | Method", num_layers: int) -> CacheTransform:
    """`parse_method(spec)`, also checking every `layers=` against a model of `num_layers`.

    Example:
        >>> check_method("snapkv:ratio=0.5,layers=0-99", 30)
        Traceback (most recent call last):
        ...
        ValueError: method 'snapkv': layers names layer 99; the model has 30 layers, 0-29
    """
    return Method.parse(spec).check(num_layers).transform


def parse_method(spec: str) -> CacheTransform:
    """The `CacheTransform` a spec string describes (see module docstring).

    Policies built under `kvjax.debug_checks()` check their scores
    for NaN; the flag is part of the cache key.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a method spec is a string such as 'snapkv:ratio=0.5', got {spec!r}")
    return _parse_method(spec, eviction.debug_checks_enabled(), _files_named(spec))


def _files_named(spec: str) -> tuple:
    """(path, inode, size, modification time) of every argument of `spec` that names a file or
    folder: a method reads its artifact (a basis, filters, a curve) when parsed, so the cache
    of parsed specs must not hand out a transform of a file rewritten since."""
    found = []
    for value in re.findall(r"=([^,+]+)", spec):
        path = value.strip()
        if os.path.exists(path):
            st = os.stat(path)
            found.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(found)


@functools.lru_cache(maxsize=None)
def _parse_method(spec: str, debug: bool, files: tuple = ()) -> CacheTransform:
    parts = spec.split("+")
    if not any(p.strip() for p in parts):
        raise ValueError("empty method spec")
    for i, part in enumerate(parts):
        if not part.strip() or not part.partition(":")[0].strip():
            raise ValueError(f"method spec {spec!r}: part {i + 1} of {len(parts)} "
                             f"({part.strip()!r}) has no method name; parts are NAME[:k=v,...] "
                             f"joined by '+' (no empty part, no trailing '+')")
    transforms = []
    for part in parts:
        t = _parse_part(part)
        if hasattr(t, "wrap"):  # fold: wraps the parts before it (kvjax.policies.recurrent.Fold)
            if not transforms:
                raise ValueError(f"method part {part!r} folds what the parts before it evict; "
                                 f"put an eviction policy first, e.g. 'snapkv:ratio=0.75+{part}'")
            t = t.wrap(transforms[0] if len(transforms) == 1 else chain(*transforms))
            transforms = []
        transforms.append(t)
    return transforms[0] if len(transforms) == 1 else chain(*transforms)


register_method("linear_state", recurrent.linear_state)
register_method("fold", recurrent.fold)
register_method("auto", planner.auto)
