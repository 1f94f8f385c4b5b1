"""CAPKV (kvpress CapPress): query-weighted leverage of the values.

A token's weight is how well its key aligns with a historical-query anchor,
`w_t = exp(tau * (cos(k_t, mu_q) - max_t cos))` per query head, where `mu_q`
is the mean pre-RoPE query of the prompt (sinks excluded) rotated by the RoPE
rotation averaged over the next `n_future` positions (as ExpectedAttention
does). Its score is `w_t * v_t' A^-1 v_t` with the capacity matrix
`A = I + sum_t (w_t + epsilon) v_t v_t'`: the weighted leverage of its value
among the others. Scores are averaged over the query heads of each KV head;
the first `sinks` tokens are kept.

Example:
    >>> t = cap(ratio=0.5)                 # kvpress CapPress(compression_ratio=0.5)
    >>> t.stats.query_moments, t.stats.moments_skip
    (True, 4)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.core.cache import EMPTY
from kvjax.core.stats import StatsSpec, mean_rotation, rope_inv_freq
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import check_int, check_real, earliest, scored_policy

NORM_EPS = 1e-12  # torch.nn.functional.normalize's eps


def _normalize(x: jax.Array) -> jax.Array:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), NORM_EPS)


def capacity_leverage(values: jax.Array, weights: jax.Array, scored: jax.Array,
                      epsilon: float) -> jax.Array:
    """[B, KVH, G, C] `v_t' A^-1 v_t` with `A = I + sum_t (w_t + eps) v_t v_t'` over the
    scored slots, per query head.

    Args:
      values: [B, KVH, C, D]; weights [B, KVH, G, C]; scored [B, KVH, C] bool.

    Example:
        >>> import jax.numpy as jnp
        >>> v = jnp.array([[[[2.0], [0.0]]]])              # 2 tokens, D = 1
        >>> w = jnp.ones((1, 1, 1, 2)); ok = jnp.array([[[True, True]]])
        >>> capacity_leverage(v, w, ok, 0.0).tolist()     # 4 / (1 + 4)
        [[[[0.800000011920929, 0.0]]]]
    """
    d = values.shape[-1]
    v = jnp.where(scored[..., None], values.astype(jnp.float32), 0.0)  # [B, KVH, C, D]
    w = jnp.where(scored[:, :, None], weights + epsilon, 0.0)  # [B, KVH, G, C]
    a = jnp.eye(d, dtype=jnp.float32) + jnp.einsum("bkgc,bkcd,bkce->bkgde", w, v, v)
    solution = jnp.linalg.solve(a, jnp.broadcast_to(
        jnp.swapaxes(v, -1, -2)[:, :, None], a.shape[:-1] + (v.shape[2],)))  # [B, KVH, G, D, C]
    return jnp.einsum("bkdc,bkgdc->bkgc", jnp.swapaxes(v, -1, -2), solution)


@dataclasses.dataclass(frozen=True)
class CapScorer:
    """CAPKV scores (see module docstring); the first `sinks` tokens protected."""

    tau: float = 5.0
    n_future: int = 512
    sinks: int = 4
    epsilon: float = 1e-6

    def __call__(self, layer, stats, budget, key):
        if stats is None or stats.q_sum.shape[-1] == 0:
            raise ValueError("cap needs the mean of the prompt's queries: run the model with "
                             "StatsSpec(query_moments=True) (the sampler does this)")
        b, kvh, c = layer.pos.shape
        d = layer.head_dim
        mean = stats.q_sum / jnp.maximum(stats.q_count, 1.0)[:, None, None]  # [B, H, D]
        start = jnp.max(layer.pos, axis=(1, 2)) + 1  # [B] the next position
        rot = mean_rotation(rope_inv_freq(stats, "cap"), start, self.n_future)  # [B, D, D]
        anchor = jnp.einsum("bij,bhj->bhi", rot, mean).reshape(b, kvh, -1, d)  # [B, KVH, G, D]
        keys = jnp.broadcast_to(layer.logical_k.astype(jnp.float32), (b, kvh, c, d))
        sink = earliest(layer.pos, self.sinks)
        scored = (layer.pos != EMPTY) & ~sink  # [B, KVH, C]
        cos = jnp.einsum("bkgd,bkcd->bkgc", _normalize(anchor), _normalize(keys))
        logits = self.tau * jnp.clip(cos, -1.0, 1.0)
        top = jnp.max(jnp.where(scored[:, :, None], logits, -jnp.inf), axis=-1, keepdims=True)
        weights = jnp.where(scored[:, :, None], jnp.exp(logits - top), 0.0)  # [B, KVH, G, C]
        values = jnp.broadcast_to(layer.logical_v.astype(jnp.float32), (b, kvh, c, d))
        lev = capacity_leverage(values, weights, scored, self.epsilon)
        return jnp.where(scored, (weights * lev).mean(axis=2), 0.0), sink


def cap(ratio: float | None = None, budget: int | None = None, tau: float = 5.0,
        n_future: int = 512, sinks: int = 4, epsilon: float = 1e-6,
        **options) -> CacheTransform:
    """CAPKV (kvpress CapPress): keep the values with the largest query-weighted leverage.

    As kvpress CapPress(compression_ratio=ratio, tau, n_future_positions=n_future,
    n_sink=sinks, epsilon).
    """
    check_real("cap", "tau", tau, 0.0)
    check_int("cap", "n_future", n_future)
    check_int("cap", "sinks", sinks, 0)
    check_real("cap", "epsilon", epsilon, 0.0)
    return scored_policy("cap", CapScorer(float(tau), n_future, sinks, float(epsilon)),
                         ratio=ratio, budget=budget,
                         stats=StatsSpec(query_moments=True, moments_skip=sinks), **options)
