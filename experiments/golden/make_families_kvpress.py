"""Make kvpress goldens on the tiny Qwen3 and Gemma 3 family checkpoints (kvpress parity).

What it makes
-------------
``tests/golden/families_kvpress.npz``: for the random-weight checkpoints of
``tests/golden/families/{qwen3,gemma3}`` (``experiments/golden/make_families.py``)
and their 272 golden input ids, the positions kvpress keeps per layer and KV
head and its scores, for SnapKV and Knorm at compression ratio 0.5, run exactly
as ``experiments/golden/make_kvpress.py`` runs them (its ``run_press``: one
prefill forward with the press's hooks, eager attention off: ``sdpa``).

Keys ``{model}_{press}_r0.50_keep`` bool [L, KVH, 272], ``..._scores`` float32
[L, KVH, 272], ``..._margin`` float32 [L, KVH], plus ``{model}_ids`` int32 [272]
and the versions. kvpress hooks every layer of a ``Gemma3ForCausalLM`` (it skips
sliding layers only for ``Gemma3ForConditionalGeneration``); compressing a layer
does not change what later layers see in the prefill forward, so the global
layer's row is what kvpress keeps there, and kvjax compresses only that layer
(its sliding layers keep their window caches).

How to run
----------
    pip install -e '.[compare]'
    python experiments/golden/make_families_kvpress.py
"""

from __future__ import annotations

import argparse
from importlib import metadata
from pathlib import Path

import numpy as np

from experiments.golden.make_kvpress import run_press

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ROOT / "tests" / "golden" / "families"
OUT = ROOT / "tests" / "golden" / "families_kvpress.npz"
MODELS = ("qwen3", "gemma3")
PRESSES = (("snapkv", 0.5), ("knorm", 0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import torch
    import transformers

    torch.set_num_threads(1)
    arrays = {}
    for name in MODELS:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            FAMILIES / name, dtype=torch.float32, attn_implementation="sdpa").eval()
        ids = np.load(FAMILIES / name / "golden.npz")["input_ids"][0]
        cfg = model.config
        arrays[f"{name}_ids"] = ids.astype(np.int32)
        for press, ratio in PRESSES:
            keep, scores, budgets, lens, margins = run_press(
                model, torch, ids, press, ratio, cfg.num_hidden_layers, cfg.num_key_value_heads)
            key = f"{name}_{press}_r{ratio:.2f}"
            arrays[f"{key}_keep"], arrays[f"{key}_scores"] = keep, scores
            arrays[f"{key}_margin"] = margins
            print(f"{key}: kept per layer {keep.sum(-1).tolist()}, smallest margin "
                  f"{np.min(margins):.3g}")
    arrays["transformers_version"] = np.array(transformers.__version__)
    arrays["torch_version"] = np.array(torch.__version__)
    arrays["kvpress_version"] = np.array(metadata.version("kvpress"))
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1000:.0f} KB)")


if __name__ == "__main__":
    main()
