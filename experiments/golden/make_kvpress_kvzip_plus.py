"""Goldens for KVzipPress with KVzip+ normalization: ``python experiments/golden/make_kvpress_kvzip_plus.py``.

What it makes
-------------
``tests/golden/kvpress_kvzip_plus.npz``, made by running kvpress 0.5.5 (never
kvjax) exactly as ``make_kvpress_kvzip.py`` runs KVzipPress (same model,
float32, sdpa, the same two passages behind the chat template's opening,
batch 1, the same keys), for ``KVzipPress(compression_ratio=r,
kvzip_plus_normalization=True)``, r in 0.5 and 0.75, at chunk_size 2048 (one
chunk) and 256 (3 and 2 chunks). KVzip+ divides each reconstruction query's
attention weights by the norm of that query's attention input ``||h||`` and
multiplies each key's by ``||v W_O||_2`` (per query head), so the file also
holds ``ctx2_kvzip_plus_r0.50_scores_l{0,29}``.

How to run (the ``compare`` extra; a few minutes on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_kvzip_plus.py [--gguf PATH] [--out PATH]
"""

from __future__ import annotations

import sys

from experiments.golden.make_kvpress import REPO_ROOT
from experiments.golden.make_kvpress_kvzip import main as kvzip_main

KVZIP_PLUS_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_kvzip_plus.npz"
PRESSES = {"kvzip_plus": {"kvzip_plus_normalization": True},
           "kvzip_plus_chunk256": {"kvzip_plus_normalization": True, "chunk_size": 256}}
SCORES_STORED = {("kvzip_plus", 2, 0.5): (0, 29)}


def main(argv=None) -> int:
    return kvzip_main(argv, PRESSES, KVZIP_PLUS_OUT, "KVzipPress", SCORES_STORED, __doc__)


if __name__ == "__main__":
    sys.exit(main())
