"""Artifact size and load-to-first-token time: an exported artifact against loading the GGUF.

    python -m experiments.bench.export --out docs/bench/export.json [--runs 3]

Exports SmolLM2-135M-Instruct (`kvjax export`, one capacity bucket of 256, chunk 64) for each
method, then times, in fresh Python processes run alternately, from the interpreter's start to
the first generated token of one chat prompt:

* `artifact`: `import kvjax.tools.exported` + `load(dir)` + `generate(..., max_new_tokens=1)`;
* `gguf`: `import models...` + `load_model(GGUF)` (which reads kvjax's converted float32 store
  after the first load, as every CLI call does) + `ask`-style `generate(..., max_new_tokens=1)`.

Each run's phases (imports, weight load, first token = prefill compile/run) are recorded;
medians over `--runs`. jax's persistent compilation cache is on for both (the default of
`models` and of `kvjax.tools.exported`), and warmed by one untimed run of each, so the numbers are
a warm start, not XLA compile time. The machine is shared with other jobs: absolute seconds
are noisy, the two paths are measured alternately in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France?"

ARTIFACT = r"""
import time, json, sys
t0 = float(sys.argv[1])
from kvjax.tools import exported
t1 = time.time()
d = exported.load(sys.argv[2])
t2 = time.time()
out = d.generate([PROMPT], max_new_tokens=1, chat=True)
t3 = time.time()
assert "flax" not in sys.modules and "models" not in sys.modules
print(json.dumps({"imports": t1 - t0, "load": t2 - t1, "first_token": t3 - t2, "total": t3 - t0,
                  "token": int(out.tokens[0, 0])}))
"""

GGUF = r"""
import time, json, sys
t0 = float(sys.argv[1])
import kvjax
from models.loading import load_model
from models.sampler import generate
t1 = time.time()
model, tok = load_model(sys.argv[2])
t2 = time.time()
ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
out = generate(model, [ids], max_new_tokens=1, chunk=64, transform=kvjax.parse_method(sys.argv[3]))
t3 = time.time()
print(json.dumps({"imports": t1 - t0, "load": t2 - t1, "first_token": t3 - t2, "total": t3 - t0,
                  "token": int(out.tokens[0, 0])}))
"""


def timed(script: str, *args: str) -> dict:
    code = f"PROMPT = {PROMPT!r}\n" + script
    done = subprocess.run([sys.executable, "-c", code, repr(time.time()), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "export.json")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--methods", default="full,snapkv:ratio=0.5+kivi:bits=4")
    args = parser.parse_args(argv)

    from models.hub import find_smollm2
    from models.loading import load_model
    from models.export import export_artifact

    gguf = find_smollm2()
    model, tokenizer = load_model(gguf)
    rows = []
    for method in args.methods.split(","):
        folder = Path(tempfile.mkdtemp(prefix="kvjax-export-"))
        start = time.perf_counter()
        export_artifact(model, tokenizer, folder, method=method, chunk=64, max_len=256,
                        buckets=(256,), source="smollm2")
        export_seconds = time.perf_counter() - start
        timed(ARTIFACT, str(folder)), timed(GGUF, str(gguf), method)  # warm the jit cache
        runs = {"artifact": [], "gguf": []}
        for _ in range(args.runs):
            runs["artifact"].append(timed(ARTIFACT, str(folder)))
            runs["gguf"].append(timed(GGUF, str(gguf), method))
        assert len({r["token"] for rs in runs.values() for r in rs}) == 1, runs
        median = {k: {phase: round(statistics.median(r[phase] for r in rs), 3)
                      for phase in ("imports", "load", "first_token", "total")}
                  for k, rs in runs.items()}
        weights = (folder / "weights.safetensors").stat().st_size
        rows.append({
            "method": method, "export_seconds": round(export_seconds, 2),
            "artifact_bytes": folder_bytes(folder), "artifact_weights_bytes": weights,
            "artifact_functions_bytes": folder_bytes(folder / "functions"),
            "artifact_tokenizer_bytes": folder_bytes(folder / "tokenizer"),
            "gguf_bytes": gguf.stat().st_size, "median_seconds": median,
            "load_to_first_token_ratio": round(median["artifact"]["total"]
                                               / median["gguf"]["total"], 3),
            "runs": runs})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "SmolLM2-135M-Instruct: kvjax export artifact vs load_model(GGUF); fresh "
                "process start to first greedy token of one chat prompt, warm jit cache",
        "command": "python -m experiments.bench.export --out " + str(args.out.relative_to(ROOT)
                                                                     if args.out.is_absolute() and ROOT in args.out.parents else args.out),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPU cores, shared "
                   f"with other jobs (noisy)", "runs": args.runs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
