"""The `kvjax` command line.

    kvjax generate --prompt "Why is the sky blue?" --chat
    kvjax generate --context-file book.txt --prompt "Who is the hero?" --chat --method full
    kvjax ppl --text experiments/data/devils_dictionary.txt --context 512 --max-tokens 4096
    kvjax ppl --text experiments/data/kjv_genesis.txt --context 1024 --prefix 768 \
        --method snapkv:ratio=0.5+kivi:bits=2
    kvjax calibrate --out basis.npz        # then --method low_rank:rank=32,basis=basis.npz
    kvjax calibrate --duo --out duo.npz    # then --method duo_attention:head_ratio=0.5,scores=duo.npz
    kvjax calibrate --duo-train --out duo.npz   # the same, with patterns trained as the paper
    kvjax calibrate --qfilters --out qf.npz   # then --method qfilter:ratio=0.5,filters=qf.npz
    kvjax calibrate --lukv --out curve.npz    # then --method lukv:ratio=0.5,curve=curve.npz
    kvjax calibrate --query-stats --out q.npz # then --method expected_attention_stats:ratio=0.5,stats=q.npz
    kvjax calibrate --kvzap linear --out kvzap # then --method kvzap:ratio=0.5,weights=kvzap
    kvjax calibrate --fastkvzip --out gates    # then --method fastkvzip:ratio=0.5,gates=gates
    kvjax calibrate --restorekv --out restore  # then --method restorekv:ratio=0.5,adapter=restore
    kvjax train-state --out maps           # then --method snapkv:budget=192+fold:map=maps
    kvjax eval --config experiments/configs/smoke.toml --out results/smoke
    kvjax eval --config experiments/configs/results.toml --out docs/results/eval \
        --results docs/RESULTS.md         # the quality grid, < 60 min on 2 cores
    kvjax bench --config experiments/configs/compare.toml --out results/bench

Every command takes `--json` (one JSON object on stdout); the commands that run a model take
`--model smollm2|PATH|ORG/NAME[@REV]` (a .gguf file, a Hugging Face directory or repo id) and
`--method NAME[:k=v,...]`.
`generate --answer-prefix TEXT` opens the reply (kvpress's answer_prefix).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp

from experiments.eval.grid import read_text

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`kvjax: error: ...`, exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"kvjax: error: {message}\n")


class BadResult(Exception):
    """A run that finished with a meaningless result (NaN): exit code 1, never printed."""


class UsageError(ValueError):
    """A bad command-line value: printed as one line, exit code 2."""


# integer option -> (lowest, highest or None); checked by `check_args` before any work
BOUNDS = {
    "max_new_tokens": (1, None), "top_k": (0, None), "seed": (0, None),
    "compress_every": (0, None), "context": (2, None), "stride": (1, None),
    "max_tokens": (2, None), "batch_size": (1, None), "prefix": (0, None),
    "tokens": (2, None), "window": (1, None), "samples": (1, None), "steps": (1, None),
    "passkeys": (1, 10), "words": (1, None),
}


def _bad(option: str, value, allowed: str) -> UsageError:
    return UsageError(f"--{option.replace('_', '-')} {value}: {allowed}")


def check_args(args) -> None:
    """UsageError for a numeric option outside its range or an unusable path (before any work)."""
    for name, (low, high) in BOUNDS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if value < low or (high is not None and value > high):
            raise _bad(name, value, f"must be an integer >= {low}"
                       + (f" and <= {high}" if high is not None else ""))
    temperature = getattr(args, "temperature", None)
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise _bad("temperature", temperature, "must be a finite number >= 0 (0 = greedy)")
    top_p = getattr(args, "top_p", None)
    if top_p is not None and not 0 < top_p <= 1:
        raise _bad("top_p", top_p, "must be in (0, 1] (1 = no nucleus filter)")
    if args.command == "ppl":
        if args.stride is not None and args.stride > args.context:
            raise _bad("stride", args.stride, f"must be in [1, --context {args.context}]")
        if args.prefix >= args.context:
            raise _bad("prefix", args.prefix, f"must be in [0, --context {args.context})")
    if args.command == "calibrate" and \
            args.duo + args.duo_train + args.qfilters + args.lukv + args.query_stats + \
            bool(args.kvzap) + args.fastkvzip + args.restorekv > 1:
        raise UsageError("--duo, --duo-train, --qfilters, --lukv, --query-stats, --kvzap, "
                         "--fastkvzip and --restorekv: give one (each writes a different file)")
    if args.command == "generate" and not args.prompt.strip() and not args.chat:
        raise _bad("prompt", repr(args.prompt), "must not be empty (or use --chat)")
    for option in ("text", "context_file", "config"):
        path = getattr(args, option, None)
        if path is not None and not Path(path).is_file():
            kind = "config" if option == "config" else "text"
            raise _bad(option, path, "is a directory: need a file" if Path(path).is_dir()
                       else f"{kind} file not found")
    out = getattr(args, "out", None)
    trained = "--kvzap" if getattr(args, "kvzap", None) else \
        "--fastkvzip" if getattr(args, "fastkvzip", False) else \
        "--restorekv" if getattr(args, "restorekv", False) else None
    if out is not None and trained:  # a checkpoint folder, made anew
        out = Path(out)
        if out.exists() and not (out / "_CHECKPOINT_METADATA").is_file():
            raise _bad("out", out, f"exists and is not a checkpoint `calibrate {trained}` "
                                   f"wrote: give a new folder")
        check_writable(out.parent, folder=True)
    elif out is not None:
        check_writable(out, folder=args.command in ("eval", "bench"))


def check_writable(path: Path, folder: bool) -> None:
    """UsageError unless `path` (a results folder, or a file to write) can be written.

    Probed for real (permission bits say nothing to root): the folder is
    created and a scratch file written and removed in it.
    """
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise _bad("out", path, "is a file: need a folder")
    if not folder and path.is_dir():
        raise _bad("out", path, "is a directory: need a file name")
    where = path if folder else path.parent
    probe = where / f".kvjax-write-test-{os.getpid()}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
        if folder and (path / "cells.jsonl").exists():
            open(path / "cells.jsonl", "a").close()
    except OSError as e:
        raise _bad("out", path, f"cannot be written ({e.strerror or e})") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default; fetched once) or a .gguf file / HF model directory")
    p.add_argument("--method", default="full", help="cache method spec, e.g. 'full'")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--mesh", help="device mesh, e.g. data=2,model=4: weights split over "
                                  "model, caches over data and model (models/sharding.py)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvjax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (greedy by default)")
    _common(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--context-file", type=Path,
                   help="text placed before the prompt (the part a method compresses)")
    g.add_argument("--chat", action="store_true", help="wrap in the model's chat template")
    g.add_argument("--answer-prefix", default="",
                   help="text that opens the reply, after the prompt (e.g. 'The pass key is')")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--impl", choices=["xla", "pallas"], default="xla",
                   help="attention: XLA, or the Pallas kernels on TPU/GPU (XLA on CPU)")
    g.add_argument("--compress-every", type=int, default=0,
                   help="also apply --method every N decode steps (0 = only after prefill)")
    g.add_argument("--monitor", action="store_true",
                   help="report what the method did (kvjax.tools.monitor): tokens kept and evicted, "
                        "attention mass retained, key/value error, auto's plan; on stderr, or "
                        "in --json")

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
    for name, text in [("eval", "a grid of task x length x method cells (experiments/eval/harness.py)"),
                       ("bench", "only the config's `speed` cells: memory, prefill and decode speed")]:
        e = sub.add_parser(name, help=text)
        e.add_argument("--config", type=config_path, required=True,
                       help="TOML grid: a file, or the name of a shipped one "
                            f"({', '.join(shipped_configs())})")
        e.add_argument("--out", type=Path, required=True,
                       help="results folder (cells.jsonl, tables.md, plots)")
        e.add_argument("--report", action="store_true", help="only rewrite tables and plots")
        e.add_argument("--no-shared-prefill", action="store_true",
                       help="one worker per cell: each method prefills its contexts again "
                            "(default: retrieval cells differing only in method share one "
                            "prefill, experiments/eval/harness.py)")
        e.add_argument("--results", type=Path,
                       help="also rewrite the generated section of this Markdown file "
                            "(e.g. docs/RESULTS.md)")
        e.add_argument("--json", action="store_true",
                       help="print one JSON object on stdout (the folder's rows) instead of "
                            "the tables")


    for name, (module, text) in MODULE_COMMANDS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=text))

    c = sub.add_parser("calibrate", help="low-rank K/V bases from real text (for low_rank)")
    c.add_argument("--model", default="smollm2", help="as for the other commands")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument("--text", type=Path, default=CALIBRATION_TEXT,
                   help="UTF-8 text file (default: The Devil's Dictionary)")
    c.add_argument("--tokens", type=int, default=16384,
                   help="calibrate on the last N tokens of the text")
    c.add_argument("--window", type=int, default=1024, help="tokens per prefill window")
    c.add_argument("--duo", action="store_true",
                   help="DuoAttention head scores instead (for duo_attention:scores=OUT): "
                        "kvpress's on-the-fly rule over 50 passages of the text")
    c.add_argument("--duo-train", action="store_true",
                   help="DuoAttention head patterns trained as the paper does instead (for "
                        "duo_attention:scores=OUT): per (layer, KV head) a gate between full "
                        "and streaming attention, fitted with optax on multi-passkey samples "
                        "of --window tokens cut from the text")
    c.add_argument("--steps", type=int, default=100,
                   help="--duo-train: optimizer steps, one new sample each; --restorekv: "
                        "optimizer steps, one (window, ratio) pair each (100)")
    c.add_argument("--passkeys", type=int, default=5,
                   help="--duo-train: passkeys per sample (5; the paper: 10)")
    c.add_argument("--words", type=int, default=16,
                   help="--duo-train: words per passkey (16; the paper: 32)")
    c.add_argument("--qfilters", action="store_true",
                   help="Q-Filters instead (for qfilter:filters=OUT): the paper's rule over "
                        "the post-RoPE queries of the windows (--samples of them)")
    c.add_argument("--lukv", action="store_true",
                   help="an LU-KV budget curve instead (for lukv:curve=OUT): per head, the "
                        "future attention ExpectedAttention's top tokens hold, allocated over "
                        "heads for ratios 0.01-0.99")
    c.add_argument("--query-stats", action="store_true",
                   help="pre-RoPE query mean and covariance per layer and head instead (for "
                        "expected_attention_stats:stats=OUT)")
    # eviction_kvzap.KINDS, spelled out: importing kvjax here would slow `kvjax --help`
    c.add_argument("--kvzap", choices=("linear", "mlp"),
                   help="a KVzap surrogate instead (for kvzap:weights=OUT, an orbax directory): "
                        "per layer, a linear map (ridge) or a two-layer MLP (optax) from each "
                        "token's attention input to the log of its KVzip+ score; trained on "
                        "90%% of the windows, scored on the rest")
    c.add_argument("--fastkvzip", action="store_true",
                   help="Fast KVzip gates instead (for fastkvzip:gates=OUT, an orbax "
                        "directory): per layer, a sink-attention gate from each token's "
                        "attention input to its KVzip score (binary cross-entropy, SGD with "
                        "momentum, optax); trained on 90%% of the windows, scored on the rest")
    c.add_argument("--restorekv", action="store_true",
                   help="RestoreKV restore embeddings and LoRA instead (for "
                        "restorekv:adapter=OUT, an orbax directory): self-distilled from the "
                        "full cache over each window's last quarter, KVzip at ratios 0.5 and "
                        "0.75 (Adam, optax, --steps); the last window held out")
    c.add_argument("--samples", type=int, default=None,
                   help="--qfilters: queries drawn at random for each layer's SVD (3000); "
                        "--kvzap, --fastkvzip: tokens drawn from each window (256)")
    c.add_argument("--out", type=Path, required=True, help="where to write the .npz basis")
    return parser


# Subcommands that live in their own module: name -> (module, help). Each module has
# `add_arguments(parser)` and `run(args) -> int` (the exit status; it prints its own output).
# A FileNotFoundError, ValueError or OSError it raises becomes `kvjax: error: ...` on stderr
# with status 2.
MODULE_COMMANDS: dict[str, tuple[str, str]] = {
    "train-state": ("experiments.cli.train_state_cmd",
                    "train feature maps for linear_state / fold with optax"),
    "compile": ("experiments.cli.compile_cmd", "compile prefill/compression/decode for a TPU slice "
                "(deviceless) and print per-chip memory"),
    "launch": ("experiments.cli.launch", "run a command as N local processes of one JAX program"),
    "export": ("experiments.cli.export_cmd", "write a jax.export artifact: prefill, compression, "
               "decode, weights, tokenizer"),
    "run-exported": ("experiments.cli.export_cmd", "generate from an artifact of `kvjax export` "
                     "(no Flax, no model code)"),
    "inspect": ("experiments.cli.inspect_cmd", "heatmaps of what a method kept per layer and KV "
                "head, and the attention mass it retained (PNG)"),
    "methods": ("experiments.cli.methods_cmd", "list every cache method: arguments, defaults, "
                "paper, and the kvpress press it equals"),
}


CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "devils_dictionary.txt"


DUO_PASSAGES, DUO_CHARS = 50, 600  # kvpress's num_samples; passage length (~150 tokens)


def cmd_calibrate_duo(args, model, tokenizer) -> dict:
    """`kvjax calibrate --duo`: head scores of DUO_PASSAGES evenly spaced passages."""
    import numpy as np

    from models.calibration import calibrate_duo_attention

    text = read_text(args.text)
    step = max(1, (len(text) - DUO_CHARS) // DUO_PASSAGES)
    texts = [tokenizer.encode(text[i * step: i * step + DUO_CHARS]) for i in range(DUO_PASSAGES)]
    start = time.perf_counter()
    scores = calibrate_duo_attention(model, [t for t in texts if t])
    np.savez(args.out, head_scores=scores)
    return {"out": str(args.out), "texts": len(texts), "head_scores_shape": list(scores.shape),
            "seconds": round(time.perf_counter() - start, 3)}


def cmd_calibrate_duo_train(args, model, tokenizer) -> dict:
    """`kvjax calibrate --duo-train`: gates trained on `--steps` multi-passkey samples of
    `--window` tokens whose haystacks come from the text's last `--tokens` tokens."""
    from models.duo_training import passkey_samples, train_duo_gates

    ids = tokenizer.encode(read_text(args.text))[-args.tokens:]
    try:
        samples = passkey_samples(tokenizer, ids, args.steps, args.window, args.passkeys,
                                  args.words)
    except ValueError as e:  # too short for the passkeys, or the text for the window
        raise _bad("window", args.window, str(e)) from None
    start = time.perf_counter()
    out = train_duo_gates(model, samples, steps=args.steps)
    out.save(args.out)
    first, last = out.history[0], out.history[-1]
    return {"out": str(args.out), "steps": args.steps, "length": args.window,
            "passkeys": args.passkeys, "words": args.words,
            "gates_shape": list(out.gates.shape),
            "retrieval_heads": int((out.gates > 0.5).sum()),
            "mean_gate": round(float(out.gates.mean()), 4),
            "distill_loss": {"first": float(first[0]), "last": float(last[0])},
            "seconds": round(time.perf_counter() - start, 3)}


