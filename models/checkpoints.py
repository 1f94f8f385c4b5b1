"""Orbax checkpoints of model weights and of compressed prompts.

- `save_weights` / `load_weights`: a model's weights and config; `load_weights`
  reads every array straight into the sharding you give (one device, or a mesh).
- `save_prompt` / `load_prompt`: a prefilled, compressed batch (`Prefilled`:
  cache, transform state, last logits, next positions) — "compress a long
  document once, ask many questions later", across processes. The checkpoint
  records the model's fingerprint and the method spec; restoring it for
  another model or method raises a `ValueError` naming both.

Both build on `kvjax.tools.checkpoint` (numbered steps written atomically by orbax:
a save killed midway leaves the previous step readable).

Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> from models.sampler import decode, prefill_and_compress
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> pre = prefill_and_compress(model, [[5, 6, 7, 8]], room=8)
    >>> where = tempfile.mkdtemp()
    >>> _ = save_prompt(where, pre, model, "full")
    >>> again = load_prompt(where, model, "full")
    >>> decode(model, again, max_new_tokens=4).tokens.shape
    (1, 4)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.tools import checkpoint
from models.llama import Llama, LlamaConfig
from models.sampler import Prefilled

Sharding = jax.sharding.Sharding | Callable[[jax.ShapeDtypeStruct], Any] | None


def _flat_weights(model: Llama) -> dict[str, jax.Array]:
    """The weights keyed by their state path, e.g. 'layers/0/mlp/up_proj/kernel'."""
    return {"/".join(map(str, path)): var.get_value()
            for path, var in nnx.to_flat_state(nnx.state(model))}


def fingerprint(model: Llama) -> str:
    """A short hash of the config and of a fixed sample of every weight (64 values of its
    first and of its last row, exact bytes): equal for the same weights on any device or
    sharding, different for other weights of the same shapes."""
    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for name, w in sorted(_flat_weights(model).items()):
        rows = (0,) * (w.ndim - 1), (-1,) * (w.ndim - 1)
        sample = np.concatenate([np.asarray(w[r]).reshape(-1)[:64] for r in rows])
        h.update(f"{name}:{w.shape}:{w.dtype}".encode() + sample.tobytes())
    return h.hexdigest()[:16]


def save_weights(directory: str | Path, model: Llama) -> Path:
    """Write `model`'s weights and config as the next step of `directory`."""
    return checkpoint.save(directory, _flat_weights(model),
                           meta=dict(kind="weights", config=model.config.to_dict()))


def load_weights(directory: str | Path, *, sharding: Sharding = None,
                 config: LlamaConfig | None = None) -> Llama:
    """The `Llama` that `save_weights` wrote, its arrays read straight into `sharding`.

    `config`, if given, must equal the saved one (a clear error otherwise).
    """
    manifest = checkpoint.read_manifest(directory)
    saved = manifest["meta"]
    if saved.get("kind") != "weights":
        raise ValueError(f"{directory} holds a {saved.get('kind')!r} checkpoint, not weights")
    if config is not None:
        checkpoint.check_meta(saved, dict(config=config.to_dict()), directory)
    config = LlamaConfig.from_dict(saved["config"])
    weights, _ = checkpoint.restore(directory, sharding=sharding)
    abstract = nnx.eval_shape(lambda: Llama(config, dtype=_dtype_of(weights), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        var.set_value(weights["/".join(map(str, path))])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _dtype_of(weights: dict[str, jax.Array]) -> Any:
    return next(iter(weights.values())).dtype


def save_prompt(directory: str | Path, pre: Prefilled, model: Llama, method: str) -> Path:
    """Write a prefilled (and compressed) batch for `model` and `method` (a method spec).

    Restore it with `load_prompt(directory, model, method)` and continue with
    `models.sampler.decode` or `extend` (e.g. a question after the context).
    """
    tree = pre._replace(next_pos=jnp.asarray(pre.next_pos))
    return checkpoint.save(directory, tree, meta=dict(kind="prompt", model=fingerprint(model),
                                                      method=method))


def load_prompt(directory: str | Path, model: Llama, method: str, *,
                sharding: Sharding = None) -> Prefilled:
    """The `Prefilled` batch `save_prompt` wrote; `model` and `method` must be the same."""
    tree, _ = checkpoint.restore(directory, sharding=sharding, expect=dict(
        kind="prompt", model=fingerprint(model), method=method))
    return tree._replace(next_pos=np.asarray(tree.next_pos))
