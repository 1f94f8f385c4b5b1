"""The hand-written reading of docs/RESULTS.md, checked number by number against its rows.

The section between the `kvjax eval` markers is generated from `docs/results/eval/cells.jsonl`
by `experiments/eval/report.py`; everything else in RESULTS.md (the readings, the deeper sweeps'
tables) is written by hand. Each claim below is a regular expression that must match the
hand-written text exactly once (whitespace normalised), so a claim cannot silently drop out
of the document, and a check that recomputes every number it captures from the JSONL rows
the text names. A quoted number agrees when it is the row value rounded to the digits
quoted (|quoted - value| <= half a unit of the last quoted digit).

Claims the rows contradict today are listed in `WRONG`: the exact quotes that disagree and
what the rows give. Such a claim must disagree in exactly those quotes (any other number in
it is still checked) and is then reported as xfail; once RESULTS.md is corrected the test
fails until the entry is removed from `WRONG`.
"""

from __future__ import annotations

import collections
import inspect
import json
import math
import re
from pathlib import Path

import pytest

from experiments.eval.grid import cell_of, read_config
from experiments.eval.report import policy_and_ratio

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "RESULTS.md"
ROWS = ROOT / "docs" / "results"
BEGIN, END = "<!-- kvjax eval: begin -->", "<!-- kvjax eval: end -->"


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROWS / name).read_text().splitlines() if line.strip()]


def prose() -> str:
    """RESULTS.md without the generated section, whitespace collapsed to single spaces."""
    text = RESULTS.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return " ".join((text[:start] + text[end:]).split())


def agrees(quoted: str, value: float) -> bool:
    """`quoted` is `value` rounded to the digits quoted."""
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    return abs(float(quoted) - value) <= 0.5 * 10 ** -decimals + 1e-9


MISMATCHES: list[tuple[str, str]] = []  # (quoted, what the rows give) of the running check


def same(quoted: str, *values: float) -> None:
    """Record every value `quoted` does not agree with (so no error hides behind another)."""
    for value in values:
        if not agrees(quoted, value):
            MISMATCHES.append((quoted, f"{value:.4g}"))


def mismatches(check, groups) -> list[tuple[str, str]]:
    """Run a claim's check: [(quoted, rows' value)], ("statement", why) for a failed assert."""
    MISMATCHES.clear()
    try:
        check(groups)
    except AssertionError as e:
        MISMATCHES.append(("statement", str(e).splitlines()[0]))
    return list(MISMATCHES)


def pct(value: float, ref: float) -> float:
    return 100 * (value / ref - 1)


# ----------------------------------------------------------------------------- the rows


def grid_keys(*configs: str) -> set:
    """The cell keys of shipped grid configs (`experiments/configs/NAME.toml`)."""
    return {c.key for name in configs
            for c in read_config(ROOT / "experiments" / "configs" / f"{name}.toml").cells}


# the results grid's rows: results.toml and compare.toml (zoo.toml writes into the same
# folder; its rows have their own table and claims: tests/test_kvpress_ppl.py)
EVAL = [r for r in load("eval/cells.jsonl")
        if cell_of(r).key in grid_keys("results", "compare")]
SMOKE = load("eval_smoke/cells.jsonl")
EVICTION = load("eviction/cells.jsonl")  # kvjax eval --config experiments/configs/eviction.toml
CODECS = load("codecs/cells.jsonl")  # kvjax eval --config experiments/configs/codecs.toml
# The tables of RESULTS.md name an eviction method by its policy and ratio columns
# (`streaming_llm:sinks=0` is the sliding window; Ada-KV and the query-aware SnapKV have
# short names) and a codec by its `label`; the rows by their method spec.
SHORT = {"snapkv:headwise=true": "adakv_snapkv", "snapkv (query-aware)": "snapkv_query_aware"}


def _policy(row: dict) -> tuple[str, float]:
    policy, ratio = policy_and_ratio(row)
    return SHORT.get(policy, policy), ratio


EVICT_PPL = [dict(r, policy=_policy(r)[0], ratio=_policy(r)[1], ppl=r["score"])
             for r in EVICTION if r["task"] == "ppl"]
EVICT_PASSKEY = [dict(b, length=r["length"], policy=_policy(r)[0], ratio=_policy(r)[1])
                 for r in EVICTION if r["task"] == "passkey" for b in r["batches"]]
CODEC_PPL = [dict(r, method=r["label"], spec=r["method"], ppl=r["score"])
             for r in CODECS if r["task"] == "ppl"]
CODEC_MEMORY = [dict(r, method=r["label"], spec=r["method"], tokens=r["length"])
                for r in CODECS if r["task"] == "memory"]
CODEC_PASSKEY = [dict(b, method=r["label"], length=r["length"])
                 for r in CODECS if r["task"] == "passkey" for b in r["batches"]]

GRID_PPL = {r["method"]: r for r in EVAL if r["task"] == "ppl"}
GRID_FULL = GRID_PPL["full"]


