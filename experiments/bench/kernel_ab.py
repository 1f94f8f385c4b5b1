"""A decode step with the shipped CPU kernels beside the same step built from another kernel
source (a previous commit's, or a variant), calls alternating in one process.

Machine load changes between runs by more than most kernel changes gain, so a before/after
measured in two processes says little; here both programs run in turn, `--repeats` rounds,
the order swapped every round (the second call of a round can find the first one's data in the
CPU's shared cache).
The other source is compiled with the same flags and registered under its own target names;
its program calls the few-row product once per weight (but see `--several-weights`), and a
kernel it lacks (e.g. `matmul_t` before it existed) runs XLA's path there. The step:
`Llama.forward` + logits of SmolLM2-135M's shapes (`--tiny`: the test configuration), random
weights, a full float32 cache of `--context` slots, one token per row. Prints and writes (`--out`) the
median and minimum ms of each, the kernel call sites in each lowered program (its layers share
one body) and the largest logits difference. `--several-weights`: the other source's product
takes several weights per call (as the shipped one since c08044e), so both programs make the
same calls. `--method` compresses every layer of the step's cache by a kvjax method (e.g.
`quantize:bits=8`), so the two sources' compressed-cache paths are compared.

    git show 654706d:kvjax/core/cpu_kernels/decode_attention.cc > /tmp/old.cc
    python -m experiments.bench.kernel_ab --other /tmp/old.cc --batch 1 --context 4096
    git show HEAD:kvjax/core/cpu_kernels/decode_attention.cc > /tmp/head.cc   # a working-tree change
    python -m experiments.bench.kernel_ab --other /tmp/head.cc --several-weights
    python -m experiments.bench.kernel_ab --other /tmp/head.cc --several-weights --method kivi:bits=4
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import json
import statistics
import os
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import kvjax
from experiments.bench.attention import make_layer
from kvjax.core import cpu_kernel
from kvjax.policies.methods import parse_method
from models.llama import Llama, LlamaConfig

TARGETS = {"TARGET": "KvjaxDecodeAttention", "MATMUL_TARGET": "KvjaxFewRowsMatmul",
           "MATMUL_T_TARGET": "KvjaxFewRowsMatmulT"}


@functools.lru_cache(maxsize=None)
def register_other(source: Path, text: str) -> dict[str, str | None]:
    """Build `source` (whose contents are `text`: a changed file builds again) and register its
    kernels as `other_*` targets: {module constant: name or None where the source lacks that
    kernel}. Once per source and contents: a target name is registered once per process."""
    command = ["g++", "-w", *cpu_kernel.flags(), f"-I{jax.ffi.include_dir()}"]
    tag = hashlib.sha256(text.encode()).hexdigest()[:12]
    # built once per contents and flags, kept in the temp folder: the next run (another
    # `--several-weights` or `--method`) loads it instead of compiling for ~25 s again
    built = hashlib.sha256("\0".join([text, *command]).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "kvjax-kernel-ab" / f"{built}.so"
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        partial = out.with_name(f"{built}.{os.getpid()}.so")
        subprocess.run([*command, str(source), "-o", str(partial)], check=True)
        partial.replace(out)
    library = ctypes.cdll.LoadLibrary(str(out))
    names = {}
    for constant, symbol in TARGETS.items():
        names[constant] = f"other_{tag}_{symbol}" if hasattr(library, symbol) else None
        if names[constant]:
            jax.ffi.register_ffi_target(names[constant],
                                        jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return names


@contextlib.contextmanager
def other_kernels(names: dict[str, str | None], several_weights: bool = False):
    """Trace with the other source's targets: one product per matmul call unless
    `several_weights` (sources before c08044e took one weight per call), and a `matmul_t` it
    lacks runs XLA's path."""
    saved = {c: getattr(cpu_kernel, c) for c in names} | {"matmul_t": cpu_kernel.matmul_t,
                                                           "matmuls": cpu_kernel.matmuls}
    for constant, name in names.items():
        setattr(cpu_kernel, constant, name or saved[constant])
    if not several_weights:
        cpu_kernel.matmuls = lambda x, ws: tuple(saved["matmuls"](x, (w,))[0] for w in ws)
    if names["MATMUL_T_TARGET"] is None:
        def matmul_t(x, w, otherwise=None):
            with cpu_kernel.disabled():
                return saved["matmul_t"](x, w, otherwise)
        cpu_kernel.matmul_t = matmul_t
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cpu_kernel, name, value)


