"""Export the decode step with `jax.export`: weights and cache go in, logits and cache come out.

The exported function takes the weights as a plain nested dict (so it needs
no Flax to run), a token batch, their positions and the cache pytree:

    step(params, tokens [B, 1], positions [B, 1], cache) -> (logits [B, V], cache)

Example:
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))   # random weights, vocab 256
    >>> exported = export_decode_step(model, batch=1, capacity=16)
    >>> blob = exported.serialize()                      # bytes, e.g. to disk
    >>> step = jax.export.deserialize(blob)
    >>> cache = kvjax.init_model_cache(model.config.cache_spec, batch=1, capacity=16)
    >>> tokens, positions = jnp.array([[5]]), jnp.array([[0]])
    >>> logits, cache = step.call(params_dict(model), tokens, positions, cache)
    >>> logits.shape, int(cache[0].length)
    ((1, 256), 1)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.core import cpu_kernel, stores
from kvjax.tools import exported
from models.llama import FEW_ROWS, Llama, fixed_rope_frequencies


def params_dict(model: Llama) -> dict[str, jax.Array]:
    """The model's weights as a flat dict keyed by path, e.g. 'layers/0/attn/q_proj/kernel'."""
    keys, leaves, _ = _flatten(nnx.state(model))
    return dict(zip(keys, leaves))


def _flatten(state) -> tuple[list[str], list[jax.Array], Any]:
    with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = ["/".join(str(k.key if hasattr(k, "key") else k.idx) for k in path
                     if hasattr(k, "key") or hasattr(k, "idx"))
            for path, _ in with_path]
    return keys, [leaf for _, leaf in with_path], treedef


def export_decode_step(model: Llama, batch: int | None = None, capacity: int | None = None, *,
                       cache: Any = None, cache_dtype: Any = jnp.float32,
                       transform: kvjax.CacheTransform | None = None,
                       platforms: Sequence[str] | None = None) -> jax.export.Exported:
    """`jax.export` of one decode step for a fixed cache layout.

    The layout is either an empty cache of `batch` sequences and `capacity`
    slots (with a codec `transform`, e.g. `kvjax.kivi(bits=2)`, that codec's
    layout: `transform.update` of a fresh cache), or that of `cache`, an
    example cache (arrays or `jax.ShapeDtypeStruct`s), e.g. a prompt
    compressed and shrunk by `snapkv:ratio=0.5+kivi:bits=4`. Every token the
    step writes is encoded in the cache's own format.

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> from models.sampler import prefill_and_compress
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> t = kvjax.parse_method("snapkv:ratio=0.5,window=8")
        >>> pre = prefill_and_compress(model, [list(range(3, 67))], transform=t, room=8)
        >>> exported = export_decode_step(model, cache=pre.cache)   # 32 kept + 8 free slots
        >>> logits, cache = exported.call(params_dict(model), jnp.array([[7]]),
        ...                               jnp.asarray(pre.next_pos)[:, None], pre.cache)
        >>> logits.shape, kvjax.num_valid(cache[0]).tolist()
        ((1, 256), [[33, 33]])
    """
    if cache is None:
        for name, value in (("batch", batch), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"export_decode_step: {name} must be an int >= 1 (or pass an "
                                 f"example cache=), got {value!r}")
    elif batch is not None or capacity is not None or transform is not None:
        raise ValueError("export_decode_step: give cache= (its layout) or batch and capacity "
                         f"(and transform), not both; got batch={batch}, capacity={capacity}, "
                         f"transform={transform}")
    graphdef, state = nnx.split(model)

    keys, _, treedef = _flatten(state)

    def step(params, tokens, positions, cache):
        weights = jax.tree_util.tree_unflatten(treedef, [params[k] for k in keys])
        logits, cache = nnx.merge(graphdef, weights)(tokens, positions, cache)
        return logits[:, -1], cache

    def empty_cache():
        if cache is not None:
            return cache
        fresh = kvjax.init_model_cache(model.config.cache_spec, batch, capacity, cache_dtype)
        return fresh if transform is None else transform.update(fresh, transform.init(fresh),
                                                                None)[0]

    layout = jax.eval_shape(empty_cache)
    kvjax.check_cache(layout, model.config.cache_spec, layout[0].batch)
    tokens = jax.ShapeDtypeStruct((layout[0].batch, 1), jnp.int32)
    params = jax.eval_shape(lambda: params_dict(model))
    # an artifact holds no custom call of this process, nor XLA layout constraints
    with cpu_kernel.disabled(), stores.without_layout_hints():
        return jax.export.export(jax.jit(step, donate_argnums=3), platforms=platforms)(
            params, tokens, tokens, layout)


# ----------------------------------------------------------------------------- artifacts

DEFAULT_CHUNK = 64
DEFAULT_MAX_LEN = 1024


