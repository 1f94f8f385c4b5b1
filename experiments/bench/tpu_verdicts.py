"""Whole-step verdicts on a TPU slice: the Llama-3-8B shape's decode step per method, compiled
for v5e:2x4 and v6e:2x4 (issue 54).

    python -m experiments.bench.tpu_verdicts --out docs/bench/tpu_verdicts.json   # ~30-60 min
    python -m experiments.bench.tpu_verdicts --only 1x1047552     # one case; other rows kept

Each row is one deviceless `kvjax compile --steps decode` of all 32 layers with `--impl
pallas`, bf16, on a data=2 x model=4 mesh (batch 1 at a million tokens: model=8, the 8B
shape with 2**20 positions, `llama3-8b-1m`): whether the decode program fits a chip's HBM (the
compiler's peak per chip, or what it needs), the cache and weight bytes per chip from the
shardings, the Pallas kernel calls and the layers that attend through XLA instead, and a
roofline *estimate* of one decode step: the cache and weight bytes per chip over the chip's
HBM bandwidth (`floor_ms_per_step`: what a step must read at least; not a measurement).
Rows are rewritten to `--out` after every compile.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from experiments.bench.kivi_tpu_temporaries import run_compile

HBM_GBPS = {"v5e": 819.0, "v6e": 1640.0}  # per chip, the published HBM bandwidths
METHODS = ("full", "kivi:bits=4", "snapkv:ratio=0.5+kivi:bits=4", "auto:budget=0.25")


class Case(NamedTuple):
    batch: int
    context: int  # prompt tokens; + 512 new tokens
    model: str
    mesh: str
    methods: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.context}"


CASES = (Case(64, 32256, "llama3-8b", "data=2,model=4", METHODS),
         Case(8, 130560, "llama3-8b", "data=2,model=4", METHODS),
         Case(1, 1047552, "llama3-8b-1m", "data=1,model=8", ("snapkv:ratio=0.5+kivi:bits=4",)))
TOPOLOGIES = ("v5e:2x4", "v6e:2x4")


def verdict_row(topology: str, method: str, case: Case) -> dict:
    """One compiled decode step of the 32-layer 8B shape -> its verdict, bytes and estimate."""
    out, line = run_compile("--topology", topology, "--mesh", case.mesh, "--model", case.model,
                            "--method", method, "--context", str(case.context),
                            "--new-tokens", "512", "--batch", str(case.batch), "--impl",
                            "pallas", "--steps", "decode")
    row = dict(topology=topology, method=method, batch=case.batch, context=case.context,
               new_tokens=512, model=case.model, mesh=case.mesh, command=line)
    if "error" in out:
        return dict(row, error=out["error"])
    step = out["decode"]
    row.update(fits=step["fits"], needs=step.get("needs"), has=step.get("has"),
               peak=step.get("peak"), temp=step.get("temp"),
               cache_bytes_per_chip=step["cache_bytes_per_chip"],
               weight_bytes_per_chip=out["weight_bytes_per_chip"],
               kernel_calls=step.get("kernel_calls"),
               kernel_refusals=step.get("kernel_refusals"))
    floor = row["cache_bytes_per_chip"] + row["weight_bytes_per_chip"]
    gbps = HBM_GBPS[topology.split(":")[0]]
    row["floor_ms_per_step"] = round(floor / gbps / 1e6, 3)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/tpu_verdicts.json"))
    parser.add_argument("--only", choices=[case.name for case in CASES],
                        help="compile one case (BATCHxCONTEXT); the file's other rows stay")
    args = parser.parse_args(argv)
    cases = [case for case in CASES if args.only in (None, case.name)]
    rows = [] if args.only is None or not args.out.exists() else [
        row for row in json.loads(args.out.read_text())["rows"]
        if f"{row['batch']}x{row['context']}" != args.only]
    for case in cases:
        for method in case.methods:
            for topology in TOPOLOGIES:
                rows.append(verdict_row(topology, method, case))
                print(json.dumps(rows[-1]), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(dict(hbm_gbps=HBM_GBPS, rows=rows), indent=1)
                                    + "\n")


if __name__ == "__main__":
    main()