def grid_vs(method: str) -> float:
    return pct(GRID_PPL[method]["score"], GRID_FULL["score"])


BYTES = "cache_bytes_per_token_bf16"  # the bytes a bfloat16 cache would hold (the tables' axis)


def grid_of_full(method: str) -> float:
    return 100 * GRID_PPL[method][BYTES] / GRID_FULL[BYTES]


def grid(task: str, method: str, length: int = 1024) -> dict:
    (row,) = [r for r in EVAL if (r["task"], r["method"], r["length"]) == (task, method, length)
              and not r["warmup"]]
    return row


def correct_of(row: dict) -> int:
    return round(row["score"] * row["trials"])


def by_depth(row: dict) -> dict[float, float]:
    out = collections.defaultdict(float)
    for depth, score in zip(row["depths"], row["scores"]):
        out[depth] += score
    return out


def speed(method: str, batch: int, length: int) -> dict:
    (row,) = [r for r in EVAL if r["task"] == "speed" and (r["method"], r["batch"], r["length"])
              == (method, batch, length)]
    return row


EVICT = {(r["policy"], r["ratio"]): r["ppl"] for r in EVICT_PPL}
EVICT_FULL = EVICT[("full", 0.0)]


def evict_vs(policy: str, ratio: float) -> float:
    return pct(EVICT[(policy, ratio)], EVICT_FULL)


def passkey(policy: str, length: int, ratio: float) -> int:
    """Correct answers of an eviction passkey cell (all its batches; full has ratio 0)."""
    ratio = 0.0 if policy == "full" else ratio
    rows = [r for r in EVICT_PASSKEY if (r["policy"], r["length"], r["ratio"]) ==
            (policy, length, ratio)]
    assert sum(r["trials"] for r in rows) == 20, (policy, length, ratio)
    return sum(r["correct"] for r in rows)


CODEC = {r["method"]: r for r in CODEC_PPL}
CODEC_BYTES = {r["method"]: r for r in CODEC_MEMORY}


def codec_vs(method: str) -> float:
    return pct(CODEC[method]["ppl"], CODEC["full"]["ppl"])


def codec_passkey(method: str) -> tuple[int, int]:
    rows = [r for r in CODEC_PASSKEY if r["method"] == method]
    return sum(r["correct"] for r in rows), sum(r["trials"] for r in rows)


SMOKE_SCORE = {(r["task"], r["method"]): r["score"] for r in SMOKE}
POLICIES_075 = [m for m in GRID_PPL if "+" not in m and m.endswith("ratio=0.75")
                or m == "snapkv:ratio=0.75,headwise=true"]


def pareto(rows: dict) -> list[str]:
    """Methods no smaller cache beats on perplexity, smallest cache first."""
    front, best = [], math.inf
    for m in sorted(rows, key=lambda m: rows[m][BYTES]):
        if rows[m]["score"] < best:
            front.append(m)
            best = rows[m]["score"]
    return front


# ----------------------------------------------------------------------------- the claims
# name -> (regex over the hand-written prose, check(captured strings))


def _cells(q):
    quality = [r for r in EVAL if not r["warmup"] and r["task"] != "speed"]
    low_rank = [r for r in quality if r["method"].startswith("low_rank")]
    timed = [r for r in EVAL if r["warmup"] or r["task"] == "speed"]
    same(q[0], len(quality) - len(low_rank) + len(timed))
    same(q[1], len(quality) - len(low_rank))
    assert q[2] == "two" and len(low_rank) == 2
    same(q[3], len(timed))


LABELS = {"H2O-0.75 + KIVI-4": "h2o:ratio=0.75+kivi:bits=4", "H2O-0.75": "h2o:ratio=0.75",
          "Ada-KV-0.75": "snapkv:ratio=0.75,headwise=true",
          "SnapKV-0.5 + KIVI-4": "snapkv:ratio=0.5+kivi:bits=4",
          "H2O-0.5 + KIVI-4": "h2o:ratio=0.5+kivi:bits=4", "KIVI-4": "kivi:bits=4",
          "int8": "quantize:bits=8,group=32", "fp8": "fp8",
          "per-token int4": "quantize:bits=4,group=32"}


def _pareto(q):
    listed = [LABELS[q[i]] for i in range(0, len(q), 3)]
    assert listed == [m for m in pareto(GRID_PPL) if m != "full"]
    for i, m in zip(range(0, len(q), 3), listed):
        same(q[i + 1], grid_of_full(m))
        same(q[i + 2], grid_vs(m))


def _codecs_off_front(q):
    front = pareto(GRID_PPL)
    for i in (0, 3):
        m = LABELS[q[i]]
        assert m not in front, m
        same(q[i + 1], grid_of_full(m))
        same(q[i + 2], grid_vs(m))


