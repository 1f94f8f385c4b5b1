"""Temporaries of the KIVI decode step compiled for a TPU chip, kernel path beside XLA's (issue 54).

    python -m experiments.bench.kivi_tpu_temporaries --out docs/bench/kivi_tpu_temporaries.json

Each row is one deviceless compile (`kvjax compile --steps decode --json`, one chip,
`--mesh data=1`, one layer, batch 64, bf16) of a model shape, a method and an attention impl,
for v5e and v6e: the compiler's `memory_analysis()` temporaries against the cache's own bytes
(`temp_over_cache`), the peak, and the Pallas kernel calls in the program (0 for `xla`).
Llama-3-8B's shape at 32,256 + 512 tokens (capacity 32,768); SmolLM2 at 7,680 + 512 (its
8,192 positions). Rows are rewritten to `--out` after every compile (~10-30 s each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SHAPES = {"llama3-8b": 32256, "smollm2": 7680}
METHODS = ("kivi:bits=4", "snapkv:ratio=0.5+kivi:bits=4")
IMPLS = ("pallas", "xla")
TOPOLOGIES = ("v5e:1x1", "v6e:1x1")


def run_compile(*args: str) -> tuple[dict, str]:
    """`kvjax compile *args --json` in a subprocess -> (its JSON, or {"error": [the last line
    of stderr]} when it printed none; the command line). A plan that does not fit is JSON too
    (exit 1)."""
    cmd = [sys.executable, "-c", "from experiments.cli.main import main; main()", "compile",
           *args, "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    line = " ".join(["kvjax", *cmd[3:]])
    if run.returncode < 0:  # e.g. the OOM killer: stderr's last line is some library's noise
        return dict(error=[f"killed by signal {-run.returncode}"]), line
    if not run.stdout.strip():
        return dict(error=run.stderr.strip().splitlines()[-1:]), line
    return json.loads(run.stdout), line


def compile_row(topology: str, model: str, method: str, impl: str, batch: int = 64) -> dict:
    """One `kvjax compile --json` decode step -> its memory numbers (or the compiler's verdict)."""
    out, line = run_compile("--topology", topology, "--mesh", "data=1", "--model", model,
                            "--layers", "1", "--method", method, "--context",
                            str(SHAPES[model]), "--new-tokens", "512", "--batch", str(batch),
                            "--impl", impl, "--steps", "decode")
    row = dict(topology=topology, model=model, method=method, impl=impl, batch=batch,
               context=SHAPES[model], new_tokens=512, command=line)
    if "error" in out:
        return dict(row, error=out["error"])
    step = out["decode"]
    return dict(row, temp=step.get("temp"), peak=step.get("peak"), fits=step.get("fits"),
                cache_bytes=step["cache_bytes"], kernel_calls=step.get("kernel_calls"),
                temp_over_cache=None if step.get("temp") is None
                else round(step["temp"] / step["cache_bytes"], 3),
                compile_seconds=step.get("seconds"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/kivi_tpu_temporaries.json"))
    args = parser.parse_args(argv)
    rows = []
    for topology in TOPOLOGIES:
        for model in SHAPES:
            for method in METHODS:
                for impl in IMPLS:
                    rows.append(compile_row(topology, model, method, impl))
                    print(json.dumps(rows[-1]), flush=True)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(dict(rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
