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

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import kvjax
from models.llama import Llama


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
    return jax.export.export(jax.jit(step, donate_argnums=3), platforms=platforms)(
        params, tokens, tokens, layout)
