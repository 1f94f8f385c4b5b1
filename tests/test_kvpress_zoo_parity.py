"""Parity with kvpress 0.5.5 for the rest of the press zoo, on the real SmolLM2.

The golden file (`experiments/golden/make_kvpress_zoo.py`, made by running
kvpress; see `experiments/golden/make_kvpress_zoo.py`) holds, per press, text
(640 and 300 tokens) and ratio (0.5, 0.75), the positions kvpress kept in
every layer and KV head, read off the cache it returned, and for scorer
presses the band of positions whose kvpress score is within 1e-4 row
standard deviations of the row's boundary score. kvjax prefills the same ids
once and applies each method (from its spec string, as a user would) to a
copy of that cache.

Checked per case: the same number kept in every (layer, KV head); the same
positions, except in the rows `FLOAT_TIES` names, where every swapped
position lies inside kvpress's boundary band (the swap is a tie or a float
rounding of a near-tie; docs/DECISIONS.md explains each).
"""

import os

import numpy as np
import pytest

import kvjax
from kvjax import EMPTY
from kvjax.policies.methods import parse_method
from models.sampler import _compress
from tests.test_kvpress_parity import keep_by_position, prefill_contexts

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_zoo.npz")
STATS = kvjax.StatsSpec(window=1024)  # every query of both texts (SnapKV's last 64 too)

# golden press name -> kvjax spec at kvpress's defaults ({r} = the ratio)
SPECS = {
    "keydiff": "keydiff:ratio={r}",
    "lagkv": "lagkv:ratio={r}",
    "non_causal_attn": "non_causal_attn:ratio={r}",
    "leverage": "leverage:ratio={r}",
    "cur": "cur:ratio={r}",
    "compactor": "compactor:ratio={r}",
    "block_keydiff": "block:inner=keydiff,ratio={r}",
    "chunkkv_snapkv": "chunkkv:inner=snapkv,ratio={r}",
    "chunkkv_knorm": "chunkkv:inner=knorm,ratio={r}",
}

# case -> (rows allowed to differ, why). A row is (layer, KV head). Every other row must be
# identical; inside these rows each swapped position must lie in kvpress's boundary band.
_LAG = ("LagKV scores are ranks: a token's rank in its partition over lag_size, 1 for sinks and "
        "the tail. Every partition holds the same values 0, 1/128, ..., 127/128, so the boundary "
        "is an exact tie across partitions (and at r=0.75, or on the 300-token text, inside the "
        "score-1 tail): kvpress keeps the tied tokens torch's CPU topk returns, kvjax the "
        "earliest slots. Same count, every swap inside the tie.")
_SAME_TOKEN = ("layer 0: two positions hold the same token, so their pre-RoPE keys (and values) "
               "are equal and kvpress's scores tie exactly (margin 0); kvjax rotates the cached "
               "keys back by their positions, which leaves them an ulp apart, and keeps the other")
FLOAT_TIES: dict[str, tuple[int, str]] = {
    "ctx1_lagkv_r0.50": (90, _LAG), "ctx1_lagkv_r0.75": (90, _LAG),
    "ctx2_lagkv_r0.50": (90, _LAG), "ctx2_lagkv_r0.75": (90, _LAG),
    # ctx1: positions 274 and 298 (token 527), heads 1 and 2; ctx2: 182 and 219 (token 1270), head 1
    "ctx1_leverage_r0.75": (2, _SAME_TOKEN), "ctx2_leverage_r0.75": (1, _SAME_TOKEN),
    # layer 0 head 0: positions 84 and 91 hold token 469, in the same 16-token CUR window
    "ctx1_cur_r0.50": (1, _SAME_TOKEN.replace("pre-RoPE keys", "key norms")),
}


def _golden():
    return np.load(GOLDEN)


def cases() -> list[str]:
    g = _golden()
    names = [str(p) for p in g["presses"]]
    return sorted(k[:-len("_keep")] for k in g.files
                  if k.endswith("_keep") and k.split("_", 1)[1].rsplit("_r", 1)[0] in SPECS
                  and k.split("_", 1)[1].rsplit("_r", 1)[0] in names)


