"""Generate from an exported decoder: an artifact directory, with neither Flax nor `models`.

`kvjax export` (`models.export.export_artifact`) writes a directory holding the model's
prefill-chunk, compression and decode-step functions serialized by `jax.export` (StableHLO,
batch size symbolic), the weights (`weights.safetensors`), the tokenizer (`tokenizer.json`)
and `manifest.json` (model config, cache spec, method, shapes, platforms, versions). This
module reads it back with jax, numpy, `safetensors`, `tokenizers` and kvjax's own cache
functions, so a server or notebook needs no model code:

    decoder = kvjax.tools.exported.load("smollm2-snapkv")
    out = decoder.generate(["The capital of France is"], max_new_tokens=8)
    out.texts[0]

The cache capacity is a small set of buckets fixed at export (`manifest["buckets"]`): a batch
is prefilled in the smallest bucket that holds its padded prompt plus the new tokens,
compressed there, then cut to the smallest bucket that holds what the method kept plus the
new tokens (`bucket_layout`) and decoded step by step, greedily, on the host.

The module docstring of `models.export` shows the round trip; `tests/test_export.py` and
`tests/test_run_exported.py` check it against the live model.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import (EMPTY, KEEP_EXACT, CacheSpec, ResidualCache, TokenCache,
                              init_model_cache)
from kvjax.core.layer import has_exact_part, is_plain
from kvjax.core.stats import LayerStats, StatsSpec, init_stats
from kvjax.core.stores import PackedChannels, resize_rows, is_dense

FORMAT = 4
"""Version of the artifact layout (`manifest.json["format"]`); another one is refused.
2: the manifest lists every file's size and SHA-256 (`files`), checked at load.
3: a sliding-window layer decodes at its window (`bucket_layout` with the `cache_spec`).
4: a KIVI key store's table is lane-flat (`PackedChannels.table`) and per-token float16
   parameters are stored as their bits in uint16 (`kvjax.core.stores.stored_params`)."""

KIND = "kvjax-exported-decoder"
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer"  # folder: tokenizer.json, tokenizer_config.json


def _register_stats() -> None:
    """`LayerStats` crosses the exported signatures: register it by the name checkpoints use."""
    try:
        jax.export.register_namedtuple_serialization(LayerStats,
                                                     serialized_name="kvjax.core.stats.LayerStats")
    except ValueError:  # registered already (kvjax.tools.checkpoint does it on demand)
        pass


_register_stats()


# ----------------------------------------------------------------------------- layouts


def pick_bucket(buckets: Sequence[int], needed: int, what: str) -> int:
    """The smallest bucket >= `needed`; ValueError naming `what` when none is large enough.

    Example:
        >>> pick_bucket((128, 256, 512), 200, "a prompt")
        256
    """
    for bucket in sorted(buckets):
        if bucket >= needed:
            return bucket
    raise ValueError(f"{what} needs {needed} cache slots; this artifact's largest capacity "
                     f"bucket is {max(buckets)} (export with a larger --max-len)")


def recent_slots(layer: ResidualCache, capacity: int) -> int:
    """Exact slots a residual layer needs to decode one token at a time in a bucket of
    `capacity`: residual + block; `capacity` for one that never flushes (ThinK's exact part
    holds every later token)."""
    return capacity if layer.residual == KEEP_EXACT else layer.residual + layer.block


def _used_groups(store: Any, valid: jax.Array) -> int:
    """Table rows some valid slot of a `PackedChannels` store uses (0 for other stores)."""
    if not isinstance(store, PackedChannels):
        return 0
    return int(jnp.max(store.used_groups(valid).sum(1)))


def _valid_rows(layer: TokenCache) -> jax.Array:
    valid = layer.pos != EMPTY  # [B, KVH, C]
    return valid.any(axis=1) if layer.pooled else valid.reshape(-1, layer.capacity)  # [R, C]


def slots_needed(cache: Sequence[Any], new_tokens: int) -> int:
    """Slots per layer (the largest layer) that hold what `cache` holds plus `new_tokens`.

    A residual layer (KIVI) counts its body's tokens plus every token that can still flush
    into it (its exact tokens and the new ones), and its key table's groups in use as whole
    groups; its exact part is `recent_slots`.
    """
    need = 0
    for layer in cache:
        if has_exact_part(layer):
            body = layer.body
            later = int(layer.recent.length) + new_tokens
            groups = _used_groups(body.k, _valid_rows(body)) * getattr(body.k, "group", 0)
            need = max(need, int(body.length) + later, groups + later)
        else:
            need = max(need, int(layer.length) + new_tokens * layer.slots_per_token)
    return need


def fixed_resize(layer: TokenCache, capacity: int, check: bool = True) -> TokenCache:
    """`kvjax.resize` whose output shape depends on `capacity` only.

    A `PackedChannels` table keeps `ceil(capacity / group)` rows, its groups in use first
    (`kvjax.resize` cuts it to the rows in use, a shape that depends on the data).
    `check` (host side) raises if a written slot or a key group in use would be lost;
    without it the function traces (`jax.eval_shape` of the layout at export).
    """
    if check and capacity < int(layer.length):
        raise ValueError(f"fixed_resize: capacity {capacity} would drop written slots (the "
                         f"cursor is at {int(layer.length)})")
    valid = _valid_rows(layer)

    def store(s):
        if isinstance(s, PackedChannels):
            rows = -(-capacity // s.group)
            if check and _used_groups(s, valid) > rows:
                raise ValueError(f"fixed_resize: {_used_groups(s, valid)} key groups in use do "
                                 f"not fit the {rows} table rows of {capacity} slots")
            s = s.collect(valid, rows)
        return resize_rows(s, capacity) if is_dense(s) else s.map_slots(
            lambda x: resize_rows(x, capacity))

    def cut(x, fill):  # [..., C] -> [..., capacity]
        c = x.shape[-1]
        if capacity <= c:
            return x[..., :capacity]
        return jnp.concatenate([x, jnp.full((*x.shape[:-1], capacity - c), fill, x.dtype)], -1)

    return layer.replace(k=store(layer.k), v=store(layer.v), pos=cut(layer.pos, EMPTY),
                         mass=None if layer.mass is None else cut(layer.mass, 0))


def bucket_layout(cache: Sequence[Any], capacity: int, check: bool = True,
                  spec: CacheSpec | None = None) -> tuple[Any, ...]:
    """Every layer cut (or padded) to `capacity` slots -- a sliding-window layer of `spec` to
    its window when smaller (`CacheSpec.layer_capacity`) --; a residual layer's body to
    `capacity` and its exact part to `recent_slots`. Host side: raises if a written slot
    would be lost.

    The decode step of a bucket is exported for this layout, so whatever a method kept is
    decoded by one compiled program per bucket, whatever its exact count. `check=False`
    skips the host-side checks (for tracing, see `fixed_resize`).
    """
    out = []
    for i, layer in enumerate(cache):
        if has_exact_part(layer):
            layer = layer.replace(body=fixed_resize(layer.body, capacity, check),
                                  recent=fixed_resize(layer.recent, recent_slots(layer, capacity), check))
        elif is_plain(layer):
            layer = fixed_resize(layer, capacity if spec is None
                                 else spec.layer_capacity(i, capacity), check)
        else:
            raise ValueError(f"bucket_layout: layer type {type(layer).__name__} is not "
                             f"exported (TokenCache or ResidualCache)")
        out.append(layer)
    return tuple(out)


def empty_state(spec: CacheSpec, stats: StatsSpec, batch: int, capacity: int,
                num_heads: int, inv_freq: np.ndarray) -> tuple[tuple[Any, ...], Any]:
    """(empty cache, empty statistics or None): what the exported prefill starts from."""
    cache = init_model_cache(spec, batch, capacity, jnp.float32,
                             track_mass=stats.attention_mass)
    if not (stats.window or stats.query_moments):
        return cache, None
    return cache, init_stats(stats, cache, num_heads, inv_freq)


# ----------------------------------------------------------------------------- tokenizer


class TextCodec:
    """The artifact's tokenizer (`tokenizers` only): encode, decode, chat template."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}
        self.chat_template = config.get("chat_template")
        self.special = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token")}

    def encode(self, text: str) -> list[int]:
        """User text -> ids; a special token's spelling is ordinary text (`kvjax.tools.chat`)."""
        from kvjax.tools.chat import encode_text

        return encode_text(self.backend, text, what="prompt")

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def chat(self, text: str) -> str:
        """`text` as one user turn of the chat template, the assistant's turn opened (to show;
        `encode_chat` gives its ids)."""
        return "".join(t for t, _ in self._chat_pieces(text))

    def encode_chat(self, text: str) -> list[int]:
        """Ids of `text` as one user turn, the assistant's turn opened: control ids only where
        the template puts them, `text` encoded as ordinary text (`kvjax.tools.chat`)."""
        from kvjax.tools.chat import encode_pieces

        return encode_pieces(self.backend, self._chat_pieces(text))

    def _chat_pieces(self, text: str) -> list[tuple[str, bool]]:
        if not self.chat_template:
            raise ValueError("chat: this artifact's tokenizer has no chat template")
        from kvjax.tools.chat import compile_template, render

        # as Hugging Face renders chat templates (models.tokenizer does the same)
        return render(compile_template(self.chat_template), [{"role": "user", "content": text}],
                      add_generation_prompt=True,
                      **{k: v or "" for k, v in self.special.items()})