def _beats_075(q):
    chain = "h2o:ratio=0.5+kivi:bits=4"
    same(q[0], grid_vs(chain))
    same(q[1], grid_of_full(chain))
    assert all(GRID_PPL[chain]["score"] < GRID_PPL[m]["score"] for m in POLICIES_075)
    sizes = [grid_of_full(m) for m in POLICIES_075]
    same(q[2], min(sizes))
    same(q[3], max(sizes))
    same(q[4], min(grid_vs(m) for m in POLICIES_075))
    same(q[5], max(grid_vs(m) for m in POLICIES_075))


def _rank_05(q):
    same(q[0], grid_vs("snapkv:ratio=0.5,headwise=true"))
    same(q[1], grid_vs("snapkv:ratio=0.5"), grid_vs("expected_attention:ratio=0.5"),
         grid_vs("h2o:ratio=0.5"))
    for s, m in zip(q[2:], ("pyramidkv", "streaming_llm", "tova", "knorm", "random",
                            "streaming_llm:sinks=0")):
        same(s, grid_vs(f"{m},ratio=0.5" if ":" in m else f"{m}:ratio=0.5"))


def _low_rank(q):
    r48 = "low_rank:rank=48,basis=docs/results/lowrank_basis.npz"
    r32 = "low_rank:rank=32,basis=docs/results/lowrank_basis.npz"
    same(q[0], GRID_PPL[r48]["score"])
    same(q[1], grid_of_full(r48))
    same(q[2], GRID_PPL[r32]["score"])


def _kivi4(q):
    from kvjax.policies.codecs import kivi
    same(q[0], grid_vs("kivi:bits=4"))
    same(q[1], grid_of_full("kivi:bits=4"))
    same(q[2], grid_of_full("quantize:bits=8,group=32"))
    same(q[3], inspect.signature(kivi).parameters["residual"].default)
    same(q[4], GRID_FULL["prefix"])


def _depth_maps(q):
    lengths = (512, 1024, 2048)
    assert all(grid("passkey", "full", n)["score"] == 1.0 for n in lengths)
    for n in lengths:
        d = by_depth(grid("passkey", "streaming_llm:ratio=0.5", n))
        assert d[0.7] == d[0.9] == 2 and d[0.1] == d[0.3] == 0, (n, d)
    snap = [correct_of(grid("passkey", "snapkv:ratio=0.5", n)) for n in lengths]
    same(q[0], min(snap))
    same(q[1], max(snap))
    for s, n in zip(q[2:], lengths):
        same(s, correct_of(grid("passkey", "h2o:ratio=0.5+kivi:bits=4", n)))


GRID_METHODS = ("full", "streaming_llm:ratio=0.5", "snapkv:ratio=0.5", "h2o:ratio=0.5+kivi:bits=4")


def _ruler(q):
    for s, m in zip(q[:4], GRID_METHODS):
        same(s, grid("niah_multikey", m)["score"])
    for s, m in zip(q[4:6], GRID_METHODS):
        same(s, grid("niah_multivalue", m)["score"])
    same(q[6], *(grid("niah_multivalue", m)["score"] for m in GRID_METHODS[2:]))


def _kvpress(q):
    side = [r for r in EVAL if r["warmup"]]
    jx = {r["method"]: r for r in side if r["engine"] == "kvjax"}
    tp = {r["method"]: r for r in side if r["engine"] == "kvpress"}
    assert set(jx) == set(tp) and all(jx[m]["score"] == tp[m]["score"] for m in jx)
    same(q[0], len(jx))
    same(q[1], sum(r["trials"] for r in jx.values()))
    same(q[2], jx["full"]["batch"])
    same(q[3], min(r["seconds_per_trial"] for r in jx.values()))
    same(q[4], max(r["seconds_per_trial"] for r in jx.values()))
    same(q[5], min(r["seconds_per_trial"] for r in tp.values()))
    same(q[6], max(r["seconds_per_trial"] for r in tp.values()))
    up = [tp[m]["seconds_per_trial"] / jx[m]["seconds_per_trial"] for m in jx]
    same(q[7], min(up))
    same(q[8], max(up))


def _floor(q):
    x = lambda b: [speed("full", b, n)["decode_ms"] / speed("full", b, n)["floor_ms"]
                   for n in (512, 2048)]
    same(q[0], min(x(1)))
    same(q[1], max(x(1)))
    same(q[2], min(x(8)))
    same(q[3], max(x(8)))


def _chain_speed(q):
    chain = "h2o:ratio=0.5+kivi:bits=4"
    mib = lambda m: speed(m, 1, 2048)["cache_bytes_per_seq"] / 2 ** 20
    same(q[0], mib("full") / mib(chain))
    same(q[1], mib(chain))
    same(q[2], mib("full"))
    for s, (m, b) in zip(q[3:7], ((chain, 1), ("full", 1), (chain, 8), ("full", 8))):
        same(s, speed(m, b, 2048)["decode_ms"])
    for i, m in ((7, chain), (9, "full")):
        tok_s = [speed(m, b, n)["prefill_tok_s"] for b in (1, 8) for n in (512, 2048)]
        same(q[i], min(tok_s))
        same(q[i + 1], max(tok_s))


