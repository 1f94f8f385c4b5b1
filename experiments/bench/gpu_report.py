"""BENCHMARKS' GPU tables, generated from the JSON rows a GPU run committed under docs/bench/.

Reads `kernels.py` outputs (`{"meta": ..., "rows": [...]}`) and prints,
per attention shape, one markdown row per page format: the kernel's time at
its default step and launch, the fastest variant of the sweep and its label,
the ratio to bf16 pages at their fastest (the same run), the bytes the call
must read and the share of the measured copy bandwidth the fastest variant
reaches. `--model` adds the whole-model table of `gpu_model_check.py`.

    python experiments/bench/gpu_report.py docs/bench/gpu_h200_bench_*.json \
        --model docs/bench/gpu_h200_model_check.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KVJAX = "kvjax paged"


def _label(method: str) -> str:
    return method[len(KVJAX):].strip() or "default"


def bench_table(paths: list[str]) -> str:
    """Markdown: one row per (shape, batch, context, format) of kvjax's kernel."""
    lines = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta, rows = data["meta"], data["rows"]
        lines.append(f"`{Path(path).name}`: {meta['device']}, driver {meta.get('driver')}, "
                     f"jax {meta.get('jax')}, copy bandwidth {meta['copy_gbs']:.0f} GB/s, "
                     f"{meta.get('date', '')}  \n`{meta.get('command', '')}`\n")
        lines.append("| shape | batch x context | format | default ms | fastest ms (variant) "
                     "| x bf16 time | MB read | of copy (fastest) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        cells = {}
        for r in rows:
            if r["method"].startswith(KVJAX) and r["ms"]:
                cells.setdefault((r["shape"], r["batch"], r["context"]), {}).setdefault(
                    r["format"], []).append(r)
        for (shape, batch, context), by_format in cells.items():
            bf16 = min((r["ms"] for r in by_format.get("bf16", [])), default=None)
            for fmt, variants in by_format.items():
                best = min(variants, key=lambda r: r["ms"])
                default = next((r["ms"] for r in variants if r["method"] == KVJAX), None)
                ratio = f"{best['ms'] / bf16:.2f}" if bf16 else "-"
                lines.append(
                    f"| {shape} | {batch} x {context} | {fmt} | "
                    f"{default if default is not None else '-'} | {best['ms']} "
                    f"({_label(best['method'])}) | {ratio} | {best['bytes'] / 1e6:.0f} | "
                    f"{best['of_copy']} |")
        failed = [r for r in rows if not r["ms"]]
        for r in failed:
            lines.append(f"\nfailed: {r['shape']} {r['method']} {r['format']}: "
                         f"{(r['error'] or '')[:160]}")
        lines.append("")
    return "\n".join(lines)


def model_table(path: str) -> str:
    data = json.loads(Path(path).read_text())
    lines = [f"`{Path(path).name}`: {data['device']}, jax {data.get('jax')}, "
             f"{data.get('layers')} layers, prompts {data['prompt_lengths']}, "
             f"{data['new_tokens']} new tokens  \n`{data.get('command', '')}`\n",
             "| method | identical tokens | first difference per row | kernel calls in step "
             "| warm generate s (xla / pallas) |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error'][:120]} | | | |")
            continue
        s = r["warm_generate_s"]
        lines.append(f"| {r['method']} | {r['identical_tokens']} / {r['tokens']} | "
                     f"{r['first_difference']} | {r['pallas_kernel_calls_in_step']} | "
                     f"{s['xla']} / {s['pallas']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", nargs="*", help="kernels.py JSON files")
    parser.add_argument("--model", default=None, help="gpu_model_check.py JSON file")
    args = parser.parse_args(argv)
    for path in [*args.bench, *([args.model] if args.model else [])]:
        if not Path(path).is_file():
            parser.error(f"no such file: {path}")
    text = bench_table(args.bench) + (model_table(args.model) if args.model else "")
    print(text)
    return text


if __name__ == "__main__":
    main()
