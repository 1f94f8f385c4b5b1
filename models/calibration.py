"""Calibration runs on real text: per-head low-rank bases for `kvjax.policies.low_rank`.

Example:
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))   # random weights, vocab 256
    >>> ids = list(range(3, 67))       # real use: tokenizer.encode(text)[-16384:]
    >>> basis = calibrate_low_rank(model, ids, window=32, batch=2, progress=False)
    >>> basis.keys.shape, basis.tokens   # [L, KVH, D, D], tokens per sequence and head
    ((2, 2, 16, 16), 64)
    >>> import os, tempfile
    >>> basis.save(os.path.join(tempfile.mkdtemp(), "basis.npz"))
"""

from __future__ import annotations

from typing import Sequence

from tqdm import tqdm

from kvjax.policies.low_rank import LowRankBasis, accumulate_moments, basis_from_moments
from models.llama import Llama


def calibrate_low_rank(model: Llama, ids: Sequence[int], window: int = 1024, batch: int = 4,
                       progress: bool = True) -> LowRankBasis:
    """Bases from the cached keys and values of `ids`, prefilled in windows of `window` tokens.

    The text is cut into consecutive windows (a shorter tail is dropped),
    prefilled `batch` windows at a time, and each cache's second moments
    are summed; the bases are their eigenvectors.
    """
    from models.sampler import prefill_batch

    windows = [list(ids[i:i + window]) for i in range(0, len(ids) - window + 1, window)]
    if not windows:
        raise ValueError(f"calibration needs at least one window of {window} tokens, "
                         f"got {len(ids)} tokens")
    moments = None
    for start in tqdm(range(0, len(windows), batch), desc="calibrating low-rank bases",
                      unit="batch", disable=not progress):
        pre = prefill_batch(model, windows[start:start + batch])
        moments = accumulate_moments(moments, pre.cache)
    return basis_from_moments(moments)