def default_buckets(chunk: int, max_len: int) -> tuple[int, ...]:
    """Capacity buckets: `2 chunk, 4 chunk, ...` doubling up to `max_len` (always included).

    Example:
        >>> default_buckets(64, 1000)
        (128, 256, 512, 1000)
    """
    out, c = [], 2 * chunk
    while c < max_len:
        out.append(c)
        c *= 2
    return (*out, max_len)


def _symbolic_batch(make: Callable[[int], Any], b) -> Any:
    """The abstract value of `make(batch)` with the batch symbolic (`b`): every dimension that
    doubles from batch 1 to batch 2 becomes `k * b`, the others stay fixed."""
    one, two = jax.eval_shape(lambda: make(1)), jax.eval_shape(lambda: make(2))

    def leaf(x1, x2):
        dims = []
        for d1, d2 in zip(x1.shape, x2.shape):
            if d1 != d2 and d2 != 2 * d1:
                raise ValueError(f"a dimension {d1} at batch 1 is {d2} at batch 2: not linear")
            dims.append(d1 if d1 == d2 else d1 * b)
        return jax.ShapeDtypeStruct(tuple(dims), x1.dtype)

    return jax.tree.map(leaf, one, two)


def batch_logits(model: Llama, h: jax.Array) -> jax.Array:
    """`model.logits(h)` for h [b, hidden] whose batch `b` may be symbolic.

    `Llama.logits` picks its computation from the row count on the host (a multiply-reduce
    for 2..FEW_ROWS rows on CPU, the dot otherwise); with a symbolic batch the same rule is
    taken per call: `lax.platform_dependent` for the CPU test and a `lax.cond` on the batch
    size, which XLA folds once the batch is known, so the artifact computes exactly what the
    live model computes at each batch size.
    """
    rows = h.shape[0]
    if model.lm_head is not None or not jax.export.is_symbolic_dim(rows):
        return model.logits(h)
    cap = model.config.final_softcap  # Gemma: Llama.logits caps what `_tied_logits` computes
    logits = _tied_logits(model, h, rows)
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _tied_logits(model: Llama, h: jax.Array, rows) -> jax.Array:
    emb = model.embed[...]
    dot = lambda h: jnp.einsum("...d,vd->...v", h.astype(emb.dtype), emb,
                               preferred_element_type=jnp.float32)
    if emb.dtype != jnp.float32:
        return dot(h)
    few = lambda h: jnp.sum(h[..., None, :].astype(jnp.float32) * emb, axis=-1)
    n = jnp.asarray(rows)
    on_cpu = lambda h: jax.lax.cond((n >= 2) & (n <= FEW_ROWS), few, dot, h)
    return jax.lax.platform_dependent(h, cpu=on_cpu, default=dot)


