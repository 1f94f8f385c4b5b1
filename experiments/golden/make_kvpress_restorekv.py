"""Goldens for RestoreKVPress: ``python experiments/golden/make_kvpress_restorekv.py``.

What it makes
-------------
``tests/golden/kvpress_restorekv.npz``, made by running kvpress 0.5.5 (never kvjax) exactly as
``make_kvpress_kvzip.py`` runs KVzipPress (same model, float32, sdpa, the same two passages
behind the chat template's opening, batch 1, the same keys), for
``RestoreKVPress(compression_ratio=r)`` at its defaults (KVzip's: chunk_size=2048, n_sink=4,
layerwise=False), r in 0.5 and 0.75. kvpress downloads RestoreKV's restore embeddings and
LoRA adapter from the hub for two 8B models only; here the press is handed the ones
``kvjax calibrate --restorekv`` trained for SmolLM2 (``ADAPTER``), written in the hub's
format (``experiments.eval.kvpress_engine.kvpress_restorekv``: the embeddings' safetensors
and a PEFT adapter, loaded by transformers). Its restore pass appends 8 tokens after the
context before KVzip masks ``int(N * min(1, r + 8 / T))`` of the N context pairs; ``..._keep``
covers the T context positions (the restore slots are never masked).

How to run (the ``compare`` extra; a few minutes on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_restorekv.py [--gguf PATH] [--out PATH]
"""

from __future__ import annotations

import sys

from experiments.golden.make_kvpress import REPO_ROOT
from experiments.golden.make_kvpress_kvzip import main as kvzip_main

RESTOREKV_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_restorekv.npz"
ADAPTER = REPO_ROOT / "experiments" / "data" / "restorekv" / "SmolLM2-135M-Instruct"
PRESSES = {"restorekv": {"adapter": str(ADAPTER)}}


def main(argv=None) -> int:
    return kvzip_main(argv, PRESSES, RESTOREKV_OUT, "RestoreKVPress", {}, __doc__)


if __name__ == "__main__":
    sys.exit(main())
