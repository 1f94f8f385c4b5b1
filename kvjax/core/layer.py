"""`CacheLayer`: the one interface every kind of cache layer implements, and their registry.

A model's cache is a tuple with one layer per decoder layer. A layer is an immutable pytree
(a `jax.tree_util.register_dataclass`), so it passes through `jit`, `vmap`, `shard_map`,
`jax.export` and orbax as it is, and every method below is a pure function of it: it returns a
new layer (or an array), never changes this one. Like optax's `GradientTransformation`, the
interface is a few named functions, and the library calls nothing else:

- `write(k_new, v_new, pos_new)`: append tokens `[B, KVH, T, D]` at positions `[B, T]`
  (negative: padding) -> the new layer (`kvjax.write`);
- `attend(q, q_pos, *, impl, window, softcap)`: attention of queries `[B, T, H, D]` over the
  layer with the XLA (`impl="xla"`) or reference (`"reference"`) path -> `[B, T, H, D]`
  float32 (`kvjax.attend`; the Pallas kernels are a backend's business: `kvjax.backends`);
- `view(keep_latent=False)`: the layer's tokens as a dense `TokenCache` (stores decoded, parts
  joined, pages gathered); a `ValueError` for a kind that holds no tokens (a pure recurrent
  state). Monitors, policies and reference paths read layers through it;
- `counters()`: `[B, KVH]` int32 occupancy for monitors -- `tokens`, `slots_used`,
  `capacity`, `pages_device`, `pages_host`, `prefetch_misses` (-1: not meaningful here);
- `free_tokens()`: host side, how many more tokens fit (`kvjax.free_tokens`);
- `check(index, spec, batch)`: a `ValueError` naming the mismatch unless the layer fits a
  model of `spec` (a `CacheSpec`) at `batch` (`kvjax.check_cache`);
- `shardings(mesh, batch_axis, kv_axis)`: the layer with every array leaf replaced by its
  `NamedSharding` (`kvjax.cache_shardings`, `kvjax.shard_cache`);
- `parts()`: the `TokenCache`s that hold the layer's slots, in slot order -- a `TokenCache`
  itself, a `ResidualCache` its encoded body and its exact part -- or `()` when its tokens are
  not dense slots (pages, a recurrent state). Slot-level code reads and rewrites them: the
  blockwise attention, eviction's `compact`, the codecs, the fold transforms (`is_plain`,
  `has_exact_part`);
- `shrink_usage()` / `shrink_plan(usage, room, max_write)` / `resized(plan)`: `kvjax.shrink`
  in three steps, so one host read serves every layer and one compiled program every layer
  of a layout: what to read on the host (jit-able, `None` for nothing), the static, hashable
  cut (host side, may run on a layer of `ShapeDtypeStruct`s), and the cut itself (jit-able).

plus `batch`, `kv_heads`, `head_dim` and `mass` (`[B, KVH, C]` float32 attention each slot
received, which the model accumulates for H2O-style policies, or None when the kind does not
track it: only token layers do). Bytes need no method: `kvjax.nbytes(layer)` counts
every array leaf of any pytree. Moving pages between memory tiers is the pool's operation on
all layers together (`kvjax.memory.tiers.spill`), not a per-layer one.

A new layer kind is one module: a frozen dataclass registered as a pytree, the methods
above, and `register_layer(cls)` (docs/guide/layout.md "Adding a layer kind"; tests/test_layer_protocol.py
builds one). `register_layer` refuses a class that misses a method, and `layer_kinds()`
lists what is registered (a kind registers when its module is imported). The library
dispatches on these methods only: no `hasattr` probe on a layer. (Two places still name
kinds, by design: the Pallas backend's table of the kinds its kernel reads,
`kvjax.backends.pallas.KERNEL_LAYOUTS`, and the fold transforms recognising the two state
kinds they make, in `kvjax.policies.recurrent`.)

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=8, head_dim=4)
    >>> is_layer(layer), isinstance(layer, CacheLayer)
    (True, True)
    >>> layer = layer.write(jnp.ones((1, 1, 3, 4)), jnp.ones((1, 1, 3, 4)), jnp.arange(3)[None])
    >>> layer.free_tokens(), layer.attend(jnp.ones((1, 1, 2, 4)), jnp.array([[2]])).shape
    (5, (1, 1, 2, 4))
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol, runtime_checkable

import jax

EMPTY = -1
"""`pos` value of a slot that holds no token (never written, padding, or evicted)."""

PROTOCOL = ("write", "attend", "view", "counters", "free_tokens", "check", "shardings",
            "shrink_usage", "shrink_plan", "resized", "parts", "replace")
"""The methods every layer kind implements (`register_layer` checks them)."""

PROPERTIES = ("batch", "kv_heads", "head_dim", "mass")
"""The sizes every layer kind reports."""


@runtime_checkable
class CacheLayer(Protocol):
    """One decoder layer's cache; see the module docstring for what each method does.

    A protocol (structural): a class implements it by having the methods, and is used by the
    library once `register_layer` accepted it.
    """

    @property
    def batch(self) -> int: ...  # sequences

    @property
    def kv_heads(self) -> int: ...  # KV heads per sequence

    @property
    def head_dim(self) -> int: ...  # D

    @property
    def mass(self) -> jax.Array | None: ...  # [B, KVH, C] float32 attention received, or None

    def write(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "CacheLayer":
        """Append `k_new`, `v_new` [B, KVH, T, D] at positions `pos_new` [B, T] (< 0: padding)."""

    def attend(self, q: jax.Array, q_pos: jax.Array, *, impl: str = "xla",
               window: int | None = None, softcap: float | None = None) -> jax.Array:
        """[B, T, H, D] float32 attention of `q` [B, T, H, D] at `q_pos` [B, T] over the layer."""

    def view(self, keep_latent: bool = False) -> Any:
        """A dense `TokenCache` of the layer's tokens (ValueError if it holds none)."""

    def counters(self) -> dict[str, jax.Array]:
        """[B, KVH] int32 tokens, slots_used, capacity, pages_device, pages_host,
        prefetch_misses."""

    def free_tokens(self) -> int:
        """Host side: how many more tokens one sequence can write."""

    def check(self, index: int, spec: Any, batch: int) -> None:
        """ValueError naming the mismatch unless the layer fits `spec` at `batch`."""

    def shardings(self, mesh: jax.sharding.Mesh, batch_axis: str | None,
                  kv_axis: str | None) -> "CacheLayer":
        """The layer with each array leaf replaced by its `NamedSharding` on `mesh`."""

    def parts(self) -> tuple[Any, ...]:
        """The `TokenCache`s holding the layer's slots in slot order, or () if none do."""

    def shrink_usage(self) -> Any:
        """Jit-able: what `shrink_plan` reads on the host (None: nothing)."""

    def shrink_plan(self, usage: Any, room: int, max_write: int, align: int = 1) -> Hashable:
        """Host side: the static cut leaving room for `room` tokens, `max_write` per write;
        slot capacities rounded up to a multiple of `align` (a kernel's tile: `kvjax.shrink`)."""

    def resized(self, plan: Hashable) -> "CacheLayer":
        """Jit-able: the layer cut (or grown) by `plan`."""

    def replace(self, **changes: Any) -> "CacheLayer":
        """The layer with some fields replaced (`dataclasses.replace`)."""


