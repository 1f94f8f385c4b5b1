"""Parity with kvpress 0.5.5's MergingPress on SmolLM2: `merging:inner=snapkv,ratio=r`.

The golden (`experiments/golden/make_kvpress_merging.py`, made by running
kvpress in float32, never kvjax) holds, per text (640 and 300 tokens of The
Devil's Dictionary) and ratio (0.5, 0.75), the positions MergingPress(SnapKVPress(r))
kept in every layer and KV head (its keys are the input keys bit for bit: the
generator checks that), how many kept values received a merge, and the merged
values of layers 0 and 29; and, for layer 14 of the 300-token text, the keys and
values kvpress's press received with the merge of exactly those inputs at four
(similarity_threshold, merge_fraction) settings.

Two comparisons, two tolerances:

* the merge alone, on kvpress's own inputs and kept positions: float32
  rounding only (`MERGE_RTOL` of each row's norm; the sums run in another
  order);
* end to end, kvjax's prefill then `merging`: also the two prefills' own
  rounding (`PREFILL_RTOL` of each row's norm, 9x the largest error measured;
  tests/test_kvpress_zoo_parity.py bounds its re-rotated keys at 1e-4), far
  below what the merge changes (checked, so the comparison cannot pass with the
  merge left out).
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.policies.eviction_merging import merge_values
from kvjax.policies.methods import parse_method
from models.sampler import _compress
from tests.near_ties import knorm_scores_by_position, near_tie_swaps
from tests.test_kvpress_parity import compress_context, keep_by_position, prefill_contexts
from tests.test_kvpress_zoo_parity import unpack

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_merging.npz")
STATS = kvjax.StatsSpec(window=1024)  # every query of both texts (SnapKV's last 64)
SPEC = "merging:inner=snapkv,ratio={r}"
MERGE_RTOL = 1e-6  # float32 sums in another order (measured: 1.2e-7 at most)
PREFILL_RTOL = 3e-5  # + the two prefills (measured: 3.4e-6 at most, layer 29)


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


def _cases() -> list[str]:
    g = np.load(GOLDEN)
    return sorted(k[:-len("_keep")] for k in g.files if k.endswith("_keep"))


def _merge_cases() -> list[str]:
    g = np.load(GOLDEN)
    return sorted(k[:-len("_merge")] for k in g.files if k.endswith("_merge"))


def _row_error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want| relative to the row's norm (rows: the last axis)."""
    scale = np.maximum(np.linalg.norm(want, axis=-1, keepdims=True), 1e-30)
    return float(np.max(np.abs(got - want) / scale))


@pytest.mark.parametrize("case", _merge_cases())
def test_merge_matches_kvpress_on_its_inputs(golden, case):
    """`merge_values` on the keys and values kvpress's press received (layer 14) at the
    positions it kept gives kvpress's merged values to float32 rounding, at the defaults and
    with the similarity threshold and merge fraction gates on."""
    prefix, thr, frac = case.rsplit("_", 2)  # ctx2_merging_snapkv_r0.50, t0.80, f1.00
    thr, frac = float(thr[1:]), float(frac[1:])
    layer = int(golden["merge_layer"])
    k, v = golden[f"ctx2_l{layer}_keys"], golden[f"ctx2_l{layer}_values"]  # [KVH, T, D]
    kvh, t, d = k.shape
    keep = unpack(golden, f"{prefix}_keep", t)[layer]  # [KVH, T]
    merged = merge_values(jnp.asarray(k)[None], jnp.asarray(v)[None], jnp.asarray(keep)[None],
                          jnp.ones((1, kvh, t), bool), thr, frac)
    got = np.asarray(merged)[0][keep].reshape(kvh, -1, d)  # kept rows, position order
    want = golden[f"{case}_merge"]
    assert _row_error(got, want) < MERGE_RTOL, (case, _row_error(got, want))
    unmerged = v[keep].reshape(kvh, -1, d)
    changed = (np.abs(want - unmerged) > 0).any(-1)
    np.testing.assert_array_equal((np.abs(got - unmerged) > 0).any(-1), changed)
    assert changed.any(), "the case merges something"
    np.testing.assert_array_equal(np.asarray(merged)[0][~keep], v[~keep])  # evicted: untouched


def test_merge_gates_differ(golden):
    """The gates are exercised, not vacuous: fewer kept values change under the similarity
    threshold (0.8) and under the merge fraction (0.75) than at the defaults."""
    cases = _merge_cases()
    counts = {}
    layer = int(golden["merge_layer"])
    for case in cases:
        prefix = case.rsplit("_", 2)[0]
        v = golden[f"ctx2_l{layer}_values"]
        keep = unpack(golden, f"{prefix}_keep", v.shape[1])[layer]
        counts[case] = int((golden[f"{case}_merge"] != v[keep].reshape(*v.shape[:1], -1,
                                                                        v.shape[2])).any(-1).sum())
    for prefix in {c.rsplit("_", 2)[0] for c in cases}:
        default = counts[f"{prefix}_t0.00_f1.00"]
        assert counts[f"{prefix}_t0.80_f1.00"] < default, counts
        assert counts[f"{prefix}_t0.00_f0.75"] < default, counts