def calibration_windows(args, ids, held_out: bool = False) -> list:
    """`ids` cut into consecutive windows of `--window` tokens (a shorter tail dropped); at
    least two when one is to be `held_out`."""
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]
    if not windows:
        raise _bad("tokens", len(ids), f"must give at least one window of {args.window} tokens")
    if held_out and len(windows) < 2:
        raise _bad("tokens", args.tokens, f"must hold at least two --window {args.window} "
                                          "windows (one is held out)")
    return windows


def cmd_calibrate_qfilters(args, model, ids) -> dict:
    """`kvjax calibrate --qfilters`: Q-Filters of the windows of `ids`."""
    import numpy as np

    from models.calibration import calibrate_qfilters

    windows = calibration_windows(args, ids)
    start = time.perf_counter()
    filters = calibrate_qfilters(model, windows, samples=args.samples or 3000)
    np.savez(args.out, q_filters=filters)
    return {"out": str(args.out), "windows": len(windows), "tokens": len(windows) * args.window,
            "samples": min(args.samples or 3000, len(windows) * args.window),
            "q_filters_shape": list(filters.shape), "seconds": round(time.perf_counter() - start, 3)}


def cmd_calibrate_lukv(args, model, ids) -> dict:
    """`kvjax calibrate --lukv`: an LU-KV budget curve from the windows of `ids`."""
    import numpy as np

    from models.calibration import calibrate_lukv

    windows = calibration_windows(args, ids)
    start = time.perf_counter()
    curve = calibrate_lukv(model, windows)
    np.savez(args.out, budget_curve=curve)
    half = curve[49]  # r = 0.5: each head's prune ratio
    return {"out": str(args.out), "windows": len(windows), "tokens": len(windows) * args.window,
            "budget_curve_shape": list(curve.shape),
            "prune_at_half": {"min": round(float(half.min()), 4),
                              "max": round(float(half.max()), 4)},
            "seconds": round(time.perf_counter() - start, 3)}


