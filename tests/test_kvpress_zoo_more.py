"""Parity with kvpress 0.5.5 on SmolLM2: CriticalKV, CriticalAdaKV, SimLayerKV, ThinK, CapPress.

The golden (`experiments/golden/make_kvpress_zoo_more.py`, made by running
kvpress, never kvjax) holds, per press, text (640 and 300 tokens of The
Devil's Dictionary) and ratio, what kvpress kept: positions per layer and KV
head (CriticalKV, CriticalAdaKV, SimLayerKV, CapPress), key channels per layer and KV
head (ThinK). kvjax prefills the same ids once, collecting every statistic
these methods need, and applies each method from its spec string to a copy
of that cache.
"""

import os

import numpy as np
import pytest

import kvjax
from kvjax import EMPTY
from tests.test_kvpress_parity import compress_context, keep_by_position, prefill_contexts
from tests.test_kvpress_zoo_parity import unpack

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_zoo_more.npz")
# every query of both texts (SnapKV's last 64, SimLayerKV's last, ThinK's last 32), W_o and
# the mean query past the 4 sinks (CapPress)
STATS = kvjax.StatsSpec(window=1024, output_projection=True, query_moments=True, moments_skip=4)

# golden press name -> kvjax spec ({r}: kvpress's compression ratio, SimLayerKV's threshold;
# {s}: 1 - r)
SPECS = {
    "critical_snapkv": "critical:inner=snapkv,ratio={r}",
    "critical_ada_snapkv": "critical_ada:inner=snapkv,ratio={r}",
    "simlayerkv": "simlayerkv:lazy_threshold={r},n_recent=128",
    "cap": "cap:ratio={r}",
    # PerLayerCompressionPress(KeyDiffPress(), [r] * 15 + [1 - r] * 15): one part per layer range
    "per_layer_keydiff": "keydiff:ratio={r},layers=0-14+keydiff:ratio={s},layers=15-29",
}

# case -> (rows allowed to differ, why). Inside these rows every swapped position must lie in
# kvpress's boundary band (stage-2 scores within 1e-4 row standard deviations of the boundary).
_STAGE2_TIE = ("a float near-tie at the stage-2 boundary: two positions' weighted scores "
               "(inner + eps) * ||v W_o||_1 differ by ~1e-5 relative (layer 8, KV head 1: "
               "positions 503 and 559, 0.400003 and 0.400007 in kvjax), below the rounding of "
               "SnapKV's window attention between the two implementations")
FLOAT_TIES: dict[str, tuple[int, str]] = {
    "ctx1_critical_ada_snapkv_r0.75": (1, _STAGE2_TIE),
}


def _cases(names) -> list[str]:
    g = np.load(GOLDEN)
    return sorted(k[:-len("_keep")] for k in g.files
                  if k.endswith("_keep") and k.split("_", 1)[1].rsplit("_r", 1)[0] in names)


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.fixture(scope="module")
def prefilled(smollm2, golden):
    """ctx -> (full cache, statistics with W_o, tokens) after prefilling the golden ids once."""
    return prefill_contexts(smollm2[0], golden, STATS)


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(SPECS))
def test_kept_positions_match_kvpress(prefilled, golden, case):
    """Exactly kvpress's kept positions in every layer and KV head, but for the named tie."""
    ctx, rest = case.split("_", 1)
    name, ratio = rest.rsplit("_r", 1)
    spec = SPECS[name].format(r=float(ratio), s=round(1 - float(ratio), 6))
    out, n = compress_context(prefilled, ctx, spec)
    ours, theirs = keep_by_position(out, n), unpack(golden, f"{case}_keep", n)
    np.testing.assert_array_equal(ours.sum(-1), theirs.sum(-1))
    differ = (ours != theirs).any(-1)
    allowed, why = FLOAT_TIES.get(case, (0, ""))
    assert differ.sum() <= allowed, (case, np.argwhere(differ).tolist())
    if differ.any():
        outside = (ours != theirs) & ~unpack(golden, f"{case}_band", n)
        assert not outside.any(), (case, why, np.argwhere(outside).tolist())


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases({"simlayerkv"}))
def test_simlayerkv_lazy_layers_match_kvpress(prefilled, golden, case):
    """The layers kvjax finds lazy are kvpress's, and no lazy score is near the threshold
    (so the decision is not a float rounding)."""
    ctx, rest = case.split("_", 1)
    threshold = float(rest.rsplit("_r", 1)[1])
    score = golden[f"{case}_lazy_score"]
    out, n = compress_context(prefilled, ctx, SPECS["simlayerkv"].format(r=threshold))
    lazy = keep_by_position(out, n).sum(-1)[:, 0] < n
    np.testing.assert_array_equal(lazy, score > threshold)
    assert np.abs(score - threshold).min() > 1e-4
    assert 0 < lazy.sum() < len(lazy), "both kinds of layer are tested"


def _think_cases() -> list[str]:
    g = np.load(GOLDEN)
    return sorted(k[:-len("_channels")] for k in g.files if k.endswith("_channels"))


@pytest.mark.slow
@pytest.mark.parametrize("case", _think_cases())
def test_think_keeps_kvpress_channels_and_stores_fewer(prefilled, golden, case):
    """`think:ratio=r` = ThinKPress(key_channel_compression_ratio=r): the same kept key
    channels in every layer and KV head; `view` of the pruned body gives exactly the keys
    kvpress leaves (the pruned channels zero, the rest unchanged); those keys' bytes shrink to
    the kept fraction (plus one [D, r] 0/1 basis per storage row); the exact part for later
    keys starts empty."""
    ctx, rest = case.split("_", 1)
    ratio = float(rest.rsplit("_r", 1)[1])
    cache, stats, n = prefilled[ctx]
    out, n = compress_context(prefilled, ctx, f"think:ratio={ratio}")
    L, kvh, d = (int(golden[k]) for k in ("num_layers", "kv_heads", "head_dim"))
    theirs = np.unpackbits(golden[f"{case}_channels"], count=L * kvh * d).reshape(L, kvh, d)
    kept = d - int(d * ratio)
    for i, (before, layer) in enumerate(zip(cache, out)):
        assert int(layer.recent.length) == 0 and (np.asarray(layer.recent.pos) == EMPTY).all()
        after = layer.body  # the prompt's keys on the kept channels
        basis = np.asarray(after.k.basis)  # [B*KVH, D, r]: a 0/1 column per kept channel
        ours = basis.sum(-1)[:kvh] > 0
        np.testing.assert_array_equal(ours, theirs[i].astype(bool), err_msg=f"layer {i}")
        full = np.asarray(kvjax.view(before).k)
        np.testing.assert_array_equal(np.asarray(kvjax.view(after).k),
                                      np.where(ours[:, None, :], full, 0.0))
        rows, slots = before.k.shape[:2]
        itemsize = before.k.dtype.itemsize
        assert kvjax.nbytes(after.k) == rows * (slots * kept + d * kept) * itemsize
        np.testing.assert_array_equal(np.asarray(after.v), np.asarray(before.v))
    assert golden[f"{case}_channel_margin"].min() > 1e-7  # no near-tie at the boundary
