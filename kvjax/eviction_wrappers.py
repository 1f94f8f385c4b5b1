"""Wrapper presses: methods that take another scored method (kvpress 0.5.5's wrappers).

* `block` (kvpress BlockPress): compress block by block, as a prompt read in
  blocks would be: start from the first `budget` tokens, then for each next
  block of `block_size` tokens score the kept tokens plus the block with the
  inner scorer (it sees only those tokens) and keep the best `budget`.

The inner method is named by its registered name (`inner="keydiff"`) and
runs at its defaults; it must be a scored policy (`kvjax.eviction`).

Example:
    >>> t = block(inner="keydiff", ratio=0.5)     # the KeyDiff paper's block-wise prefill
    >>> t.update.scorer.block_size
    128
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import EMPTY
from kvjax.eviction import Scorer, ScoredUpdate, check_int, scored_policy
from kvjax.eviction_sequence import gather, in_sequence, to_slots
from kvjax.selection import rank
from kvjax.stats import StatsSpec
from kvjax.transforms import CacheTransform


def _inner(name: str, wrapper: str, ratio: float | None) -> tuple[Scorer, StatsSpec]:
    """(scorer, stats) of the registered scored method `name` at its defaults (and the
    wrapper's ratio, for scorers that depend on it: Compactor's blending)."""
    from kvjax.methods import METHODS, did_you_mean

    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"{wrapper}: inner={name!r} is not a registered method"
                         f"{did_you_mean(str(name), METHODS)}; give a scored policy such as "
                         f"inner=keydiff")
    try:
        transform = METHODS[name](ratio=0.5 if ratio is None else ratio)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{wrapper}: inner={name!r} takes no ratio, so it is not a scored "
                         f"policy ({e})") from None
    if not isinstance(transform.update, ScoredUpdate) or transform.update.headwise:
        raise ValueError(f"{wrapper}: inner={name!r} is not a per-head scored policy")
    return transform.update.scorer, transform.stats


def _keep_best(scores, protect, valid, budget) -> jax.Array:
    """[B, KVH, C] the `budget` [B, KVH] best valid slots, protected ones first."""
    scores = jnp.where(protect, jnp.inf, scores.astype(jnp.float32))
    return (rank(scores, valid) < budget[..., None]) & valid


@dataclasses.dataclass(frozen=True)
class BlockScorer:
    """BlockPress around `inner`: iterative block-wise selection; scores 1 = kept, 0 = not."""

    inner: Scorer
    block_size: int = 128

    def __call__(self, layer, stats, budget, key):
        seq = in_sequence(layer)
        b, kvh, c = seq.order.shape
        i = jnp.arange(c)[None, None]  # token index
        n_kept = jnp.minimum(budget.reshape(-1, 1), seq.n)  # [B, KVH]
        kept = seq.valid & (i < n_kept[..., None])  # the first n_kept tokens

        def step(s, kept):
            lo = n_kept + s * self.block_size
            block = seq.valid & (i >= lo[..., None]) & (i < lo[..., None] + self.block_size)
            current = kept | block  # token order
            sub = layer.replace(pos=to_slots(seq, jnp.where(current, seq.pos, EMPTY)))
            scores, protect = self.inner(sub, stats, budget, key)
            keep = _keep_best(scores, protect, sub.pos != EMPTY, n_kept)  # slots
            return gather(seq, keep[..., None])[..., 0]

        steps = -(-c // self.block_size)
        kept = jax.lax.fori_loop(0, steps, step, kept)
        return to_slots(seq, kept.astype(jnp.float32)), jnp.zeros(seq.valid.shape, bool)


def block(inner: str = "keydiff", ratio: float | None = None, budget: int | None = None,
          block_size: int = 128, **options) -> CacheTransform:
    """BlockPress (KeyDiff paper, Park et al. 2025): compress block by block with `inner`.

    As kvpress BlockPress(press=INNER(compression_ratio=ratio), block_size).
    kvpress hands the kept tokens to the next block's scoring in score order;
    kvjax in position order: scorers that read neighbours (LagKV, CUR, SnapKV's
    window) differ there, order-free ones (KeyDiff, Knorm) do not.
    """
    check_int("block", "block_size", block_size, 1)
    scorer, stats = _inner(inner, "block", ratio)
    return scored_policy("block", BlockScorer(scorer, block_size), ratio=ratio, budget=budget,
                         stats=stats, **options)
