"""`kvjax compile`: compile prefill, compression and decode for a TPU pod slice, deviceless.

    kvjax compile --topology v5e:2x4 --mesh data=2,model=4 --model llama3-8b \\
        --method snapkv:ratio=0.5+kivi:bits=4 --context 32768 --batch 8

libtpu describes the slice on this CPU host (`kernels_pallas.tpu_compile`); the
model is given by shape alone (`models.sharding.abstract_model`: `nnx.eval_shape`,
no weight materialized), weights and caches carry the shardings of
`models.sharding`, and each jitted step of `models.sampler` (`_prefill`,
`_compress`, `_decode`) is lowered and compiled by XLA:TPU. Nothing runs; the
per-chip bytes printed are the compiler's `memory_analysis()`:
arguments + outputs - aliased (donated) + temporaries = the step's peak.

The decode step's cache is the compressed cache `generate` decodes from: its
shape is planned by running the method for real on one sequence and one KV head
(all KV heads for head-wise budgets; one layer when every layer gets the same
method, all layers otherwise; random keys, zero statistics: budgets depend only on
lengths), shrinking it as `generate` does, and repeating those rows abstractly for
the batch and the KV heads.

Models by shape: `smollm2` (SmolLM2-135M), `llama3-8b`, `llama3-70b`, `llama3-8b-1m`
(the 8B shape with 1,048,576 positions, as its 1M-context finetunes extend it), or a
model path / repo id (its config only).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from typing import Any

import numpy as np

TOPOLOGY = re.compile(r"^(v5e|v6e):(\d+)x(\d+)$")
STEPS = ("prefill", "compress", "decode")


def llama3_shape(size: str, max_position: int = 131072):
    """A Llama-3-8B / 70B-shaped `LlamaConfig` (bf16 planning; weights never built)."""
    from models.llama import LlamaConfig, RopeScaling

    dims = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32),
            "70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64)}
    return LlamaConfig(vocab_size=128256, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
                       rope_scaling=RopeScaling(), tie_embeddings=False, max_position=max_position,
                       bos_id=128000, eos_ids=(128009,), **dims[size])


def model_shape(name: str):
    """The config of `name`: a shape name, else a model's own config (no weights read)."""
    from models.llama import LlamaConfig
    if name == "smollm2":
        return LlamaConfig.smollm2_135m()
    if name in ("llama3-8b", "llama3-70b"):
        return llama3_shape(name.split("-")[1])
    if name == "llama3-8b-1m":  # the 8B shape at 2**20 positions, as its 1M-context finetunes
        return llama3_shape("8b", max_position=1 << 20)  # (shapes only: RoPE is not planned)
    from models.loading import model_config
    return model_config(name)


def topology_devices(name: str) -> list:
    """The devices of a deviceless TPU slice `v5e:2x4` / `v6e:2x2` ... (libtpu)."""
    import os
    m = TOPOLOGY.match(name or "")
    if not m:
        raise ValueError(f"topology {name!r}: expected CHIP:XxY with CHIP v5e or v6e, "
                         f"e.g. v5e:2x4")
    from kernels_pallas.tpu_compile import libtpu_available
    if not libtpu_available():
        raise ValueError("compiling for a TPU needs libtpu: pip install -e '.[tpu-compile]'")
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        # measured: with JAX_PLATFORMS=cpu, XLA:TPU (libtpu) segfaulted compiling these steps
        # (SpatialMajorConvolution cost model); without it the same compiles succeed
        raise ValueError("unset JAX_PLATFORMS=cpu for kvjax compile: libtpu's compiler "
                         "crashes under it (the CPU is still used as the host)")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    x, y = int(m.group(2)), int(m.group(3))
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=name, chip_config_name="default",
        chips_per_host_bounds=(x, y, 1), num_slices=1, wrap=(False, False, False))
    return list(topo.devices)


def _abstract(tree: Any, shardings: Any) -> Any:
    import jax
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _replicated(tree: Any, mesh) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), tree)