POLICIES = ("streaming_llm", "streaming_llm:sinks=0", "snapkv", "pyramidkv", "adakv_snapkv", "tova",
            "h2o", "expected_attention", "knorm", "random")


def _under_2(q):
    four = ("h2o", "snapkv", "adakv_snapkv", "expected_attention")
    same(q[0], min(evict_vs(p, 0.5) for p in four))
    same(q[1], max(evict_vs(p, 0.5) for p in four))
    same(q[2], min(EVICT[(p, 0.5)] for p in four))
    same(q[3], max(EVICT[(p, 0.5)] for p in four))
    same(q[4], EVICT_FULL)


def _at_075(q):
    four = ("h2o", "snapkv", "adakv_snapkv", "expected_attention")
    same(q[0], min(evict_vs(p, 0.75) for p in four))
    same(q[1], max(evict_vs(p, 0.75) for p in four))


def _best_09(q):
    assert min(POLICIES, key=lambda p: EVICT[(p, 0.9)]) == "h2o"
    same(q[0], evict_vs("h2o", 0.9))
    same(q[1], evict_vs("random", 0.5))
    same(q[2], EVICT[("streaming_llm:sinks=0", 0.25)])


def _pyramid_equals_snapkv(q):
    assert EVICT[("pyramidkv", 0.75)] == EVICT[("snapkv", 0.75)]
    same(q[0], 768 * (1 - 0.9))  # the uniform budget's mean over layers, in tokens
    same(q[1], round(768 * (1 - 0.9)))
    same(q[2], int(768 * (1 - 0.9)))
    same(q[3], EVICT[("pyramidkv", 0.9)])
    same(q[4], EVICT[("snapkv", 0.9)])


def _fall_to(q):
    lows = [passkey(p, n, 0.5) for p in ("snapkv", "pyramidkv", "adakv_snapkv")
            for n in (1024, 2048)]  # the lengths of the kvpress reference quoted beside it
    same(q[0], min(lows))
    same(q[1], max(lows))


def _accumulated(q):
    counts = [passkey(p, n, 0.5) for p in ("h2o", "tova") for n in (1024, 2048)]
    same(q[0], min(counts))
    same(q[1], max(counts))


def _at_4k(q):
    for s, p in zip(q, ("streaming_llm:sinks=0", "streaming_llm", "tova", "snapkv_query_aware",
                        "h2o")):
        same(s, passkey(p, 4096, 0.5))


def _query_aware(q):
    assert all(passkey("snapkv_query_aware", n, 0.5) > passkey("snapkv", n, 0.5)
               for n in (1024, 2048, 4096))
    for s, args in zip(q, (("snapkv_query_aware", 2048), ("snapkv", 2048),
                           ("snapkv_query_aware", 4096), ("snapkv", 4096))):
        same(s, passkey(*args, 0.5))


def _full_passkey(q):
    assert passkey("full", 1024, 0) == passkey("full", 2048, 0) == 20
    same(q[0], passkey("full", 4096, 0))


def _from_log(q):
    second = {(r["policy"], r["ratio"]) for r in EVICT_PASSKEY
              if r["length"] == 4096 and r["first"] == 10 and r.get("source")}
    ratios = {r["ratio"] for r in EVICT_PASSKEY if r["policy"] == "snapkv"}
    claimed = ({("full", 0.0)} | {(p, r) for p in ("streaming_llm", "streaming_llm:sinks=0",
                                                   "snapkv", "pyramidkv") for r in ratios}
               | {("adakv_snapkv", r) for r in (0.25, 0.5)})
    assert len(ratios) == 4 and second == claimed, f"second batches from the log: {sorted(second)}"
    same(q[0], len(second))


def _own_batches(q):
    same(q[0], sum(1 for r in EVICT_PASSKEY if r["length"] == 4096 and not r.get("source")))
    tova = sorted((r["first"], r["correct"]) for r in EVICT_PASSKEY
                  if (r["policy"], r["length"], r["ratio"]) == ("tova", 4096, 0.25))
    same(q[1], tova[0][1])
    same(q[2], tova[1][1])


def _memory(q):
    kvh, d, layers, itemsize = 3, 64, 30, 4  # SmolLM2, float32
    per_token = kvh * (2 * d * itemsize + 4)
    same(q[0], per_token)
    same(q[1], per_token * layers * 2048 / 1e6)
    same(q[2], (per_token * 1024 + 4) * layers / 1e6)


def _smoke_cells(q):
    same(q[0], min(r["seconds"] for r in SMOKE))
    same(q[1], max(r["seconds"] for r in SMOKE))
    same(q[2], min(r["peak_rss_gb"] for r in SMOKE))
    same(q[3], max(r["peak_rss_gb"] for r in SMOKE))


