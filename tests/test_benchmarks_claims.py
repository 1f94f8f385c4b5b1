"""docs/BENCHMARKS.md's tables that quote committed JSON agree with it (issue 48: claims pinned).

The compiler-read table of the GPU kernel ("The kernel since, read from the compiler"): every
row's launch, warp-instructions per loop step, instructions per KB, step bytes and programs per
multiprocessor, before and now, are the first (default-launch) row of their shape and format
in `docs/bench/triton_static_sm90_before.json` and `docs/bench/triton_static_sm90.json`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"Llama-3-8B": "llama3-8b", "SmolLM2": "smollm2"}
FORMATS = {"bf16": "bf16", "fp8": "fp8", "int8": "int8", "int4": "int4", "KIVI-4": "kivi4",
           "KIVI-2": "kivi2"}
ROW = re.compile(r"^\|\s*([^|]*?)\s*\| (\S+) \(([\d.]+) KB\) \| (\d+x\d+)(?: codes path)?, ([\d,]+), "
                 r"([\d,]+) \| (\d+x\d+), ([\d,]+), ([\d,]+) \| (\d+) -> (\d+) \|$")


def defaults(name: str) -> dict:
    """(shape, format) -> the first row of a triton_static JSON (its default launch)."""
    rows = json.loads((ROOT / "docs" / "bench" / name).read_text())["rows"]
    first = {}
    for r in rows:
        first.setdefault((r["shape"], r["format"]), r)
    return first


def test_compiler_read_kernel_table_is_its_json_rows():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    section = text[text.index("### The kernel since, read from the compiler"):]
    before, now = defaults("triton_static_sm90_before.json"), defaults("triton_static_sm90.json")
    number = lambda s: int(s.replace(",", ""))
    launch = lambda r: f"{r['num_warps']}x{r['num_stages']}"
    shape, checked = None, 0
    for line in section.splitlines():
        m = ROW.match(line)
        if not m:
            if checked and not line.startswith("|"):
                break
            continue
        shape = SHAPES[m[1].strip()] if m[1].strip() else shape
        key = (shape, FORMATS[m[2]])
        old, new = before[key], now[key]
        assert float(m[3]) == round(new["step_bytes"] / 1000, 1) == round(old["step_bytes"] / 1000, 1)
        for (lq, wq, kq), r in (((m[4], m[5], m[6]), old), ((m[7], m[8], m[9]), new)):
            assert (lq, number(wq)) == (launch(r), r["loop_warp_instructions"]), line
            assert abs(number(kq) - r["warp_instructions_per_kb"]) <= 0.5, line  # rounded
        assert (int(m[10]), int(m[11])) == (old["programs_per_sm"], new["programs_per_sm"]), line
        checked += 1
    assert checked == 10, f"{checked} rows of the table matched its pattern"


def section_matches(heading: str, row: re.Pattern) -> list[re.Match]:
    """The lines of BENCHMARKS.md's section `heading` (to the next ### heading) that `row`
    matches."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    lines = text[text.index(heading):].splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if line.startswith("### ")), len(lines))
    return [m for m in map(row.match, lines[:end]) if m]


