"""Weights and caches on a device mesh: `--mesh data=2,model=4`.

A mesh has up to two named axes: `data` splits the batch (sequences), `model`
splits the weights (Megatron-style: attention heads, MLP hidden units, the
vocabulary) and the KV cache. The rules, by parameter path:

| weight | shape | split |
|---|---|---|
| `attn.q_proj/k_proj/v_proj.kernel` | [hidden, heads*D] | columns over `model` (whole heads) |
| `attn.o_proj.kernel` | [heads*D, hidden] | rows over `model` (partial sums, one all-reduce) |
| `mlp.gate_proj/up_proj.kernel` | [hidden, I] | columns over `model` |
| `mlp.down_proj.kernel` | [I, hidden] | rows over `model` (one all-reduce) |
| `embed` | [V, hidden] | rows (vocabulary) over `model` |
| `lm_head.kernel` | [hidden, V] | columns over `model` |
| norms, anything else | | replicated |

Attention weights are split by head only when the KV heads divide evenly over
`model` (then every shard holds whole GQA groups: its query heads and the KV
heads they read); otherwise (SmolLM2: 3 KV heads, `model=4`) they are
replicated and only the MLP and vocabulary are split. A dimension that the
axis does not divide is never split. Weights are replicated over `data`.

The cache follows `kvjax.shard_cache` (the rule is stated there): sequences over
`data`, then KV heads over `model` when each data shard holds one sequence and
the KV heads divide, else whole sequences over `data` x `model`, else
sequences over `data` only (replicated over `model`).

The mesh uses `AxisType.Auto` on purpose: `jax.make_mesh` defaults to Explicit
axes, under which every reshape of a sharded activation in models/llama.py
(`[B, T, H*D] -> [B, T, H, D]`) must be told its output sharding; with Auto axes
the model code stays mesh-agnostic and XLA's sharding propagation inserts the
collectives (checked by tests/test_sharding.py: tokens equal one device's, no
all-gather of cache tensors).

Example:
    >>> parse_mesh("data=2,model=4")
    (('data', 2), ('model', 4))
    >>> cfg = LlamaConfig.smollm2_135m()
    >>> param_spec(("layers", 0, "attn", "q_proj", "kernel"), (576, 576), cfg, 4)  # 3 KV heads
    P()
    >>> param_spec(("layers", 0, "mlp", "up_proj", "kernel"), (576, 1536), cfg, 4)
    P(None, 'model')
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import kvjax
from kvjax.core.cache import Cache, cache_shardings as _cache_shardings
from models.llama import Llama, LlamaConfig

AXES = ("data", "model")
"""Mesh axis names: `data` splits sequences, `model` splits weights and KV heads."""

_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
_ROWS = ("o_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """`"data=2,model=4"` -> (("data", 2), ("model", 4)); a missing axis has size 1.

    Raises ValueError naming the bad part (axis names are `data` and `model`,
    sizes positive integers).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"mesh {text!r}: expected AXIS=SIZE[,AXIS=SIZE] with AXIS in {AXES}")
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or name not in AXES or name in sizes:
            raise ValueError(f"mesh {text!r}: bad part {part.strip()!r}; expected AXIS=SIZE "
                             f"with AXIS one of {AXES}, each once")
        try:
            sizes[name] = int(size)
        except ValueError:
            sizes[name] = 0
        if sizes[name] < 1 or str(sizes[name]) != size.strip():
            raise ValueError(f"mesh {text!r}: size of {name!r} must be an integer >= 1, "
                             f"got {size.strip()!r}")
    return tuple((name, sizes.get(name, 1)) for name in AXES)


def make_mesh(spec: str | Sequence[tuple[str, int]], devices: Sequence[Any] | None = None) -> Mesh:
    """A `("data", "model")` mesh with Auto axes over `devices` (default: all devices).

    The axis sizes must multiply to the device count (ValueError otherwise).

    Example:
        >>> dict(make_mesh("data=1,model=1").shape)
        {'data': 1, 'model': 1}
    """
    axes = parse_mesh(spec) if isinstance(spec, str) else tuple(spec)
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(size for _, size in axes)
    if math.prod(shape) != len(devices):
        raise ValueError(f"needs {math.prod(shape)} devices "
                         f"({' x '.join(f'{a}={n}' for a, n in axes)}), "
                         f"{len(devices)} available (set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count=N for fake CPU devices)")
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, tuple(name for name, _ in axes),
                axis_types=(AxisType.Auto,) * len(axes))


def attention_split(cfg: LlamaConfig, model_size: int) -> bool:
    """True when attention weights are split by head: KV heads (hence whole GQA groups) divide."""
    return model_size > 1 and cfg.num_kv_heads % model_size == 0


