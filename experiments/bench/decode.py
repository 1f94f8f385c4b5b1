"""Prefill throughput, decode latency and compile time of kvjax on the real model, beside the floor and transformers.

For each batch size x context x weight dtype it measures:
  * prefill tokens/s: a batch of `context - new_tokens` random-token prompts
    (`models.sampler.prefill_and_compress`, full cache), after compilation;
  * decode ms/step: `models.sampler.decode` of `new_tokens` greedy tokens
    (end-of-sequence ignored), divided by the forward steps it ran; and the
    process CPU ms per step (all threads), which a loaded machine inflates less
    than the wall time;
  * compile seconds: the first prefill and the first decode call minus their
    warm medians (with `--cold`, jax's persistent compilation cache is off, so
    these are cold compiles);
  * the floor: bytes one decode step must read (every weight once, plus the
    valid keys and values) / this machine's read bandwidth, measured beside
    every cell;
  * Hugging Face transformers on the same GGUF, same machine, same run
    (when the `compare` extra is installed): prefill, then a `past_key_values`
    decode loop of the same length.
Medians over `--repeats` runs. Writes JSON and CSV, a PNG plot, and prints a
Markdown table.

    python experiments/bench/decode.py                       # full grid, ~15 min on 2 cores
    python experiments/bench/decode.py --batches 1 --contexts 512 --no-hf   # quick look
    python experiments/bench/decode.py --dtypes float32 --contexts 2048 --no-hf --cold
"""

from __future__ import annotations

import argparse
import csv
import json
import os

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader bars
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from experiments.eval.floor import read_bandwidth_gbs
from models.loading import build_model, load_weights, resolve_model_path
from models.sampler import decode, prefill_and_compress

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def emit(result, out: Path | None) -> None:
    """Print `result` as indented JSON and, with `out`, write the same text there."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")


def step_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step must read: all weights once, plus valid keys and values."""
    weights = kvjax.nbytes(nnx.state(model, nnx.Param))
    cfg = model.config
    cache = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim * 4
    return weights + cache


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, length).tolist() for _ in range(batch)]


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def bench_kvjax(model, batch: int, context: int, new_tokens: int, repeats: int,
                prefill_repeats: int, chunk: int) -> dict:
    """Warm prefill tok/s, decode wall and CPU ms/step, and compile seconds of one cell."""
    cfg = model.config
    length = context - new_tokens
    chunk = max(d for d in range(1, chunk + 1) if length % d == 0)  # no padding: cache = context
    prompts = random_prompts(batch, length, cfg.vocab_size)
    run_prefill = lambda: prefill_and_compress(model, prompts, room=new_tokens, chunk=chunk)
    start = time.perf_counter()
    pre = jax.block_until_ready(run_prefill())  # compiles
    first_prefill = time.perf_counter() - start
    prefill_s = statistics.median(timed(run_prefill, prefill_repeats))

    def run_decode():  # the cache is donated: decode a fresh copy each time
        copy = pre._replace(cache=jax.tree_util.tree_map(jnp.copy, pre.cache))
        return decode(model, copy, max_new_tokens=new_tokens, eos_ids=()).tokens

    first_decode = timed(run_decode, 1)[0]
    cpu_start = time.process_time()
    decode_times = timed(run_decode, repeats)
    cpu_s = (time.process_time() - cpu_start) / repeats
    decode_s = statistics.median(decode_times)
    steps = new_tokens - 1  # forward steps after the prefill's logits
    return {"prefill_tok_s": batch * length / prefill_s,
            "decode_ms": 1e3 * decode_s / steps,
            "decode_cpu_ms": 1e3 * cpu_s / steps,
            "compile_prefill_s": max(first_prefill - prefill_s, 0.0),
            "compile_decode_s": max(first_decode - decode_s, 0.0),
            "cache_bytes": kvjax.nbytes(pre.cache)}


