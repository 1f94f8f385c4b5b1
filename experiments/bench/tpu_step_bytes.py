"""Bytes one decode step moves on a v5e chip, per cache kind, against the cache's and the
weights' own bytes (issue 54).

    pip install -e '.[tpu-compile]' && python -m experiments.bench.tpu_step_bytes   # ~10 min

Each row is one deviceless `kvjax compile --steps decode --step-bytes` of one layer of the
Llama-3-8B shape at batch 64 x 32,768 slots (32,256 prompt tokens + 512 new), bf16, on
v5e:1x1: the compiler's `cost_analysis()['bytes accessed']` of one decode step compiled
alone (the Mosaic calls count their `pl.CostEstimate`), for the usual step (every
`kvjax.core.branches.rare_cond` -- residual flush, KIVI kernel fallback -- traced as its
usual branch) and as the program runs (XLA charges each conditional its larger branch: an
upper bound). `ratio` = usual step / (cache + weights), the issue's <= 1.2x aim;
`excess_of_cache` = (step - cache - weights) / cache: what the step moves beyond one read
of each, as a fraction of the cache. A static count, not a timing. With one layer the
weights are dominated by the embedding and the LM head (2.1 of 2.5 GB).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.bench.kivi_tpu_temporaries import run_compile

METHODS = ("full", "fp8", "quantize:bits=8", "quantize:bits=4",
           "quantize:bits=4,param_dtype=bfloat16", "kivi:bits=4",
           "kivi:bits=4,param_dtype=bfloat16", "snapkv:ratio=0.5+kivi:bits=4", "auto:budget=0.25",
           "think:ratio=0.5", "knorm:ratio=0.5,headwise=true")


def step_row(method: str, batch: int = 64, context: int = 32256) -> dict:
    """One layer's decode step through the TPU kernel -> its bytes against the cache's and
    the weights'. (Not the XLA path: its block loop is a `while`, which the cost analysis
    counts once, so its count is not the step's.)"""
    out, line = run_compile("--topology", "v5e:1x1", "--mesh", "data=1", "--model", "llama3-8b",
                            "--layers", "1", "--method", method, "--context", str(context),
                            "--new-tokens", "512", "--batch", str(batch), "--impl", "pallas",
                            "--steps", "decode", "--step-bytes")
    row = dict(method=method, batch=batch, context=context, new_tokens=512,
               command=line)
    if "error" in out:
        return dict(row, error=out["error"])
    step = out["decode"]
    cache, weights = step["cache_bytes_per_chip"], out["weight_bytes_per_chip"]
    usual = step.get("step_bytes_accessed")
    row.update(fits=step["fits"], cache_bytes=cache, weight_bytes=weights,
               step_bytes=usual, step_bytes_every_rare_branch=step.get(
                   "step_bytes_every_rare_branch"),
               kernel_calls=step.get("step_kernel_calls"))
    if usual is not None:
        row["ratio"] = round(usual / (cache + weights), 3)
        row["excess_of_cache"] = round((usual - cache - weights) / cache, 3)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/tpu_step_bytes.json"))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    args = parser.parse_args(argv)
    rows = []
    for method in args.methods:
        rows.append(step_row(method))
        print(json.dumps(rows[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(chip="v5e", rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
