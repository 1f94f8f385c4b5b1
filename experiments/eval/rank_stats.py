"""Rank statistics the result scripts share."""

from __future__ import annotations

import numpy as np


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two equal-size arrays (flattened; ties share their mean
    rank).

    Example:
        >>> spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 30.0, 20.0]))
        0.5
        >>> spearman(np.array([1.0, 1.0, 2.0]), np.array([5.0, 5.0, 9.0]))
        1.0
    """
    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for value in np.unique(x):  # ties share their mean rank
            r[x == value] = r[x == value].mean()
        return r
    ra, rb = ranks(np.ravel(a)), ranks(np.ravel(b))
    return float(np.corrcoef(ra, rb)[0, 1])
