"""The physical floor a speed number is read against: this machine's memory read bandwidth,
measured in the same run as the number (the load of a shared machine drifts)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def read_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 7) -> float:
    """Median GB/s of a jitted sum over a `nbytes` float32 array (one read pass).

    >>> read_bandwidth_gbs(1 << 20, repeats=3) > 0
    True
    """
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9
