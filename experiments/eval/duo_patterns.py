"""DuoAttention's trained head patterns beside kvpress's on-the-fly scores, for one model.

    python experiments/eval/duo_patterns.py --out docs/results/duo \
        --trained experiments/data/duo/SmolLM2-135M-Instruct.npz \
        --on-the-fly experiments/data/duo/SmolLM2-135M-Instruct-on-the-fly.npz

Reads the two `.npz` files `kvjax calibrate --duo-train` and `--duo` write and reports: the
gates' spread (how many above 0.5, i.e. retrieval heads by the paper's deploy threshold), the
training's distillation loss and mean gate at its start and end, the Spearman rank
correlation of the two score sets, and at head ratios 0.25, 0.5 and 0.75 how many streaming
heads the two choose alike. Writes `patterns.json` and `patterns.png` (both score maps,
layer x KV head, and the training curve).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from experiments.eval.rank_stats import spearman

RATIOS = (0.25, 0.5, 0.75)


def report(trained_path: str, on_the_fly_path: str) -> dict:
    from kvjax.policies.eviction_duo import streaming_heads

    trained = np.load(trained_path)
    gates, fly = trained["head_scores"], np.load(on_the_fly_path)["head_scores"]
    history = trained["history"]
    overlap = {}
    for r in RATIOS:
        a, b = streaming_heads(gates, r), streaming_heads(fly, r)
        overlap[str(r)] = {"streaming_heads": int(a.sum()), "chosen_by_both": int((a & b).sum())}
    return {"trained": trained_path, "on_the_fly": on_the_fly_path,
            "config": json.loads(str(trained["config"])),
            "shape": list(gates.shape),
            "gates_above_half": int((gates > 0.5).sum()),
            "gates_at_zero": int((gates <= 1e-6).sum()),
            "gates_at_one": int((gates >= 1 - 1e-6).sum()),
            "distill_loss": {"first": float(history[0, 0]), "last": float(history[-1, 0]),
                             "max": float(history[:, 0].max())},
            "mean_gate": {"first": float(history[0, 1]), "last": float(history[-1, 1])},
            "spearman_trained_vs_on_the_fly": round(spearman(gates, fly), 4),
            "streaming_heads_alike": overlap}


def plot(trained_path: str, on_the_fly_path: str, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = np.load(trained_path)
    fly = np.load(on_the_fly_path)["head_scores"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 1, 2]})
    for ax, data, title in ((axes[0], trained["head_scores"], "trained gates"),
                            (axes[1], fly, "on-the-fly scores")):
        image = ax.imshow(data, aspect="auto", cmap="viridis")
        ax.set_title(title)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax)
    history = trained["history"]
    lines = axes[2].plot(history[:, 0], label="distillation loss (log)")
    axes[2].set_xlabel("step")
    axes[2].set_yscale("log")
    twin = axes[2].twinx()
    lines += twin.plot(history[:, 1], color="tab:orange", label="mean gate")
    axes[2].set_title("training")
    axes[2].legend(lines, [line.get_label() for line in lines], loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trained", required=True, help="`kvjax calibrate --duo-train` output")
    ap.add_argument("--on-the-fly", required=True, help="`kvjax calibrate --duo` output")
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    row = report(args.trained, args.on_the_fly)
    (args.out / "patterns.json").write_text(json.dumps(row, indent=1) + "\n")
    plot(args.trained, args.on_the_fly, args.out / "patterns.png")
    print(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
