"""`kvjax inspect`: what a cache method did to one prompt, per layer and KV head, as a PNG.

    kvjax inspect --context-file experiments/data/kjv_genesis_1-3.txt \\
        --prompt "What did God create on the first day?" --method snapkv:ratio=0.5 --out x.png

The prompt (or the context, when `--context-file` is given: it is what a method compresses,
as in `kvjax generate`) is prefilled with the statistics the method needs, and the method's
first update runs through `kvjax.tools.monitor.monitored`. Three panels:

1. kept positions: one row per (layer, KV head), one column per token position; a kept
   token is coloured by the relative error of its stored key (0 = exact), an evicted one is
   blank;
2. attention mass retained per layer and KV head (where the method saw attention; blank
   otherwise);
3. relative key error per layer and KV head.

`--json` prints the monitor's summary and the per-layer/head tables. For `auto:budget=F`
the plan (codec bits per layer, tokens kept per layer and KV head, the damage table's
source) is also drawn as NAME.plan.png and printed under "plan".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from experiments.eval.grid import read_text


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="as for `kvjax generate`")
    p.add_argument("--method", default="full", help="cache method spec, e.g. snapkv:ratio=0.5")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompt", required=True)
    p.add_argument("--context-file", type=Path,
                   help="text before the prompt: what the method compresses")
    p.add_argument("--chat", action="store_true", help="wrap in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="keep the last N tokens of what is compressed (default 4096)")
    p.add_argument("--out", type=Path, required=True, help="PNG file to write")
    p.add_argument("--json", action="store_true", help="print the monitor as JSON on stdout")


def kept_matrix(before, after) -> tuple[np.ndarray, np.ndarray]:
    """([KVH, N] bool kept, [KVH, N] float relative key error per position) of one layer of
    batch row 0, N = one past the largest position held before."""
    from kvjax.tools.monitor import dense, match_positions
    db, da = dense(before), dense(after)
    pb, pa = np.asarray(db.pos)[0], np.asarray(da.pos)[0]  # [KVH, C]
    n = int(pb.max()) + 1
    kvh = pb.shape[0]
    idx, found = (np.asarray(x)[0] for x in match_positions(db.pos, da.pos))
    kb = np.broadcast_to(np.asarray(db.logical_k, np.float32)[0], (kvh, *db.k.shape[-2:]))
    ka = np.broadcast_to(np.asarray(da.logical_k, np.float32)[0], (kvh, *da.k.shape[-2:]))
    kept = np.zeros((kvh, n), bool)
    err = np.full((kvh, n), np.nan)
    for h in range(kvh):
        for j in np.nonzero(found[h])[0]:
            p, exact = int(pa[h, j]), kb[h, idx[h, j]]
            kept[h, p] = True
            err[h, p] = np.linalg.norm(ka[h, j] - exact) / max(np.linalg.norm(exact), 1e-30)
    return kept, err


def inspect(model, ids: list[int], method):
    """(cache before, cache after, monitor) of `method`'s (a spec or a parsed `kvjax.Method`)
    first update on one prompt."""
    import jax
    import kvjax
    from kvjax.tools.monitor import monitored
    from models.sampler import prefill_batch

    transform = monitored(kvjax.Method.parse(method).transform)
    pre = prefill_batch(model, [ids], stats=transform.stats)
    before = jax.tree_util.tree_map(lambda x: x.copy(), pre.cache)
    after, (_, monitor) = jax.jit(transform.update)(pre.cache, transform.init(pre.cache),
                                                    pre.stats)
    return before, after, monitor


def draw(before, after, monitor, title: str, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kvjax.tools.monitor import per_head

    rows = [kept_matrix(b, a) for b, a in zip(before, after)]
    n = max(k.shape[1] for k, _ in rows)
    pad = lambda x, fill: np.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=fill)
    kept = np.concatenate([pad(k, False) for k, _ in rows])  # [L*KVH, N]
    err = np.concatenate([pad(e, np.nan) for _, e in rows])
    shown = np.where(kept, np.nan_to_num(err), np.nan)
    mass = per_head(monitor, "mass_retained")[:, 0]  # [L, KVH] batch row 0
    kerr = per_head(monitor, "k_error")[:, 0]
    layers, kvh = mass.shape
    fig = plt.figure(figsize=(14, 6.5))
    grid = fig.add_gridspec(1, 3, width_ratios=[6, 1, 1], wspace=0.35)
    ax = fig.add_subplot(grid[0])
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # NaN (evicted, unseen): blank
    vmax = max(float(np.nanmax(shown)) if np.isfinite(shown).any() else 0.0, 1e-6)
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=vmax)
    ax.set_xlabel("token position")
    ax.set_ylabel(f"layer x KV head ({kvh} heads per layer)")
    ax.set_yticks(np.arange(0, layers * kvh, kvh * max(1, layers // 10)))
    ax.set_yticklabels([str(i) for i in range(0, layers, max(1, layers // 10))])
    ax.set_title(f"kept: {int(kept.sum())} of {kept.size} (layer, head, position); "
                 f"blank = evicted; colour = relative key error")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    for i, (data, name) in enumerate(((mass, "attention mass\nretained"),
                                      (kerr, "relative key\nerror"))):
        axi = fig.add_subplot(grid[i + 1])
        imi = axi.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap,
                         vmin=0, vmax=1 if i == 0 else max(float(np.nanmax(data)), 1e-6))
        axi.set_title(name)
        axi.set_xlabel("KV head")
        axi.set_ylabel("layer")
        axi.set_xticks(range(kvh))
        fig.colorbar(imi, ax=axi, fraction=0.1, pad=0.04)
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def run(args) -> int:
    from kvjax.tools.monitor import per_head, summary
    from models.loading import load_model
    from models.pipeline import chat_prompt

    try:
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens {args.max_tokens}: must be an integer >= 2")
        if args.out.suffix.lower() != ".png":
            raise ValueError(f"--out {args.out}: must name a .png file")
        import kvjax
        method = kvjax.Method.parse(args.method)  # a bad spec fails before the model loads
        context = read_text(args.context_file) if args.context_file else None
        if not args.prompt.strip():
            raise ValueError("--prompt: must not be empty")
        import jax.numpy as jnp
        model, tok = load_model(args.model, dtype=jnp.bfloat16 if args.dtype == "bfloat16"
                                else jnp.float32)
        head, question = chat_prompt(tok, args.prompt, context, chat=args.chat)
        ids = (head if context is not None else question)[-args.max_tokens:]
        before, after, monitor = inspect(model, ids, method)
        draw(before, after, monitor, f"{args.method} on {len(ids)} tokens "
             f"({Path(args.context_file).name if args.context_file else 'prompt'})", args.out)
        plan = _auto_plan(method, model, after, len(ids), args)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    s = summary(monitor)
    if args.json:
        tables = {f: np.round(per_head(monitor, f)[:, 0], 6).tolist()
                  for f in ("tokens", "evicted", "mass_retained", "k_error", "v_error")}
        print(json.dumps({"method": args.method, "tokens": len(ids), "out": str(args.out),
                          "summary": s, "per_layer_head": tables,
                          **({"plan": plan} if plan else {})}, allow_nan=True))
    else:
        print(f"wrote {args.out}: {s}")
        if plan:
            print(f"auto's plan ({plan['source']}): {plan['picture']}")
    return 0


def _auto_plan(method, model, after, tokens: int, args) -> dict | None:
    """For an `auto` method: its plan (bits per layer, tokens kept per layer and KV head),
    drawn beside `--out` as NAME.plan.png; None for other methods."""
    from experiments.eval.planner_view import draw_plan, kept_per_head, plan_summary
    plan = plan_summary(method, model)
    if plan is not None:
        kept = kept_per_head(after)
        plan["kept"] = kept.tolist()
        plan["picture"] = str(args.out.with_suffix(".plan.png"))
        draw_plan(plan, kept, tokens, f"{args.method} on {tokens} tokens",
                  args.out.with_suffix(".plan.png"))
    return plan