def _by_batch(tree: Any, batch: int, mesh) -> Any:
    """Leaves whose leading axis is the batch split over `data` (when it divides), others replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    d = dict(mesh.shape).get("data", 1)

    def spec(x):
        split = d > 1 and x.ndim and x.shape[0] == batch and batch % d == 0
        return NamedSharding(mesh, P("data", *[None] * (x.ndim - 1)) if split else P())
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=spec(x)), tree)


def uniform_method(spec: str) -> bool:
    """True when every layer gets the same method (no `layers=`, no per-layer schedule)."""
    return not any(word in spec for word in ("layers=", "pyramidkv", "schedule"))


def planned_cache(cfg, transform, spec: str, batch: int, context: int, room: int, dtype,
                  impl="xla"):
    """Shapes (ShapeDtypeStructs, no shardings) of the cache `generate` decodes from.

    The method runs for real on one sequence of `context` random tokens (one layer when
    `uniform_method`, else every layer), is shrunk with room for `room` more tokens as
    `generate` shrinks it for `impl` (capacities a multiple of `kvjax.tile_slots(impl)`),
    and its per-sequence rows are repeated for `batch` sequences.
    """
    import jax
    import jax.numpy as jnp
    import kvjax

    layers = 1 if uniform_method(spec) else cfg.num_layers
    kvh = cfg.num_kv_heads
    if transform is kvjax.full():  # nothing to run: the prefilled cache with its room
        return jax.eval_shape(lambda: kvjax.init_model_cache(
            cfg.cache_spec, batch, context + room, dtype))
    heads = kvh if "headwise" in spec else 1  # per-head budgets are equal: plan one head
    cache = _one_sequence(cfg, transform, layers, heads, context, room, dtype,
                          kvjax.tile_slots(impl))
    one = cache if layers == cfg.num_layers else cache * cfg.num_layers

    def widen(layer):
        rows = layer.k.shape[0]
        target = batch * (1 if layer.pooled else kvh)
        grow = lambda x: jax.ShapeDtypeStruct((target, *x.shape[1:]), x.dtype) \
            if x.ndim and x.shape[0] == rows else jax.ShapeDtypeStruct(x.shape, x.dtype)
        meta = lambda x: None if x is None else jax.ShapeDtypeStruct(
            (batch, kvh, *x.shape[2:]), x.dtype)
        return layer.replace(k=jax.tree_util.tree_map(grow, layer.k),
                             v=jax.tree_util.tree_map(grow, layer.v), pos=meta(layer.pos),
                             mass=meta(layer.mass),
                             length=jax.ShapeDtypeStruct((), jnp.int32))

    return tuple(layer.map_parts(widen) for layer in one)  # a residual layer: both parts


@functools.lru_cache(maxsize=8)
def _one_sequence(cfg, transform, layers: int, kvh: int, context: int, room: int, dtype,
                  align: int):
    """The method run for real on one sequence of `context` random keys over `kvh` KV heads
    (with their share of query heads), then shrunk (capacities a multiple of `align`);
    abstract shapes."""
    import jax
    import jax.numpy as jnp
    import kvjax
    from kvjax.core.stats import init_stats
    from models.llama import fixed_rope_frequencies

    d, query_heads = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads * kvh
    cache = kvjax.init_model_cache(kvjax.CacheSpec(layers, kvh, d), 1, context + room, dtype,
                                   track_mass=transform.stats.attention_mass)
    k, v = jax.random.normal(jax.random.key(0), (2, 1, kvh, context, d), dtype)
    cache = tuple(kvjax.write(layer, k, v, jnp.arange(context)[None]) for layer in cache)
    stats = None
    if transform.stats.window or transform.stats.query_moments:
        stats = init_stats(transform.stats, cache, query_heads, fixed_rope_frequencies(cfg))
    cache, _ = jax.jit(transform.update)(cache, transform.init(cache), stats)
    cache = kvjax.shrink(cache, room, 1, align)
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cache)


def memory(compiled) -> dict:
    """Per-chip bytes of a compiled step: arguments, outputs, aliased, temporaries, peak."""
    m = compiled.memory_analysis()
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
           "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
           "code": m.generated_code_size_in_bytes}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["code"]
    return out


SIZE = r"([\d.]+)\s*([KMGT]i?B?|B)?"
UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
OUT_OF_MEMORY = [  # (needs, has) in the compiler's out-of-memory messages
    re.compile(rf"\({SIZE}\) exceeds available HBM \({SIZE}\)"),
    re.compile(rf"[Uu]sed {SIZE} of {SIZE} hbm"),
]


def _bytes(number: str, unit: str | None) -> int:
    return int(float(number) * UNITS[(unit or "")[:1]])


def does_not_fit(error: Exception) -> dict | None:
    """The compiler's "does not fit in HBM" failure as {needs, has (bytes per chip), message},
    or None for any other error. XLA:TPU refuses a program whose arguments, outputs and
    temporaries exceed a chip's HBM with RESOURCE_EXHAUSTED; that is a verdict, not a crash."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    line = next((l.strip() for l in text.splitlines() if "RESOURCE_EXHAUSTED" in l), text[:300])
    for pattern in OUT_OF_MEMORY:
        found = pattern.search(text)
        if found:
            needs, has = _bytes(*found.group(1, 2)), _bytes(*found.group(3, 4))
            return dict(fits=False, needs=needs, has=has, message=line[:400])
    return dict(fits=False, needs=None, has=None, message=line[:400])