def test_step_bytes_table_is_its_json_rows():
    """"Bytes one decode step moves, per cache kind": every row is its method's row of
    docs/bench/tpu_step_bytes.json (GB to two places, ratio and excess to three)."""
    rows = {r["method"]: r for r in
            json.loads((ROOT / "docs" / "bench" / "tpu_step_bytes.json").read_text())["rows"]}
    row = re.compile(r"^\| `([^`]+)` \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                     r"(-?[\d.]+) \| (\d+) \|$")
    seen = []
    for m in section_matches("### Bytes one decode step moves, per cache kind", row):
        line = m[0]
        r = rows[m[1]]
        gb = lambda key: f"{r[key] / 1e9:.2f}"
        assert (m[2], m[3], m[4]) == (gb("cache_bytes"), gb("step_bytes"),
                                      gb("step_bytes_every_rare_branch")), line
        assert (float(m[5]), float(m[6]), int(m[7])) == (r["ratio"], r["excess_of_cache"],
                                                         r["kernel_calls"]), line
        assert r["ratio"] == round(r["step_bytes"] / (r["cache_bytes"] + r["weight_bytes"]), 3)
        seen.append(m[1])
    assert sorted(seen) == sorted(rows), seen


def test_paged_bytes_table_is_its_json_rows():
    """"Bytes one attention call over a page pool moves": every row is its (layer, page,
    codes, parameters) row of docs/bench/tpu_paged_bytes.json (GB to two places, ratio to
    three), and the ratio is the row's own step / layer bytes."""
    rows = {(r["kind"], str(r["page"]), r["codes"], r["param_dtype"] or "-"): r for r in
            json.loads((ROOT / "docs" / "bench" / "tpu_paged_bytes.json").read_text())["rows"]}
    row = re.compile(r"^\| (\w+) \| (\d+) \| (\w+) \| ([\w-]+) \| ([\d.]+) \| ([\d.]+) \| "
                     r"([\d.]+) \| (\d+) \|$")
    seen = []
    for m in section_matches("### Bytes one attention call over a page pool moves", row):
        r = rows[m.groups()[:4]]
        assert (m[5], m[6]) == (f"{r['layer_bytes'] / 1e9:.2f}", f"{r['step_bytes'] / 1e9:.2f}")
        assert (float(m[7]), int(m[8])) == (r["ratio"], r["kernel_calls"]), m[0]
        assert r["ratio"] == round(r["step_bytes"] / r["layer_bytes"], 3)
        seen.append(m.groups()[:4])
    assert sorted(seen) == sorted(rows), seen


HBM_GIB = {"v5e": 15.75, "v6e": 31.25}  # a chip's HBM as the compiler reports it


def _verdict(r: dict) -> str:
    """A tpu_verdicts row's verdict as BENCHMARKS words it (GiB to two places)."""
    gib = lambda n: f"{n / 2**30:.2f}"
    if r["fits"]:
        return f"fits: peak {gib(r['peak'])} of {HBM_GIB[r['topology'][:3]]:.2f} GiB"
    return f"does not fit: needs {gib(r['needs'])} GiB, has {gib(r['has'])}"


def test_whole_step_verdicts_table_is_its_json_rows():
    """"Whole-step verdicts": every row is its (batch, tokens, method, chip) row of
    docs/bench/tpu_verdicts.json -- the compiler's verdict, bytes per chip, Mosaic calls and the
    roofline estimate (cache + weights per chip over the chip's bandwidth), and every JSON row
    has its line."""
    data = json.loads((ROOT / "docs" / "bench" / "tpu_verdicts.json").read_text())
    rows = {(r["batch"], r["context"] + r["new_tokens"], r["method"], r["topology"]): r
            for r in data["rows"]}
    row = re.compile(r"^\| (\d+) x ([\d,]+) \| `([^`]+)` \| (v[56]e:\dx\d) \| ([^|]+) \| "
                     r"([\d.]+) GiB \| ([\d.]+) GiB \| (\d+|-) \| ([\d.]+) \|$")
    seen = []
    for m in section_matches("### Whole-step verdicts", row):
        line = m[0]
        key = (int(m[1]), int(m[2].replace(",", "")), m[3], m[4])
        r = rows[key]
        gib = lambda n: f"{n / 2**30:.2f}"
        assert m[5].strip() == _verdict(r), line
        assert (m[6], m[7]) == (gib(r["cache_bytes_per_chip"]), gib(r["weight_bytes_per_chip"]))
        assert m[8] == (str(r["kernel_calls"]) if r["fits"] else "-"), line
        gbps = data["hbm_gbps"][m[4].split(":")[0]]
        floor = (r["cache_bytes_per_chip"] + r["weight_bytes_per_chip"]) / gbps / 1e6
        assert float(m[9]) == r["floor_ms_per_step"] == round(floor, 3), line
        seen.append(key)
    assert sorted(seen) == sorted(rows), sorted(set(rows) - set(seen))


def test_ragged_cost_table_is_its_json_rows():
    """"One prefill chunk beside 63 decode tokens": every row is its (chunk, form) row of
    docs/bench/tpu_ragged_cost.json, and the ratios are the rows' own against the padded row."""
    rows = json.loads((ROOT / "docs" / "bench" / "tpu_ragged_cost.json").read_text())["rows"]
    by_key = {(str(r["chunk"]), r["form"]): r for r in rows}
    row = re.compile(r"^\| (\d+) \| (padded|ragged) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                     r"([\d.]+) \|$")
    seen = []
    for m in section_matches("### One prefill chunk beside 63 decode tokens", row):
        r = by_key[(m[1], m[2])]
        assert (m[3], m[4]) == (f"{r['flops'] / 1e9:.1f}", f"{r['bytes_accessed'] / 1e9:.2f}")
        padded = by_key[(m[1], "padded")]
        assert float(m[5]) == r["flops_vs_padded"] == round(r["flops"] / padded["flops"], 3)
        assert float(m[6]) == r["bytes_vs_padded"] == round(
            r["bytes_accessed"] / padded["bytes_accessed"], 3)
        seen.append((m[1], m[2]))
    assert sorted(seen) == sorted(by_key), seen
