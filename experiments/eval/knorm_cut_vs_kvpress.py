"""Where kvjax's and kvpress's Knorm cuts part on one RULER prompt: for every layer and KV
head, the context positions kvjax keeps (`compress` with `knorm:ratio=R`) against those
kvpress's KnormPress keeps (`topk` of minus the key norm, `int(n * (1 - R))` of them, on
transformers' keys of the same token ids), and the same `topk` rule on kvjax's own keys, which
separates tie-breaking from rounding. Needs the `kvpress` extra (torch, transformers).

    PYTHONPATH=. python -m experiments.eval.knorm_cut_vs_kvpress --task vt --trial 3

Prints one line per head whose kept sets differ: the swapped token count both ways, the
largest difference of the two engines' key norms, and the gap between the norms on either
side of the cut (0.0: tied there). docs/RESULTS.md cites its output for `vt`'s fourth trial.
"""

from __future__ import annotations

import argparse

import numpy as np


def cut_differences(task: str, trial: int, ratio: float, length: int = 3840) -> list[tuple]:
    """(layer, head, swapped kvjax/kvpress, swapped topk-on-each-engine's-keys, max |norm
    difference|, gap at the cut) for every head whose kept sets differ."""
    import torch

    import kvjax
    from experiments.eval.cells import make_prompts
    from experiments.eval.grid import Cell
    from experiments.eval.hf_reference import load_hf_reference
    from models.loading import load_model, resolve_model_path
    from models.sampler import compress, for_full_layers, prefill_batch

    cell = Cell(task, length, f"knorm:ratio={ratio}", trials=trial + 1, batch=1)
    model, tokenizer = load_model("smollm2")
    context = make_prompts(cell, tokenizer).contexts[trial]
    n, kept = len(context), int(len(context) * (1 - ratio))
    pre = prefill_batch(model, [context])
    ours = compress(pre, for_full_layers(model, kvjax.parse_method(cell.method)), shrink=False)
    hf, _, _ = load_hf_reference(resolve_model_path("smollm2"), dtype=torch.float32,
                                 attn_implementation="sdpa")
    with torch.inference_mode():
        theirs = hf(torch.tensor([context]), use_cache=True).past_key_values
    top = lambda norms: set(torch.topk(torch.from_numpy(-norms), kept).indices.tolist())
    out = []
    for i, layer in enumerate(pre.cache):
        k_ours = np.asarray(layer.k, np.float32)[:, :n]  # [KVH, n, D], batch 1
        norm_ours = np.linalg.norm(k_ours, axis=-1)
        norm_theirs = np.linalg.norm(theirs.layers[i].keys[0].numpy(), axis=-1)
        kept_pos = np.asarray(ours.cache[i].pos)[0]  # [KVH, C]
        for h in range(k_ours.shape[0]):
            pos = kept_pos[h]
            swapped = len(set(pos[pos >= 0].tolist()) ^ top(norm_theirs[h])) // 2
            rule = len(top(norm_ours[h]) ^ top(norm_theirs[h])) // 2
            if swapped or rule:
                edge = np.sort(norm_theirs[h])[kept - 1:kept + 1]
                out.append((i, h, swapped, rule, float(np.abs(norm_ours[h] - norm_theirs[h]).max()),
                            float(edge[1] - edge[0])))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="vt")
    parser.add_argument("--trial", type=int, default=3, help="0-based trial index")
    parser.add_argument("--ratio", type=float, default=0.5)
    args = parser.parse_args(argv)
    if not 0 < args.ratio < 1:
        raise SystemExit(f"--ratio must be in (0, 1), got {args.ratio}")
    rows = cut_differences(args.task, args.trial, args.ratio)
    print("layer head swapped(kvjax,kvpress) swapped(topk on each engine's keys) "
          "max|norm diff| gap-at-cut")
    for row in rows:
        print(*row)


if __name__ == "__main__":
    main()