# ----------------------------------------------------------------------------- the loader


def use_compilation_cache() -> None:
    """jax's persistent compilation cache in `$KVJAX_CACHE/jit` (default ~/.cache/kvjax/jit),
    as `models` sets it: a second process compiles nothing. `KVJAX_COMPILATION_CACHE=0` opts
    out; a `jax_compilation_cache_dir` you configured yourself is left alone."""
    import os

    if os.environ.get("KVJAX_COMPILATION_CACHE", "1").strip().lower() in ("0", "false", "no",
                                                                          "off"):
        return
    if jax.config.jax_compilation_cache_dir is None:
        root = Path(os.environ.get("KVJAX_CACHE", Path.home() / ".cache" / "kvjax"))
        jax.config.update("jax_compilation_cache_dir", str(root.expanduser() / "jit"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@dataclasses.dataclass(frozen=True)
class Generated:
    """What `ExportedDecoder.generate` returns (the live sampler's `Generation`, plus text)."""

    tokens: np.ndarray  # [B, max_new_tokens] int32; pad_id after a sequence's end token
    num_tokens: np.ndarray  # [B] int32 tokens generated per sequence, end token included
    texts: list[str] | None  # decoded tokens (None without a tokenizer)
    cache: Any = dataclasses.field(repr=False)  # the cache after generation (bucket layout)
    prefill_bucket: int = 0  # capacity the prompt was prefilled and compressed in
    decode_bucket: int = 0  # capacity the compressed cache was decoded in
    first_token_seconds: float = 0.0  # from the call to the first token on the host


_NUMBER = (int, float)
MANIFEST_SCHEMA: dict[str, Any] = {
    "kind": str, "format": int, "source": str, "model": dict, "cache_spec": dict,
    "method": str, "stats": dict, "chunk": int, "max_len": int, "buckets": [int],
    "platforms": [str], "batch": str, "sampling": str, "eos_ids": [int], "pad_id": int,
    "bos_id": (int, type(None)), "inv_freq": [_NUMBER], "weights": dict, "functions": dict,
    "shapes": dict, "versions": dict, "files": dict,
}
"""Every key of `manifest.json` and its JSON type (`[t]`: a list of t); no other key."""

_MODEL_KEYS = {"vocab_size": int, "num_heads": int, "max_position": int, "head_dim": int}


def file_record(path: Path) -> dict[str, Any]:
    """{"size", "sha256"} of one artifact file, as the manifest's `files` holds it."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _type_ok(value: Any, kind: Any) -> bool:
    if isinstance(kind, list):
        return isinstance(value, list) and all(_type_ok(v, kind[0]) for v in value)
    if kind in (int, _NUMBER) or (isinstance(kind, tuple) and int in kind):
        if isinstance(value, bool):
            return False
    return isinstance(value, kind)


def _inside(directory: Path, relative: Any, where: str) -> Path:
    """`directory / relative` for a plain relative path inside the artifact (never `..`, never
    absolute: a manifest must not make the loader read elsewhere)."""
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute() \
            or ".." in Path(relative).parts:
        raise ValueError(f"{directory / MANIFEST}: {where} names {relative!r}; need a relative "
                         f"path inside the artifact")
    return directory / relative


def check_manifest(directory: Path, manifest: Any) -> dict[str, Any]:
    """ValueError naming `manifest.json` and the first thing wrong with its schema: a key
    missing or unexpected, a value of the wrong type, a bucket without its functions."""
    where = directory / MANIFEST
    if not isinstance(manifest, dict):
        raise ValueError(f"{where}: not a JSON object")
    if manifest.get("kind") != KIND or manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: artifact kind {manifest.get('kind')!r} format "
                         f"{manifest.get('format')!r}; this kvjax reads {KIND!r} format {FORMAT}"
                         f" (export it again with this kvjax)")
    missing = [k for k in MANIFEST_SCHEMA if k not in manifest]
    extra = sorted(k for k in manifest if k not in MANIFEST_SCHEMA)
    if missing or extra:
        raise ValueError(f"{where}: keys missing {missing}, unexpected {extra}")
    for key, kind in MANIFEST_SCHEMA.items():
        if not _type_ok(manifest[key], kind):
            raise ValueError(f"{where}: {key!r} is {manifest[key]!r:.80}, of the wrong type")
    for key, kind in _MODEL_KEYS.items():
        if not _type_ok(manifest["model"].get(key), kind) or manifest["model"][key] < 1:
            raise ValueError(f"{where}: model.{key} is {manifest['model'].get(key)!r}; need "
                             f"an int >= 1")
    m = manifest
    if not m["buckets"] or any(b < 2 or b > m["max_len"] for b in m["buckets"]):
        raise ValueError(f"{where}: buckets {m['buckets']} must be a non-empty list of ints in "
                         f"[2, max_len = {m['max_len']}]")
    if m["chunk"] < 1 or m["max_len"] > m["model"]["max_position"]:
        raise ValueError(f"{where}: chunk {m['chunk']} / max_len {m['max_len']} out of range "
                         f"(chunk >= 1, max_len <= the model's {m['model']['max_position']} "
                         f"positions)")
    longrope = (m["model"].get("rope_scaling") or {}).get("rope_type") == "longrope"
    if len(m["inv_freq"]) != (0 if longrope else m["model"]["head_dim"] // 2):
        raise ValueError(f"{where}: inv_freq has {len(m['inv_freq'])} entries; the model's "
                         f"head_dim {m['model']['head_dim']} needs {m['model']['head_dim'] // 2}"
                         f" (none with longrope RoPE, whose frequencies change with the context)")
    vocab = m["model"]["vocab_size"]
    if not 0 <= m["pad_id"] < vocab or any(not 0 <= e < vocab for e in m["eos_ids"]):
        raise ValueError(f"{where}: pad_id {m['pad_id']} / eos_ids {m['eos_ids']} must be in "
                         f"[0, {vocab})")
    names = {"prefill", "decode"} | ({"compress"} if m["method"] != "full" else set())
    buckets = {str(b) for b in m["buckets"]}
    if set(m["functions"]) != buckets:
        raise ValueError(f"{where}: functions are given for buckets {sorted(m['functions'])}, "
                         f"the manifest lists buckets {m['buckets']}")
    for bucket, fns in m["functions"].items():
        if not isinstance(fns, dict) or set(fns) != names:
            raise ValueError(f"{where}: bucket {bucket} has functions {fns!r:.80}; need "
                             f"{sorted(names)}")
        for name, rel in fns.items():
            _inside(directory, rel, f"functions[{bucket}][{name}]")
    files = m["files"]
    needed = {rel for fns in m["functions"].values() for rel in fns.values()} | {WEIGHTS}
    if not needed <= set(files):
        raise ValueError(f"{where}: files lists no size and hash for "
                         f"{sorted(needed - set(files))}")
    for rel, record in files.items():
        _inside(directory, rel, "files")
        if not (isinstance(record, dict) and set(record) == {"size", "sha256"}
                and _type_ok(record["size"], int) and isinstance(record["sha256"], str)):
            raise ValueError(f"{where}: files[{rel!r}] is {record!r:.80}; need "
                             f"{{'size': int, 'sha256': str}}")
    return manifest


def check_files(directory: Path, manifest: dict[str, Any]) -> None:
    """ValueError naming the first file of the artifact that is missing or whose size or
    SHA-256 differs from the manifest's record (truncated, altered, swapped)."""
    for rel, want in manifest["files"].items():
        path = _inside(directory, rel, "files")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != want["size"]:
            raise ValueError(f"{path}: {size} bytes, the manifest says {want['size']} "
                             f"(truncated or altered)")
        if file_record(path)["sha256"] != want["sha256"]:
            raise ValueError(f"{path}: SHA-256 differs from the manifest's (altered)")


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such artifact folder")
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {MANIFEST}; not an artifact of `kvjax export`")
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return check_manifest(directory, manifest)


class ExportedDecoder:
    """An exported decoder loaded from its directory (see the module docstring)."""

    def __init__(self, directory: str | Path):
        from safetensors.numpy import load_file

        self.directory = Path(directory)
        self.manifest = _read_manifest(self.directory)
        use_compilation_cache()
        m = self.manifest
        platform = jax.default_backend()
        if platform not in m["platforms"]:
            raise ValueError(f"{self.directory}: exported for {m['platforms']}, this process "
                             f"runs on {platform!r}; export with --platforms including it")
        check_files(self.directory, m)  # sizes and hashes before anything is read
        self.config = m["model"]
        try:
            self.cache_spec = CacheSpec(**m["cache_spec"])
            self.stats_spec = StatsSpec(**m["stats"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.directory / MANIFEST}: cache_spec or stats is not what "
                             f"this kvjax writes ({e})") from None
        self.chunk = int(m["chunk"])
        self.buckets = tuple(int(b) for b in m["buckets"])
        self.eos_ids = tuple(m["eos_ids"])
        self.pad_id = int(m["pad_id"])
        self.inv_freq = np.asarray(m["inv_freq"], np.float32)
        self.compresses = m["method"] != "full"
        try:
            weights = load_file(str(self.directory / WEIGHTS))
        except Exception as e:  # safetensors' own errors on a damaged file
            raise ValueError(f"{self.directory / WEIGHTS}: not a readable safetensors file "
                             f"({type(e).__name__}: {e})") from None
        self.params = {k: jnp.asarray(v) for k, v in weights.items()}
        folder = self.directory / TOKENIZER
        try:
            self.tokenizer = (TextCodec(folder) if (folder / "tokenizer.json").is_file()
                              else None)
        except Exception as e:  # tokenizers' / json's errors on a damaged file
            raise ValueError(f"{folder}: not a readable tokenizer ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None
        self._fns: dict[tuple[str, int], Any] = {}

    def __repr__(self) -> str:
        m = self.manifest
        return (f"ExportedDecoder({str(self.directory)!r}, method={m['method']!r}, "
                f"buckets={self.buckets}, platforms={m['platforms']})")

    def _fn(self, name: str, bucket: int):
        """The deserialized function `name` of `bucket`, jitted once (cache argument donated)."""
        key = (name, bucket)
        if key not in self._fns:
            path = self.directory / self.manifest["functions"][str(bucket)][name]
            try:
                exported = jax.export.deserialize(bytearray(path.read_bytes()))
            except Exception as e:  # flatbuffers' errors on a damaged file
                raise ValueError(f"{path}: not a readable jax.export function "
                                 f"({type(e).__name__}: {e})") from None
            donate = {"prefill": (3,), "decode": (3,), "compress": (0,)}[name]
            self._fns[key] = jax.jit(exported.call, donate_argnums=donate)
        return self._fns[key]

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]], chat: bool = False
               ) -> list[list[int]]:
        """Token ids of each prompt (strings through the tokenizer, id lists as they are)."""
        from kvjax.tools.chat import token_id_lists

        if isinstance(prompts, (str, bytes)) or prompts is None:
            raise TypeError(f"prompts must be a list of strings or token-id lists, got "
                            f"{type(prompts).__name__} {prompts!r:.80}")
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("prompts: this artifact has no tokenizer; pass token ids")
                p = self.tokenizer.encode_chat(p) if chat else self.tokenizer.encode(p)
            out.append(p)
        out = token_id_lists(out)  # float ids are a TypeError, never truncated
        vocab = int(self.config["vocab_size"])
        for i, p in enumerate(out):
            if not p:
                raise ValueError(f"prompts[{i}]: every prompt needs at least one token")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {vocab}), got "
                                 f"{min(p)}..{max(p)}")
        return out

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int):
        """Left-pad, prefill chunk by chunk, compress: (logits [B, V], cache, next_pos [B], bucket)."""
        lengths = np.array([len(p) for p in prompts], np.int32)
        c = self.chunk
        width = -(-int(lengths.max()) // c) * c
        if int(lengths.max()) + max_new_tokens > int(self.config["max_position"]):
            raise ValueError(f"prompt plus new tokens exceed the model's context "
                             f"{self.config['max_position']} tokens")
        bucket = pick_bucket(self.buckets, width + max_new_tokens,
                             f"a prompt of {int(lengths.max())} tokens ({width} padded) plus "
                             f"{max_new_tokens} new tokens")
        tokens = np.full((len(prompts), width), self.pad_id, np.int32)
        positions = np.full((len(prompts), width), EMPTY, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p):] = p
            positions[i, width - len(p):] = np.arange(len(p))
        cache, stats = empty_state(self.cache_spec, self.stats_spec, len(prompts), bucket,
                                   int(self.config["num_heads"]), self.inv_freq)
        prefill = self._fn("prefill", bucket)
        for start in range(0, width, c):
            logits, cache, stats = prefill(self.params, tokens[:, start:start + c],
                                           positions[:, start:start + c], cache, stats)
        if self.compresses:
            cache = self._fn("compress", bucket)(cache, stats)
        return logits, cache, lengths, bucket

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 32,
                 *, chat: bool = False) -> Generated:
        """Greedy continuation of every prompt (strings or token-id lists), one batch.

        As `models.sampler.generate` with greedy sampling: a sequence that drew an end token
        gets `pad_id` after it, and decoding stops when every sequence has ended.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if isinstance(prompts, str) or not len(prompts):
            raise ValueError("prompts: need a non-empty list of strings or token-id lists")
        start = time.perf_counter()
        ids = self.encode(prompts, chat=chat)
        logits, cache, next_pos, prefill_bucket = self.prefill(ids, max_new_tokens)
        bucket = pick_bucket(self.buckets, slots_needed(cache, max_new_tokens - 1),
                             "the compressed cache plus the new tokens")
        cache = bucket_layout(cache, bucket, spec=self.cache_spec)
        decode = self._fn("decode", bucket)
        eos = np.asarray(self.eos_ids if self.eos_ids else (-1,), np.int32)
        b = len(ids)
        out = np.full((b, max_new_tokens), self.pad_id, np.int32)
        done = np.zeros((b,), bool)
        pos = next_pos.astype(np.int32)
        first = None
        for step in range(max_new_tokens):
            if step:
                logits, cache = decode(self.params, token[:, None], pos[:, None], cache)
                pos = pos + 1
            token = np.where(done, self.pad_id, np.argmax(np.asarray(logits), axis=-1)
                             ).astype(np.int32)
            first = first if first is not None else time.perf_counter() - start
            out[:, step] = token
            done |= np.isin(token, eos)
            if done.all():
                break
        ended = np.isin(out, eos) if self.eos_ids else np.zeros_like(out, bool)
        num = np.where(ended.any(1), ended.argmax(1) + 1, max_new_tokens).astype(np.int32)
        texts = None if self.tokenizer is None else [
            self.tokenizer.decode(row[:n]) for row, n in zip(out, num)]
        return Generated(out, num, texts, cache, prefill_bucket, bucket, round(first, 4))


def load(directory: str | Path) -> ExportedDecoder:
    """The exported decoder in `directory` (written by `kvjax export`)."""
    return ExportedDecoder(directory)


# ----------------------------------------------------------------------------- TPU check


def compile_for_tpu(directory: str | Path, chip: str = "v5e", batch: int = 1,
                    buckets: Sequence[int] | None = None) -> dict[str, Any]:
    """Compile every exported function of an artifact for one chip of a deviceless TPU slice.

    XLA:TPU (and Mosaic, for kernels) accepts or rejects the StableHLO exactly as on the
    chip, so a broken TPU entry fails here and not on a pod (`kernels_pallas.tpu_compile`;
    needs libtpu, the `tpu-compile` extra). Nothing runs. Returns, per bucket and function,
    the compiler's per-chip argument and temporary bytes for `batch` sequences.
    """
    from kernels_pallas.tpu_compile import abstract_like, tpu_device

    directory = Path(directory)
    manifest = _read_manifest(directory)
    check_files(directory, manifest)
    if "tpu" not in manifest["platforms"]:
        raise ValueError(f"{directory}: exported for {manifest['platforms']}, not tpu")
    device = tpu_device(chip)
    spec, stats = CacheSpec(**manifest["cache_spec"]), StatsSpec(**manifest["stats"])
    chunk, report = int(manifest["chunk"]), {}
    load = lambda b, name: jax.export.deserialize(bytearray(
        (directory / manifest["functions"][str(b)][name]).read_bytes()))
    for bucket in buckets or manifest["buckets"]:
        prefill = load(bucket, "prefill")
        params = jax.tree_util.tree_unflatten(prefill.in_tree, prefill.in_avals)[0][0]
        cache, layer_stats = jax.eval_shape(lambda: empty_state(
            spec, stats, batch, bucket, manifest["model"]["num_heads"],
            np.asarray(manifest["inv_freq"], np.float32)))
        tokens = jax.ShapeDtypeStruct((batch, chunk), jnp.int32)
        step = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
        calls = {"prefill": (prefill, (params, tokens, tokens, cache, layer_stats))}
        if "compress" in manifest["functions"][str(bucket)]:
            compress = load(bucket, "compress")
            calls["compress"] = (compress, (cache, layer_stats))
            cache = jax.eval_shape(compress.call, cache, layer_stats)
        layout = jax.eval_shape(lambda c: bucket_layout(c, bucket, check=False, spec=spec), cache)
        calls["decode"] = (load(bucket, "decode"), (params, step, step, layout))
        report[str(bucket)] = {}
        for name, (exp, args) in calls.items():
            compiled = jax.jit(exp.call).lower(*abstract_like(args, device)).compile()
            memory = compiled.memory_analysis()
            report[str(bucket)][name] = {
                "argument_bytes": int(memory.argument_size_in_bytes),
                "temp_bytes": int(memory.temp_size_in_bytes)}
    return {"chip": chip, "batch": batch, "buckets": report}
