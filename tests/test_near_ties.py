"""`tests/near_ties.py`: the rule golden-position tests use for float32 near-ties."""

import numpy as np
import pytest

from tests.near_ties import near_tie_swaps

OURS = np.array([[[1, 1, 0, 0], [1, 0, 1, 0]]], bool)  # [1, 2 heads, 4 positions]


def test_swaps_only_at_near_ties():
    """A swap of two positions scoring within 1e-4 passes and is counted; one of scores 5%
    apart, a swap in another chunk, or a different count fails."""
    theirs = np.array([[[1, 0, 1, 0], [1, 0, 1, 0]]], bool)
    tied = np.array([[[5, 2, 2 * (1 - 1e-6), 1], [5, 2, 2, 1]]], np.float32)
    assert near_tie_swaps(OURS, theirs, tied) == 1
    assert near_tie_swaps(OURS, OURS, tied * np.nan) == 0  # equal keeps need no scores
    with pytest.raises(AssertionError, match="not a near-tie"):
        near_tie_swaps(OURS, theirs, tied * np.array([1, 1, 0.95, 1], np.float32))
    with pytest.raises(AssertionError, match="kept counts"):  # chunks of 2: 2|0 against 1|1
        near_tie_swaps(OURS, theirs, tied, chunk=2)
    with pytest.raises(AssertionError, match="kept counts"):
        near_tie_swaps(OURS, ~OURS & (np.arange(4) < 3), tied)