@pytest.fixture(scope="module")
def prefilled(smollm2, golden):
    """ctx -> (full cache, statistics, tokens) after prefilling the golden ids once."""
    return prefill_contexts(smollm2[0], golden, STATS)


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases())
def test_merging_matches_kvpress(prefilled, golden, case):
    """`merging:inner=snapkv,ratio=r` = MergingPress(SnapKVPress(r)): kvpress's kept
    positions in every layer and KV head; the kept keys exactly the prefill's (kvpress's are
    its input keys bit for bit); as many merged values per (layer, KV head) as kvpress;
    layers 0 and 29's merged values kvpress's to `PREFILL_RTOL`."""
    ctx, rest = case.split("_", 1)
    ratio = float(rest.rsplit("_r", 1)[1])
    cache, _, n = prefilled[ctx]
    out, n = compress_context(prefilled, ctx, SPEC.format(r=ratio))
    np.testing.assert_array_equal(keep_by_position(out, n), unpack(golden, f"{case}_keep", n))
    plain, _ = compress_context(prefilled, ctx, f"snapkv:ratio={ratio}")  # the same slots, unmerged
    merged = np.zeros(golden[f"{case}_merged"].shape, int)
    for i, (after, before) in enumerate(zip(out, plain)):
        np.testing.assert_array_equal(np.asarray(after.pos), np.asarray(before.pos))
        np.testing.assert_array_equal(np.asarray(after.k), np.asarray(before.k))
        valid = np.asarray(after.pos)[0] != kvjax.EMPTY  # [KVH, C]
        got = np.asarray(after.logical_v)[0]
        unmerged = np.asarray(before.logical_v)[0]
        merged[i] = ((got != unmerged).any(-1) & valid).sum(-1)
        if f"{case}_values_l{i}" in golden.files:
            want = golden[f"{case}_values_l{i}"]  # [KVH, n_kept, D] position order
            kvh, kept, d = want.shape
            got = got[valid].reshape(kvh, kept, d)
            assert _row_error(got, want) < PREFILL_RTOL, (case, i, _row_error(got, want))
            # the merge moves values far more than the tolerance
            assert _row_error(unmerged[valid].reshape(kvh, kept, d), want) > 100 * PREFILL_RTOL
    np.testing.assert_array_equal(merged, golden[f"{case}_merged"])


@pytest.mark.slow
def test_merged_cache_shrinks_as_the_ratio_says(prefilled):
    """Merging keeps the inner method's slots: after `shrink` the cache holds n_kept tokens
    per KV head, bytes exactly those of SnapKV at the same ratio, about (1 - r) of the full
    cache."""
    cache, _, n = prefilled["ctx2"]
    first = cache[0]

    def token_bytes(tokens: int) -> int:  # keys, values, positions and the cursor, per model
        kv = 2 * first.k.shape[0] * tokens * first.head_dim * first.k.dtype.itemsize
        return len(cache) * (kv + first.pos.size // first.capacity * tokens * 4 + 4)

    for ratio in (0.5, 0.75):
        out, _ = compress_context(prefilled, "ctx2", SPEC.format(r=ratio))
        plain, _ = compress_context(prefilled, "ctx2", f"snapkv:ratio={ratio}")
        small = kvjax.shrink(out, room=0)
        kept = n - int(n * ratio)
        assert all(layer.capacity == kept for layer in small)
        assert kvjax.nbytes(small) == kvjax.nbytes(kvjax.shrink(plain, room=0)) == \
            token_bytes(kept)
        assert abs(token_bytes(kept) / token_bytes(n) - kept / n) < 1e-5  # the cursors


@pytest.mark.parametrize("spec, words", [
    ("merging:similarity_threshold=1.5", ("similarity_threshold", "[0.0, 1.0]", "1.5")),
    ("merging:similarity_threshold=-0.1", ("similarity_threshold", "-0.1")),
    ("merging:merge_fraction=0", ("merge_fraction", "(0, 1]", "got 0")),
    ("merging:merge_fraction=1.2", ("merge_fraction", "1.2")),
    ("merging:headwise=true", ("headwise", "per-head")),
    ("merging:inner=nope", ("inner", "nope")),
    ("merging:inner=kivi", ("inner", "kivi")),
    ("merging:ratio=1.0", ("ratio", "[0, 1)")),
])
def test_bad_arguments_name_the_argument(spec, words):
    with pytest.raises(ValueError) as e:
        parse_method(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_merging_needs_a_plain_cache_before_a_codec():
    """After a codec the values are codes: a clear ValueError, not a silent plain eviction."""
    import jax
    cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 32), batch=1, capacity=16)
    k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 8, 32))
    cache = tuple(kvjax.write(layer, k, v, jnp.arange(8)[None]) for layer in cache)
    t = parse_method("quantize:bits=4+merging:inner=knorm,ratio=0.5")
    with pytest.raises(ValueError, match="merging: needs plain float token caches"):
        t.update(cache, t.init(cache), None)
    ok = parse_method("merging:inner=knorm,ratio=0.5+quantize:bits=4")
    out, _ = ok.update(cache, ok.init(cache), None)
    assert int(kvjax.num_valid(kvjax.view(out[0]))[0, 0]) == 4