def param_spec(path: Sequence[Any], shape: Sequence[int], cfg: LlamaConfig,
               model_size: int) -> P:
    """The PartitionSpec of the weight at state path `path` (rules in the module docstring)."""
    names = [str(p) for p in path]
    if model_size <= 1 or not shape:
        return P()
    module = names[-2] if len(names) >= 2 else names[-1]
    if module in _ATTENTION and not attention_split(cfg, model_size):
        return P()
    if names[-1] == "embed" and shape[0] % model_size == 0:
        return P("model", None)
    if names[-1] == "bias" and module in _COLUMNS and shape[0] % model_size == 0:
        return P("model")
    if names[-1] != "kernel" or len(shape) != 2:
        return P()
    if module in _COLUMNS and shape[1] % model_size == 0:
        return P(None, "model")
    if module in _ROWS and shape[0] % model_size == 0:
        return P("model", None)
    return P()


def _axis_size(mesh: Mesh, name: str) -> int:
    return dict(mesh.shape).get(name, 1)


def state_shardings(model_or_state: Any, cfg: LlamaConfig, mesh: Mesh) -> Any:
    """The NamedSharding of every leaf of an NNX state (a tree of the same structure)."""
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state)
    m = _axis_size(mesh, "model")
    flat = nnx.to_flat_state(state)
    return nnx.from_flat_state([
        (path, NamedSharding(mesh, param_spec(path, var.shape, cfg, m))) for path, var in flat])


