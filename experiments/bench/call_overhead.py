"""What one `decode` call costs besides its steps: the real model's Python and dispatch time.

Times a warm `models.sampler.decode` of the real SmolLM2-135M that runs no forward step
(`max_new_tokens=1`: the prefill's logits give the one token), so what is left is the call's
own cost -- checks, handing the model's 272 weights to the compiled program, dispatch -- which
every `generate`, `prefill_batch` and scoring call pays once. Beside it, the two ways to hand
the weights over: walking the module graph (`nnx.split`, what the calls did before) and
flattening the model as a pytree (`jax.tree.flatten`, what they do now). Medians of
`--repeats` calls, in ms; writes JSON with `--out`.

    python -m experiments.bench.call_overhead --out docs/bench/call_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.bench.decode import timed


def median_ms(fn, repeats: int) -> float:
    fn()  # warm: compiles, fills caches
    return 1e3 * statistics.median(timed(fn, repeats))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")

    import kvjax
    from models.loading import load_model
    from models.sampler import decode, prefill_batch

    model, tokenizer = load_model("smollm2")
    pre = prefill_batch(model, [tokenizer.encode("The capital of France is")],
                        stats=kvjax.full().stats, room=1)

    def decode_call():  # the cache is donated: a fresh copy each call (made before the timer)
        return decode(model, pre._replace(cache=fresh.pop()), max_new_tokens=1, eos_ids=())

    fresh = [jax.block_until_ready(jax.tree.map(jnp.copy, pre.cache))
             for _ in range(args.repeats + 1)]
    result = {"decode_call_ms": median_ms(decode_call, args.repeats),
              "nnx_split_ms": median_ms(lambda: nnx.split(model), args.repeats),
              "tree_flatten_ms": median_ms(lambda: jax.tree.flatten(model), args.repeats),
              "weights": len(jax.tree.leaves(model)), "repeats": args.repeats}
    text = json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()})
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
