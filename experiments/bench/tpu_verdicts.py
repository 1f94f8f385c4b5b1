"""Whole-step verdicts on a TPU slice: the Llama-3-8B shape's decode step per method, compiled
for v5e:2x4 and v6e:2x4 (issue 54).

    python -m experiments.bench.tpu_verdicts --out docs/bench/tpu_verdicts.json   # ~1 h

Each row is one deviceless `kvjax compile --steps decode --step-bytes` of all 32 layers on a
data=2 x model=4 mesh with `--impl pallas`, bf16: whether the decode program fits a chip's HBM
(the compiler's peak per chip), the cache and weight bytes per chip from the shardings, the
Pallas kernel calls, and one decode step compiled alone: its bytes accessed per chip (XLA's
cost analysis; the kernel's own `CostEstimate` for its calls, which counts every page of
the block tables; XLA's own loops are counted once, so the xla-path layers are undercounted)
and a roofline *estimate* of its time, bytes / the chip's HBM bandwidth. Rows are rewritten
to `--out` after every compile.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.bench.kivi_tpu_temporaries import run_compile

HBM_GBPS = {"v5e": 819.0, "v6e": 1640.0}  # per chip, the published HBM bandwidths
SHAPES = ((64, 32256), (8, 130560))  # (batch, prompt tokens); + 512 new tokens
METHODS = ("full", "kivi:bits=4", "snapkv:ratio=0.5+kivi:bits=4", "auto:budget=0.25")
TOPOLOGIES = ("v5e:2x4", "v6e:2x4")


def verdict_row(topology: str, method: str, batch: int, context: int) -> dict:
    """One compiled decode step of the 32-layer 8B shape -> its verdict, bytes and estimate."""
    out, line = run_compile("--topology", topology, "--mesh", "data=2,model=4", "--model",
                            "llama3-8b", "--method", method, "--context", str(context),
                            "--new-tokens", "512", "--batch", str(batch), "--impl", "pallas",
                            "--steps", "decode", "--step-bytes")
    row = dict(topology=topology, method=method, batch=batch, context=context, new_tokens=512,
               command=line)
    if "error" in out:
        return dict(row, error=out["error"])
    step = out["decode"]
    row.update(fits=step["fits"], needs=step.get("needs"), has=step.get("has"),
               peak=step.get("peak"), temp=step.get("temp"),
               cache_bytes_per_chip=step["cache_bytes_per_chip"],
               weight_bytes_per_chip=out["weight_bytes_per_chip"],
               kernel_calls=step.get("kernel_calls"),
               step_bytes_accessed=step.get("step_bytes_accessed"))
    if row["step_bytes_accessed"]:
        floor = row["cache_bytes_per_chip"] + row["weight_bytes_per_chip"]
        row["step_over_cache_and_weights"] = round(row["step_bytes_accessed"] / floor, 3)
        gbps = HBM_GBPS[topology.split(":")[0]]
        row["estimate_ms_per_step"] = round(row["step_bytes_accessed"] / gbps / 1e6, 3)
        row["floor_ms_per_step"] = round(floor / gbps / 1e6, 3)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/tpu_verdicts.json"))
    args = parser.parse_args(argv)
    rows = []
    for batch, context in SHAPES:
        for method in METHODS:
            for topology in TOPOLOGIES:
                rows.append(verdict_row(topology, method, batch, context))
                print(json.dumps(rows[-1]), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(dict(hbm_gbps=HBM_GBPS, rows=rows), indent=1)
                                    + "\n")


if __name__ == "__main__":
    main()
