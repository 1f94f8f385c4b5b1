"""Parity with kvpress 0.5.5 on the real SmolLM2: same weights, same context, same ratio.

The golden file (`experiments/golden/make_kvpress.py`, the `compare` extra)
holds, for every press, the slots kvpress keeps per layer and KV head and the
scores it computed. kvjax prefills the same token ids once, collecting the
statistics every policy needs, then applies each policy to a copy of that
cache.

What is checked, for all 14 golden cases (SnapKV r=0.25/0.5/0.75, PyramidKV,
StreamingLLM, Knorm, TOVA, ExpectedAttention r=0.25/0.5/0.75 and Ada-KV over
SnapKV on the 640-token passage; SnapKV, Knorm, ExpectedAttention on the
300-token one):

* the kept positions are *identical* to kvpress's in every layer and KV head
  (Ada-KV included: its per-head counts differ from head to head, and each
  head keeps exactly kvpress's positions), with one listed exception;
* the exception (`FLOAT_TIES`) is ctx2 Knorm, layer 0, KV head 1: positions
  30, 48 and 78 hold the same token (id 655), and in layer 0 a key before
  RoPE depends on the token only, and RoPE is a rotation, so the three keys
  have equal norms in exact arithmetic. Float32 rounding of the rotation
  leaves them one ulp apart, differently in torch and kvjax: kvpress scores
  30 and 78 at -13.417133 and 48 at -13.417134 and keeps 78 (the budget
  leaves one slot for the three); kvjax keeps another of the three, which
  one depends on its float32 sines and cosines (48 with XLA's, 30 with the
  CPU kernel's libm `cosf`/`sinf`). The test asserts that the swap stays
  inside that tie and that the swapped positions' kvpress scores lie within
  1e-6 relative of the boundary score;
* the scores of unprotected tokens agree to 2e-4 relative (Knorm, TOVA,
  SnapKV, ExpectedAttention; PyramidKV and Ada-KV use SnapKV's scores).

Budgets are equal by construction at these settings; the float64 `int()`
boundary of kvpress's budget (`docs/DECISIONS.md`) is not hit by any golden
ratio (640 and 300 times 0.25, 0.5, 0.75 are exact in float64).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import EMPTY
from kvjax.policies import eviction as ev
from models.sampler import _compress, prefill_and_compress

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_golden.npz")
STATS = kvjax.StatsSpec(window=64, query_moments=True, moments_skip=4)

POLICIES = {
    "snapkv": (lambda r: kvjax.snapkv(ratio=r), ev.SnapKVScorer(64, 5)),
    "streaming_llm": (lambda r: kvjax.streaming_llm(ratio=r), None),
    "knorm": (lambda r: kvjax.knorm(ratio=r), ev.knorm_scores),
    "tova": (lambda r: kvjax.tova(ratio=r), ev.tova_scores),
    "expected_attention": (lambda r: kvjax.expected_attention(ratio=r),
                           ev.ExpectedAttentionScorer(512, 4, True, True, 0.0)),
    "pyramidkv": (lambda r: kvjax.pyramidkv(ratio=r), None),
    "adakv_snapkv": (lambda r: kvjax.snapkv(ratio=r, headwise=True), None),
}


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


def prefill_contexts(model, golden, stats: kvjax.StatsSpec) -> dict:
    """ctx -> (full cache, statistics, tokens) after prefilling each golden context's ids once,
    collecting `stats`."""
    probe = kvjax.CacheTransform(lambda cache: (), lambda c, s, st=None: (c, s), stats)
    out = {}
    for ctx in ("ctx1", "ctx2"):
        ids = golden[f"{ctx}_ids"].tolist()
        pre = prefill_and_compress(model, [ids], transform=probe, shrink=False)
        out[ctx] = (pre.cache, pre.stats, len(ids))
    return out


def reconstructed_contexts(smollm2, golden, spec: str) -> dict:
    """ctx -> (full cache, statistics with the reconstruction pass's scores of the method
    `spec` (its prompt bound to SmolLM2's tokenizer), tokens) for each golden context."""
    from models.reconstruction import reconstruct, with_tokenizer
    from models.sampler import prefill_batch
    model, tok = smollm2
    rec = with_tokenizer(kvjax.parse_method(spec), tok).stats.reconstruction
    out = {}
    for ctx in ("ctx1", "ctx2"):
        ids = golden[f"{ctx}_ids"].tolist()
        pre = prefill_batch(model, [ids])
        out[ctx] = (pre.cache, reconstruct(model, pre.cache, pre.stats, pre.next_pos, [ids],
                                           rec), len(ids))
    return out


def compress_context(prefilled: dict, ctx: str, spec: str):
    """(the cache of `prefill_contexts` for `ctx` compressed by the method `spec`, tokens)."""
    cache, stats, n = prefilled[ctx]
    transform = kvjax.parse_method(spec)
    out, _ = _compress(transform.update, cache, transform.init(cache), stats)
    return out, n


@pytest.fixture(scope="module")
def prefilled(smollm2, golden):
    """ctx -> the full cache and statistics after prefilling the golden ids."""
    return prefill_contexts(smollm2[0], golden, STATS)


def keep_by_position(cache, n):
    """[L, KVH, n] bool: which token positions each layer and KV head kept (batch row 0)."""
    keep = np.zeros((len(cache), cache[0].kv_heads, n), bool)
    for i, layer in enumerate(cache):
        pos = np.asarray(layer.pos)[0]  # [KVH, C]
        for h in range(pos.shape[0]):
            keep[i, h, pos[h][pos[h] != EMPTY]] = True
    return keep


def cases(golden_file=GOLDEN):
    names = np.load(golden_file).files
    return sorted(k[:-len("_keep")] for k in names if k.endswith("_keep"))


# case -> {(layer, KV head): positions whose scores tie in exact arithmetic}: the float ties
# the module docstring explains; kvjax and kvpress may keep different ones of a tie (as many
# each), every other row must be identical.
FLOAT_TIES = {"ctx2_knorm_r0.50": {(0, 1): {30, 48, 78}}}
TIE_RTOL = 1e-6  # one float32 ulp of the scores, relative


def differences(ours, theirs):
    """{(layer, head): (only ours, only theirs)} of two [L, KVH, T] keep masks."""
    out = {}
    for layer, head in zip(*np.nonzero((ours != theirs).any(-1))):
        only = lambda a, b: set(np.flatnonzero(a[layer, head] & ~b[layer, head]).tolist())
        out[(int(layer), int(head))] = (only(ours, theirs), only(theirs, ours))
    return out


@pytest.mark.parametrize("case", cases())
def test_kept_positions_match_kvpress(prefilled, golden, case):
    """Exactly kvpress's positions per layer and KV head, except the listed float ties."""
    ctx, rest = case.split("_", 1)
    name, ratio = rest.rsplit("_r", 1)
    cache, stats, n = prefilled[ctx]
    transform = POLICIES[name][0](float(ratio))
    out, _ = _compress(transform.update, cache, transform.init(cache), stats)
    ours, theirs = keep_by_position(out, n), golden[f"{case}_keep"]
    np.testing.assert_array_equal(ours.sum(-1), theirs.sum(-1))  # budgets per layer and head
    diff = differences(ours, theirs)
    ties = FLOAT_TIES.get(case, {})
    assert diff.keys() <= ties.keys(), (case, diff)
    for row, (mine, kvpress) in diff.items():
        assert len(mine) == len(kvpress) and mine | kvpress <= ties[row], (case, row, diff)
    scores = golden[f"{case}_scores"]
    for (layer, head), (mine, kvpress) in diff.items():
        s = scores[layer, head]
        boundary = s[theirs[layer, head]].min()  # kvpress's smallest kept score
        swapped = sorted(mine | kvpress)
        assert np.all(np.abs(s[swapped] - boundary) <= TIE_RTOL * abs(boundary)), (
            case, layer, head, swapped, s[swapped], boundary)


@pytest.mark.parametrize("case", [c for c in cases() if c.split("_", 1)[1].rsplit("_r", 1)[0]
                                  in ("snapkv", "knorm", "tova", "expected_attention")])
def test_scores_match_kvpress(prefilled, golden, case):
    ctx, rest = case.split("_", 1)
    name = rest.rsplit("_r", 1)[0]
    cache, stats, n = prefilled[ctx]
    scorer = POLICIES[name][1]
    budget = jnp.zeros((1,), jnp.int32)
    worst = 0.0
    for i, layer in enumerate(cache):
        scores, protect = scorer(layer, stats[i], budget, jax.random.key(0))
        pos = np.asarray(layer.pos)[0]
        want = golden[f"{case}_scores"][i]  # [KVH, n]
        for h in range(pos.shape[0]):
            slots = np.flatnonzero((pos[h] != EMPTY) & ~np.asarray(protect)[0, h])
            got = np.asarray(scores)[0, h, slots]
            ref = want[h, pos[h, slots]]
            scale = np.abs(ref).max()
            err = np.abs(got - ref).max() / scale
            worst = max(worst, err)
    assert worst < 2e-4, (case, worst)