def _smoke_streaming(q):
    sl, full = "streaming_llm:ratio=0.5", "full"
    want = [SMOKE_SCORE[("niah_multikey", sl)], SMOKE_SCORE[("niah_multikey", full)],
            SMOKE_SCORE[("niah_multivalue", sl)], SMOKE_SCORE[("niah_multivalue", full)],
            SMOKE_SCORE[("passkey", sl)]]
    for s, v in zip(q, want):
        same(s, v)


def _smoke_chain(q):
    chain = "snapkv:ratio=0.5+kivi:bits=4"
    for s, task in zip(q, ("niah_multikey", "niah_multivalue", "passkey")):
        same(s, SMOKE_SCORE[(task, chain)])


def _codec_every_key(q):
    for m in ("int8", "fp8-e4m3", "int4-channel", "kivi-4", "full"):
        assert codec_passkey(m) == (20, 20), m


def _codec_misses(q):
    correct, trials = codec_passkey("int4")
    same(q[0], trials - correct)
    same(q[1], codec_passkey("kivi-2")[0])
    assert codec_passkey("int2")[0] == 0 and codec_passkey("low_rank-48")[0] == 0


def _codec_chains_passkey(q):
    same(q[0], codec_passkey("snapkv-0.5+kivi-4")[0])
    same(q[1], passkey("snapkv", 2048, 0.5))
    same(q[2], codec_passkey("streaming_llm-0.5+kivi-4")[0])
    same(q[3], passkey("streaming_llm", 2048, 0.5))


def _codec_trials(q):
    run = {r["method"] for r in CODEC_PASSKEY}
    assert all(codec_passkey(m)[1] == 20 for m in run)
    same(q[0], 20)
    same(q[1], len(run))


def _codec_bytes(q):
    exact = [r for m, r in CODEC_BYTES.items()
             if not m.startswith("low_rank") and m != "kivi-4+snapkv-0.5"]
    same(q[0], max(abs(r["bytes_per_token"] - r["theoretical"]) for r in exact))
    r48 = CODEC_BYTES["low_rank-48"]
    same(q[1], (r48["bytes_per_token"] - r48["theoretical"]) * r48["tokens"] / 1e6)
    same(q[2], CODEC_BYTES["kivi-4+snapkv-0.5"]["bytes_per_token"])
    same(q[3], CODEC_BYTES["snapkv-0.5+kivi-4"]["bytes_per_token"])
    same(q[4], CODEC["kivi-4+snapkv-0.5"]["ppl"])
    same(q[5], CODEC["snapkv-0.5+kivi-4"]["ppl"])


def _codec_4bit(q):
    same(q[0], codec_vs("kivi-4"))
    same(q[1], CODEC["kivi-4"]["ppl"])
    same(q[2], CODEC["full"]["ppl"])
    same(q[3], 100 * CODEC_BYTES["kivi-4"]["bytes_per_token"] /
         CODEC_BYTES["full"]["bytes_per_token"])
    same(q[4], codec_vs("int8"))
    same(q[5], codec_vs("fp8-e4m3"))
    for s, m in zip(q[6:], ("int4", "int4-g16", "int4-channel", "fp8-e5m2")):
        same(s, codec_vs(m))


def _codec_2bit(q):
    same(q[0], codec_vs("kivi-2"))
    same(q[1], CODEC["kivi-2"]["ppl"])
    same(q[2], CODEC["int2"]["ppl"])
    same(q[3], CODEC["low_rank-48"]["ppl"])
    same(q[4], CODEC["low_rank-32"]["ppl"])


def _codec_chains(q):
    full = CODEC_BYTES["full"]["bytes_per_token"]
    same(q[0], CODEC["snapkv-0.5+kivi-4"]["ppl"])
    same(q[1], CODEC_BYTES["snapkv-0.5+kivi-4"]["bytes_per_token"])
    same(q[2], 100 * CODEC_BYTES["snapkv-0.5+kivi-4"]["bytes_per_token"] / full)
    same(q[3], EVICT[("snapkv", 0.5)])
    same(q[4], full * 0.5)  # half the tokens, each with its keys, values and position
    same(q[5], CODEC["h2o-0.5+kivi-4"]["ppl"])
    same(q[6], CODEC_BYTES["h2o-0.5+kivi-4"]["bytes_per_token"])


