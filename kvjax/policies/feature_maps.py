"""Feature maps for linear attention: `phi(q) . psi(k) ~ exp(q . k / sqrt(d))`.

A recurrent-state layer (`kvjax.policies.recurrent`) never keeps keys: it keeps
`S = sum psi(k) v^T` and `z = sum psi(k)` and answers a query with
`phi(q)^T S` and `phi(q)^T z`. The feature maps decide how well that
approximates softmax attention:

- `elu_map`: `elu(x) + 1` on both sides (Katharopoulos et al. 2020). Positive,
  training-free, but *not* on the scale of `exp(q.k/sqrt d)`: fine for pure
  linear attention (the scale cancels), a poor estimate beside softmax tokens.
- `random_features`: positive random features (Performer FAVOR+):
  `phi(x) = exp(w^T x' - |x'|^2 / 2) / sqrt(F)`, `x' = x / d^(1/4)`, `w ~ N(0, I)`
  from a fixed seed, an unbiased estimate `E[phi(q).phi(k)] = exp(q.k/sqrt d)`:
  the same scale as a softmax numerator, so it can sit beside kept tokens
  under one normaliser (`kvjax.policies.recurrent.FoldedLayer`).
- `hedgehog`: learned, per KV head, separate query and key maps (LESS's
  phi / psi): `phi(x) = exp([xW, -xW] + b)` (Hedgehog's +/- pair with
  an exp output instead of a softmax, so the absolute scale is learned too),
  trained by `models.train_state.train_feature_maps` on a model's own queries
  and keys. A bias per feature carries the scale; it starts at
  `-log(F)/2 - 4`, so an untrained pair multiplies to about e^-8 and training
  starts from eviction alone (the state adds almost nothing) rather than from
  a state that swamps the kept tokens.

A `FeatureMap` is a frozen, hashable value (its parameters are host numpy
arrays, compared by content), so it can be a static field of a cache layer:
jit keys on it, `jax.export` serializes it, and a map with the same numbers
never recompiles.

Example:
    >>> fm = random_features(head_dim=64, features=128, seed=0)
    >>> q = jax.random.normal(jax.random.key(0), (6, 5, 64))  # [B*KVH, N, D]
    >>> phi = fm.query(q, kv_heads=3)
    >>> phi.shape, bool((phi > 0).all())   # [B*KVH, N, F], positive features
    ((6, 5, 128), True)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("elu", "prf", "hedgehog")
LOG_CLIP = 20.0  # learned exp features: |exponent| <= 20, so a feature product stays < e^40
BIAS_OFFSET = 4.0  # untrained learned pair: phi.psi ~ e^-8, so training starts at eviction alone


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureMap:
    """A query map `phi` and a key map `psi` from head_dim `D` to `features` `F`.

    `params` (host numpy arrays, by kind):
      elu: ();  prf: (w [D, F],);
      hedgehog: (wq [KVH, D, F/2], bq [KVH, F], wk [KVH, D, F/2], bk [KVH, F]).
    """

    kind: str
    head_dim: int
    features: int
    params: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"FeatureMap: kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("head_dim", "features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"FeatureMap: {name} must be an int >= 1, got {value!r}")

    # hashed and compared by content: a static field of a jitted pytree
    @functools.cached_property
    def digest(self) -> str:
        h = hashlib.sha256(f"{self.kind}/{self.head_dim}/{self.features}".encode())
        for p in self.params:
            h.update(str(p.shape).encode() + np.ascontiguousarray(p, np.float32).tobytes())
        return h.hexdigest()

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, FeatureMap) and self.digest == other.digest

    def __repr__(self) -> str:
        return f"FeatureMap({self.kind}, D={self.head_dim}, F={self.features}, {self.digest[:8]})"

    @property
    def kv_heads(self) -> int | None:
        """KV heads a learned map has parameters for (None: the same map for every head)."""
        return self.params[0].shape[0] if self.kind == "hedgehog" else None

    def query(self, x: jax.Array, kv_heads: int) -> jax.Array:
        """phi: [R, N, D] grouped queries (row r serves KV head r % kv_heads) -> [R, N, F] f32."""
        return self._apply(x, kv_heads, 0)

    def key(self, x: jax.Array, kv_heads: int) -> jax.Array:
        """psi: [R, N, D] keys (row r = KV head r % kv_heads) -> [R, N, F] f32."""
        return self._apply(x, kv_heads, 2)

    def _apply(self, x: jax.Array, kv_heads: int, which: int) -> jax.Array:
        x = x.astype(jnp.float32)
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"FeatureMap: inputs have head_dim {x.shape[-1]}, the map takes "
                             f"{self.head_dim}")
        if self.kind == "elu":
            return jax.nn.elu(x) + 1.0
        if self.kind == "prf":
            return prf_features(x, jnp.asarray(self.params[0]))
        w, b = (jnp.asarray(p) for p in self.params[which:which + 2])
        if w.shape[0] != kv_heads:
            raise ValueError(f"FeatureMap: a learned map for {w.shape[0]} KV heads cannot serve "
                             f"a layer of {kv_heads}")
        rows = x.shape[0]
        w = jnp.tile(w, (rows // kv_heads, 1, 1))  # [R, D, F/2], row r -> head r % KVH
        b = jnp.tile(b, (rows // kv_heads, 1))
        return hedgehog_features(x, w, b)

    # ---------------------------------------------------------------- serialization

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, *[np.asarray(p, np.float32) for p in self.params])
        header = json.dumps(dict(kind=self.kind, head_dim=int(self.head_dim),
                                 features=int(self.features), n=len(self.params))).encode()
        return len(header).to_bytes(4, "little") + header + buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "FeatureMap":
        n = int.from_bytes(data[:4], "little")
        meta = json.loads(data[4:4 + n])
        arrays = np.load(io.BytesIO(data[4 + n:]))
        params = tuple(arrays[f"arr_{i}"] for i in range(meta.pop("n")))
        return cls(params=params, **meta)


def prf_features(x: jax.Array, w: jax.Array) -> jax.Array:
    """Positive random features of `x` [..., D] with `w` [D, F]: E[phi(q).phi(k)] = exp(q.k/sqrt D).

    The exponent `w.x' - |x'|^2/2` is at most `|w_f|^2 / 2` (about D/2), so it
    never overflows float32.
    """
    d, f = w.shape
    xs = x * d ** -0.25
    expo = xs @ w - 0.5 * jnp.sum(xs * xs, axis=-1, keepdims=True)
    return jnp.exp(expo) * f ** -0.5


def hedgehog_features(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """exp([xW, -xW] + b) for rows `x` [R, N, D], `w` [R, D, F/2], `b` [R, F]."""
    u = jnp.einsum("rnd,rdf->rnf", x, w)
    u = jnp.concatenate([u, -u], axis=-1) + b[:, None, :]
    return jnp.exp(jnp.clip(u, -LOG_CLIP, LOG_CLIP))


# ----------------------------------------------------------------------------- factories


def _check_int(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@functools.lru_cache(maxsize=None)
def elu_map(head_dim: int) -> FeatureMap:
    """elu(x) + 1 on queries and keys (F = D)."""
    _check_int("elu_map: head_dim", head_dim)
    return FeatureMap("elu", head_dim, head_dim)


@functools.lru_cache(maxsize=None)
def random_features(head_dim: int, features: int = 128, seed: int = 0) -> FeatureMap:
    """Positive random features for exp(q.k / sqrt(D)), `w ~ N(0, I)` drawn from `seed`."""
    _check_int("random_features: head_dim", head_dim)
    _check_int("random_features: features", features)
    _check_int("random_features: seed", seed, 0)
    w = np.random.default_rng(seed).standard_normal((head_dim, features)).astype(np.float32)
    return FeatureMap("prf", head_dim, features, (w,))


def hedgehog(kv_heads: int, head_dim: int, features: int = 64, seed: int = 0) -> FeatureMap:
    """A learnable map (untrained: small random weights), per KV head, F = `features` (even)."""
    _check_int("hedgehog: kv_heads", kv_heads)
    _check_int("hedgehog: head_dim", head_dim)
    _check_int("hedgehog: features", features, 2)
    if features % 2:
        raise ValueError(f"hedgehog: features must be even (a +/- pair), got {features}")
    rng = np.random.default_rng(seed)
    half = features // 2
    init = lambda: (rng.standard_normal((kv_heads, head_dim, half)) * head_dim ** -0.75
                    ).astype(np.float32)
    bias = np.full((kv_heads, features), -0.5 * np.log(features) - BIAS_OFFSET, np.float32)
    return FeatureMap("hedgehog", head_dim, features, (init(), bias, init(), bias.copy()))


def with_params(fm: FeatureMap, params: Sequence[Any]) -> FeatureMap:
    """The same kind of map with new parameters (e.g. trained ones), as host numpy."""
    return dataclasses.replace(fm, params=tuple(np.asarray(p, np.float32) for p in params))


# ----------------------------------------------------------------------------- saved maps

MAPS_FILE = "feature_maps.json"


@dataclasses.dataclass
class SavedMaps:
    """Learned maps of every layer, as saved by orbax: `params[i]` = layer i's parameters."""

    params: list  # per layer: [wq, bq, wk, bk] float32 arrays


