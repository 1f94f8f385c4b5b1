"""The physical floor a speed number is read against: this machine's memory read bandwidth and
float32 matmul throughput, measured in the same run as the number (the load of a shared machine
drifts), and the FLOPs of a prefill."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `fn` (which blocks until its work is done).

    >>> median_seconds(lambda: None, 3) >= 0
    True
    """
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 7) -> float:
    """Median GB/s of a jitted sum over a `nbytes` float32 array (one read pass).

    >>> read_bandwidth_gbs(1 << 20, repeats=3) > 0
    True
    """
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    return nbytes / median_seconds(lambda: total(x).block_until_ready(), repeats) / 1e9


def matmul_gflops(rows: int, inner: int, cols: int, repeats: int = 5) -> float:
    """Median GFLOP/s of a jitted float32 `[rows, inner] @ [inner, cols]` on this machine.

    >>> matmul_gflops(64, 32, 16, repeats=3) > 0
    True
    """
    a = jnp.ones((rows, inner), jnp.float32)
    b = jnp.ones((inner, cols), jnp.float32)
    product = jax.jit(jnp.matmul)
    product(a, b).block_until_ready()
    return 2 * rows * inner * cols / median_seconds(lambda: product(a, b).block_until_ready(),
                                                    repeats) / 1e9


def prefill_flops(cfg, tokens: int) -> dict:
    """FLOPs of one batch-1 causal prefill of `tokens` tokens through a model of config `cfg`
    (a `models.llama.LlamaConfig`): two per weight of every layer's matmuls per token
    ("dense"), causal attention's two products over T (T + 1) / 2 query-key pairs per query
    head and layer ("attention"), the last position's logits ("logits"), and their "total"."""
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = cfg.hidden_size * (h * d + 2 * kvh * d) + h * d * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    dense = 2 * tokens * per_layer * cfg.num_layers
    attention = 2 * 2 * h * d * tokens * (tokens + 1) // 2 * cfg.num_layers
    logits = 2 * cfg.hidden_size * cfg.vocab_size
    return {"dense": dense, "attention": attention, "logits": logits,
            "total": dense + attention + logits}
