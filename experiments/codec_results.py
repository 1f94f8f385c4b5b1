"""Codecs and eviction + codec chains on SmolLM2: bytes per token, perplexity, passkey.

    python experiments/codec_results.py                 # about 20 min on 2 cores
    python experiments/codec_results.py --plot-only     # redraw from the JSONL files

For every method in `METHODS` (a label and a `--method` spec) beside the full cache:

* memory: one 4096-token window of prose is prefilled into a bfloat16 cache,
  compressed and shrunk (`room=0`); bytes per context token = `nbytes(cache)`
  / 4096, over all layers and KV heads. Each is printed beside its
  theoretical value (`theoretical_bytes`), so an accounting bug shows.
* ppl: continuation perplexity as in `eviction_results.py` (KJV Genesis,
  windows of 1024, the first 768 tokens compressed, the rest scored).
* passkey: the query-agnostic protocol of `eviction_results.py` (2048 tokens,
  20 trials): the context is compressed, then the question appended.

Quality runs compute in float32 on the same codes; the memory column is the
bfloat16-storage footprint. Rows append to `<out>/codec_{memory,ppl,passkey}.jsonl`
(one passkey row per batch of trials; a rerun skips what is there); `<out>/codec_pareto.png` puts every codec,
chain and eviction policy (from `eviction_*.jsonl`) on quality vs bytes.
The low-rank bases are calibrated on the end of The Devil's Dictionary
(`kvjax calibrate`) unless `<out>/lowrank_basis.npz` exists.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from experiments.eviction_results import append, load_rows, merged_stats, whole_cells
from experiments.ppl import window_ids

BASIS = "{basis}"
METHODS = {
    "full": "full",
    "fp8-e4m3": "fp8",
    "fp8-e5m2": "fp8:fmt=e5m2",
    "int8": "quantize:bits=8,group=32",
    "int4": "quantize:bits=4,group=32",
    "int4-g16": "quantize:bits=4,group=16",
    "int4-channel": "quantize:bits=4,group=32,axis=channel",
    "int2": "quantize:bits=2,group=32",
    "kivi-4": "kivi:bits=4",
    "kivi-2": "kivi:bits=2",
    "low_rank-48": f"low_rank:rank=48,basis={BASIS}",
    "low_rank-32": f"low_rank:rank=32,basis={BASIS}",
    "low_rank-16": f"low_rank:rank=16,basis={BASIS}",
    "snapkv-0.5+kivi-4": "snapkv:ratio=0.5+kivi:bits=4",
    "snapkv-0.5+kivi-2": "snapkv:ratio=0.5+kivi:bits=2",
    "snapkv-0.75+kivi-4": "snapkv:ratio=0.75+kivi:bits=4",
    "kivi-4+snapkv-0.5": "kivi:bits=4+snapkv:ratio=0.5",
    "streaming_llm-0.5+kivi-4": "streaming_llm:ratio=0.5+kivi:bits=4",
    "tova-0.5+kivi-4": "tova:ratio=0.5+kivi:bits=4",
    "h2o-0.5+kivi-4": "h2o:ratio=0.5+kivi:bits=4",
    "h2o-0.5+int8": "h2o:ratio=0.5+quantize:bits=8,group=32",
}
MEMORY_TOKENS = 4096


def transform_of(label: str, basis: Path):
    import kvjax
    return kvjax.parse_method(METHODS[label].replace(BASIS, str(basis)))


def theoretical_bytes(label: str, n: int, layers: int = 30, kv_heads: int = 3, d: int = 64) -> float:
    """Bytes per context token from the formats alone (bf16 dense parts, fp16 parameters).

    Per token, layer and KV head: keys and values, plus a 4-byte position.
    KIVI-b: keys `d*b/8` code bytes + a 2-byte group id + `2*2*d/G` table
    bytes; values `d*b/8` + `2*2*d/G`; the newest `R .. R+G-1` tokens dense.
    Eviction first keeps `floor(n * (1 - r))` tokens; H2O adds a float32
    attention mass per slot. Per-layer constants
    (cursors, the spare table row, low-rank bases) are left out.
    """
    kept = n
    fmt = label
    if "+" in label:
        first, second = label.split("+")
        evictor, codec = (first, second) if "kivi" not in first else (second, first)
        kept = int(np.floor(n * (1 - float(evictor.rsplit("-", 1)[1]))))
        fmt = codec
    mass = 4 if "h2o" in label else 0  # H2O keeps a float32 attention mass per slot
    dense = 2 * d * 2 + 4 + mass
    exact = 0  # tokens kept dense
    if fmt == "full":
        per = dense
    elif fmt.startswith("fp8"):
        per = 2 * d + 4 + mass
    elif fmt.startswith("low_rank"):
        per = 2 * int(fmt.split("-")[1]) * 2 + 4 + mass
    else:
        bits = int(fmt.split("-")[1][0]) if fmt.startswith("kivi") else int(fmt[3])
        group = 16 if fmt.endswith("g16") else 32
        if fmt.startswith("kivi") or fmt == "int4-channel":
            channel = d * bits / 8 + 2 + 2 * 2 * d / group
            tokens = channel if fmt == "int4-channel" else d * bits / 8 + 2 * 2 * d / group
            per = channel + tokens + 4 + mass
            residual = 128 if fmt.startswith("kivi") else 0
            exact = kept - max(0, (kept - residual) // group) * group
        else:
            per = 2 * (d * bits / 8 + 2 * 2 * d / group) + 4 + mass
    return ((kept - exact) * per + exact * dense) * layers * kv_heads / n


def run_memory(model, tokenizer, out: Path, labels, basis: Path, text: Path) -> None:
    import jax.numpy as jnp
    import kvjax
    from models.sampler import compress, prefill_batch

    path = out / "codec_memory.jsonl"
    todo = [x for x in labels if x not in {r["method"] for r in load_rows(path)}]
    if not todo:
        return
    (ids,) = window_ids(tokenizer, text, MEMORY_TOKENS, 1)
    transforms = {x: transform_of(x, basis) for x in todo}
    pre = prefill_batch(model, [ids], stats=merged_stats(transforms.values()),
                        cache_dtype=jnp.bfloat16)
    for label, t in transforms.items():
        own = pre
        if not t.stats.attention_mass:  # the mass the union collected is not this method's
            own = pre._replace(cache=tuple(layer.replace(mass=None) for layer in pre.cache))
        small = compress(own, t, keep_input=True, room=0) if label != "full" else own
        measured = kvjax.nbytes(small.cache) / MEMORY_TOKENS
        row = {"method": label, "spec": METHODS[label], "tokens": MEMORY_TOKENS,
               "bytes_per_token": measured, "theoretical": theoretical_bytes(label, MEMORY_TOKENS)}
        append(path, row)
        print(f"  {label:26s} {measured:9.1f} B/token (theory {row['theoretical']:9.1f})",
              flush=True)


def run_ppl(model, tokenizer, out: Path, labels, basis: Path, text: Path, context: int,
            prefix: int, windows: int) -> None:
    import jax
    from models.sampler import compress, prefill_batch
    from models.scoring import score_continuations

    path = out / "codec_ppl.jsonl"
    todo = [x for x in labels if x not in {r["method"] for r in load_rows(path)}]
    if not todo:
        return
    wins = window_ids(tokenizer, text, context, windows)
    transforms = {x: transform_of(x, basis) for x in todo}
    pre = prefill_batch(model, [w[:prefix] for w in wins], stats=merged_stats(transforms.values()),
                        room=context - prefix)
    for label, t in transforms.items():
        start = time.perf_counter()
        small = compress(pre, t, keep_input=True, shrink=False)
        lps = score_continuations(model, small, [w[prefix:] for w in wins])
        nll = -float(sum(np.sum(lp, dtype=np.float64) for lp in lps))
        count = sum(len(lp) for lp in lps)
        row = {"method": label, "spec": METHODS[label], "context": context, "prefix": prefix,
               "windows": len(wins), "tokens_scored": count, "nll": nll,
               "ppl": float(np.exp(nll / count)), "text": text.name,
               "seconds": round(time.perf_counter() - start, 1)}
        append(path, row)
        print(f"  {label:26s} ppl {row['ppl']:.3f} ({row['seconds']} s)", flush=True)
        jax.clear_caches()


def run_passkey(model, tokenizer, out: Path, labels, basis: Path, length: int, trials: int,
                batch_size: int, max_new: int = 8) -> None:
    import jax
    from experiments.eviction_results import DEPTHS
    from experiments.passkey import make_trials, score_trials
    from models.sampler import compress, decode, extend, prefill_batch

    path = out / "codec_passkey.jsonl"
    done = {(r["method"], r.get("first", "all")) for r in load_rows(path) if r["length"] == length}
    all_trials = make_trials(tokenizer, length, DEPTHS, max(1, trials // len(DEPTHS)), seed=length)
    transforms = {x: transform_of(x, basis) for x in labels}
    for first in range(0, len(all_trials), batch_size):
        todo = [x for x in labels if (x, first) not in done and (x, "all") not in done]
        if not todo:
            continue
        batch = all_trials[first:first + batch_size]
        room = max_new + max(len(t.question) for t in batch)
        pre = prefill_batch(model, [t.context for t in batch],
                            stats=merged_stats(transforms[x] for x in todo), room=room)
        for label in todo:
            small = compress(pre, transforms[label], keep_input=True, shrink=False)
            small = extend(model, small, [t.question for t in batch])
            gen = decode(model, small, max_new_tokens=max_new)
            texts = [tokenizer.decode(row[:n].tolist()) for row, n in zip(gen.tokens, gen.num_tokens)]
            correct = score_trials(batch, texts)
            append(path, {"method": label, "spec": METHODS[label], "length": length,
                          "first": first, "trials": len(correct), "correct": int(sum(correct)),
                          "example": texts[0]})
            print(f"  {label:26s} {sum(correct)}/{len(correct)}  {texts[0]!r}", flush=True)
        del pre
        jax.clear_caches()


def passkey_cells(rows: list[dict], length: int) -> dict[str, dict]:
    """Passkey rows of one length merged over their batches, by method."""
    cells = {}
    for r in rows:
        if r["length"] != length:
            continue
        cell = cells.setdefault(r["method"], {"trials": 0, "correct": 0})
        cell["trials"] += r["trials"]
        cell["correct"] += r["correct"]
    for cell in cells.values():
        cell["accuracy"] = cell["correct"] / cell["trials"]
    return cells


def pareto_front(points):
    """Points (bytes, loss) not beaten on both by another point, sorted by bytes."""
    front, best = [], float("inf")
    for b, loss, name in sorted(points):
        if loss < best:
            front.append((b, loss, name))
            best = loss
    return front


def plot_and_tables(out: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = {r["method"]: r for r in load_rows(out / "codec_memory.jsonl")}
    if "full" not in memory:
        return ""
    full_bytes = memory["full"]["bytes_per_token"]
    md = ["| method | spec | bytes/token (measured) | theoretical | vs bf16 | ppl | "
          "passkey 2k |", "|---|---|---|---|---|---|---|"]
    ppl = {r["method"]: r for r in load_rows(out / "codec_ppl.jsonl")}
    passkey = passkey_cells(load_rows(out / "codec_passkey.jsonl"), 2048)
    for label in METHODS:
        if label not in memory:
            continue
        m = memory[label]
        md.append(f"| {label} | `{m['spec'].replace(BASIS, 'B')}` | {m['bytes_per_token']:.0f} | "
                  f"{theoretical_bytes(label, m['tokens']):.0f} | "
                  f"{m['bytes_per_token'] / full_bytes:.3f} | "
                  + (f"{ppl[label]['ppl']:.3f}" if label in ppl else "-") + " | "
                  + (f"{passkey[label]['correct']}/{passkey[label]['trials']}"
                     if label in passkey else "-") + " |")

    # eviction policies from eviction_results.py: bytes are the kept fraction of the full cache
    eviction_ppl = [r for r in load_rows(out / "eviction_ppl.jsonl") if r["policy"] != "full"]
    eviction_pk = [r for r in whole_cells(load_rows(out / "eviction_passkey.jsonl"))
                   if r["length"] == 2048 and r["policy"] not in ("full",)
                   and not r["policy"].endswith("_query_aware")]
    evicted = lambda r: full_bytes * np.floor(MEMORY_TOKENS * (1 - r["ratio"])) / MEMORY_TOKENS
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    panels = [
        (axes[0], "continuation perplexity (lower is better)",
         [(memory[x]["bytes_per_token"], ppl[x]["ppl"], x) for x in ppl if x in memory],
         [(evicted(r), r["ppl"], f"{r['policy']}-{r['ratio']}") for r in eviction_ppl], 1),
        (axes[1], "passkey accuracy at 2048 tokens (higher is better)",
         [(memory[x]["bytes_per_token"], passkey[x]["accuracy"], x) for x in passkey if x in memory],
         [(evicted(r), r["accuracy"], f"{r['policy']}-{r['ratio']}") for r in eviction_pk], -1),
    ]
    for ax, title, codec_pts, evict_pts, sign in panels:
        if not codec_pts:
            continue
        chains = [p for p in codec_pts if "+" in p[2]]
        codecs = [p for p in codec_pts if "+" not in p[2]]
        for pts, style, name in ((evict_pts, dict(color="0.6", marker="."), "eviction only"),
                                 (codecs, dict(color="C0", marker="o"), "codec"),
                                 (chains, dict(color="C3", marker="s"), "eviction + codec")):
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        for b, y, name in codec_pts:
            ax.annotate(name, (b, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        front = pareto_front([(b, sign * y, n) for b, y, n in codec_pts + evict_pts])
        ax.step([p[0] for p in front], [sign * p[1] for p in front], where="post", color="k",
                lw=1, label="Pareto front")
        ax.set(title=title, xlabel="cache bytes per context token (bf16 storage, log)",
               xscale="log")
        if sign > 0:
            ax.set(yscale="log", ylabel="perplexity")
        else:
            ax.set(ylabel="accuracy", ylim=(-0.05, 1.05))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "codec_pareto.png", dpi=120)
    plt.close(fig)
    if ppl:
        front = pareto_front([(memory[x]["bytes_per_token"], ppl[x]["ppl"], x) for x in ppl
                              if x in memory] + [(evicted(r), r["ppl"], f"{r['policy']}-{r['ratio']}")
                                                 for r in eviction_ppl])
        md += ["", "Perplexity Pareto front (bytes/token, ppl): " + ", ".join(
            f"{n} ({b:.0f}, {y:.2f})" for b, y, n in front)]
    return "\n".join(md)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tasks", nargs="+", default=["memory", "ppl", "passkey"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--ppl-text", type=Path,
                        default=Path(__file__).parent / "data" / "kjv_genesis.txt")
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; available: {list(METHODS)}")
    if not args.plot_only:
        from models.calibration import calibrate_low_rank
        from models.hub import enable_compilation_cache
        from models.loading import load_model

        enable_compilation_cache()
        model, tokenizer = load_model(args.model)
        basis = args.out / "lowrank_basis.npz"
        if not basis.exists() and any(BASIS in METHODS[x] for x in args.methods):
            text = Path(__file__).parent / "data" / "devils_dictionary.txt"  # as `kvjax calibrate`
            ids = tokenizer.encode(text.read_text(encoding="utf-8"))[-16384:]
            calibrate_low_rank(model, ids).save(basis)
        if "memory" in args.tasks:
            run_memory(model, tokenizer, args.out, args.methods, basis, args.ppl_text)
        if "ppl" in args.tasks:
            run_ppl(model, tokenizer, args.out, args.methods, basis, args.ppl_text, 1024, 768,
                    args.ppl_windows)
        if "passkey" in args.tasks:
            run_passkey(model, tokenizer, args.out, args.methods, basis, 2048, args.trials,
                        args.batch_size)
    tables = plot_and_tables(args.out)
    (args.out / "codec_tables.md").write_text(tables + "\n")
    print(tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
