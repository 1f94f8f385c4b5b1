"""LoRA adapters for kvjax's decoder: low-rank deltas on chosen projections, merged into a
copy of the model for the passes that use them.

A `LoRA` holds, per target projection, `A` [L, d_in, r] and `B` [L, r, d_out] stacked over
layers; the adapted projection of layer l is `W + (alpha / r) A_l B_l` (PEFT's convention:
`A` starts uniform in +-1/sqrt(d_in), `B` at zero, so a fresh adapter changes nothing).
`merged(model, params, alpha)` returns a model whose targets carry the merged weights, as a
pure function of `params`, so `jax.grad` reaches the adapter through any forward of the
merged model. RestoreKV (kvpress `RestoreKVPress`) runs one such pass over the cache before
eviction, with the adapter on, and decodes with it off.

Example:
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> lora = LoRA.initial(model, rank=4, targets=("q_proj", "v_proj"))
    >>> lora.a["q_proj"].shape, lora.b["v_proj"].shape   # [L, d_in, r], [L, r, d_out]
    ((2, 64, 4), (2, 4, 32))
    >>> same = merged(model, lora.params(), lora.alpha)   # B = 0: the model's own weights
    >>> w = lambda m: m.layers[0].attn.q_proj.kernel[...]
    >>> bool((w(same) == w(model)).all())
    True
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.tools import checkpoint

# target name -> the projection's path inside a decoder layer
TARGETS = {"q_proj": ("attn", "q_proj"), "k_proj": ("attn", "k_proj"),
           "v_proj": ("attn", "v_proj"), "o_proj": ("attn", "o_proj"),
           "gate_proj": ("mlp", "gate_proj"), "up_proj": ("mlp", "up_proj"),
           "down_proj": ("mlp", "down_proj")}


@dataclasses.dataclass(frozen=True, eq=False)
class LoRA:
    """Low-rank adapters of some projections of every layer (float32 numpy arrays)."""

    a: dict[str, np.ndarray]  # target -> [L, d_in, r]
    b: dict[str, np.ndarray]  # target -> [L, r, d_out]
    alpha: float = 16.0

    def __post_init__(self):
        if not self.a or set(self.a) != set(self.b) or not set(self.a) <= set(TARGETS):
            raise ValueError(f"LoRA: a and b need the same targets among {sorted(TARGETS)}, "
                             f"got {sorted(self.a)} and {sorted(self.b)}")
        ranks = {self.a[t].shape[-1] for t in self.a} | {self.b[t].shape[1] for t in self.b}
        for t in self.a:
            a, b = self.a[t], self.b[t]
            if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
                raise ValueError(f"LoRA: {t} needs a [L, d_in, r] and b [L, r, d_out], got "
                                 f"{a.shape} and {b.shape}")
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                raise ValueError(f"LoRA: {t} is not all finite")
        if len(ranks) != 1 or 0 in ranks:
            raise ValueError(f"LoRA: every target needs the same rank >= 1, got {sorted(ranks)}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha > 0):
            raise ValueError(f"LoRA: alpha must be a finite number > 0, got {self.alpha!r}")

    @property
    def rank(self) -> int:
        return next(iter(self.a.values())).shape[-1]

    @classmethod
    def initial(cls, model, rank: int = 8, alpha: float = 16.0,
                targets: tuple[str, ...] = tuple(TARGETS), seed: int = 0) -> "LoRA":
        """A fresh adapter for `model` (PEFT's start: uniform A, zero B)."""
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown or not targets:
            raise ValueError(f"LoRA.initial: targets must be among {sorted(TARGETS)}, got "
                             f"{list(targets)}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoRA.initial: rank must be an int >= 1, got {rank!r}")
        rng = np.random.default_rng(seed)
        a, b = {}, {}
        for t in targets:
            d_in, d_out = _kernel(model.layers[0], t).shape
            bound = 1 / math.sqrt(d_in)
            a[t] = rng.uniform(-bound, bound, (len(model.layers), d_in, rank)).astype(np.float32)
            b[t] = np.zeros((len(model.layers), rank, d_out), np.float32)
        return cls(a, b, float(alpha))

    def params(self) -> dict[str, tuple[jax.Array, jax.Array]]:
        """The trainable arrays: target -> (A, B) as jax arrays (a pytree for optax)."""
        return {t: (jnp.asarray(self.a[t]), jnp.asarray(self.b[t])) for t in sorted(self.a)}

    @classmethod
    def from_params(cls, params: dict, alpha: float) -> "LoRA":
        return cls({t: np.asarray(a, np.float32) for t, (a, _) in params.items()},
                   {t: np.asarray(b, np.float32) for t, (_, b) in params.items()}, float(alpha))

    def check_model(self, model) -> None:
        """A ValueError naming the first target whose shapes do not fit `model`."""
        if next(iter(self.a.values())).shape[0] != len(model.layers):
            raise ValueError(f"LoRA: made for {next(iter(self.a.values())).shape[0]} layers, "
                             f"the model has {len(model.layers)}")
        for t in self.a:
            want = _kernel(model.layers[0], t).shape
            got = (self.a[t].shape[1], self.b[t].shape[2])
            if got != want:
                raise ValueError(f"LoRA: {t} adapts a [{got[0]}, {got[1]}] projection, the "
                                 f"model's is {list(want)}")

    def save(self, path: str | os.PathLike) -> None:
        """Write the adapter as a kvjax checkpoint at `path` (`kvjax.tools.checkpoint`)."""
        checkpoint.save(path, dict(a=self.a, b=self.b), meta=dict(kind="lora", alpha=self.alpha))


def load_lora(path: str | os.PathLike) -> LoRA:
    """The `LoRA` saved at `path`; a ValueError naming the path when it is not one (or is
    damaged: `kvjax.tools.checkpoint.restore`)."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA: {str(path)!r} is not an orbax checkpoint directory")
    tree, meta = checkpoint.restore(path, expect=dict(kind="lora"))
    f32 = lambda arrays: {t: np.asarray(x, np.float32) for t, x in arrays.items()}
    return LoRA(f32(tree["a"]), f32(tree["b"]), float(meta["alpha"]))


def _kernel(layer, target: str):
    group, name = TARGETS[target]
    return getattr(getattr(layer, group), name).kernel


def merged(model, params: dict[str, tuple[jax.Array, jax.Array]], alpha: float):
    """A copy of `model` whose target projections of layer l are `W + (alpha / r) A_l B_l`
    (float32 product, cast to the weight's dtype); pure in `params`, so it can be traced and
    differentiated. `model` itself is not changed."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for t, (a, b) in params.items():
        scale = alpha / a.shape[-1]
        for i in range(a.shape[0]):
            path = ("layers", i, *TARGETS[t], "kernel")
            w = flat[path]
            delta = jnp.matmul(a[i], b[i], precision=jax.lax.Precision.HIGHEST) * scale
            flat[path] = w.replace((w[...].astype(jnp.float32) + delta).astype(w.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
