"""kvjax's continuation perplexity beside kvpress's for every row of the golden.

`tests/golden/kvpress_ppl.json` (made by `experiments/golden/make_kvpress_ppl.py`, kvpress
only) holds kvpress's perplexity of the last 256 tokens of a 1024-token window after the first
768 were compressed, per text and method; this script computes kvjax's for every row with the
function behind `kvjax ppl` and writes both, with the relative difference, to
`docs/results/kvpress_ppl_parity.json` (the suite checks a subset:
tests/test_kvpress_ppl.py).

    python -m experiments.eval.kvpress_ppl_parity [--out PATH] [--only NAMES]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "results" / "kvpress_ppl_parity.json"
GOLDEN = REPO / "tests" / "golden" / "kvpress_ppl.json"


def golden_rows() -> tuple[dict, dict]:
    """(the golden file, {(text, spec): row})."""
    with open(GOLDEN) as f:
        golden = json.load(f)
    return golden, {(r["text"], r["spec"]): r for r in golden["rows"]}


def kvjax_ppl(model, tokenizer, golden: dict, text: str, spec: str) -> tuple[float, int]:
    """(perplexity, tokens scored) of the golden window as `kvjax ppl` computes it."""
    from experiments.eval.ppl import perplexity
    from kvjax.policies.methods import parse_method
    from models.reconstruction import with_tokenizer

    from experiments.golden.make_kvpress_ppl import resolve

    transform = with_tokenizer(parse_method(resolve(spec)), tokenizer)
    result = perplexity(model, golden["ids"][text], context=golden["window"],
                        prefix=golden["prefix"], transform=transform, batch_size=1)
    return result.ppl, result.tokens_scored


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--only", help="comma-separated method names (default: all); the other "
                                   "rows of an existing --out file are kept")
    args = ap.parse_args(argv)
    from models.hub import find_smollm2
    from models.loading import load_model

    model, tokenizer = load_model(find_smollm2())
    golden, rows = golden_rows()
    only = set(args.only.split(",")) if args.only else None
    kept = {(r["text"], r["spec"]): r for r in json.loads(Path(args.out).read_text())["rows"]} \
        if only and Path(args.out).exists() else {}
    out = []
    for (text, spec), want in rows.items():
        if only and spec.split(":")[0] not in only:
            if (text, spec) in kept:
                out.append(kept[text, spec])
            continue
        start = time.perf_counter()
        ppl, scored = kvjax_ppl(model, tokenizer, golden, text, spec)
        rel = ppl / want["ppl"] - 1
        out.append(dict(text=text, spec=spec, press=want["press"], kvpress_ppl=want["ppl"],
                        kvjax_ppl=ppl, relative_difference=rel, tokens_scored=scored,
                        kvjax_seconds=round(time.perf_counter() - start, 1)))
        print(f"{text:18s} {spec:42s} kvpress {want['ppl']:.6f} kvjax {ppl:.6f} "
              f"{rel:+.1e}", flush=True)
    worst = max(out, key=lambda r: abs(r["relative_difference"]))
    print(f"largest relative difference: {worst['relative_difference']:+.2e} "
          f"({worst['text']}, {worst['spec']}) over {len(out)} rows")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(
        command="python -m experiments.eval.kvpress_ppl_parity", window=golden["window"],
        prefix=golden["prefix"], kvpress_version=golden["kvpress_version"], rows=out),
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
