"""What `auto` planned, for `kvjax inspect` and the eval rows: per layer the codec bits and
per layer and KV head the tokens kept, and a picture of it.

Example:
    >>> plan_summary("snapkv:ratio=0.5", None) is None     # not an auto method
    True
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _auto_update(method):
    import kvjax
    from kvjax.policies import planner
    update = kvjax.Method.parse(method).transform.update
    return update if isinstance(update, planner.AutoUpdate) else None


def plan_summary(method, model) -> dict | None:
    """The static part of an `auto` method's plan for `model` (bits and token share per
    layer, where its damage table came from), or None for another method."""
    update = _auto_update(method)
    if update is None:
        return None
    c = model.config
    shape = c.num_layers, c.num_kv_heads, c.head_dim
    fraction = update.plan_fraction(*shape)
    plan = update.plan_for(*shape)
    return {"bits": [p.bits for p in plan], "keep": [p.keep for p in plan],
            "keys": [p.keys for p in plan],
            "plan_fraction": fraction, "source": update.source(*shape)}


def monitor_plan(method, model, state) -> dict | None:
    """For `kvjax generate --monitor`: an `auto` method's plan (`plan_summary`) with what its
    last update decided, read off the `AutoState` inside `state` (the transform state a
    generation returns, wrapped or not): the budget in bytes and the tokens each layer and KV
    head kept (batch row 0). None for another method."""
    import jax

    from kvjax.policies import planner
    plan = plan_summary(method, model)
    if plan is None:
        return None
    found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, planner.AutoState))
             if isinstance(x, planner.AutoState)]
    if found:
        plan["budget_bytes"] = float(found[0].budget_bytes)
        plan["kept"] = np.asarray(found[0].head_kept)[:, 0].tolist()  # [L, KVH]
    return plan


def kept_per_head(cache) -> np.ndarray:
    """[L, KVH] tokens each head holds in batch row 0 of a cache."""
    import kvjax
    return np.stack([np.asarray(kvjax.view(layer).pos[0] != kvjax.EMPTY).sum(-1)
                     for layer in cache])


def draw_plan(summary: dict, kept: np.ndarray, tokens: int, title: str, out: Path) -> None:
    """Two panels: tokens kept per (layer, KV head) with the layer's bits written in, and the
    bits per layer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers, kvh = kept.shape
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(7, 0.25 * layers + 2),
                                 gridspec_kw={"width_ratios": [3, 1]})
    im = ax.imshow(kept / tokens, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for layer in range(layers):
        for h in range(kvh):
            ax.text(h, layer, f"{kept[layer, h]}", ha="center", va="center", fontsize=6,
                    color="white" if kept[layer, h] < 0.5 * tokens else "black")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(f"tokens kept of {tokens}")
    fig.colorbar(im, ax=ax, fraction=0.05, label="share kept")
    channel = [k == "channel" for k in summary.get("keys", ["token"] * layers)]
    bx.barh(np.arange(layers), summary["bits"], color=["C2" if c else "C1" for c in channel])
    bx.invert_yaxis()
    bx.set_xlabel("bits")
    bx.set_xticks([2, 4, 8])
    bx.set_title("codec (green: per-channel keys)", fontsize=7)
    fig.suptitle(f"{title}\n{summary['source']}", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