def make_step(graphdef):
    """A fresh jitted step (a fresh function: jit's trace cache must not share programs)."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, cache, tokens, positions):
        model = nnx.merge(graphdef, state)
        h, cache, _ = model.forward(tokens, positions, cache)
        return model.logits(h[:, 0]), cache
    return step


def filled_cache(cfg, batch: int, context: int, method: str = "full"):
    """Every layer holding `context - 8` random tokens (room for the steps), compressed by
    `method` unless it is full (`experiments.bench.attention.make_layer`, one seed per layer)."""
    length = context - 8
    if method != "full":
        return tuple(make_layer(method, batch, length, room=8, seed=i, kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim) for i in range(cfg.num_layers)), length
    keys = jax.random.normal(jax.random.key(1), (batch, cfg.num_kv_heads, length, cfg.head_dim))
    positions = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
    empty = kvjax.init_model_cache(cfg.cache_spec, batch, context)
    return tuple(kvjax.write(layer, keys, keys, positions) for layer in empty), length


def compare(other: Path, cfg: LlamaConfig, batch: int, context: int, repeats: int,
            several_weights: bool = False, method: str = "full") -> dict:
    """Median / min ms of the step with the shipped kernels and with `other`'s, alternating
    (`several_weights`: `other_kernels`)."""
    names = register_other(other, other.read_text())
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    cache, length = filled_cache(cfg, batch, context, method)
    tokens = jnp.full((batch, 1), 5, jnp.int32)
    positions = jnp.full((batch, 1), length, jnp.int32)
    steps = {"shipped": make_step(graphdef), "other": make_step(graphdef)}
    caches = {k: jax.tree.map(jnp.copy, cache) for k in steps}
    logits, call_sites = {}, {}
    for name, step in steps.items():  # trace and compile; the same inputs give both logits
        with (other_kernels(names, several_weights) if name == "other"
              else contextlib.nullcontext()):
            text = step.lower(state, cache, tokens, positions).as_text()
            call_sites[name] = text.count("stablehlo.custom_call")  # layers share one body
            logits[name], _ = step(state, jax.tree.map(jnp.copy, cache), tokens, positions)
    gap = float(jnp.max(jnp.abs(logits["shipped"] - logits["other"])))
    times = {k: [] for k in steps}
    for round_ in range(repeats):  # the order alternates: a call can leave the next one data
        for name in sorted(steps, reverse=bool(round_ % 2)):  # in the shared cache (weights)
            step = steps[name]
            start = time.perf_counter()
            out, caches[name] = step(state, caches[name], tokens, positions)
            jax.block_until_ready(out)
            times[name].append(1e3 * (time.perf_counter() - start))
    row = {"batch": batch, "context": context, "method": method, "other": str(other),
           "cache_mb": kvjax.nbytes(cache) / 1e6, "cache_tokens": length,
           "several_weights": several_weights,
           "missing_in_other": [c for c, n in names.items() if n is None],
           **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
           **{f"{k}_min_ms": min(v) for k, v in times.items()},
           "shipped_x_other": statistics.median(times["shipped"]) / statistics.median(times["other"]),
           "max_abs_logits_diff": gap,
           **{f"{k}_kernel_call_sites": n for k, n in call_sites.items()}}
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--other", type=Path, required=True, help="the other kernel source (.cc)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--method", default="full",
                   help="the cache's method (kvjax method spec, e.g. quantize:bits=8)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tiny", action="store_true",
                   help="the tiny test configuration (models.llama.LlamaConfig.tiny) instead of "
                        "SmolLM2-135M's shapes: checks the script in seconds")
    p.add_argument("--several-weights", action="store_true",
                   help="the other source's matmul takes several weights per call, as the "
                        "shipped one (sources from c08044e on)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.context < 16 or args.repeats < 1:
        p.error(f"--batch >= 1, --context >= 16 and --repeats >= 1, got {args.batch}, "
                f"{args.context}, {args.repeats}")
    if not args.other.is_file():
        p.error(f"--other {args.other}: no such file")
    if not cpu_kernel.registered():
        p.error("the shipped CPU kernels could not be built here (see the warning)")
    try:
        parse_method(args.method)
    except ValueError as e:
        p.error(f"--method {args.method!r}: {e}")
    cfg = LlamaConfig.tiny() if args.tiny else LlamaConfig.smollm2_135m()
    row = compare(args.other, cfg, args.batch, args.context, args.repeats,
                  args.several_weights, args.method)
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
