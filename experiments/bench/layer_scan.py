"""Would a `lax.scan` over layers cut compile time, and what would it cost per decode step?

A measurement, not a model path: SmolLM2-135M's decode step (random weights of the real
shapes, f32, a cache of `--context` slots holding `context - 8` tokens) written two ways:

  * loop: the model as it is (`Llama.forward`: a Python loop over 30 per-layer weights and
    per-layer `TokenCache`s, the cache donated);
  * scan: `lax.scan` over stacked weights `[L, ...]`, the stacked cache `[L, B*KVH, C, D]`
    carried through the scan with the new row written in place (`dynamic_update_slice` at
    (layer, slot)) and an online-softmax attention that reads `(layer, block)` slices of it.

It prints and writes (`--out`.json) the compile CPU seconds, the warm step's wall and process
CPU milliseconds, and the copies in the compiled program. CPU milliseconds are the work done;
on a loaded machine the wall time mostly measures the other processes.

    python experiments/bench/layer_scan.py --batches 1 8 --context 2048
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import kvjax
from models.llama import Llama, LlamaConfig, apply_rope, rope_frequencies

BLOCK = 256  # attention block (slots), as kvjax.attend_blockwise


def measure(b: int, C: int, repeats: int) -> list[dict]:
    cfg = LlamaConfig.smollm2_135m()
    L, H, KVH, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G, R, BLK = H // KVH, b * KVH, BLOCK
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    st = lambda f: jnp.stack([f(l) for l in model.layers])
    W = dict(q=st(lambda l: l.attn.q_proj.kernel[...]), k=st(lambda l: l.attn.k_proj.kernel[...]),
             v=st(lambda l: l.attn.v_proj.kernel[...]), o=st(lambda l: l.attn.o_proj.kernel[...]),
             g=st(lambda l: l.mlp.gate_proj.kernel[...]), u=st(lambda l: l.mlp.up_proj.kernel[...]),
             d=st(lambda l: l.mlp.down_proj.kernel[...]), n1=st(lambda l: l.input_norm.weight[...]),
             n2=st(lambda l: l.post_attn_norm.weight[...]))
    emb = model.embed[...]
    fnorm = model.norm.weight[...]
    inv = rope_frequencies(cfg)
    T = C - 8
    eps = cfg.rms_norm_eps
    rms = lambda x, w: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w
    mm = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)

    @functools.partial(jax.jit, donate_argnums=(1, 2, 3))
    def scan_step(W, K, V, P, tok, pos, length):
        x = jnp.take(emb, tok, axis=0)  # [B, HID]

        def layer(carry, w):
            x, K, V, P, i = carry
            y = rms(x, w["n1"])
            q = apply_rope(mm(y, w["q"]).reshape(b, 1, H, D), pos[:, None], inv)
            k = apply_rope(mm(y, w["k"]).reshape(b, 1, KVH, D), pos[:, None], inv)
            v = mm(y, w["v"]).reshape(b, KVH, D)
            K = jax.lax.dynamic_update_slice(K, k.reshape(1, R, 1, D), (i, 0, length, 0))
            V = jax.lax.dynamic_update_slice(V, v.reshape(1, R, 1, D), (i, 0, length, 0))
            new_pos = jnp.broadcast_to(pos[:, None, None], (b, KVH, 1))[None]
            P = jax.lax.dynamic_update_slice(P, new_pos, (i, 0, 0, length))
            qg = q.reshape(R, G, D) * D ** -0.5

            def blk(j, c):
                m, l_, acc = c
                start = jnp.minimum(j * BLK, C - BLK)
                kb = jax.lax.dynamic_slice(K, (i, 0, start, 0), (1, R, BLK, D))[0]
                vb = jax.lax.dynamic_slice(V, (i, 0, start, 0), (1, R, BLK, D))[0]
                pb = jax.lax.dynamic_slice(P, (i, 0, 0, start), (1, b, KVH, BLK))[0].reshape(R, 1, BLK)
                ok = ((pb >= 0) & (pb <= pos.repeat(KVH)[:, None, None])
                      & (start + jnp.arange(BLK) >= j * BLK))  # read each slot once
                s = jnp.where(ok, jnp.einsum("ngd,nsd->ngs", qg, kb), -1e30)  # [R, G, BLK]
                mn = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - mn[..., None]) * ok
                cr = jnp.exp(m - mn)
                return mn, l_ * cr + p.sum(-1), acc * cr[..., None] + jnp.einsum("ngs,nsd->ngd", p, vb)
            nb = (length + 1 + BLK - 1) // BLK
            init = (jnp.full((R, G), -1e30), jnp.zeros((R, G)), jnp.zeros((R, G, D)))
            m, l_, acc = jax.lax.fori_loop(0, nb, blk, init)
            a = (acc / l_[..., None]).reshape(b, H * D)
            x = x + mm(a, w["o"])
            y = rms(x, w["n2"])
            x = x + mm(jax.nn.silu(mm(y, w["g"])) * mm(y, w["u"]), w["d"])
            return (x, K, V, P, i + 1), None
        (x, K, V, P, _), _ = jax.lax.scan(layer, (x, K, V, P, 0), W)
        h = rms(x, fnorm)
        return jnp.einsum("bd,vd->bv", h, emb), K, V, P

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, cache, tok, p1):
        m = nnx.merge(graphdef, state)
        h, cache, _ = m.forward(tok, p1, cache)
        return m.logits(h[:, 0]), cache

    def bench(run):
        ts = []
        for _ in range(repeats):
            c, t = time.process_time(), time.perf_counter()
            jax.block_until_ready(run())
            ts.append((time.perf_counter() - t, time.process_time() - c))
        return 1e3 * min(t[0] for t in ts), 1e3 * statistics.median(t[1] for t in ts)

    key = jax.random.key(1)
    kk = jax.random.normal(key, (b, KVH, T, D))
    pos_t = jnp.broadcast_to(jnp.arange(T)[None], (b, T))
    tok = jnp.full((b,), 5, jnp.int32)
    pos = jnp.full((b,), T, jnp.int32)
    rows = []

    K = jnp.zeros((L, R, C, D)).at[:, :, :T].set(kk.reshape(R, T, D)[None])
    V = K + 0
    P = jnp.full((L, b, KVH, C), -1, jnp.int32).at[..., :T].set(jnp.arange(T))
    c0 = time.process_time()
    comp = scan_step.lower(W, K, V, P, tok, pos, jnp.int32(T)).compile()
    compile_s = time.process_time() - c0
    box = [K, V, P]

    def run_scan():
        lg, *box[:] = comp(W, *box, tok, pos, jnp.int32(T))
        return lg

    run_scan()
    wall, cpu = bench(run_scan)
    rows.append(dict(variant="scan", batch=b, context=C, compile_cpu_s=compile_s,
                     step_wall_min_ms=wall, step_cpu_ms=cpu, copies=comp.as_text().count(" copy(")))
    del box[:], K, V, P

    cache = kvjax.init_model_cache(cfg.cache_spec, b, C)
    cache = tuple(kvjax.write(layer, kk, kk, pos_t) for layer in cache)
    c0 = time.process_time()
    comp = step.lower(state, cache, tok[:, None], pos[:, None]).compile()
    compile_s = time.process_time() - c0
    box = [cache]

    def run_loop():
        lg, box[0] = comp(state, box[0], tok[:, None], pos[:, None])
        return lg

    run_loop()
    wall, cpu = bench(run_loop)
    rows.append(dict(variant="loop", batch=b, context=C, compile_cpu_s=compile_s,
                     step_wall_min_ms=wall, step_cpu_ms=cpu, copies=comp.as_text().count(" copy(")))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("experiments/out/layer_scan"))
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # cold compiles
    rows = []
    for b in args.batches:
        for row in measure(b, args.context, args.repeats):
            row["load_average"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