N = r"(\d+(?:\.\d+)?)"  # a quoted number
CLAIMS = {
    "cells": (rf"One run of all {N} cells.*The {N} quality cells ran first.*The (two) "
              rf"low-rank perplexity cells.*The {N} timed cells", _cells),
    "peak_rss": (rf"peak resident memory of any worker was {N} GB",
                 lambda q: same(q[0], max(r["peak_rss_gb"] for r in EVAL))),
    "pareto": (r"The Pareto front, from the smallest cache up: - " + "; - ".join(
        [r"(" + "|".join(re.escape(k) for k in LABELS) + rf") \({N} %, \+{N} %\)"] * 7) + r"\.",
        _pareto),
    "codecs_off_front": (rf"per-token int4 keeps {N} % \(\+{N} %\) and fp8 {N} % \(\+{N} %\), "
                         r"neither on the front",
                         lambda q: _codecs_off_front(["per-token int4", *q[:2], "fp8", *q[2:]])),
    "beats_075": (rf"H2O-0.5 \+ KIVI-4 reaches \+{N} % at {N} %, where every policy alone at "
                  rf"r = 0.75 \({N}-{N} %\) costs \+{N} to \+{N} %", _beats_075),
    "rank_05": (rf"Ada-KV \+{N} %; - SnapKV, ExpectedAttention and H2O \+{N} %; - PyramidKV "
                rf"\+{N} %, StreamingLLM \+{N} %, TOVA \+{N} %, Knorm \+{N} %; - random \+{N} %; "
                rf"- a sliding window without sinks \+{N} %", _rank_05),
    "pyramid_075": (r"PyramidKV equals SnapKV at r = 0.75, as in kvpress",
                    lambda q: same(str(GRID_PPL["pyramidkv:ratio=0.75"]["score"]),
                                   GRID_PPL["snapkv:ratio=0.75"]["score"])),
    "low_rank": (rf"rank 48 doubles perplexity \({N}, at {N} % of the bytes\) and rank 32 "
                 rf"quadruples it \({N}\)", _low_rank),
    "kivi4": (rf"KIVI-4 costs \+{N} % at {N} % of the bytes, against int8's {N} %. Its {N} "
              rf"exact recent tokens are a sixth of a {N}-token prefix", _kivi4),
    "depth_maps": (rf"SnapKV-0.5, scoring the context's last 64 tokens, finds {N}-{N} of "
                   rf"10. - H2O-0.5 \+ KIVI-4 finds {N}, {N} and {N} of 10", _depth_maps),
    "ruler": (rf"multi-key: full {N}, StreamingLLM {N}, SnapKV {N}, H2O \+ KIVI-4 {N}; - "
              rf"multi-value: full {N}, StreamingLLM {N}, SnapKV and H2O \+ KIVI-4 {N}\.",
              _ruler),
    "kvpress": (rf"The {N} presses gave the same answer on all {N} trials.*kvjax at batch {N} "
                rf"took {N}-{N} s and kvpress at batch 1 took {N}-{N} s: {N}-{N}x", _kvpress),
    "bandwidth_floor": (rf"The full cache decodes at {N}-{N}x the bandwidth floor at batch 1, "
                        rf"and at {N}-{N}x at batch 8", _floor),
    "chain_speed": (rf"holds {N}x fewer bytes at 2k \({N} against {N} MiB per sequence\), yet "
                    rf"it decodes \*slower\*: {N} against {N} ms/step at batch 1, and {N} "
                    rf"against {N} at batch 8.*\({N}-{N} against {N}-{N} tokens/s\)",
                    _chain_speed),
    "evict_under_2": (rf"H2O, SnapKV, Ada-KV and ExpectedAttention lose {N}–{N}% at r = 0.5 "
                      rf"\({N}–{N} against {N}\)", _under_2),
    "evict_075": (rf"against 5.27\) and {N}–{N}% at r = 0.75", _at_075),
    "evict_09_random_window": (rf"H2O is the best at 0.9 \(\+{N}%\).*random is far worse "
                               rf"\(\+{N}% at r = 0.5\).*outlier: {N} already at r = 0.25",
                               _best_09),
    "evict_pyramid": (rf"PyramidKV equals SnapKV at r = 0.75, and is within one token of its "
                      rf"budget at 0.9.*rounding the {N}-token mean to {N} at r = 0.9 where "
                      rf"SnapKV floors it to {N} \({N} against {N}\)", _pyramid_equals_snapkv),
    "passkey_fall": (rf"They fall to {N}–{N}/20 at r = 0.5", _fall_to),
    "passkey_accumulated": (rf"hold up best at 1k and 2k: {N}–{N}/20 at r = 0.5", _accumulated),
    "passkey_4k": (rf"at r = 0.5, sliding window {N}/20, StreamingLLM {N}/20, TOVA {N}/20, "
                   rf"query-aware SnapKV {N}/20, H2O {N}/20", _at_4k),
    "passkey_query_aware": (rf"at every length: {N}/20 against {N}/20 at 2k and r = 0.5, "
                            rf"{N}/20 against {N}/20 at 4k", _query_aware),
    "passkey_full": (rf"every key at 1k and 2k, and {N}/20 at 4k", _full_passkey),
    "passkey_4k_from_log": (rf"and the second batch for {N} cells \(full; StreamingLLM, sliding "
                            rf"window, SnapKV and PyramidKV at all four ratios; Ada-KV at r = 0.25 "
                            rf"and 0.5\), come from the log", _from_log),
    "passkey_4k_own": (rf"The other {N} batches were run on their own.*TOVA at r = 0.25: "
                       rf"{N}/10, then {N}/10", _own_batches),
    "memory": (rf"that is {N} bytes per token and layer.*drops from {N} MB to {N} MB", _memory),
    "smoke_cells": (rf"Each cell ran in its own worker process: {N}-{N} s per cell, peak "
                    rf"resident memory {N}-{N} GB", _smoke_cells),
    "smoke_streaming": (rf"on the needle tasks: {N} against {N} \(multi-key\) and {N} against "
                        rf"{N} \(multi-value\). On passkey it drops to {N}", _smoke_streaming),
    "smoke_chain": (rf"loses most needles: {N} and {N}, and {N} on passkey", _smoke_chain),
    "codec_every_key": (r"int8, fp8-e4m3, per-channel int4 and KIVI-4 find every key, like the "
                        r"full cache", _codec_every_key),
    "codec_misses": (rf"Per-token int4 misses {N} of 20. - KIVI-2 finds {N} and per-token int2 "
                     rf"none.*Low-rank at rank 48 finds none", _codec_misses),
    "codec_chains_passkey": (rf"SnapKV \+ KIVI-4 gets {N}/20 \(SnapKV alone {N}/20\), and "
                             rf"StreamingLLM \+ KIVI-4 gets {N}/20 \(StreamingLLM alone {N}/20\)",
                             _codec_chains_passkey),
    "codec_trials": (rf"\*\*Passkey column.\*\* {N} trials for the {N} methods run",
                     _codec_trials),
    "codec_bytes": (rf"within the 4-byte per-layer cursors \({N} B/token\).*\(float32, {N} MB "
                    rf"at rank 48\).*`kivi-4\+snapkv-0.5` costs {N} against {N} B/token.*"
                    rf"same for both orders, {N} against {N}", _codec_bytes),
    "codec_4bit": (rf"KIVI-4 costs \+{N}% perplexity \({N} against {N}\) at {N}% of the bf16 "
                   rf"bytes. int8 costs \+{N}% and fp8-e4m3 \+{N}%.*Per-token int4 with groups "
                   rf"of 32 channels costs \+{N}%. Groups of 16 cost \+{N}%, and per-channel int4 "
                   rf"without a residual \+{N}%.*fp8-e5m2, with only 2 mantissa bits, costs "
                   rf"\+{N}%", _codec_4bit),
    "codec_2bit": (rf"KIVI-2 costs \+{N}% \({N}\).*Per-token int2 breaks the model \({N}\).*"
                   rf"perplexity doubles \({N}\). At rank 32 it is {N}\.", _codec_2bit),
    "codec_chains": (rf"SnapKV at r = 0.5 then KIVI-4 reaches {N} at {N} B/token, {N}% of bf16. "
                     rf"SnapKV alone at r = 0.5 gets {N}, but needs {N} B/token. - H2O at r = 0.5 "
                     rf"with KIVI-4 gets {N} at {N} B/token", _codec_chains),
}
# claim -> (the quotes that disagree, "statement" for a wrong sentence; what the rows say)
WRONG: dict[str, tuple[list[str], str]] = {}  # none today: RESULTS.md was corrected


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_results_claim_agrees_with_its_rows(name):
    pattern, check = CLAIMS[name]
    matches = list(re.finditer(pattern, prose()))
    assert len(matches) == 1, f"claim {name!r}: {len(matches)} matches of {pattern!r} in the prose"
    found = mismatches(check, matches[0].groups())
    if name not in WRONG:
        assert not found, f"RESULTS.md claim {name!r}: (quoted, rows give) {found}"
        return
    quotes, rows_say = WRONG[name]
    assert [q for q, _ in found] == quotes, (
        f"claim {name!r} was listed as wrong in {quotes}, now it disagrees in {found}: "
        f"update WRONG (remove the entry once RESULTS.md is corrected)")
    pytest.xfail(f"RESULTS.md is wrong here: {rows_say}")


