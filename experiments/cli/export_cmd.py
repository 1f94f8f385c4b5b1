"""`kvjax export` and `kvjax run-exported`: write a compiled-decoder artifact, generate from it.

    kvjax export --method snapkv:ratio=0.5+kivi:bits=4 --out smollm2-snapkv \
        --platforms cpu,cuda,tpu --max-len 1024
    kvjax run-exported smollm2-snapkv --prompt "Why is the sky blue?" --chat

`export` loads the model (`--model`, as for every command), writes the artifact
(`models.export.export_artifact`) and, with `--check-tpu`, compiles its TPU entry for a
deviceless TPU slice (`kvjax.tools.exported.compile_for_tpu`). `run-exported` needs only the
artifact: it goes through `kvjax.tools.exported`, which imports neither Flax nor `models`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def add_arguments(parser) -> None:
    """Arguments of `kvjax export` or `kvjax run-exported` (told apart by the parser's name)."""
    if parser.prog.split()[-1] == "run-exported":
        parser.add_argument("artifact", type=Path, help="folder written by `kvjax export`")
        parser.add_argument("--prompt", action="append", required=True,
                            help="a prompt; repeat for a batch")
        parser.add_argument("--chat", action="store_true", help="wrap in the chat template")
        parser.add_argument("--max-new-tokens", type=int, default=32)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        return
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default) or a .gguf file / HF directory / repo id")
    parser.add_argument("--method", default="full", help="cache method spec, e.g. "
                        "'snapkv:ratio=0.5+kivi:bits=4'")
    parser.add_argument("--out", type=Path, required=True, help="artifact folder to write")
    parser.add_argument("--platforms", default="cpu",
                        help="comma-separated jax.export platforms: cpu, cuda, rocm, tpu")
    parser.add_argument("--max-len", type=int, default=1024,
                        help="largest cache capacity (prompt + new tokens) the artifact serves")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk in tokens")
    parser.add_argument("--buckets", default="",
                        help="comma-separated capacities (default: 2 x chunk doubling to "
                             "--max-len)")
    parser.add_argument("--check-tpu", action="store_true",
                        help="compile the TPU entry for a deviceless v5e slice (needs libtpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{option} {text!r}: need comma-separated integers") from None


def check_export_args(args, platforms: tuple[str, ...], buckets) -> None:
    """ValueError naming the first option out of range (the model-dependent limits, such as
    --max-len <= the model's positions, are `export_artifact`'s)."""
    if not platforms or any(p not in ("cpu", "cuda", "rocm", "tpu") for p in platforms):
        raise ValueError(f"--platforms {args.platforms!r}: must be a comma-separated list of "
                         f"cpu, cuda, rocm, tpu")
    if args.chunk < 1:
        raise ValueError(f"--chunk {args.chunk}: must be an integer >= 1")
    if args.max_len < 2 * args.chunk:
        raise ValueError(f"--max-len {args.max_len}: must be >= 2 x --chunk ({2 * args.chunk})")
    if buckets and any(b <= args.chunk or b > args.max_len for b in buckets):
        raise ValueError(f"--buckets {args.buckets}: each must be in [--chunk + 1 = "
                         f"{args.chunk + 1}, --max-len = {args.max_len}]")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: is a file; need a folder")


def run_export(args) -> dict:
    from kvjax.tools.exported import compile_for_tpu
    from models.export import export_artifact
    from models.hub import enable_compilation_cache
    from models.loading import load_model

    platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
    if args.check_tpu and "tpu" not in platforms:
        raise ValueError(f"--check-tpu needs tpu in --platforms, got {args.platforms!r}")
    buckets = _ints(args.buckets, "buckets") or None
    check_export_args(args, platforms, buckets)  # before the model loads
    enable_compilation_cache()
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    path = export_artifact(model, tokenizer, args.out, method=args.method, platforms=platforms,
                           max_len=args.max_len, chunk=args.chunk, buckets=buckets,
                           source=str(args.model))
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))
    result = {"out": str(path), "method": args.method, "platforms": list(platforms),
              "buckets": manifest["buckets"], "bytes": sum(
                  f.stat().st_size for f in path.rglob("*") if f.is_file()),
              "seconds": round(time.perf_counter() - start, 3)}
    if args.check_tpu:
        result["tpu"] = compile_for_tpu(path)
    return result


def run_exported(args) -> dict:
    from kvjax.tools import exported

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: must be an integer >= 1")
    start = time.perf_counter()
    decoder = exported.load(args.artifact)
    loaded = time.perf_counter() - start
    out = decoder.generate(args.prompt, args.max_new_tokens, chat=args.chat)
    return {"texts": out.texts, "tokens": [row[:n].tolist() for row, n in
                                           zip(out.tokens, out.num_tokens)],
            "method": decoder.manifest["method"], "prefill_bucket": out.prefill_bucket,
            "decode_bucket": out.decode_bucket, "load_seconds": round(loaded, 3),
            "first_token_seconds": out.first_token_seconds,
            "seconds": round(time.perf_counter() - start, 3)}


def run(args) -> int:
    """Errors propagate: `kvjax`'s main prints them as one line with exit status 2."""
    result = run_exported(args) if args.command == "run-exported" else run_export(args)
    if args.json:
        print(json.dumps(result, allow_nan=False))
    elif args.command == "run-exported":
        print("\n".join(result["texts"]))
    else:
        print(f"wrote {result['out']} ({result['bytes'] / 2**20:.1f} MiB, buckets "
              f"{result['buckets']}, platforms {','.join(result['platforms'])}) in "
              f"{result['seconds']} s")
    return 0
