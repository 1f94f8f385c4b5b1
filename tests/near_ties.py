"""Kept positions compared up to float32 near-ties at the cut.

Two engines (kvjax and kvpress, or one batched run and one run alone) score the same tokens
to float32 rounding, not bit for bit: where two positions straddle a head's cut with scores
equal to rounding (a repeated token's key, two keys of equal norm), each engine may keep a
different one. Which one it keeps then depends on the CPU's instruction set (XLA:CPU's
AVX2 and AVX-512 kernels sum in different orders), so a list of named ties holds on one
machine only. This states the rule instead: the same count kept, and every position one keeps
and the other does not scores within `SCORE_RTOL` of every other such position of its row.
"""

import numpy as np

import kvjax

# Relative spread allowed among a row's swapped positions. The scores of the deepest layer
# differ between kvjax and kvpress by up to 2e-4 relative (tests/test_kvpress_kvzip.py::
# test_scores_match_kvpress); the swaps measured (2026-12-07) spread 0 to 7e-7.
SCORE_RTOL = 1e-4


def scores_by_position(layer, slot_scores, n: int, row: int = 0) -> np.ndarray:
    """[KVH, n] float32 `slot_scores` [B, KVH, C] of batch row `row` by token position
    (`layer.pos` [B, KVH, C]); NaN where no slot holds the position."""
    pos = np.asarray(layer.pos)[row]
    scores = np.broadcast_to(np.asarray(slot_scores, np.float32)[row], pos.shape)
    out = np.full((pos.shape[0], n), np.nan, np.float32)
    for h in range(pos.shape[0]):
        held = (pos[h] != kvjax.EMPTY) & (pos[h] < n)
        out[h, pos[h][held]] = scores[h][held]
    return out


def knorm_scores_by_position(layer, n: int, row: int = 0) -> np.ndarray:
    """[KVH, n] Knorm's scores (minus the key's norm) of `layer`'s row `row` by position."""
    from kvjax.policies.eviction import knorm_scores
    return scores_by_position(layer, knorm_scores(kvjax.view(layer), None, None, None)[0], n, row)


def near_tie_swaps(ours: np.ndarray, theirs: np.ndarray, scores: np.ndarray,
                   chunk: int | None = None, rtol: float = SCORE_RTOL) -> int:
    """Asserts two keep masks agree but for swaps at near-ties; returns the rows that swap.

    Args:
      ours, theirs: [..., n] bool, the positions each keeps per row.
      scores: [..., n] float, one engine's scores of the same positions (higher kept).
      chunk: the rows are the `chunk`-long pieces of the last axis (per-chunk budgets).
      rtol: allowed spread of a row's swapped scores, relative to their largest magnitude.
    """
    ours, theirs, scores = (np.asarray(x) for x in (ours, theirs, scores))
    if chunk is not None:  # [..., n] -> [..., chunks, chunk], padding kept by neither
        pad = [(0, 0)] * (ours.ndim - 1) + [(0, -ours.shape[-1] % chunk)]
        ours, theirs = (np.pad(x, pad).reshape(x.shape[:-1] + (-1, chunk)) for x in (ours, theirs))
        scores = np.pad(scores, pad).reshape(ours.shape)
    np.testing.assert_array_equal(ours.sum(-1), theirs.sum(-1), err_msg="kept counts")
    differ = ours != theirs
    rows = np.argwhere(differ.any(-1))
    for row in map(tuple, rows):
        swapped = scores[row][differ[row]]
        spread, scale = np.ptp(swapped), np.abs(swapped).max()
        assert np.isfinite(swapped).all() and spread <= rtol * scale, (
            f"row {row} swaps positions {np.flatnonzero(differ[row]).tolist()} whose scores "
            f"{swapped.tolist()} spread {spread:.3g} > {rtol} x {scale:.3g}: not a near-tie")
    return len(rows)
