"""Prefill-plus-planning time of `auto` beside the same prefill with a fixed chain, warm,
interleaved (issue 53 asks for within 1.3x).

    python experiments/eval/planner_overhead.py --tokens 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="*", default=["full", "snapkv:ratio=0.5+kivi:bits=4",
                                                     "expected_attention:ratio=0.5+kivi:bits=4",
                                                     "auto:budget=0.125"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import jax

    from kvjax import parse_method
    from models.loading import load_model
    from models.sampler import prefill_and_compress
    model, tokenizer = load_model("smollm2")
    text = Path("experiments/data/kjv_genesis.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)[:args.tokens]
    run = lambda m: jax.block_until_ready(prefill_and_compress(
        model, [ids], transform=parse_method(m), room=256).cache)
    times = {m: [] for m in args.methods}
    for m in args.methods:
        run(m)  # compile
    for _ in range(args.repeats):
        for m in args.methods:
            start = time.perf_counter()
            run(m)
            times[m].append(time.perf_counter() - start)
    rows = {m: round(statistics.median(t), 3) for m, t in times.items()}
    print(json.dumps({"tokens": args.tokens, "median_seconds": rows}))
    if args.out:
        args.out.write_text(json.dumps({"tokens": args.tokens, "median_seconds": rows,
                                        "all_seconds": times}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
