"""Greedy decoding of a real model over a paged or tiered cache, a share of the pages kept in
host memory after every step: the decode loops of tests/test_offload.py's token-identity tests
(moved here from experiments/bench/offload.py: tests import no benchmark script)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import kvjax
from kvjax.memory.paging import init_paged_cache, reserve
from kvjax.memory.tiers import (host_pages_in_use, init_tiered_cache, keep_on_host, prefetch,
                                tier_counts)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, state, tokens, positions, cache):
    model = nnx.merge(graphdef, state)
    h, cache, _ = model.forward(tokens, positions, cache)
    return jnp.argmax(model.logits(h[:, -1]), -1).astype(jnp.int32), cache


def _keep_on_host(pool, layers, fraction: float):
    """Spill the coldest pages (by recency) until `fraction` of the allocated pages are on
    the host (as far as spillable pages allow): `kvjax.memory.tiers.keep_on_host`, one jitted call."""
    return keep_on_host(pool, layers, fraction)


def greedy_paged(model, prompt, steps: int, *, page_size: int = 16, host_fraction: float = 0.5,
                 bits: int | None = None, prefetch_pages: bool = True):
    """Greedy tokens of `model` for one prompt over a paged cache, `host_fraction` of whose
    pages are kept in host memory after every step (0: a plain all-device pool).

    Returns (tokens, info): info has `host_share` (after each step's spill: the share of
    allocated pages the next step finds on the host), `misses` (host pages read
    without a staged copy, summed over layers and heads) and the final `tier_counts`."""
    cfg = model.config
    need = -(-(len(prompt) + steps) // page_size)
    rows = cfg.num_kv_heads
    pages = rows * need + 2
    args = (page_size, 1, cfg.num_kv_heads, need, cfg.head_dim, cfg.num_layers)
    if host_fraction > 0:
        pool, cache = init_tiered_cache(pages, pages, *args, bits=bits, group=32)
    else:
        pool, cache = init_paged_cache(2 * pages, *args, bits=bits, group=32)
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray([prompt], jnp.int32)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    out, share, misses = [], [], 0
    for step in range(steps):
        pool, cache = reserve(pool, cache, jnp.array([tokens.shape[1]]))
        if host_fraction > 0 and prefetch_pages:
            cache = prefetch(cache, host_pages_in_use(cache[0]))  # what this step reads
        token, cache = _forward(graphdef, state, tokens, positions, cache)
        kvjax.check_pool(pool)
        if host_fraction > 0:  # spill what this step wrote and made cold: the next step reads
            pool, cache = _keep_on_host(pool, cache, host_fraction)  # from both tiers
            counts = tier_counts(pool, cache[0])
            share.append(counts["host"] / counts["allocated"])
        out.append(int(token[0]))
        tokens, positions = token[:, None], positions[:, -1:] + 1
    if host_fraction > 0:
        misses = int(sum(int(l.misses.sum()) for l in cache))
    kvjax.check_pool(pool, cache)
    return out, {"host_share": share, "misses": misses,
                 "tier_counts": tier_counts(pool, cache[0])}


def greedy_kivi(model, prompt, steps: int, method: str, *, host_fraction: float | None = None,
                prefetch_pages: bool = True):
    """Greedy tokens of `model` for one prompt compressed by a KIVI `method` (e.g.
    ``"snapkv:ratio=0.5+kivi:bits=4,group=16,residual=16"``): `host_fraction=None` decodes
    over the unpaged KIVI cache; a number loads it into pages (`kvjax.memory.paged_kivi`) and keeps
    that share of the allocated pages in host memory after every step (0: all on device).

    Returns (tokens, info) as `greedy_paged` (info empty for the unpaged run)."""
    from kvjax.policies.methods import parse_method
    from kvjax.memory.paged_kivi import bodies, flush_tokens, from_residual, with_bodies
    from models.sampler import prefill_and_compress
    pre = prefill_and_compress(model, [prompt], transform=parse_method(method), room=steps)
    cache = pre.cache
    token = jnp.argmax(pre.logits, -1).astype(jnp.int32)
    paged = host_fraction is not None
    tiered = paged and host_fraction > 0
    if paged:
        first = cache[0]
        need = -(-(first.body.capacity + steps) // first.block) + 1  # pages per row
        pages = first.batch * first.kv_heads * need + 2
        pool, cache = from_residual(cache, max_pages=need, device_pages=pages,
                                    host_pages=pages if tiered else 0)
    graphdef, state = nnx.split(model)
    positions = jnp.asarray(pre.next_pos, jnp.int32)[:, None]
    out, share = [int(token[0])], []
    for step in range(steps - 1):
        if paged:
            pool, b = reserve(pool, bodies(cache), flush_tokens(cache))
            if tiered and prefetch_pages:
                b = prefetch(b, host_pages_in_use(b[0]))  # what this step reads
            cache = with_bodies(cache, b)
        token, cache = _forward(graphdef, state, token[:, None], positions, cache)
        if tiered:
            pool, b = _keep_on_host(pool, bodies(cache), host_fraction)
            cache = with_bodies(cache, b)
            counts = tier_counts(pool, b[0])
            share.append(counts["host"] / max(counts["allocated"], 1))
        out.append(int(token[0]))
        positions = positions + 1
    if not paged:
        return out, {}
    kvjax.check_pool(pool, bodies(cache))
    misses = int(sum(int(l.body.misses.sum()) for l in cache)) if tiered else 0
    return out, {"host_share": share, "misses": misses,
                 "tier_counts": tier_counts(pool, cache[0].body)}