# ----------------------------------------------------------------------------- the tiny model

TINY_STATS = kvjax.StatsSpec(window=128)  # every query of the prompts below
TINY_PROMPTS = [80, 53]  # tokens of two prompts batched together (left padding)


@pytest.fixture(scope="module")
def tiny_prefilled(tiny_model):
    """(batch of two prompts of different lengths, each prompt alone), prefilled once."""
    from models.sampler import prefill_batch
    prompts = [np.random.default_rng(i).integers(3, 250, n).tolist()
               for i, n in enumerate(TINY_PROMPTS)]
    batch = prefill_batch(tiny_model, prompts, stats=TINY_STATS)
    alone = [prefill_batch(tiny_model, [p], stats=TINY_STATS) for p in prompts]
    return batch, alone


def _kept(cache, row: int):
    """[layer] -> (positions [KVH, n] sorted, values [KVH, n, D] in the same order)."""
    out = []
    for layer in cache:
        pos, v = np.asarray(layer.pos)[row], np.asarray(layer.logical_v)[row]
        order = [np.argsort(np.where(p == kvjax.EMPTY, 1 << 30, p))[:(p != kvjax.EMPTY).sum()]
                 for p in pos]
        out.append((np.stack([p[o] for p, o in zip(pos, order)]),
                    np.stack([x[o] for x, o in zip(v, order)])))
    return out


@pytest.mark.parametrize("inner", ["snapkv", "knorm", "keydiff"])
def test_batched_rows_merge_as_alone(tiny_prefilled, inner):
    """Prompts of different lengths in one batch keep the positions and merged values each
    keeps alone (left padding is never a merge source or target). The batch's keys equal the
    alone run's to float32 rounding only (other matmul shapes), so Knorm may swap two keys of
    norms within 1e-4 (`tests/near_ties.py`); such a head's merged values are not compared,
    and at most one head of the model may swap."""
    from models.sampler import compress
    batch, alone = tiny_prefilled
    transform = parse_method(f"merging:inner={inner},ratio=0.5")
    out = compress(batch, transform, keep_input=True, shrink=False)
    swapped = 0
    for row, n in enumerate(TINY_PROMPTS):
        one = compress(alone[row], transform, keep_input=True, shrink=False)
        for i, ((pos_b, v_b), (pos_a, v_a)) in enumerate(zip(_kept(out.cache, row),
                                                             _kept(one.cache, 0))):
            same = [np.array_equal(b, a) for b, a in zip(pos_b, pos_a)]
            if inner == "knorm" and not all(same):
                keep = [np.stack([np.isin(np.arange(n), h) for h in p]) for p in (pos_b, pos_a)]
                swapped += near_tie_swaps(*keep, knorm_scores_by_position(alone[row].cache[i], n))
            else:
                np.testing.assert_array_equal(pos_b, pos_a)
            for h in np.flatnonzero(same):
                np.testing.assert_allclose(v_b[h], v_a[h], rtol=1e-5, atol=1e-6)
    assert swapped <= 1


def test_compiles_once_per_shape(tiny_prefilled):
    """Another ratio of the same shapes traces nothing: the ratio is state, as for every
    scored method (the merge gates are compile-time constants)."""
    from tests.conftest import TraceCounter
    batch, _ = tiny_prefilled
    first, second = (parse_method(f"merging:inner=snapkv,ratio={r}") for r in (0.5, 0.75))
    _compress(first.update, batch.cache, first.init(batch.cache), batch.stats)
    with TraceCounter() as traces:
        out, _ = _compress(second.update, batch.cache, second.init(batch.cache), batch.stats)
    assert traces.count == 0
    assert {int(x) for x in (np.asarray(out[0].pos)[0] != kvjax.EMPTY).sum(-1)} == \
        {TINY_PROMPTS[0] - int(TINY_PROMPTS[0] * 0.75)}