jax.tree_util.register_dataclass(SavedMaps, data_fields=["params"], meta_fields=[])


def save_maps(path: str | Path, maps: Sequence[FeatureMap]) -> Path:
    """Save per-layer learned maps to directory `path` (orbax `StandardCheckpointer`)."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    if not maps or any(m.kind != "hedgehog" for m in maps):
        raise ValueError("save_maps: need one learned (hedgehog) map per layer")
    path.mkdir(parents=True, exist_ok=True)
    meta = dict(kind="hedgehog", num_layers=len(maps), kv_heads=maps[0].kv_heads,
                head_dim=maps[0].head_dim, features=maps[0].features)
    ckpt = path / "params"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(ckpt, SavedMaps([list(m.params) for m in maps]), force=True)
    (path / MAPS_FILE).write_text(json.dumps(meta, indent=1))
    return path


@functools.lru_cache(maxsize=16)
def load_maps(path: str | Path) -> tuple[FeatureMap, ...]:
    """Per-layer maps saved by `save_maps` (restored into an abstract `SavedMaps` target)."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    meta_file = path / MAPS_FILE
    if not meta_file.is_file():
        raise ValueError(f"feature maps {str(path)!r}: no {MAPS_FILE} there; expected a "
                         f"directory written by `kvjax train-state --out DIR`")
    meta = json.loads(meta_file.read_text())
    template = hedgehog(meta["kv_heads"], meta["head_dim"], meta["features"])
    abstract = SavedMaps([[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in template.params]
                          for _ in range(meta["num_layers"])])
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path / "params", abstract)
    return tuple(with_params(template, layer) for layer in restored.params)