_KINDS: list[type] = []


def register_layer(cls: type) -> type:
    """Make `cls` a layer kind the library accepts; returns `cls` (usable as a decorator).

    Raises a TypeError naming what `cls` lacks when it does not implement `CacheLayer`.
    Register the class after `jax.tree_util.register_dataclass`: a layer is a pytree.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_layer: cls must be a class, got {cls!r}")
    missing = [m for m in PROTOCOL if not callable(getattr(cls, m, None))]
    missing += [p for p in PROPERTIES if not hasattr(cls, p)]
    if missing:
        raise TypeError(f"register_layer: {cls.__name__} does not implement CacheLayer: "
                        f"missing {', '.join(missing)}")
    if cls not in _KINDS:
        _KINDS.append(cls)
    return cls


def layer_kinds() -> tuple[type, ...]:
    """Every registered layer kind, in registration order."""
    return tuple(_KINDS)


def is_layer(x: Any) -> bool:
    """True when `x` is an instance of a registered layer kind (the one kind test there is)."""
    return isinstance(x, tuple(_KINDS))


def kind_of(x: Any) -> type | None:
    """The registered layer kind `x` is an instance of, or None when `x` is no layer: how a
    transform meeting a cache it did not make recognises the kinds it makes itself."""
    return next((cls for cls in _KINDS if isinstance(x, cls)), None)


def is_plain(layer: CacheLayer) -> bool:
    """True when `layer` is its own one part (a `TokenCache`): what sliding-window layers,
    RoPE re-rotation and the fold transforms rewrite slot by slot."""
    parts = layer.parts()
    return len(parts) == 1 and parts[0] is layer


def has_exact_part(layer: CacheLayer) -> bool:
    """True for a layer of two parts, an encoded body and an exact part (a KIVI
    `ResidualCache`): what the codecs, the monitor's flush errors and export buckets size."""
    return len(layer.parts()) == 2


def unknown_counters(batch: int, kv_heads: int) -> dict[str, jax.Array]:
    """`counters()` of a layer that holds no tokens: -1 tokens and slots, no pages."""
    import jax.numpy as jnp
    unknown, zero = jnp.full((batch, kv_heads), -1, jnp.int32), jnp.zeros((batch, kv_heads),
                                                                          jnp.int32)
    return dict(tokens=unknown, slots_used=unknown, capacity=unknown, pages_device=zero,
                pages_host=zero, prefetch_misses=zero)