def unpack(golden, key: str, n: int) -> np.ndarray:
    """[L, KVH, n] bool from a packbits array of the golden."""
    L, kvh = int(golden["num_layers"]), int(golden["kv_heads"])
    return np.unpackbits(golden[key], count=L * kvh * n).reshape(L, kvh, n).astype(bool)


@pytest.fixture(scope="module")
def golden():
    return _golden()


@pytest.fixture(scope="module")
def prefilled(smollm2, golden):
    """ctx -> (full cache, statistics, tokens) after prefilling the golden ids once."""
    return prefill_contexts(smollm2[0], golden, STATS)


@pytest.mark.slow
@pytest.mark.parametrize("case", cases())
def test_kept_positions_match_kvpress(prefilled, golden, case):
    """Exactly kvpress's kept positions per layer and KV head, but for the named ties."""
    ctx, rest = case.split("_", 1)
    name, ratio = rest.rsplit("_r", 1)
    cache, stats, n = prefilled[ctx]
    transform = parse_method(SPECS[name].format(r=float(ratio)))
    out, _ = _compress(transform.update, cache, transform.init(cache), stats)
    ours, theirs = keep_by_position(out, n), unpack(golden, f"{case}_keep", n)
    np.testing.assert_array_equal(ours.sum(-1), theirs.sum(-1))
    differ = (ours != theirs).any(-1)
    allowed, why = FLOAT_TIES.get(case, (0, ""))
    assert differ.sum() <= allowed, (case, np.argwhere(differ).tolist())
    if differ.any():
        band = unpack(golden, f"{case}_band", n)
        outside = (ours != theirs) & ~band
        assert not outside.any(), (case, why, np.argwhere(outside).tolist())


def rerotate_cases() -> list[str]:
    g = _golden()
    return sorted(k[:-len("_keep")] for k in g.files
                  if k.endswith("_keep") and "_rerotate_knorm_" in k)


@pytest.mark.slow
@pytest.mark.parametrize("case", rerotate_cases())
def test_rerotation_matches_kvpress(prefilled, golden, case):
    """`knorm:ratio=r+rerotate` = KeyRerotationPress(KnormPress(r)): Knorm's kept tokens
    (kvpress's, but for the Knorm tie of tests/test_kvpress_parity.py), moved to positions
    0..n_kept-1 in order, values untouched, keys re-rotated as kvpress re-rotates them."""
    ctx, rest = case.split("_", 1)
    ratio = float(rest.rsplit("_r", 1)[1])
    cache, stats, n = prefilled[ctx]
    inner = parse_method(f"knorm:ratio={ratio}")
    both = parse_method(f"knorm:ratio={ratio}+rerotate")
    kept, _ = _compress(inner.update, cache, inner.init(cache), stats)
    moved, _ = _compress(both.update, cache, both.init(cache), stats)
    ours, theirs = keep_by_position(kept, n), unpack(golden, f"{case}_keep", n)
    differ = (ours != theirs).any(-1)
    # the Knorm tie named in test_kvpress_parity.py (ctx2, layer 0, KV head 1: positions 30,
    # 48 and 78 hold one token)
    assert set(map(tuple, np.argwhere(differ).tolist())) <= ({(0, 1)} if ctx == "ctx2" else set())
    for layer_kept, layer_moved in zip(kept, moved):
        count = (np.asarray(layer_kept.pos) != EMPTY).sum(-1)  # [B, KVH]
        pos = np.asarray(layer_moved.pos)[0]
        for h in range(pos.shape[0]):
            np.testing.assert_array_equal(pos[h][:count[0, h]], np.arange(count[0, h]))
        np.testing.assert_array_equal(np.asarray(layer_moved.v), np.asarray(layer_kept.v))
    for key in (k for k in golden.files if k.startswith(case + "_keys_l")):
        layer = int(key.rsplit("_l", 1)[1])
        want = golden[key]  # [KVH, n_kept, D]
        got = np.asarray(moved[layer].logical_k)[0, :, :want.shape[1]]
        scale = np.linalg.norm(want, axis=-1, keepdims=True)
        assert np.max(np.abs(got - want) / scale) < 1e-4, (case, layer)
