"""Does `kvjax generate --answer-prefix` find passkeys as often as kvpress's pipeline?

On passkey contexts made with a seed no test or result uses, each context is written to a file
and asked about as a user would on the command line,

    kvjax generate --chat --context-file F --prompt Q [--answer-prefix P] --method M

(the command's own argument parsing, checks and `cmd_generate`, on one loaded model), and
through kvpress's own pipeline with the same question and answer prefix
(`pipe(context, question=Q, answer_prefix=P, press=...)`, transformers on the same GGUF).
Methods: the full cache and eviction at ratio 0.5. Writes JSON, CSV and a PNG.

    python experiments/eval/answer_prefix_check.py --out docs/results/answer_prefix

Needs the `compare` extra for the kvpress side (`--no-kvpress` skips it).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

from experiments.eval.passkey import ANSWER_PREFIX, QUESTION, make_trials, parse_answer

METHODS = ("full", "snapkv:ratio=0.5", "streaming_llm:ratio=0.5")
SEED = 20261130  # no test, config or result uses this seed


def context_text(tokenizer, trial) -> str:
    """The user turn's text of a passkey context (instruction + haystack), no chat markup."""
    rendered = tokenizer.decode(trial.context, skip_special_tokens=False)
    return rendered.split("<|im_start|>user\n", 1)[1]


def kvjax_answer(model, tokenizer, model_path: str, context_file: Path, method: str,
                 prefix: str | None, max_new_tokens: int) -> str:
    """`kvjax generate --json` with these arguments, on an already loaded model: the
    command's own argument parsing and `cmd_generate`; the generated text."""
    from experiments.cli.main import build_parser, check_args, check_model_args, cmd_generate

    argv = ["generate", "--model", model_path, "--chat", "--context-file", str(context_file),
            "--prompt", QUESTION, "--method", method, "--max-new-tokens", str(max_new_tokens),
            "--json"] + (["--answer-prefix", prefix] if prefix else [])
    args = build_parser().parse_args(argv)
    check_args(args)
    check_model_args(args, model.config)
    return cmd_generate(args, model, tokenizer)["text"]


def kvpress_answers(model_path: Path, contexts: list[str], method: str,
                    max_new_tokens: int) -> list[str]:
    """kvpress's pipeline (public call) with the same question and answer prefix."""
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    import torch
    from transformers import pipeline

    from experiments.eval.hf_reference import load_hf_reference
    from experiments.eval.kvpress_engine import press_for

    model, hf_tokenizer, _ = load_hf_reference(model_path, dtype=torch.float32,
                                               attn_implementation="sdpa")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=hf_tokenizer)
    press = press_for(method)
    with torch.inference_mode():
        return [pipe(c, question=QUESTION, answer_prefix=ANSWER_PREFIX, press=press,
                     max_new_tokens=max_new_tokens)["answer"] for c in contexts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--length", type=int, default=1024, help="context tokens")
    parser.add_argument("--trials", type=int, default=10, help="contexts (depths 0.1-0.9)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--no-kvpress", action="store_true")
    args = parser.parse_args(argv)

    from models.loading import load_model, resolve_model_path

    model_path = resolve_model_path("smollm2")
    model, tokenizer = load_model(model_path)
    depths = [0.1 + 0.8 * i / max(1, args.trials - 1) for i in range(args.trials)]
    trials = make_trials(tokenizer, args.length, depths, 1, seed=SEED)
    folder = args.out / "contexts"
    folder.mkdir(parents=True, exist_ok=True)
    contexts = [context_text(tokenizer, t) for t in trials]
    files = []
    for i, text in enumerate(contexts):
        files.append(folder / f"passkey_{i:02d}.txt")
        files[-1].write_text(text)

    rows = []
    for method in args.methods:
        runs = {"kvjax, no prefix": None, "kvjax --answer-prefix": ANSWER_PREFIX}
        for engine, prefix in runs.items():
            start = time.perf_counter()
            texts = [kvjax_answer(model, tokenizer, str(model_path), f, method, prefix,
                                  args.max_new_tokens) for f in files]
            rows += [dict(method=method, engine=engine, trial=i, depth=round(t.depth, 3),
                          answer=t.answer, text=text, found=parse_answer(text) == t.answer,
                          seconds=round((time.perf_counter() - start) / len(files), 2))
                     for i, (t, text) in enumerate(zip(trials, texts))]
        if not args.no_kvpress:
            start = time.perf_counter()
            texts = kvpress_answers(model_path, contexts, method, args.max_new_tokens)
            rows += [dict(method=method, engine="kvpress pipeline, answer_prefix", trial=i,
                          depth=round(t.depth, 3), answer=t.answer, text=text,
                          found=parse_answer(text) == t.answer,
                          seconds=round((time.perf_counter() - start) / len(files), 2))
                     for i, (t, text) in enumerate(zip(trials, texts))]

    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    with open(args.out / "rows.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    found = {(m, e): sum(r["found"] for r in rows if (r["method"], r["engine"]) == (m, e))
             for m in args.methods for e in engines}
    lines = ["| method | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    lines += [f"| `{m}` | " + " | ".join(f"{found[m, e]}/{len(files)}" for e in engines) + " |"
              for m in args.methods]
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3))
    width = 0.8 / len(engines)
    for j, e in enumerate(engines):
        ax.bar([i + j * width for i in range(len(args.methods))],
               [found[m, e] / len(files) for m in args.methods], width, label=e)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(args.methods))],
                  args.methods)
    ax.set_ylabel(f"passkeys found ({len(files)} contexts)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "found.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