def resolve(name: str | FeatureMap, layer: int, kv_heads: int, head_dim: int,
            features: int = 128, seed: int = 0) -> FeatureMap:
    """The map a method spec names for `layer`: "elu", "prf" (random features) or a saved dir.

    Called at trace time with the cache's static shapes; a learned map is
    checked against them.
    """
    if isinstance(name, FeatureMap):
        fm = name
    elif name == "elu":
        fm = elu_map(head_dim)
    elif name in ("prf", "random"):
        fm = random_features(head_dim, features, seed)
    elif isinstance(name, str) and Path(name).is_dir():
        maps = load_maps(name)
        if not 0 <= layer < len(maps):
            raise ValueError(f"feature maps {name!r} have {len(maps)} layers; layer {layer} "
                             f"has none")
        fm = maps[layer]
    else:
        raise ValueError(f"unknown feature map {name!r}: use 'elu', 'prf' or the directory of "
                         f"maps saved by `kvjax train-state --out DIR`")
    if fm.head_dim != head_dim or (fm.kv_heads is not None and fm.kv_heads != kv_heads):
        raise ValueError(f"feature map {fm} does not fit a layer of {kv_heads} KV heads of "
                         f"head_dim {head_dim}")
    return fm


def check_map_name(name: Any) -> None:
    """Eager ValueError for a map that cannot exist (so a method spec fails at parse time)."""
    if isinstance(name, FeatureMap) or name in ("elu", "prf", "random"):
        return
    if isinstance(name, str) and (Path(name) / MAPS_FILE).is_file():
        return
    raise ValueError(f"unknown feature map {name!r}: use 'elu', 'prf' or the directory of "
                     f"maps saved by `kvjax train-state --out DIR`")


def feature_bytes(fm: FeatureMap) -> int:
    """Bytes of the map's parameters (shared by all sequences; not in a cache's `nbytes`)."""
    return sum(math.prod(p.shape) * 4 for p in fm.params)