def test_every_wrong_claim_is_a_claim():
    assert set(WRONG) <= set(CLAIMS)


# ----------------------------------------------------------------------------- the hand-written tables


def md_table(heading: str) -> list[list[str]]:
    """The first markdown table after `heading` in RESULTS.md: rows of cells, header first."""
    text = RESULTS.read_text()
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not set(line) <= set("|- "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_generated_section_is_the_report_of_its_rows(tmp_path):
    """The section between the `kvjax eval` markers is what `report.report` makes of
    `docs/results/eval/cells.jsonl` today (run on a copy of the rows, so the committed
    plots and tables are not rewritten): a relabelled or rerun row fails it until the
    section is regenerated."""
    import shutil

    from experiments.eval import report
    shutil.copy(ROWS / "eval" / "cells.jsonl", tmp_path / "cells.jsonl")
    text = RESULTS.read_text()
    section = text[text.index(BEGIN) + len(BEGIN) + 1:text.index(END) - 1]
    header, body = section.split("\n\n", 1)
    assert header.startswith("Generated from `docs/results/eval/cells.jsonl` by `kvjax eval")
    assert body == report.report(tmp_path, "results/eval/")


def test_eviction_passkey_table_is_its_rows():
    header, *rows = md_table("\n### Passkey retrieval\n")
    ratios = [float(h.split("=")[1]) for h in header[2:]]
    assert len(rows) == 3 * 12
    for row in rows:
        policy, length = row[0].strip("*").replace("full cache", "full"), int(row[1])
        for cell, ratio in zip(row[2:], ratios):
            assert cell == f"{passkey(policy, length, ratio)}/20", (policy, length, ratio, cell)


def test_eviction_ppl_table_is_its_rows():
    header, *rows = md_table("\n### Continuation perplexity\n")
    ratios = [float(h.split("=")[1]) for h in header[1:]]
    for row in rows:
        policy = row[0].strip("*").replace("full cache", "full")
        for cell, ratio in zip(row[1:], ratios):
            same(cell, EVICT[(policy, 0.0 if policy == "full" else ratio)])
    assert {r[0].strip("*").replace("full cache", "full") for r in rows} == \
        {p for p, _ in EVICT}


def test_codec_table_is_its_rows():
    header, *rows = md_table("| method | spec | bytes/token (measured)")
    assert len(rows) == len(CODEC_PPL)
    full = CODEC_BYTES["full"]["bytes_per_token"]
    for method, spec, measured, theoretical, vs_bf16, ppl, pk in rows:
        b = CODEC_BYTES[method]
        assert spec == f"`{b['spec']}`".replace("docs/results/lowrank_basis.npz", "B") or \
            spec.startswith("`low_rank"), (method, spec)
        same(measured, b["bytes_per_token"])
        same(theoretical, b["theoretical"])
        same(vs_bf16, b["bytes_per_token"] / full)
        same(ppl, CODEC[method]["ppl"])
        correct, trials = codec_passkey(method)
        assert pk == (f"{correct}/{trials}" if trials else "-"), (method, pk)


@pytest.mark.parametrize("task", ["passkey", "niah_multikey", "niah_multivalue",
                                  "variable_tracking", "common_words"])
def test_smoke_tables_are_their_rows(task):
    _, *rows = md_table(f"#### {task}\n")
    assert {m for m, _ in rows} == {m for t, m in SMOKE_SCORE if t == task}
    for method, score in rows:
        same(score, SMOKE_SCORE[(task, method)])


def test_linear_state_passkey_table_is_its_rows():
    """The issue-17 table (passkey at equal cache bytes) is `linear_state/cells.jsonl`, cell by
    cell: successes, trials, successes per depth and bytes; and reading (1): the fold answers
    exactly the trials that eviction alone answers."""
    rows = {(r["length"], r["method"]): r for r in load("linear_state/cells.jsonl")
            if r["task"] == "passkey" and r["status"] == "ok"}
    text = RESULTS.read_text().split("### Passkey at equal cache bytes (issue 17)", 1)[1]
    table = [line for line in text.split("\n\n")[2].splitlines() if line.startswith("| ")][1:]
    assert len(table) == len(rows) >= 5
    for line in table:
        length, method, counts, _ci, depths, nbytes = [c.strip() for c in line.strip("|").split("|")]
        r = rows[(int(length), method.strip("`"))]
        k, n = (int(x) for x in counts.strip("*").split("/"))
        assert (k, n) == (round(sum(r["scores"])), len(r["scores"]))
        by = collections.Counter()
        for depth, score in zip(r["depths"], r["scores"]):
            by[depth] += round(score)
        assert [int(c.split("/")[0]) for c in depths.split(" / ")] == [by[d] for d in sorted(by)]
        assert int(nbytes.replace(",", "")) == round(r["cache_bytes_per_seq"])
    for policy in ("streaming_llm", "snapkv"):
        fold = f"{policy}:budget=192+fold:map=docs/results/linear_state_maps"
        assert rows[(1024, fold)]["scores"] == rows[(1024, f"{policy}:budget=224")]["scores"]


def test_readme_counts_are_the_projects():
    """README's counts of the project's own parts: the cache methods `kvjax methods` lists,
    how many of them name the kvpress press they equal, and the notebooks the suite runs (the
    test counts: tests/test_tiers.py)."""
    from kvjax.policies.methods import describe_methods
    readme = " ".join((ROOT / "README.md").read_text().split())
    listed = re.search(r"`kvjax methods` lists (\d+) cache methods, (\d+) of which name the "
                       r"kvpress [\d.]+ press they equal", readme)
    notebooks = re.search(r"and the (\w+) notebooks of `experiments/notebooks/`", readme)
    assert listed and notebooks, "README no longer states these counts"
    methods = describe_methods()
    assert (int(listed.group(1)), int(listed.group(2))) == \
        (len(methods), sum(bool(m["kvpress"]) for m in methods))
    words = ("one two three four five six seven eight nine ten").split()
    assert words.index(notebooks.group(1)) + 1 == \
        len(list((ROOT / "experiments" / "notebooks").glob("*.ipynb")))