def export_artifact(model: Llama, tokenizer: Any, out: str | Path, *,
                    method: str | kvjax.Method = "full",
                    platforms: Sequence[str] = ("cpu",), max_len: int | None = None,
                    chunk: int = DEFAULT_CHUNK, buckets: Sequence[int] | None = None,
                    source: str = "") -> Path:
    """Write an artifact that `kvjax.tools.exported.load` generates from without Flax or `models`.

    The directory holds, per capacity bucket, the prefill chunk (`chunk` tokens), the
    method's compression and the decode step, each `jax.export`ed with a symbolic batch
    for `platforms`; `weights.safetensors` (float32, by state path); the tokenizer (HF
    `tokenizer.json`, when `tokenizer` is given); and `manifest.json`. `max_len` (default
    the smaller of 1024 and the model's positions) is the largest capacity served.
    Returns the directory.

    Example (a tiny random model; `kvjax.tools.exported.load` needs neither Flax nor `models`):
        >>> import tempfile
        >>> from kvjax.tools import exported
        >>> from models.llama import LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> path = export_artifact(model, None, tempfile.mkdtemp(), max_len=64, chunk=16,
        ...                        buckets=(64,))
        >>> decoder = exported.load(path)
        >>> out = decoder.generate([[5, 6, 7], [8, 9]], max_new_tokens=3)   # batch 2
        >>> out.tokens.shape, out.prefill_bucket
        ((2, 3), 64)
    """
    from models.sampler import for_full_layers
    # as the sampler: a sliding-window layer keeps its window cache, methods compress the rest
    method = kvjax.Method.parse(method).check(model.config.num_layers)  # parsed once
    transform = for_full_layers(model, method.transform)
    cfg = model.config
    max_len = min(DEFAULT_MAX_LEN, cfg.max_position) if max_len is None else max_len
    for name, value, low in (("chunk", chunk, 1), ("max_len", max_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"export_artifact: {name} must be an int >= {low}, got {value!r}")
    if max_len > cfg.max_position:
        raise ValueError(f"export_artifact: max_len {max_len} exceeds the model's "
                         f"{cfg.max_position} positions")
    if max_len < 2 * chunk:
        raise ValueError(f"export_artifact: max_len {max_len} must be >= 2 x chunk ({chunk}): "
                         f"a prompt chunk plus room to generate")
    buckets = tuple(sorted(set(buckets))) if buckets else default_buckets(chunk, max_len)
    if any(not isinstance(c, int) or c < chunk + 1 or c > max_len for c in buckets):
        raise ValueError(f"export_artifact: buckets {buckets} must be ints in "
                         f"[chunk + 1 = {chunk + 1}, max_len = {max_len}]")
    platforms = tuple(platforms)
    bad = [p for p in platforms if p not in ("cpu", "cuda", "rocm", "tpu")]
    if not platforms or bad:
        raise ValueError(f"export_artifact: platforms {platforms} must be among cpu, cuda, "
                         f"rocm, tpu")
    if cfg.tie_embeddings is False and model.lm_head is None:
        raise ValueError("export_artifact: untied embeddings without an lm_head")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = transform.stats
    inv_freq = np.asarray(fixed_rope_frequencies(cfg), np.float32)
    graphdef, state = nnx.split(model)
    keys, _, treedef = _flatten(state)
    merged = lambda params: nnx.merge(graphdef, jax.tree_util.tree_unflatten(
        treedef, [params[k] for k in keys]))

    def prefill(params, tokens, positions, cache, stats):
        h, cache, stats = merged(params).forward(tokens, positions, cache, stats, spec)
        return batch_logits(merged(params), h[:, -1]), cache, stats

    def compress(cache, stats):
        return transform.update(cache, transform.init(cache), stats)[0]

    def decode(params, tokens, positions, cache):
        h, cache, _ = merged(params).forward(tokens, positions, cache)
        return batch_logits(merged(params), h[:, -1]), cache

    (b,) = jax.export.symbolic_shape("b")
    params = jax.eval_shape(lambda: params_dict(model))
    tokens = jax.ShapeDtypeStruct((b, chunk), jnp.int32)
    step = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    functions, shapes, versions = {}, {}, {}
    for capacity in buckets:
        empty = lambda batch: exported.empty_state(cfg.cache_spec, spec, batch, capacity,
                                                   cfg.num_heads, inv_freq)
        cache, stats = _symbolic_batch(empty, b)
        folder = out / "functions" / str(capacity)
        folder.mkdir(parents=True, exist_ok=True)
        functions[str(capacity)], shapes[str(capacity)] = {}, {}

        def write(name, fn, args, donate):
            # an artifact holds no custom call of this process, nor XLA layout constraints
            with cpu_kernel.disabled(), stores.without_layout_hints():
                exp = jax.export.export(jax.jit(fn, donate_argnums=donate),
                                        platforms=platforms)(*args)
            (folder / f"{name}.jaxexport").write_bytes(exp.serialize())
            functions[str(capacity)][name] = f"functions/{capacity}/{name}.jaxexport"
            skip = len(params) if name != "compress" else 0  # the weights: in "weights"
            shapes[str(capacity)][name] = {"in": [str(a) for a in exp.in_avals[skip:]],
                                           "out": [str(a) for a in exp.out_avals]}
            versions["calling_convention"] = exp.calling_convention_version
            return jax.tree_util.tree_unflatten(exp.out_tree, exp.out_avals)

        write("prefill", prefill, (params, tokens, tokens, cache, stats), (3,))
        if method.spec != "full":  # the compressed layout, batch still symbolic
            cache = write("compress", compress, (cache, stats), (0,))
        layout = jax.eval_shape(lambda c: exported.bucket_layout(c, capacity, check=False,
                                                                 spec=cfg.cache_spec),
                                cache)
        write("decode", decode, (params, step, step, layout), (3,))
    from safetensors.numpy import save_file
    save_file({k: np.asarray(v) for k, v in params_dict(model).items()},
              str(out / exported.WEIGHTS))
    if tokenizer is not None:
        tokenizer.save(out / exported.TOKENIZER)
    import importlib.metadata as md
    written = [rel for fns in functions.values() for rel in fns.values()] + [exported.WEIGHTS]
    if tokenizer is not None:
        written += sorted(str(f.relative_to(out)) for f in (out / exported.TOKENIZER).rglob("*")
                          if f.is_file())
    manifest = {
        "kind": exported.KIND, "format": exported.FORMAT, "source": source,
        "model": cfg.to_dict(), "cache_spec": dataclasses.asdict(cfg.cache_spec),
        "method": method.spec, "stats": dataclasses.asdict(spec), "chunk": chunk,
        "max_len": max_len, "buckets": list(buckets), "platforms": list(platforms),
        "batch": "symbolic (b >= 1)", "sampling": "greedy, host-side loop",
        "eos_ids": list(cfg.eos_ids), "pad_id": 0, "bos_id": cfg.bos_id,
        "inv_freq": [float(x) for x in inv_freq],
        "weights": {"file": exported.WEIGHTS, "dtype": "float32", "layout": "state path"},
        "functions": functions, "shapes": shapes,
        "versions": {"jax": jax.__version__, "jaxlib": md.version("jaxlib"),
                     "kvjax": md.version("kvjax"), "flax": md.version("flax"),
                     **versions},
        "files": {rel: exported.file_record(out / rel) for rel in written},
    }
    (out / exported.MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return out
