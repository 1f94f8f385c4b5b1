"""Prefill throughput of the real SmolLM2 against the compute floor, beside transformers.

    python experiments/bench/prefill_throughput.py --tokens 8192 --out docs/bench/prefill_throughput.json

One batch-1 prefill of `--tokens` tokens of KJV Genesis into a float32 cache, timed warm
(median of `--repeats`, after a compile-and-run), for each prefill chunk in `--chunks`
(`models.sampler.prefill_batch`: a scan of chunks, each attending to the cache so far). The
floor is the prefill's matmul FLOPs over this machine's matmul throughput measured in the same
run (`experiments.eval.floor.matmul_gflops`: the median of a float32 `[T, hidden] @ [hidden, intermediate]`
product, the MLP's own shape): projections and MLP `2 * T * (weights)`, causal attention
`2 * 2 * H * D * T (T + 1) / 2` per layer, one row of logits. Beside them transformers'
float32 forward of the same ids (sdpa attention, torch's threads = this process's cores,
`logits_to_keep=1`), the `compare` extra; `--no-hf` skips it. Writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from experiments.eval.floor import matmul_gflops, median_seconds, prefill_flops

TEXT = Path(__file__).resolve().parents[1] / "data" / "kjv_genesis.txt"


def kvjax_prefill_seconds(model, ids, chunk: int, repeats: int) -> tuple[float, float]:
    """(first call incl. compile, warm median) seconds of `prefill_batch` at `chunk`."""
    import jax

    from models.sampler import prefill_batch

    def run():
        jax.block_until_ready(prefill_batch(model, [ids], chunk=chunk).logits)

    start = time.perf_counter()
    run()
    return time.perf_counter() - start, median_seconds(run, repeats)


def hf_prefill_seconds(ids, repeats: int) -> float:
    import torch

    from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference

    model, _, _ = load_hf_reference(DEFAULT_GGUF, dtype=torch.float32,
                                    attn_implementation="sdpa", threads=os.cpu_count())
    x = torch.tensor([ids])

    def run():
        with torch.inference_mode():
            model(input_ids=x, use_cache=True, logits_to_keep=1)

    run()
    return median_seconds(run, repeats)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunks", default="256,1024,2048", help="prefill chunks, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' prefill")
    p.add_argument("--out", type=Path, help="write the JSON row here too")
    args = p.parse_args(argv)

    from models.loading import load_model

    model, tokenizer = load_model("smollm2")
    cfg = model.config
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"--tokens {args.tokens}: the text has only {len(ids)}")
    flops = prefill_flops(cfg, args.tokens)
    row = {"tokens": args.tokens, "model": "SmolLM2-135M-Instruct", "dtype": "float32",
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "flops": flops, "kvjax": []}
    gflops = [matmul_gflops(args.tokens, cfg.hidden_size, cfg.intermediate_size)]
    for chunk in (int(c) for c in args.chunks.split(",")):
        first, warm = kvjax_prefill_seconds(model, ids, chunk, args.repeats)
        row["kvjax"].append({"chunk": chunk, "first_call_s": round(first, 2),
                             "warm_s": round(warm, 3),
                             "tokens_per_s": round(args.tokens / warm, 1)})
        gflops.append(matmul_gflops(args.tokens, cfg.hidden_size, cfg.intermediate_size))
    row["matmul_gflops"] = [round(g, 1) for g in gflops]
    floor = flops["total"] / (statistics.median(gflops) * 1e9)
    row["floor_s"] = round(floor, 3)
    for r in row["kvjax"]:
        r["over_floor"] = round(r["warm_s"] / floor, 2)
    if not args.no_hf:
        hf = hf_prefill_seconds(ids, args.repeats)
        row["transformers"] = {"warm_s": round(hf, 3), "tokens_per_s": round(args.tokens / hf, 1),
                               "over_floor": round(hf / floor, 2)}
    print(json.dumps(row, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n")
    return row


if __name__ == "__main__":
    main()
