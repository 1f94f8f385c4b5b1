"""The `kvjax` command line.

    kvjax generate --prompt "Why is the sky blue?" --chat
    kvjax generate --context-file book.txt --prompt "Who is the hero?" --chat --method full
    kvjax ppl --text experiments/data/devils_dictionary.txt --context 512 --max-tokens 4096
    kvjax ppl --text experiments/data/kjv_genesis.txt --context 1024 --prefix 768 \
        --method snapkv:ratio=0.5+kivi:bits=2
    kvjax calibrate --out basis.npz        # then --method low_rank:rank=32,basis=basis.npz
    kvjax eval --config experiments/configs/smoke.toml --out results/smoke
    kvjax eval --config experiments/configs/results.toml --out docs/results/eval \
        --results docs/RESULTS.md         # the quality grid, < 60 min on 2 cores
    kvjax bench --config experiments/configs/compare.toml --out results/bench

Every command takes `--model smollm2|PATH` (a .gguf file or a Hugging Face
directory), `--method NAME[:k=v,...]` and `--json` (one JSON object on stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default; fetched once) or a .gguf file / HF model directory")
    p.add_argument("--method", default="full", help="cache method spec, e.g. 'full'")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (greedy by default)")
    _common(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--context-file", type=Path,
                   help="text placed before the prompt (the part a method compresses)")
    g.add_argument("--chat", action="store_true", help="wrap in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--impl", choices=["xla", "pallas"], default="xla",
                   help="attention: XLA, or the Pallas kernels on TPU/GPU (XLA on CPU)")
    g.add_argument("--compress-every", type=int, default=0,
                   help="also apply --method every N decode steps (0 = only after prefill)")

    p = sub.add_parser("ppl", help="perplexity of a text file with sliding windows")
    _common(p)
    p.add_argument("--text", type=Path, required=True, help="UTF-8 text file")
    p.add_argument("--context", type=int, required=True, help="window length N in tokens")
    p.add_argument("--stride", type=int, help="window advance S (default N)")
    p.add_argument("--max-tokens", type=int, help="use only the first M tokens of the text")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward batch")
    p.add_argument("--prefix", type=int, default=0,
                   help="P: prefill and compress each window's first P tokens with --method, "
                        "score only the rest (needed by any method other than full)")
    for name, text in [("eval", "a grid of task x length x method cells (experiments/harness.py)"),
                       ("bench", "only the config's `speed` cells: memory, prefill and decode speed")]:
        e = sub.add_parser(name, help=text)
        e.add_argument("--config", type=Path, required=True,
                       help="TOML grid, e.g. experiments/configs/results.toml")
        e.add_argument("--out", type=Path, required=True,
                       help="results folder (cells.jsonl, tables.md, plots)")
        e.add_argument("--report", action="store_true", help="only rewrite tables and plots")
        e.add_argument("--results", type=Path,
                       help="also rewrite the generated section of this Markdown file "
                            "(e.g. docs/RESULTS.md)")

    c = sub.add_parser("calibrate", help="low-rank K/V bases from real text (for low_rank)")
    c.add_argument("--model", default="smollm2", help="as for the other commands")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument("--text", type=Path, default=CALIBRATION_TEXT,
                   help="UTF-8 text file (default: The Devil's Dictionary)")
    c.add_argument("--tokens", type=int, default=16384,
                   help="calibrate on the last N tokens of the text")
    c.add_argument("--window", type=int, default=1024, help="tokens per prefill window")
    c.add_argument("--out", type=Path, required=True, help="where to write the .npz basis")
    return parser


CALIBRATION_TEXT = Path(__file__).parent / "data" / "devils_dictionary.txt"


def cmd_calibrate(args, model, tokenizer) -> dict:
    from models.calibration import calibrate_low_rank

    ids = tokenizer.encode(_read_text(args.text))[-args.tokens:]
    start = time.perf_counter()
    basis = calibrate_low_rank(model, ids, window=args.window)
    basis.save(args.out)
    captured = {r: basis.captured(r) for r in (8, 16, 32, 48)}
    return {"out": str(args.out), "tokens": len(ids), "seconds": round(time.perf_counter() - start, 3),
            "energy_captured": {r: {"keys": k, "values": v} for r, (k, v) in captured.items()}}


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    return path.read_text(encoding="utf-8")


def build_prompt(tokenizer, prompt: str, context: str | None, chat: bool) -> str:
    """The full prompt text: context first, then the prompt (inside the chat template)."""
    user = prompt if context is None else f"{context.rstrip()}\n\n{prompt}"
    if not chat:
        return user
    return tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                         add_generation_prompt=True)


def split_prompt(tokenizer, prompt: str, context: str, chat: bool) -> tuple[list[int], list[int]]:
    """(context ids, prompt ids) of `build_prompt`'s text, cut right after the context.

    The context is compressed before the prompt is seen (query-agnostic). The
    cut is a paragraph break; when the two halves tokenize differently from
    the whole (a merge across the cut) the halves are encoded on their own.
    """
    full = build_prompt(tokenizer, prompt, context, chat)
    cut = full.index(context.rstrip()) + len(context.rstrip())
    head, ids = tokenizer.encode(full[:cut]), tokenizer.encode(full)
    if ids[:len(head)] == head and len(ids) > len(head):
        return head, ids[len(head):]
    return head, tokenizer.encode(full[cut:])


def cmd_generate(args, model, tokenizer) -> dict:
    from kvjax import nbytes
    from models.sampler import Sampling, generate

    context = _read_text(args.context_file) if args.context_file else None
    if context is None:
        ids, contexts = tokenizer.encode(build_prompt(tokenizer, args.prompt, None, args.chat)), None
    else:
        head, ids = split_prompt(tokenizer, args.prompt, context, args.chat)
        contexts = [head]
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    start = time.perf_counter()
    out = generate(model, [ids], contexts=contexts, max_new_tokens=args.max_new_tokens,
                   sampling=sampling, transform=_transform(args.method), seed=args.seed,
                   compress_every=args.compress_every, impl=args.impl)
    seconds = time.perf_counter() - start
    tokens = out.tokens[0, :out.num_tokens[0]].tolist()
    return {"text": tokenizer.decode(tokens), "tokens": tokens,
            "prompt_tokens": len(ids) + (len(contexts[0]) if contexts else 0),
            "context_tokens": len(contexts[0]) if contexts else 0,
            "cache_bytes": nbytes(out.cache),
            "method": args.method, "seconds": round(seconds, 3)}



def cmd_ppl(args, model, tokenizer) -> dict:
    from experiments.ppl import perplexity

    ids = tokenizer.encode(_read_text(args.text))[:args.max_tokens]
    start = time.perf_counter()
    result = perplexity(model, ids, args.context, args.stride, batch_size=args.batch_size,
                        prefix=args.prefix, transform=_transform(args.method))
    return {"ppl": result.ppl, "nll": result.nll, "tokens_scored": result.tokens_scored,
            "text_tokens": len(ids), "context": args.context,
            "stride": args.stride or args.context, "prefix": args.prefix,
            "method": args.method, "seconds": round(time.perf_counter() - start, 3)}


def _transform(spec: str):
    from kvjax import parse_method
    return parse_method(spec)


def enable_compilation_cache() -> None:
    """Keep compiled executables on disk so a second run skips XLA compilation."""
    import jax
    from models.hub import cache_dir

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jit"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def cmd_eval(args) -> int:
    """Run the grid's unfinished cells (each in a worker process), then write the report."""
    from experiments import harness, report

    try:
        grid = harness.load_config(args.config)
        cells = [c for c in grid.cells if args.command == "eval" or c.task == "speed"]
        if not cells:
            raise ValueError(f"{args.config}: no `speed` cells to bench")
        if not args.report:
            harness.sweep(cells, args.out, grid.max_rss_gb, workers=grid.workers)
        if args.results:
            report.write_results(args.out, args.results,
                                 header=f"Generated from `{args.out}/cells.jsonl` by `kvjax "
                                        f"{args.command} --config {args.config} --out {args.out} "
                                        f"--results {args.results}` (any config writing to "
                                        f"that folder regenerates the whole section).\n\n")
        print(report.report(args.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("eval", "bench"):
        return cmd_eval(args)
    from models.loading import load_model

    enable_compilation_cache()
    try:
        _transform(getattr(args, "method", "full"))
        for path in (getattr(args, "text", None), getattr(args, "context_file", None)):
            if path is not None:
                _read_text(path)  # fail before the model loads
        model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
        commands = {"generate": cmd_generate, "ppl": cmd_ppl, "calibrate": cmd_calibrate}
        result = commands[args.command](args, model, tokenizer)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    result["model"] = args.model
    if args.json:
        print(json.dumps(result))
    elif args.command == "generate":
        print(result["text"])
    elif args.command == "calibrate":
        print(f"wrote {result['out']} from {result['tokens']} tokens; energy kept by rank "
              + ", ".join(f"{r}: keys {e['keys']:.3f} values {e['values']:.3f}"
                          for r, e in result["energy_captured"].items()))
    else:
        print(f"perplexity {result['ppl']:.4f} over {result['tokens_scored']} tokens "
              f"(context {result['context']}, stride {result['stride']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