def cmd_calibrate_query_stats(args, model, ids) -> dict:
    """`kvjax calibrate --query-stats`: query statistics of the windows of `ids`."""
    import numpy as np

    from models.calibration import calibrate_query_stats

    windows = calibration_windows(args, ids)
    start = time.perf_counter()
    mean, cov = calibrate_query_stats(model, windows)
    np.savez(args.out, query_mean=mean, query_cov=cov)
    return {"out": str(args.out), "windows": len(windows), "tokens": len(windows) * args.window,
            "query_mean_shape": list(mean.shape), "seconds": round(time.perf_counter() - start, 3)}


def cmd_calibrate_token_scorer(args, model, tokenizer, ids) -> dict:
    """`kvjax calibrate --kvzap KIND` or `--fastkvzip`: a KVzap surrogate (on the log of KVzip+
    scores) or Fast KVzip gates (on KVzip scores) trained on 90% of the windows of `ids`,
    the fit reported on the rest (R^2 and Spearman of the targets)."""
    import shutil

    from kvjax.policies.eviction_fastkvzip import fit_gates
    from kvjax.policies.eviction_kvzap import fit_linear, fit_mlp, fit_quality
    from models.calibration import kvzap_training_data, kvzip_training_data
    from models.reconstruction import chat_prompt

    out = Path(args.out)  # checked by `check_args`: new, or a checkpoint this command wrote
    windows = calibration_windows(args, ids, held_out=True)
    held = max(1, len(windows) // 10)
    start = time.perf_counter()
    data = kvzap_training_data if args.kvzap else kvzip_training_data
    x, y = data(model, windows, chat_prompt(tokenizer), samples=args.samples or 256)
    split = len(x) // len(windows) * (len(windows) - held)
    cfg = model.config
    if args.kvzap:
        fitted = (fit_linear if args.kvzap == "linear" else fit_mlp)(x[:split], y[:split])
    else:
        fitted = fit_gates(x[:split], y[:split], groups=cfg.num_heads // cfg.num_kv_heads)
    quality = fit_quality(fitted, x[split:], y[split:])
    if out.exists():
        shutil.rmtree(out)
    fitted.save(out)
    return {"out": str(out), **({"kind": fitted.kind} if args.kvzap else {}),
            "windows": len(windows), "held_out": held, "train_tokens": split,
            "held_out_tokens": len(x) - split, "held_out_r2": quality["r2"],
            "held_out_spearman": quality["spearman"],
            "seconds": round(time.perf_counter() - start, 3)}


def cmd_calibrate_restorekv(args, model, tokenizer, ids) -> dict:
    """`kvjax calibrate --restorekv`: restore tokens trained on the windows of `ids`, each
    window's first three quarters the context (the ppl cells' prefix), the last held out."""
    import shutil

    from models.reconstruction import chat_prompt
    from models.restorekv import train_restorekv

    windows = calibration_windows(args, ids, held_out=True)
    start = time.perf_counter()
    out = train_restorekv(model, windows, chat_prompt(tokenizer), prefix=args.window * 3 // 4,
                          steps=args.steps)
    if Path(args.out).exists():
        shutil.rmtree(args.out)
    out.tokens.save(args.out)
    return {"out": str(args.out), **out.config,
            "loss": {"first": float(out.history[0]), "last": float(out.history[-1])},
            "held_out_kl": out.held_out, "seconds": round(time.perf_counter() - start, 3)}


def cmd_calibrate(args, model, tokenizer) -> dict:
    from models.calibration import calibrate_low_rank

    if args.duo:
        return cmd_calibrate_duo(args, model, tokenizer)
    if args.duo_train:
        return cmd_calibrate_duo_train(args, model, tokenizer)
    ids = tokenizer.encode(read_text(args.text))[-args.tokens:]
    if args.qfilters:
        return cmd_calibrate_qfilters(args, model, ids)
    if args.lukv:
        return cmd_calibrate_lukv(args, model, ids)
    if args.query_stats:
        return cmd_calibrate_query_stats(args, model, ids)
    if args.kvzap or args.fastkvzip:
        return cmd_calibrate_token_scorer(args, model, tokenizer, ids)
    if args.restorekv:
        return cmd_calibrate_restorekv(args, model, tokenizer, ids)
    start = time.perf_counter()
    basis = calibrate_low_rank(model, ids, window=args.window)
    basis.save(args.out)
    captured = {r: basis.captured(r) for r in (8, 16, 32, 48)}
    return {"out": str(args.out), "tokens": len(ids), "seconds": round(time.perf_counter() - start, 3),
            "energy_captured": {r: {"keys": k, "values": v} for r, (k, v) in captured.items()}}


def check_model_args(args, cfg) -> None:
    """Checks that need the model: `layers=` of the method, lengths within its positions."""
    from kvjax.policies.methods import Method

    Method.parse(getattr(args, "method", "full")).check(cfg.num_layers)
    limit = cfg.max_position
    if args.command == "ppl" and args.context > limit:
        raise _bad("context", args.context, f"must be <= the model's {limit} positions")
    if args.command == "calibrate" and args.window > limit:
        raise _bad("window", args.window, f"must be <= the model's {limit} positions")
    if args.command == "generate" and args.max_new_tokens >= limit:
        raise _bad("max_new_tokens", args.max_new_tokens,
                   f"must be < the model's {limit} positions (the prompt needs some)")


def _mesh(args):
    """The `--mesh` of a command (models.sharding.make_mesh), or None."""
    if not getattr(args, "mesh", None):
        return None
    from models.sharding import make_mesh
    try:
        return make_mesh(args.mesh)
    except ValueError as e:
        raise _bad("mesh", args.mesh, str(e).removeprefix(f"mesh {args.mesh!r}: ")) from None


def _on_mesh(args, method):
    """(the parsed method, its transform pinned to `--mesh`; place_cache, None without one).
    `method` is what `main` parsed (a spec, from a caller of `cmd_*`, is parsed here)."""
    from kvjax.policies.methods import Method
    method = Method.parse(method)
    mesh = getattr(args, "mesh_obj", None)
    if mesh is None:
        return method, None
    from models.sharding import cache_placer, on_mesh
    return method.with_transform(on_mesh(method.transform, mesh)), cache_placer(mesh)


def _impl(args):
    """`--impl`; with `--mesh`, "pallas" is the kernel per shard (models.sharding.pallas_impl)."""
    mesh = getattr(args, "mesh_obj", None)
    if mesh is None or args.impl != "pallas":
        return args.impl
    from models.sharding import pallas_impl
    return pallas_impl(mesh)


def cmd_generate(args, model, tokenizer) -> dict:
    from models.pipeline import ask
    from models.sampler import Sampling

    method, place_cache = _on_mesh(args, args.method)
    if getattr(args, "monitor", False):
        from kvjax.tools.monitor import monitored
        method = method.with_transform(monitored(method.transform))
    answer = ask(model, tokenizer, args.prompt, method=method, chat=args.chat,
                 context=read_text(args.context_file) if args.context_file else None,
                 answer_prefix=args.answer_prefix, max_new_tokens=args.max_new_tokens,
                 sampling=Sampling(args.temperature, args.top_k, args.top_p), seed=args.seed,
                 compress_every=args.compress_every, impl=_impl(args), place_cache=place_cache)
    result = {"text": answer.text, "tokens": answer.tokens,
              "prompt_tokens": answer.context_tokens + answer.question_tokens,
              "context_tokens": answer.context_tokens, "cache_bytes": answer.cache_bytes,
              "method": method.spec, "seconds": answer.seconds}
    if getattr(args, "monitor", False):
        from kvjax.tools.monitor import find_monitor, refresh, summary
        result["monitor"] = summary(refresh(find_monitor(answer.transform_state), answer.cache))
        from experiments.eval.planner_view import monitor_plan
        plan = monitor_plan(args.method, model, answer.transform_state)
        if plan is not None:  # auto: what it planned (bits, keys, tokens per layer and head)
            result["monitor"]["plan"] = plan
        if not args.json:
            print("monitor: " + json.dumps(result["monitor"]), file=sys.stderr)
    return result


def cmd_ppl(args, model, tokenizer) -> dict:
    from experiments.eval.ppl import perplexity

    ids = tokenizer.encode(read_text(args.text))[:args.max_tokens]
    start = time.perf_counter()
    method, place_cache = _on_mesh(args, args.method)  # with --mesh: caches on the mesh
    result = perplexity(model, ids, args.context, args.stride, batch_size=args.batch_size,
                        prefix=args.prefix, place_cache=place_cache,
                        transform=method.transform)
    if not math.isfinite(result.ppl):
        raise BadResult(f"perplexity is {result.ppl} (summed NLL {result.nll}): the model gave "
                        f"non-finite log-probabilities; not reporting it")
    return {"ppl": result.ppl, "nll": result.nll, "tokens_scored": result.tokens_scored,
            "cache_bytes": result.cache_bytes, "full_bf16_bytes": result.full_bf16_bytes,
            "text_tokens": len(ids), "context": args.context,
            "stride": args.stride or args.context, "prefix": args.prefix,
            "method": method.spec, "seconds": round(time.perf_counter() - start, 3)}


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The grids shipped with kvjax (package data): `--config ruler_long` names one."""


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.toml"))


def config_path(value: str) -> Path:
    """`--config`: a TOML file, or the bare name of a shipped grid (`ruler_long`), which an
    installed wheel can run without the repository.

    >>> config_path("ruler_long") == CONFIGS / "ruler_long.toml"
    True
    """
    path = Path(value)
    shipped = CONFIGS / f"{value}.toml"
    if not path.exists() and "/" not in value and not path.suffix and shipped.is_file():
        return shipped
    return path


def cmd_eval(args) -> int:
    """Run the grid's unfinished cells (each in a worker process), then write the report."""
    from experiments.eval import harness
    from experiments.eval import report

    try:
        if not args.config.is_file():
            raise _bad("config", args.config, "is a directory: need a file" if
                       args.config.is_dir() else "config file not found; shipped configs: "
                       + ", ".join(shipped_configs()))
        grid = harness.load_config(args.config)
        cells = [c for c in grid.cells if args.command == "eval" or c.task == "speed"]
        if not cells:
            raise ValueError(f"{args.config}: no `speed` cells to bench")
        if args.report and not (args.out / "cells.jsonl").is_file():
            raise _bad("out", args.out, "has no cells.jsonl to report on")
        check_writable(args.out, folder=True)  # before the sweep, not after it
        if args.results is not None:
            check_results_file(args.results)
        if not args.report:
            harness.prepare_bases(grid, cells, args.out)  # [bases.NAME] files a cell needs
            harness.check_models(cells)
            harness.sweep(cells, args.out, grid.max_rss_gb, workers=grid.workers,
                          share_prefill=not args.no_shared_prefill)
        if args.results:
            report.write_results(args.out, args.results,
                                 header=f"Generated from `{args.out}/cells.jsonl` by `kvjax "
                                        f"{args.command} --config {args.config} --out {args.out} "
                                        f"--results {args.results}` (any config writing to "
                                        f"that folder regenerates the whole section).\n\n")
        tables = report.report(args.out)
        if args.json:
            rows = report.latest_rows(args.out)
            print(json.dumps(json_safe(dict(
                command=args.command, config=str(args.config), out=str(args.out),
                tables=str(args.out / "tables.md"), cells=len(cells),
                results=None if args.results is None else str(args.results),
                ok=sum(r.get("status") == "ok" for r in rows),
                failed=sum(r.get("status") != "ok" for r in rows), rows=rows)),
                allow_nan=False))
        else:
            print(tables)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, harness.Interrupted) as e:
        print(f"kvjax: {e or 'interrupted'}", file=sys.stderr)
        return 130
    except OSError as e:  # e.g. the disk filled up during the sweep: finished rows are kept
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 1
    return 0


def notice(message: str) -> None:
    """One line on stderr (never stdout, which may carry --json) before a long silent step;
    `KVJAX_QUIET=1` hides these lines (the test suite sets it: its error tests count lines)."""
    if os.environ.get("KVJAX_QUIET", "") in ("", "0"):
        print(f"kvjax: {message}", file=sys.stderr, flush=True)


def notice_conversion(model: str) -> None:
    """Before a GGUF's first conversion to float32 (about 20 s for SmolLM2 on 2 cores), unless
    `load_model` announces it itself (it does when it draws a progress bar: a terminal)."""
    from models.loading import converted_dir, progress_enabled, resolve_model_path
    path = resolve_model_path(model)  # fetches the default model once (with its own notice)
    if path.is_file() and not converted_dir(path).is_dir() and not progress_enabled():
        notice(f"converting {path.name} to float32 (once, about 20 s for SmolLM2; later runs "
               f"read the copy)")


def notice_compile(folder: Path | None) -> None:
    """Before a first run's compile (tens of seconds): when the compilation cache holds no
    program yet (a fresh machine), or is switched off."""
    if folder is not None and folder.is_dir() and any(
            not entry.name.startswith(".") for entry in folder.iterdir()):
        return
    where = (f"later runs read them from {folder}" if folder is not None
             else "KVJAX_COMPILATION_CACHE=0: every run compiles")
    notice(f"compiling the model's steps (first run: tens of seconds; {where})")


def json_safe(value):
    """`value` with every non-finite float as None (JSON has no NaN; a failed cell has them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def check_results_file(path: Path) -> None:
    """UsageError unless the --results Markdown file can be rewritten (checked before a sweep)."""
    if path.is_dir():
        raise _bad("results", path, "is a directory: need a Markdown file")
    try:
        if path.exists():
            open(path, "a").close()
        else:
            check_writable(path, folder=False)
    except OSError as e:
        raise _bad("results", path, f"cannot be written ({e.strerror or e})") from None
    except UsageError as e:
        raise _bad("results", path, str(e).split(": ", 1)[-1]) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # $KVJAX_PLUGINS for every command: a bad one is an error, never silently ignored
        from kvjax.policies.methods import load_plugins
        load_plugins()
    except ValueError as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    # a process of `kvjax launch` joins the others (KVJAX_* variables); the variable is tested
    # here too so that other runs (`run-exported`) never import models.sharding (and Flax)
    if args.command != "launch" and os.environ.get("KVJAX_COORDINATOR"):
        from models.sharding import init_distributed
        init_distributed()
    if args.command in ("eval", "bench"):
        return cmd_eval(args)
    if args.command in MODULE_COMMANDS:
        try:
            return importlib.import_module(MODULE_COMMANDS[args.command][0]).run(args)
        except (FileNotFoundError, ValueError, OSError) as e:
            print(f"kvjax: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("kvjax: interrupted", file=sys.stderr)
            return 130
    from models.hub import enable_compilation_cache
    from models.loading import load_model

    if argv is None and args.command == "generate":  # the console command (not a caller's
        # process, whose later programs would keep the XLA loop): a first run is not held up
        # by the CPU kernel's build (kvjax.core.cpu_kernel.build_mode)
        os.environ.setdefault("KVJAX_CPU_KERNEL_BUILD", "background")
    try:
        check_args(args)
        jit_cache = enable_compilation_cache()  # a second run skips XLA compilation
        from kvjax.policies.methods import Method
        args.method = Method.parse(getattr(args, "method", "full"))  # parsed once, carried on
        for path in (getattr(args, "text", None), getattr(args, "context_file", None)):
            if path is not None:
                read_text(path)  # fail before the model loads
        mesh = _mesh(args)  # before the model loads: a bad mesh fails fast
        notice_conversion(args.model)
        model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
        check_model_args(args, model.config)
        from models.reconstruction import with_tokenizer  # kvzip's prompt: this tokenizer's ids
        args.method = args.method.with_transform(with_tokenizer(args.method.transform, tokenizer))
        if mesh is not None:
            from models.sharding import shard_model
            model = shard_model(model, mesh)
            args.mesh_obj = mesh
        notice_compile(jit_cache)
        commands = {"generate": cmd_generate, "ppl": cmd_ppl, "calibrate": cmd_calibrate}
        result = commands[args.command](args, model, tokenizer)
        result["model"] = args.model
        text = json.dumps(result, allow_nan=False)  # a NaN is an error, not invalid JSON
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    except BadResult as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvjax: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(text)
    elif args.command == "generate":
        print(result["text"])
    elif args.command == "calibrate" and "head_scores_shape" in result:
        print(f"wrote {result['out']}: DuoAttention head scores {result['head_scores_shape']} "
              f"from {result['texts']} passages")
    elif args.command == "calibrate" and "energy_captured" in result:
        print(f"wrote {result['out']} from {result['tokens']} tokens; energy kept by rank "
              + ", ".join(f"{r}: keys {e['keys']:.3f} values {e['values']:.3f}"
                          for r, e in result["energy_captured"].items()))
    elif args.command == "calibrate":  # the trained artifacts: what the fit reports
        print(f"wrote {result['out']}: " + json.dumps(
            {k: v for k, v in result.items() if k not in ("out", "model")}, allow_nan=False))
    else:
        print(f"perplexity {result['ppl']:.4f} over {result['tokens_scored']} tokens "
              f"(context {result['context']}, stride {result['stride']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
