"""Where the CPU decode-attention kernel's time goes at batch 1: its compute per slot, its
speed over a step's layers from memory and from the shared cache, and a pure read of the same
bytes, on one and two threads (`experiments/bench/kernel_parts.cc`, built with the kernel's flags).

The question it answers: is the kernel's time over a step's caches the memory transfer, its
own work, or both added up? With `compute` the stages' ns per slot and `read` the pure read at
T threads, "overlapped" predicts max(read, compute / T) and "added" read + compute / T; the
JSON keeps both beside the measured time.

    python -m experiments.bench.kernel_parts --out docs/bench/kernel_parts_b1_4096.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import jax

from experiments.bench.decode import emit
from kvjax.core import cpu_kernel

DRIVER = Path(__file__).with_name("kernel_parts.cc")


def build(source: Path = cpu_kernel.SOURCE) -> Path:
    """The driver compiled against `source` with the kernel's flags (an executable)."""
    out = Path(tempfile.mkdtemp()) / "kernel_parts"
    flags = [f for f in cpu_kernel.flags() if f not in ("-shared", "-fPIC")]
    subprocess.run(["g++", "-w", *flags, f"-I{jax.ffi.include_dir()}",
                    f'-DKERNEL_SOURCE="{source.resolve()}"', str(DRIVER), "-o", str(out),
                    "-lpthread"], check=True)
    return out


def with_models(result: dict) -> dict:
    """`result` plus, per thread count, the overlapped and added predictions (ms)."""
    stages = next(s for s in result["stages"] if s["slots"] == 512)  # data in L2, as streamed
    per_slot_ns = stages["scores_ns"] + stages["softmax_ns"] + stages["values_ns"]
    compute_ms = per_slot_ns * result["rows"] * result["slots"] * result["layers"] / 1e6
    for read in result["read"]:
        t = read["threads"]
        read["compute_ms"] = compute_ms / t
        read["overlapped_ms"] = max(read["ms"], compute_ms / t)
        read["added_ms"] = read["ms"] + compute_ms / t
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--slots", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=cpu_kernel.CHUNK)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.layers < 1 or args.slots < 16 or args.slots % 16 or args.chunk < 1 or args.repeats < 1:
        p.error(f"--layers >= 1, --slots >= 16 and a multiple of 16, --chunk >= 1, --repeats >= 1; "
                f"got {args.layers}, {args.slots}, {args.chunk}, {args.repeats}")
    run = subprocess.run([str(build()), str(args.layers), str(args.slots), str(args.chunk),
                          str(args.repeats)], check=True, capture_output=True, text=True)
    emit(with_models(json.loads(run.stdout)), args.out)


if __name__ == "__main__":
    main()
