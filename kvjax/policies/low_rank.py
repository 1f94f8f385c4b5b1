"""Low-rank K/V: per-layer, per-KV-head bases from calibration caches, and the codec.

The basis of a head is the top right singular vectors of the matrix of its
cached vectors (keys after RoPE, or values) stacked over calibration tokens:
the eigenvectors of the second moment `X^T X`, sorted by eigenvalue. A rank-r
store keeps `z = x P_r` per token; attention scores `q . (P_r z)` are computed
as `(P_r^T q) . z`, exactly, and values are lifted after weighting.

Keys are taken after RoPE because that is what the cache holds and what
makes latent scoring exact. (Pre-RoPE keys are lower-rank, as Palu notes, but
then RoPE must be re-applied after reconstruction, so scores would need the
full keys.) DECISIONS.md records this.

Example:
    >>> import kvjax, os, tempfile
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 8), batch=1, capacity=32)
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 32, 8))   # [B, KVH, T, D]
    >>> cache = tuple(kvjax.write(c, k, v, jnp.arange(32)[None]) for c in cache)
    >>> moments = None
    >>> for c in [cache]:                      # dense caches of calibration text, after prefill
    ...     moments = accumulate_moments(moments, c)
    >>> basis = basis_from_moments(moments)                  # LowRankBasis
    >>> path = os.path.join(tempfile.mkdtemp(), "basis.npz")
    >>> basis.save(path); basis = LowRankBasis.load(path)
    >>> basis.keys.shape, basis.tokens                       # [L, KVH, D, D], tokens per head
    ((2, 1, 8, 8), 32)
    >>> t = low_rank(basis, rank=4)
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.cache import EMPTY, Cache
from kvjax.policies.codecs import Codec, _codec_transform
from kvjax.core.transforms import CacheTransform


class LowRankBasis(NamedTuple):
    """Full orthonormal bases, columns sorted by the energy they capture."""

    keys: np.ndarray  # [L, KVH, D, D] float32; column j of [l, h] is basis vector j
    values: np.ndarray  # [L, KVH, D, D]
    key_energy: np.ndarray  # [L, KVH, D] eigenvalues of K^T K (descending)
    value_energy: np.ndarray  # [L, KVH, D]
    tokens: int  # calibration tokens per sequence and head that made it

    def save(self, path: str | Path) -> None:
        np.savez(path, keys=self.keys, values=self.values, key_energy=self.key_energy,
                 value_energy=self.value_energy, tokens=self.tokens)

    @classmethod
    def load(cls, path: str | Path) -> "LowRankBasis":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no low-rank basis at {path}; make one with "
                                    f"`kvjax calibrate --out {path}`")
        with np.load(path) as f:
            return cls(f["keys"], f["values"], f["key_energy"], f["value_energy"],
                       int(f["tokens"]))

    def captured(self, rank: int) -> tuple[float, float]:
        """Mean fraction of key and value energy the first `rank` vectors keep."""
        frac = lambda e: float(np.mean(e[..., :rank].sum(-1) / np.maximum(e.sum(-1), 1e-30)))
        return frac(self.key_energy), frac(self.value_energy)


@jax.jit
def _layer_moments(k: jax.Array, v: jax.Array, pos: jax.Array):
    """Second moments [KVH, D, D] of one layer's valid keys and values, summed over the batch."""
    b, kvh, c = pos.shape
    valid = (pos != EMPTY).astype(jnp.float32).reshape(b, kvh, c, 1)
    kk = k.astype(jnp.float32).reshape(b, kvh, c, -1) * valid
    vv = v.astype(jnp.float32).reshape(b, kvh, c, -1) * valid
    return (jnp.einsum("bhcd,bhce->hde", kk, kk), jnp.einsum("bhcd,bhce->hde", vv, vv),
            valid.sum())


def accumulate_moments(moments, cache: Cache):
    """Add a dense cache's per-layer key and value second moments (float64 on the host)."""
    out = []
    for i, layer in enumerate(cache):
        if layer.pooled:
            raise ValueError("calibration needs per-head caches (no head-wise eviction)")
        kk, vv, n = (np.asarray(x, np.float64) for x in _layer_moments(layer.k, layer.v, layer.pos))
        out.append((kk, vv, n) if moments is None else
                   (moments[i][0] + kk, moments[i][1] + vv, moments[i][2] + n))
    return out


def basis_from_moments(moments) -> LowRankBasis:
    """Eigen-decompose accumulated moments into sorted per-head bases."""
    def eig(m):  # [KVH, D, D] -> vectors, values (descending)
        w, u = np.linalg.eigh(m)
        return u[..., ::-1].astype(np.float32), np.maximum(w[..., ::-1], 0).astype(np.float32)

    keys, kvals, values, vvals = [], [], [], []
    for kk, vv, _ in moments:
        (ku, kw), (vu, vw) = eig(kk), eig(vv)
        keys.append(ku), kvals.append(kw), values.append(vu), vvals.append(vw)
    kvh = moments[0][0].shape[0]
    tokens = int(moments[0][2] // kvh)
    return LowRankBasis(np.stack(keys), np.stack(values), np.stack(kvals), np.stack(vvals), tokens)


def low_rank(basis: LowRankBasis, rank: int, key_rank: int | None = None,
             value_rank: int | None = None) -> CacheTransform:
    """Store keys and values as rank-r coordinates on calibrated per-head bases.

    `rank` applies to both unless `key_rank` / `value_rank` override it. A
    rank equal to head_dim is lossless (up to float rounding).

    Example:
        >>> import kvjax
        >>> eye = np.broadcast_to(np.eye(8, dtype=np.float32), (2, 1, 8, 8))  # [L, KVH, D, D]
        >>> energy = np.ones((2, 1, 8), np.float32)
        >>> t = low_rank(LowRankBasis(eye, eye, energy, energy, tokens=1), rank=4)  # D / 2
        >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 8), batch=1, capacity=32)
        >>> small, _ = t.update(cache, t.init(cache), None)
        >>> kvjax.nbytes(cache), kvjax.nbytes(small)  # k, v 32x8 -> 32x4 floats, + 8x4 bases
        (4360, 2824)
    """
    d = basis.keys.shape[-1]
    ranks = (key_rank or rank, value_rank or rank)
    if any(not 1 <= r <= d for r in ranks):
        raise ValueError(f"low_rank: ranks {ranks} must be in [1, head_dim={d}]")

    def init(cache: Sequence) -> tuple:
        if len(cache) != basis.keys.shape[0]:
            raise ValueError(f"low_rank: the basis has {basis.keys.shape[0]} layers, the cache "
                             f"{len(cache)}")
        if cache[0].kv_heads != basis.keys.shape[1] or cache[0].head_dim != d:
            raise ValueError(f"low_rank: the basis is for {basis.keys.shape[1]} KV heads of "
                             f"dim {d}, the cache has {cache[0].kv_heads} of {cache[0].head_dim}")
        return tuple((jnp.asarray(basis.keys[i, ..., :ranks[0]]),
                      jnp.asarray(basis.values[i, ..., :ranks[1]])) for i in range(len(cache)))

    latent = Codec("latent")
    return _codec_transform((latent, latent), init=init)