def _place(value: Any, sharding: NamedSharding) -> jax.Array:
    """Put a whole host value on `sharding`: each process builds only its addressable shards."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_model(model: Llama, mesh: Mesh) -> Llama:
    """A copy of `model` with every weight placed on `mesh` by `param_spec`.

    In a multi-process run each process materializes only the shards of its own
    devices (`jax.make_array_from_callback`); it still reads the whole weight
    file on the host (GGUF blocks are dequantized whole), which bounds host, not
    device, memory.

    Example:
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> sharded = shard_model(model, make_mesh("data=1,model=1"))
        >>> sharded.layers[0].mlp.up_proj.kernel.get_value().sharding.spec
        P()
    """
    graphdef, state = nnx.split(model)
    shardings = dict(nnx.to_flat_state(state_shardings(state, model.config, mesh)))
    flat = list(nnx.to_flat_state(state))
    placed = []
    for path, var in flat:
        placed.append((path, var.replace(_place(var.get_value(), shardings[path]))))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def abstract_model(cfg: LlamaConfig, mesh: Mesh, dtype: Any = jax.numpy.float32):
    """(graphdef, state of ShapeDtypeStructs carrying their shardings): a model by shape alone.

    No weight is materialized (`nnx.eval_shape`), so a Llama-3-70B-shaped
    decoder can be compiled for a TPU pod slice on a laptop.

    Example:
        >>> g, s = abstract_model(LlamaConfig.tiny(), make_mesh("data=1,model=1"))
        >>> type(s["embed"].get_value()).__name__
        'ShapeDtypeStruct'
    """
    abstract = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    m = _axis_size(mesh, "model")
    flat = [(path, var.replace(jax.ShapeDtypeStruct(
                var.shape, var.dtype,
                sharding=NamedSharding(mesh, param_spec(path, var.shape, cfg, m)))))
            for path, var in nnx.to_flat_state(state)]
    return graphdef, nnx.from_flat_state(flat)


def cache_placer(mesh: Mesh) -> Callable[[Cache], Cache]:
    """`place_cache` for `models.sampler.generate`: the cache split by `kvjax.shard_cache`."""
    return functools.partial(kvjax.shard_cache, mesh=mesh,
                             batch_axis="data" if "data" in mesh.axis_names else None,
                             kv_axis="model" if "model" in mesh.axis_names else None)


def cache_shardings(cache: Cache, mesh: Mesh) -> Any:
    """The shardings `cache_placer(mesh)` gives `cache` (arrays or ShapeDtypeStructs)."""
    return _cache_shardings(cache, mesh,
                                 batch_axis="data" if "data" in mesh.axis_names else None,
                                 kv_axis="model" if "model" in mesh.axis_names else None)


@functools.lru_cache(maxsize=None)
def _pinned_update(update: Callable, mesh: Mesh) -> Callable:
    def pinned(cache, state, stats=None):
        cache, state = update(cache, state, stats)
        return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh)), state
    return pinned


def on_mesh(transform: kvjax.CacheTransform, mesh: Mesh) -> kvjax.CacheTransform:
    """`transform` whose output cache is pinned to the `cache_placer(mesh)` layout.

    Inside jit a compression's output layout is otherwise XLA's choice (it may
    split a compacted cache over slots); pinning keeps every later step
    shard-local. `full()` is returned unchanged (nothing to pin; the samplers
    test `transform is full()`). The same arguments give the same object, so
    jitted code keyed on the update does not recompile.
    """
    if transform is kvjax.full():
        return transform
    return transform._replace(update=_pinned_update(transform.update, mesh))


def collectives(hlo_text: str) -> list[tuple[str, str]]:
    """(op, result shape) of every collective in compiled HLO text (all-gather, all-reduce,
    all-to-all, collective-permute, reduce-scatter), e.g. ("all-gather", "f32[8,64,32]")."""
    import re
    ops = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
    found = []
    for line in hlo_text.splitlines():
        m = re.search(rf"=\s*(\(?[^=]*?\)?)\s+({ops})(-start|-done)?\(", line)
        if m and m.group(3) != "-done":
            found.append((m.group(2), m.group(1).strip()))
    return found


ENV = ("KVJAX_COORDINATOR", "KVJAX_NUM_PROCESSES", "KVJAX_PROCESS_ID", "KVJAX_LOCAL_DEVICES")
"""Environment of a multi-process run (set by `kvjax launch`): coordinator host:port,
process count, this process's id, and fake CPU devices per process (0 = the platform's)."""


def init_distributed(environ: dict | None = None) -> bool:
    """`jax.distributed.initialize` from `KVJAX_*` variables; False (nothing done) without them.

    Call before anything touches a device. With `KVJAX_LOCAL_DEVICES=n` each process
    gets n CPU devices (`jax_num_cpu_devices`); CPU collectives go over gloo.
    """
    import os
    env = os.environ if environ is None else environ
    if not env.get("KVJAX_COORDINATOR"):
        return False
    try:
        count, index = int(env["KVJAX_NUM_PROCESSES"]), int(env["KVJAX_PROCESS_ID"])
        local = int(env.get("KVJAX_LOCAL_DEVICES", "0"))
    except (KeyError, ValueError) as e:
        raise ValueError(f"multi-process run: {ENV[1]} and {ENV[2]} must be integers "
                         f"({e})") from None
    if not 0 <= index < count:
        raise ValueError(f"multi-process run: {ENV[2]}={index} must be in [0, {count})")
    if local:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", local)
    # generous timeouts: on a loaded host one process may finish minutes after the other
    jax.distributed.initialize(coordinator_address=env["KVJAX_COORDINATOR"],
                               num_processes=count, process_id=index,
                               heartbeat_timeout_seconds=600, shutdown_timeout_seconds=1800)
    return True


def gather_to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) array as one host numpy array on every process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def pallas_impl(mesh: Mesh, *, backend: str | None = None,
                interpret: Any = False) -> kvjax.PallasOnMesh:
    """`impl=` for the samplers and `kvjax.attend`: the Pallas kernel per shard of `mesh`.

    `generate(sharded, prompts, place_cache=cache_placer(mesh), impl=pallas_impl(mesh))`
    runs attention in the kernel on each device's block of the cache
    (`kvjax.backends.sharded`), never on a gathered cache. On CPU there is no
    compiled kernel: it falls back to XLA unless `backend="tpu"`, `interpret=True`.

    Example:
        >>> pallas_impl(make_mesh("data=1,model=1")).kv_axis
        'model'
    """
    return kvjax.PallasOnMesh(mesh, backend, interpret,
                              batch_axis="data" if "data" in mesh.axis_names else None,
                              kv_axis="model" if "model" in mesh.axis_names else None)


def attend_on_mesh(q: jax.Array, q_pos: jax.Array, layer: Any, mesh: Mesh, *,
                   backend: str | None = None, interpret: Any = False) -> jax.Array:
    """`kvjax.attend_pallas` under `jax.shard_map`: each device runs the kernel on its shard
    (`kvjax.backends.sharded.attend_on_mesh` with `pallas_impl(mesh)`).

    q [B, T, H, D] and q_pos [B, T] are split like the layer's `pos` (`cache_axes`:
    sequences over `data`, or over `data` x `model`; query heads over `model` when
    the KV heads are), so a device's query heads read exactly its KV heads (whole
    GQA groups) and no collective is needed. On CPU pass `backend="tpu"` with
    `interpret=True`. Returns [B, T, H, D] float32 with q's split.
    """
    from kvjax.backends.sharded import attend_on_mesh as run

    return run(q, q_pos, layer, pallas_impl(mesh, backend=backend, interpret=interpret))
