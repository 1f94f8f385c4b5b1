"""Where one batched decode step's time goes: the whole step beside its parts, in CPU ms.

SmolLM2-135M shapes with random weights (speed does not depend on the values), a full
float32 cache of `context` slots holding `context - 8` tokens, timed warm:

  * step: `Llama.forward` of one token per row + `Llama.logits`, the cache donated;
  * noattn: the 30 layers' projections, norms and MLPs without attention (the weight dots);
  * attn: `kvjax.attend` of one query per row over every layer's cache;
  * logits: the tied-embedding logits of `batch` rows.

Prints the minimum and median wall ms and the median process CPU ms (all threads) of each.
On a loaded machine the wall time measures the other processes; CPU ms is the work done.

    python experiments/bench/step_parts.py 8 2048 8        # batch, context, repeats
"""
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
import kvjax
from models.llama import Llama, LlamaConfig

b = int(sys.argv[1]); ctx = int(sys.argv[2]); reps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
which = sys.argv[4].split(",") if len(sys.argv) > 4 else ["step", "noattn", "attn", "logits"]
dt = jnp.bfloat16 if os.environ.get("DT") == "bf16" else jnp.float32
cfg = LlamaConfig.smollm2_135m()
model = Llama(cfg, dtype=dt, rngs=nnx.Rngs(0))
graphdef, state = nnx.split(model)
key = jax.random.key(1)
cache = kvjax.init_model_cache(cfg.cache_spec, b, ctx)
# fill: write ctx-8 tokens into every layer
T = ctx - 8
kk = jax.random.normal(key, (b, cfg.num_kv_heads, T, cfg.head_dim))
pos = jnp.broadcast_to(jnp.arange(T)[None], (b, T))
cache = tuple(kvjax.write(l, kk, kk, pos) for l in cache)
tok = jnp.full((b, 1), 5, jnp.int32); p1 = jnp.full((b, 1), T, jnp.int32)


@functools.partial(jax.jit, donate_argnums=(1,))
def step(state, cache, tok, p1):
    m = nnx.merge(graphdef, state)
    h, cache, _ = m.forward(tok, p1, cache)
    return m.logits(h[:, 0]), cache

@jax.jit
def noattn(state, x):
    m = nnx.merge(graphdef, state)
    for l in m.layers:
        a = l.attn
        y = l.input_norm(x)
        q = a.q_proj(y); k = a.k_proj(y); v = a.v_proj(y)
        x = x + a.o_proj(q) + 0 * (k.sum() + v.sum())
        x = x + l.mlp(l.post_attn_norm(x))
    return m.norm(x)

@jax.jit
def attn(cache, q, p1):
    outs = [kvjax.attend(q, p1, c) for c in cache]
    return sum(o.sum() for o in outs)

@jax.jit
def logits(state, h):
    m = nnx.merge(graphdef, state)
    return m.logits(h)

x = jax.random.normal(key, (b, 1, cfg.hidden_size))
q = jax.random.normal(key, (b, 1, cfg.num_heads, cfg.head_dim))
h = jax.random.normal(key, (b, cfg.hidden_size))
box = [cache]
def run_step():
    lg, box[0] = step(state, box[0], tok, p1)
    return lg
fns = {"step": run_step, "noattn": lambda: noattn(state, x),
       "attn": lambda: attn(box[0], q, p1), "logits": lambda: logits(state, h)}
for n in which:
    jax.block_until_ready(fns[n]())
res = {n: [] for n in which}
for _ in range(reps):
    for n in which:
        c0 = time.process_time(); t0 = time.perf_counter()
        jax.block_until_ready(fns[n]())
        res[n].append((1e3 * (time.perf_counter() - t0), 1e3 * (time.process_time() - c0)))
for n in which:
    w = [r[0] for r in res[n]]; c = [r[1] for r in res[n]]
    print(f"{n:8s} wall min {min(w):7.1f} med {statistics.median(w):7.1f}  cpu med {statistics.median(c):7.1f} ms")