def _compiled(step: str, lower, result: dict):
    """Compile `lower()`; record the step's memory, or its "does not fit" verdict, in result."""
    start = time.perf_counter()
    try:
        compiled = lower().compile()
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory is a verdict
        verdict = does_not_fit(e)
        if verdict is None:
            raise
        result[step] = dict(verdict, seconds=round(time.perf_counter() - start, 1))
        return None
    result[step] = dict(memory(compiled), fits=True,
                        seconds=round(time.perf_counter() - start, 1))
    return compiled


def compile_steps(cfg, mesh, method, context: int, batch: int, *, dtype=None,
                  impl: str = "xla", new_tokens: int = 16, chunk: int = 512,
                  steps=("prefill", "compress", "decode"), step_bytes: bool = False) -> dict:
    """Compile `steps` of generation for `mesh`'s devices; {step: memory(...)} plus seconds.
    `method`: a spec or a parsed `kvjax.Method`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    import kvjax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from kvjax.core.stats import init_stats
    from models import sampler
    from models.llama import fixed_rope_frequencies
    from models.sharding import abstract_model, cache_shardings, on_mesh

    dtype = jnp.bfloat16 if dtype is None else dtype
    if impl == "pallas":  # the TPU kernel per shard (the host's default backend is the CPU);
        # a prefill chunk goes to it in query blocks of at most MAX_QUERY_ROWS rows
        # (kvjax.backends.pallas.attend_pallas: one 508-token block overflowed v5e's VMEM)
        from models.sharding import pallas_impl
        impl = pallas_impl(mesh, backend="tpu")
    method = kvjax.Method.parse(method)
    spec, transform = method.spec, method.transform
    placed = on_mesh(transform, mesh)
    graphdef, state = abstract_model(cfg, mesh, dtype)
    model = nnx.merge(graphdef, state)  # weights as ShapeDtypeStructs
    chunk = min(chunk, context)
    if context % chunk:
        raise ValueError(f"--context {context} must be a multiple of the prefill chunk {chunk}")
    capacity = context + new_tokens
    result: dict[str, Any] = {}
    dense = jax.eval_shape(lambda: kvjax.init_model_cache(
        cfg.cache_spec, batch, capacity, dtype, track_mass=transform.stats.attention_mass))
    cache = _abstract(dense, cache_shardings(dense, mesh))
    stats = None
    if transform.stats.window or transform.stats.query_moments:
        stats = _by_batch(jax.eval_shape(lambda c: init_stats(
            transform.stats, c, cfg.num_heads, fixed_rope_frequencies(cfg)), dense), batch, mesh)
    ids = _by_batch(jax.ShapeDtypeStruct((batch, context), jnp.int32), batch, mesh)
    if "prefill" in steps:
        compiled = _compiled("prefill", lambda: sampler._prefill.lower(
            model, ids, ids, cache, stats, sampler.PrefillConfig(chunk, transform.stats, impl)),
            result)
        if compiled is not None:
            result["prefill"]["kernel_calls"] = kernel_calls(compiled.as_text())
    if "compress" in steps and transform is not kvjax.full():
        tstate = _replicated(jax.eval_shape(transform.init, dense), mesh)
        _compiled("compress", lambda: sampler._compress_stacked.lower(
            placed.update, cache, tstate, stats), result)
    if "decode" in steps:
        small = planned_cache(cfg, transform, spec, batch, context, new_tokens, dtype, impl)
        small_cache = _abstract(small, cache_shardings(small, mesh))
        tstate = _replicated(jax.eval_shape(transform.init, small), mesh)
        logits = _by_batch(jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32), batch,
                           mesh)
        next_pos = _by_batch(jax.ShapeDtypeStruct((batch,), jnp.int32), batch, mesh)
        key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                                   sharding=NamedSharding(mesh, P()))
        start = sampler.DecodeStart(logits, tstate, None, next_pos, key)
        config = sampler.DecodeConfig(new_tokens, eos_ids=tuple(cfg.eos_ids), impl=impl)
        compiled = _compiled("decode", lambda: sampler._decode.lower(
            model, small_cache, start, config), result)
        result["decode"]["cache_bytes"] = kvjax.nbytes(small)
        if compiled is not None:
            result["decode"]["kernel_calls"] = kernel_calls(compiled.as_text())
            if impl != "xla":
                result["decode"]["kernel_refusals"] = kernel_refusals(small)
        if compiled is not None and step_bytes:
            result["decode"].update(one_step_bytes(model, small_cache, next_pos, impl))
    result["weight_bytes"] = kvjax.nbytes(state)
    result["weight_bytes_per_chip"] = shard_bytes(state)
    if "decode" in result:
        result["decode"]["cache_bytes_per_chip"] = shard_bytes(small_cache)
    return result


def one_step_bytes(model, cache, positions, impl) -> dict:
    """One decode step (the model over one token per sequence, cache write and logits) compiled
    alone: the compiler's bytes accessed per chip (`cost_analysis`; the Pallas kernel's own
    `CostEstimate` counts for its custom calls), and its kernel calls. The decode loop's
    program is a `while` whose trip count the cost analysis does not know.

    `step_bytes_accessed` counts the usual step: every `kvjax.core.branches.rare_cond` (a
    residual flush, a host fetch, a page scrub, the KIVI kernel's XLA fallback) traced as
    its usual branch; `step_bytes_every_rare_branch` the program as it runs, which XLA
    charges the larger branch of each conditional (an upper bound)."""
    import jax
    from kvjax.core.branches import usual_branches_only

    def step(model, cache, positions):
        h, cache, _ = model.forward(positions[:, None], positions[:, None], cache, impl=impl)
        return model.logits(h[:, 0]), cache

    def compiled():  # a new function each time: no trace is shared between the two
        jax.clear_caches()  # nor with jitted functions traced before (their caches ignore the pin)
        return jax.jit(lambda *a: step(*a), donate_argnums=1).lower(model, cache,
                                                                    positions).compile()

    with usual_branches_only():
        usual = compiled()
    every = compiled()
    return dict(step_bytes_accessed=int(usual.cost_analysis()["bytes accessed"]),
                step_bytes_every_rare_branch=int(every.cost_analysis()["bytes accessed"]),
                step_kernel_calls=kernel_calls(usual.as_text()))


def kernel_refusals(cache) -> dict[str, int]:
    """{why the TPU kernel does not read a layer: how many layers} of an abstract cache
    (`kvjax.backends.pallas.kernel_refusal`); empty when the kernel reads every layer."""
    import jax
    from kvjax.backends.pallas import kernel_refusal

    found: dict[str, int] = {}

    def look(cache):
        for layer in cache:
            reason = kernel_refusal(layer, "tpu")
            if reason is not None:
                found[reason] = found.get(reason, 0) + 1
        return 0

    jax.eval_shape(look, cache)
    return found


def kernel_calls(hlo_text: str) -> int:
    """Pallas attention kernel calls in compiled HLO text (custom calls named
    `kvjax_paged_attention...`): 0 when attention compiled on the XLA path."""
    return sum(1 for line in hlo_text.splitlines()
               if "custom-call(" in line and "kvjax_paged_attention" in line.split("=")[0])


def shard_bytes(tree: Any) -> int:
    """Bytes of the largest shard of every leaf (ShapeDtypeStructs with shardings), summed:
    what one chip holds, from the shardings alone (no compiler, no layout padding)."""
    import jax
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v5e:2x4 or v6e:2x4")
    p.add_argument("--mesh", required=True, help="e.g. data=2,model=4 (product = chips)")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 | llama3-8b | llama3-70b | llama3-8b-1m (by shape) | a model "
                        "path or repo id")
    p.add_argument("--layers", type=int, default=0,
                   help="compile only the first N decoder layers (0 = all; memory grows "
                        "linearly with layers, compile time too)")
    p.add_argument("--method", default="full", help="cache method spec")
    p.add_argument("--context", type=int, required=True, help="prompt tokens N")
    p.add_argument("--batch", type=int, default=1, help="sequences B")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps compiled")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="weights and cache")
    p.add_argument("--impl", choices=["xla", "pallas"], default="xla", help="attention")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                   help="which jitted steps to compile (default: all three)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--step-bytes", action="store_true",
                   help="also compile one decode step alone and report its bytes accessed "
                        "per chip: the usual step (no residual flush, host fetch or kernel "
                        "fallback) and, as an upper bound, every rare branch taken")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _shortfall(verdict: dict) -> str:
    if verdict["needs"] is None:
        return f"exceeds a chip's HBM ({verdict['message'][:200]})"
    return f"needs {_gib(verdict['needs'])} per chip, has {_gib(verdict['has'])}"


def run(args) -> int:
    import jax.numpy as jnp
    for name, low in (("context", 1), ("batch", 1), ("new_tokens", 1), ("layers", 0)):
        if getattr(args, name) < low:
            print(f"kvjax: error: --{name.replace('_', '-')} {getattr(args, name)}: must be an "
                  f"integer >= {low}", file=sys.stderr)
            return 2
    try:
        import kvjax
        from models.sharding import make_mesh
        method = kvjax.Method.parse(args.method)  # a bad spec fails before anything compiles
        cfg = model_shape(args.model)
        if args.layers:
            import dataclasses
            cfg = dataclasses.replace(cfg, num_layers=min(args.layers, cfg.num_layers))
        if args.context + args.new_tokens > cfg.max_position:
            raise ValueError(f"--context {args.context} + --new-tokens {args.new_tokens} exceeds "
                             f"the model's {cfg.max_position} positions")
        mesh = make_mesh(args.mesh, topology_devices(args.topology))
        result = compile_steps(cfg, mesh, method, args.context, args.batch,
                               dtype=getattr(jnp, args.dtype), impl=args.impl,
                               new_tokens=args.new_tokens, steps=tuple(args.steps),
                               step_bytes=args.step_bytes)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    result.update(topology=args.topology, mesh=args.mesh, model=args.model, method=args.method,
                  context=args.context, batch=args.batch, impl=args.impl)
    steps = [step for step in STEPS if step in result]
    fits = all(result[step]["fits"] for step in steps)
    result["fits"] = fits
    if args.json:
        print(json.dumps(result))
        return 0 if fits else 1
    print(f"{args.model} on {args.topology} ({args.mesh}), {args.method}, "
          f"{args.batch} x {args.context} tokens, per chip:")
    for step in steps:
        m = result[step]
        if not m["fits"]:
            print(f"  {step:8s} does not fit: {_shortfall(m)} (compiler: {m['message'][:200]})")
            continue
        print(f"  {step:8s} peak {_gib(m['peak'])} (arguments {_gib(m['argument'])}, "
              f"temporaries {_gib(m['temp'])}, outputs {_gib(m['output'])}, "
              f"aliased {_gib(m['alias'])}; compiled in {m['seconds']} s)")
        if step == "decode" and args.impl == "pallas":  # a layer the kernel cannot read: XLA
            print(f"  {'':8s} {m['kernel_calls']} Pallas kernel calls")
            for reason, n in m.get("kernel_refusals", {}).items():
                print(f"  {'':8s} {n} layers attend through XLA: {reason}")
        if "step_bytes_accessed" in m:
            print(f"  {'':8s} one step alone: {_gib(m['step_bytes_accessed'])} accessed per chip "
                  f"({_gib(m['step_bytes_every_rare_branch'])} counting every rare branch: "
                  f"a flush, a fetch, a fallback)")
    for step in steps:
        if not result[step]["fits"]:
            print(f"kvjax: does not fit {args.topology}: the {step} step "
                  f"{_shortfall(result[step])}", file=sys.stderr)
    return 0 if fits else 1