def bench_hf(gguf_path: Path, dtype: str, batch: int, context: int, new_tokens: int,
             repeats: int, prefill_repeats: int) -> dict | None:
    try:
        import copy

        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    key = (str(gguf_path), dtype)
    if key not in _HF_MODELS:
        _HF_MODELS.clear()
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name,
            dtype=getattr(torch, dtype)).eval()
    model = _HF_MODELS[key]
    ids = torch.tensor(random_prompts(batch, context - new_tokens, model.config.vocab_size))

    def run_prefill():
        with torch.inference_mode():
            return model(ids, use_cache=True)

    prefill_s = statistics.median(timed(run_prefill, prefill_repeats))
    prompt = run_prefill()

    def run_decode():
        with torch.inference_mode():
            past = copy.deepcopy(prompt.past_key_values)
            token = prompt.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - start

    run_decode()  # warm-up
    decode_s = statistics.median(run_decode() for _ in range(repeats))
    return {"hf_prefill_tok_s": batch * (context - new_tokens) / prefill_s,
            "hf_decode_ms": 1e3 * decode_s / (new_tokens - 1)}


_HF_MODELS: dict = {}


def save(rows: list[dict], meta: dict, out: Path) -> None:
    """Write `out`.json and `out`.csv."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    short = {"float32": "f32", "bfloat16": "bf16"}
    labels = [f"b{r['batch']} c{r['context']}\n{short[r['dtype']]}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.27, [r["decode_ms"] for r in rows], 0.27, label="kvjax")
    ax.bar(x, [r.get("hf_decode_ms") or 0 for r in rows], 0.27, label="transformers")
    ax.bar(x + 0.27, [r["floor_ms"] for r in rows], 0.27, label="bandwidth floor")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("decode ms / step (lower is better)")
    ax.set_title("SmolLM2-135M decode step, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed decode runs (median)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefill runs (median)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--cold", action="store_true",
                   help="switch jax's persistent compilation cache off: compile seconds are cold")
    p.add_argument("--out", type=Path, default=Path("experiments/out/bench_decode"))
    args = p.parse_args(argv)

    if args.cold:
        jax.config.update("jax_enable_compilation_cache", False)
    path = resolve_model_path(args.model)
    cfg, params = load_weights(path)
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s; jax {jax.__version__} on {jax.devices()[0]}", flush=True)
    meta = {"bandwidth_gbs": bandwidth, "jax": jax.__version__, "cpus": os.cpu_count(),
            "new_tokens": args.new_tokens, "repeats": args.repeats,
            "prefill_repeats": args.prefill_repeats, "model": str(path),
            "cold_compile": args.cold, "load_average": os.getloadavg()}
    rows = []
    for dtype in args.dtypes:
        model = build_model(cfg, params, DTYPES[dtype])
        for batch in args.batches:
            for context in args.contexts:
                row = {"dtype": dtype, "batch": batch, "context": context}
                row.update(bench_kvjax(model, batch, context, args.new_tokens, args.repeats,
                                       args.prefill_repeats, args.chunk))
                bandwidth = read_bandwidth_gbs()  # beside the cell: the machine's load drifts
                row.update(bandwidth_gbs=bandwidth, load_average=os.getloadavg()[0],
                           floor_ms=1e3 * step_bytes(model, batch, context) / (bandwidth * 1e9))
                if not args.no_hf and path.suffix == ".gguf":
                    row.update(bench_hf(path, dtype, batch, context, args.new_tokens,
                                        args.repeats, args.prefill_repeats) or {})
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)
                save(rows, meta, args.out)  # after every cell: an interrupted run keeps its rows
    plot(rows, args.out.with_suffix(".png"))
    print("\n| dtype | batch | context | prefill tok/s | decode ms/step | decode CPU ms/step "
          "| floor ms | x floor | compile s (prefill + decode) "
          "| transformers prefill tok/s | transformers decode ms/step | kvjax speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf = r.get("hf_decode_ms")
        speedup = "" if hf is None else f"{hf / r['decode_ms']:.2f}x"
        print(f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['prefill_tok_s']:.0f} | "
              f"{r['decode_ms']:.1f} | {r['decode_cpu_ms']:.1f} | {r['floor_ms']:.1f} | "
              f"{r['decode_ms'] / r['floor_ms']:.2f} | "
              f"{r['compile_prefill_s']:.1f} + {r['compile_decode_s']:.1f} | "
              f"{r.get('hf_prefill_tok_s', float('nan')):.0f} | "
              f"{hf if hf is None else round(hf, 1)} | "
              f"{speedup} |")


if __name__ == "__main__":
    main()
