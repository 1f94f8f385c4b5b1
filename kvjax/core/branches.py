"""Conditionals a decode step rarely takes, named so that a byte count can leave them out.

A decode step holds a few `lax.cond`s whose usual branch does nothing: a residual layer
flushes a block into its body once every `block` steps, a host tier fetches only on a
miss, a paged layer scrubs a page only when a row starts one, the TPU kernel falls back
to XLA's block loop only when eviction spread a page's KIVI groups. XLA's static cost
analysis charges a conditional its larger branch, so a step's counted bytes are those of
a step taking every rare branch at once. `rare_cond(pred, rare, usual, *operands)` is
`lax.cond(pred, rare, usual, *operands)`; inside `usual_branches_only()` it traces
`usual(*operands)` alone, so a compiled step counts what the common step moves
(`kvjax compile --step-bytes`). For counting only: a program traced that way is wrong
whenever `pred` is true.

Example:
    >>> import jax.numpy as jnp
    >>> flush = lambda x: x * 0
    >>> f = lambda x: rare_cond(x[0] > 5, flush, lambda x: x, x)
    >>> f(jnp.array([9.0])).tolist(), f(jnp.array([1.0])).tolist()
    ([0.0], [1.0])
    >>> with usual_branches_only():
    ...     f(jnp.array([9.0])).tolist()
    [9.0]
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax

_USUAL_ONLY = contextvars.ContextVar("kvjax_usual_branches_only", default=False)


def rare_cond(pred, rare: Callable, usual: Callable, *operands) -> Any:
    """`lax.cond(pred, rare, usual, *operands)`, or `usual(*operands)` alone inside
    `usual_branches_only()`."""
    if _USUAL_ONLY.get():
        return usual(*operands)
    return jax.lax.cond(pred, rare, usual, *operands)


@contextlib.contextmanager
def usual_branches_only() -> Iterator[None]:
    """Trace every `rare_cond` as its usual branch (to count a common step's bytes; never
    to run: the program is wrong whenever a rare branch was due)."""
    token = _USUAL_ONLY.set(True)
    try:
        yield
    finally:
        _USUAL_ONLY.reset(token)
