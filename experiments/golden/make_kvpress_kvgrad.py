"""Goldens for KVgradPress: ``python experiments/golden/make_kvpress_kvgrad.py``.

What it makes
-------------
``tests/golden/kvpress_kvgrad.npz``, made by running kvpress 0.5.5 (never kvjax)
exactly as ``make_kvpress_kvzip.py`` runs KVzipPress (same model, float32,
sdpa, the same two passages behind the chat template's opening, batch 1, the
same keys), for ``KVgradPress(compression_ratio=r)`` at its defaults
(chunk_size=512: 2 chunks for the 640-token passage, 1 for the 300-token one;
n_sink=4, layerwise=False), r in 0.5 and 0.75. KVgradPress is KVzip's
reconstruction with each attention weight times ``||v W_O||_2`` (per query
head) and ``||d Phi / d a_p||_2`` (the gradient, over the pass, of
``Phi = sum_p ||h_p^L||^2`` with respect to the attention output of probe
token p), so the file also holds ``ctx2_kvgrad_r0.50_scores_l{0,29}``.

How to run (the ``compare`` extra; a few minutes on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_kvgrad.py [--gguf PATH] [--out PATH]
"""

from __future__ import annotations

import sys

from experiments.golden.make_kvpress import REPO_ROOT
from experiments.golden.make_kvpress_kvzip import main as kvzip_main

KVGRAD_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_kvgrad.npz"
PRESSES = {"kvgrad": {}}
SCORES_STORED = {("kvgrad", 2, 0.5): (0, 29)}


def main(argv=None) -> int:
    return kvzip_main(argv, PRESSES, KVGRAD_OUT, "KVgradPress", SCORES_STORED, __doc__)


if __name__ == "__main__":
    sys.exit(main())
