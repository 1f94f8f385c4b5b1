"""Each family's tiny checkpoint (tests/golden/families) on a GPU, `impl="pallas"` beside "xla".

Per family: the float32 logits of the 272 golden tokens (prefill in 64-token chunks, then the
last 16 one at a time) against transformers' golden logits, for both impls; the Pallas kernel
calls in one decode step's lowered program (0 means "pallas" took the XLA path for that
layout); the 32 greedy tokens of `generate(..., impl="pallas")` with a SnapKV+KIVI chain and
with the full cache, the latter against transformers' golden tokens.

    python experiments/bench/gpu_families_check.py --out DIR     # writes DIR/families_gpu.json

Measured on an H200 (jax 0.11.2, 2026-12-04; 86 s with compilation): logits within
0.9e-6 to 1.9e-6 relative of transformers' for both impls and every family; 32 greedy tokens
identical with `impl="pallas"`; the chain's tokens equal between impls. The kernel runs in
every layer program: 1 call per decode step for the families of one layer kind (layers of
one kind share one program), 2 for Gemma 3 (local and global). Before sliding layers'
joined caches were rounded up to `models.llama.JOIN_ALIGN` slots, a window + 1-slot layer had
no page size and took the XLA path (0 calls for Mistral and Phi-3).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

jax.config.update("jax_default_matmul_precision", "highest")

import kvjax  # noqa: E402
from models.loading import build_model, load_hf_dir  # noqa: E402
from models.sampler import generate  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden" / "families"
FAMILIES = ("llama3", "qwen2", "qwen3", "mistral_sw", "gemma3", "phi3")
CHAIN = "snapkv:ratio=0.5+kivi:bits=4,group=32,residual=32"


def kernel_calls(model, cache) -> int:
    graphdef, state = nnx.split(model)

    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache, impl="pallas")

    hlo = jax.jit(step).lower(state, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 271),
                              cache).as_text()
    return sum(hlo.count(f"custom_call @{name}") for name in (
        "__gpu$xla.gpu.triton", "tpu_custom_call", "mosaic_gpu"))


def logits_error(model, golden, impl: str) -> tuple[float, int]:
    ids = jnp.asarray(golden["input_ids"], jnp.int32)
    t, chunk, steps = ids.shape[1], 64, 16
    cache = kvjax.init_model_cache(model.config.cache_spec, 1, t)
    step = jax.jit(lambda m, x, p, c: m(x, p, c, impl=impl))
    outs = []
    for start in range(0, t - steps, chunk):
        end = min(start + chunk, t - steps)
        logits, cache = step(model, ids[:, start:end], jnp.arange(start, end)[None], cache)
        outs.append(logits)
    calls = kernel_calls(model, cache) if impl == "pallas" else 0
    for i in range(t - steps, t):
        logits, cache = step(model, ids[:, i:i + 1], jnp.array([[i]]), cache)
        outs.append(logits)
    ours = np.asarray(jnp.concatenate(outs, axis=1), np.float64)
    theirs = golden["logits"].astype(np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max()), calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/out/gpu"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in FAMILIES:
        start = time.perf_counter()
        model = build_model(*load_hf_dir(GOLDEN / name))
        golden = dict(np.load(GOLDEN / name / "golden.npz"))
        row = {"family": name, "device": str(jax.devices()[0])}
        for impl in ("xla", "pallas"):
            row[f"rel_err_{impl}"], calls = logits_error(model, golden, impl)
            if impl == "pallas":
                row["kernel_calls_per_decode_step"] = calls
        prompt = golden["input_ids"][0, :int(golden["prompt_len"])].tolist()
        full = generate(model, [prompt], max_new_tokens=32, eos_ids=(), chunk=64, impl="pallas")
        row["greedy_equal"] = bool((full.tokens[0] == golden["greedy"]).all())
        chain = {impl: generate(model, [prompt], max_new_tokens=32, eos_ids=(), chunk=64,
                                impl=impl, transform=kvjax.parse_method(CHAIN)).tokens[0]
                 for impl in ("xla", "pallas")}
        row["chain_pallas_equals_xla"] = bool((chain["xla"] == chain["pallas"]).all())
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    (args.out / "families_gpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
