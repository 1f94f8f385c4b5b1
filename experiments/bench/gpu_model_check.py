"""Whole-model decode with `impl="pallas"` beside `impl="xla"` on a GPU or TPU: tokens and time.

The SmolLM2-135M architecture (30 layers, 9 query / 3 KV heads of 64) with
random weights (the real GGUF, 98 MB, does not fit the 64 MiB a device call
may carry), greedy, for each method: the generated tokens of both
implementations side by side (identical tokens, and the first step where a row
differs), the number of Pallas kernel calls in the compiled decode step (0
would mean the "pallas" run silently took the XLA path), and the warm
wall-clock seconds of one whole `generate` call of each.

Random weights give near-flat logits, so a kernel that sums in another order
can flip a near-tie where the real model would not: a late `first_difference`
in one row is rounding, a difference at step 0 in every row is a bug.
Most of a first run is compilation (on an H200, 30 layers x 2 impls x 3
methods did not finish in 130 s); `--layers` shortens it.

    python experiments/bench/gpu_model_check.py --out $OUT/model_check.json   # on the GPU
    python experiments/bench/gpu_model_check.py --layers 4 --methods full     # quick
    python -m experiments.bench.gpu_model_check --smoke --layers 1 --out x.json  # CPU: the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.backends.pallas import pallas_backend
from models.llama import Llama, LlamaConfig
from models.sampler import generate

METHODS = ("full", "kivi:bits=4,group=32,residual=128", "snapkv:ratio=0.5+kivi:bits=4")


def kernel_calls(model, cache, batch: int) -> int:
    """Pallas kernel calls (custom calls) in the lowered program of one `impl="pallas"` decode step over `cache`
    (0 would mean the "pallas" run took the XLA path)."""
    graphdef, state = nnx.split(model)

    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache, impl="pallas")

    tokens = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), 1000, jnp.int32)
    hlo = jax.jit(step).lower(state, tokens, positions, cache).as_text()
    return sum(hlo.count(f"custom_call @{name}") for name in (
        "__gpu$xla.gpu.triton", "tpu_custom_call", "mosaic_gpu"))


def run(args) -> dict:
    cfg = dataclasses.replace(LlamaConfig.smollm2_135m(), num_layers=args.layers)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in args.prompt_lengths]
    from experiments.bench.kernels import environment
    report = dict(**environment(), backend=pallas_backend(), rows=[], layers=args.layers,
                  prompt_lengths=args.prompt_lengths, new_tokens=args.new_tokens)
    for method in args.methods:
        row = dict(method=method)
        try:
            outs, seconds = {}, {}
            for impl in ("xla", "pallas"):
                call = lambda: generate(model, prompts, max_new_tokens=args.new_tokens,
                                        transform=kvjax.parse_method(method), impl=impl)
                call()  # compile
                start = time.perf_counter()
                outs[impl] = call()
                seconds[impl] = round(time.perf_counter() - start, 3)
            a, b = (np.asarray(outs[i].tokens) for i in ("xla", "pallas"))
            differs = a != b
            row.update(
                identical_tokens=int((~differs).sum()), tokens=int(a.size),
                first_difference=[int(np.argmax(r)) if r.any() else None for r in differs],
                warm_generate_s=seconds,
                generate_ms_per_new_token={i: round(1e3 * t / args.new_tokens, 2)
                                           for i, t in seconds.items()})
            try:
                row["pallas_kernel_calls_in_step"] = kernel_calls(model, outs["pallas"].cache,
                                                                   len(prompts))
            except Exception as e:  # noqa: BLE001 - reported, the other rows go on
                row["pallas_kernel_calls_in_step"] = f"{type(e).__name__}: {e}"[:300]
        except Exception as e:  # noqa: BLE001 - reported, the other methods go on
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(row, flush=True)
        report["rows"].append(row)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[700, 512, 300, 1000])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2: 30)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="run without a GPU or TPU too (on CPU impl=\"pallas\" takes the XLA "
                             "path): checks the script, not the kernel")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    for method in args.methods:  # a bad spec fails here, before any compile
        try:
            kvjax.parse_method(method)
        except ValueError as e:
            parser.error(f"--methods: {e}")
    if pallas_backend() is None and not args.smoke:
        raise SystemExit("gpu_model_check: no GPU or TPU here")
    report = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
