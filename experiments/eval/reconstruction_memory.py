"""Memory and time of KVzip's and KVgrad's reconstruction pass on the real model at a batch.

    python experiments/eval/reconstruction_memory.py --out docs/results/kvzip --batch 8 --length 1024

For each method (KVzip, KVzip+, KVCompose, KVgrad: the four passes `models.reconstruction`
compiles) prefills `--batch` contexts of `--length` tokens of KJV Genesis into SmolLM2 and runs
`prefill_and_compress`, each in its own process: the pass's compiled temporaries
(`memory_analysis`, the program of one pass), the process's peak resident memory and the
wall time of the whole call (first compile included). Writes `memory.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("kvzip:ratio=0.5", "kvzip:ratio=0.5,plus=true", "kvcompose:ratio=0.5",
           "kvgrad:ratio=0.5")
PASSES = ("_pass_scores", "_plus_pass_scores", "_gradient_pass_scores")
TEXT = Path("experiments/data/kjv_genesis.txt")


def measure(method: str, batch: int, length: int) -> dict:
    """One method's row, in this process."""
    import kvjax
    import models.reconstruction as reconstruction
    from models.loading import load_model
    from models.sampler import prefill_and_compress

    model, tokenizer = load_model("smollm2")
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    contexts = [ids[i * length:(i + 1) * length] for i in range(batch)]
    row = {"method": method, "batch": batch, "length": length}
    for name in PASSES:  # wrap each pass: its compiled temporaries, then the call itself
        original = getattr(reconstruction, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            if "pass_temp_gib" not in row:
                memory = _original.lower(*args, **kwargs).compile().memory_analysis()
                row.update(pass_function=_name, pass_temp_gib=memory.temp_size_in_bytes / 2**30,
                           pass_argument_gib=memory.argument_size_in_bytes / 2**30)
            return _original(*args, **kwargs)

        setattr(reconstruction, name, wrapped)
    transform = reconstruction.with_tokenizer(kvjax.parse_method(method), tokenizer)
    start = time.perf_counter()
    out = prefill_and_compress(model, contexts, transform=transform, room=8)
    kvjax.num_valid(out.cache[0]).block_until_ready()
    row["seconds"] = time.perf_counter() - start
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for memory.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this method, print JSON
    args = ap.parse_args(argv)
    for name in ("batch", "length"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.one:
        print(json.dumps(measure(args.one, args.batch, args.length)))
        return 0
    rows = []
    for method in args.methods:  # a process each: peak memory is the method's own
        done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--batch",
                               str(args.batch), "--length", str(args.length), "--one", method],
                              capture_output=True, text=True)
        if done.returncode:
            rows.append({"method": method, "error": done.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "experiments/eval/reconstruction_memory.py", "--out",
                        str(args.out), "--batch", str(args.batch), "--length", str(args.length)])
    (args.out / "memory.json").write_text(json.dumps(
        {"command": command, "machine": f"{platform.processor() or platform.machine()}, "
                                        f"{os.cpu_count()} cores",
         "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
