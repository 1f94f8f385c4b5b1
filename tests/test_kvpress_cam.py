"""Parity with kvpress 0.5.5's CAMPress on SmolLM2: `cam:budget=K` with `compress_every=8`.

The golden (`experiments/golden/make_kvpress_cam.py`, made by running kvpress in float32,
never kvjax) holds, per text (640 and 300 tokens of The Devil's Dictionary: all but the last
16 prefilled, those 16 fed one per forward) and ratio r (0.5, 0.75; target_size K = the
prefill's tokens x (1 - r)), for each of the two compressions of every layer (after forward 8
and after forward 16, with `CAMPress(KnormPress(), compression_interval=8, target_size=K)`):
the positions kept, the 8 merge candidates, their merge probabilities per KV head and the
uniform draws kvpress's mask came from (`u < p`, the same distribution as its
`torch.bernoulli(p)`); the values layers 0 and 29 held after the first compression (300-token
text, r = 0.75); and the inputs and output of one compression (layer 14, the second, same
case).

kvjax draws its own uniforms, so the comparisons give kvjax's merge kvpress's draws
(`cam_merge_values(..., merge=u < p)`); the policy's own update is checked to be the same plan
and merge with its draws. Tolerances:

* the merge alone, on kvpress's own inputs: float32 rounding only (`MERGE_RTOL` of each
  value row's norm, `PROB_ATOL` on probabilities: 32-term sums in another order);
* end to end, kvjax's prefill and steps: also the two forwards' rounding (`PREFILL_RTOL`, as
  tests/test_kvpress_merging.py, and `E2E_PROB_ATOL`).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.core.layout import compact
from kvjax.policies.eviction import knorm_scores
from kvjax.policies.eviction_cam import (cam, cam_merge_values, cam_plan, merge_probability,
                                         merge_uniforms)
from kvjax.policies.methods import parse_method

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_cam.npz")
MERGE_RTOL = 1e-6  # float32 sums in another order (measured: 4.8e-8)
PROB_ATOL = 1e-6  # (measured: 3.0e-8)
PREFILL_RTOL = 3e-5  # + the two prefills' rounding (measured: 2.1e-6, layer 29)
E2E_PROB_ATOL = 1e-4  # + the two forwards' attention rounding (measured: 1.6e-5)
MERGE_BUDGET = 32
# (case, compression, layer) where kvpress's mean scores tie exactly at the budget (golden
# margin 0): positions holding the same token (a layer-0 key's norm depends on its token
# only, RoPE keeps norms), among which torch's `topk` picked; kvjax breaks them kvpress's way
# (`_break_tie`) so the rest of the run stays comparable, and checks the tie is exact
# (case, compression, layer) -> (kvpress's candidate, kvjax's): kvpress takes the evicted
# tokens from one `topk(largest=False)` and the kept ones from another `topk`; under an exact
# tie at the budget (two positions of one token at layer 0) the two calls broke it opposite
# ways, so kvpress's candidate is a token it also *kept* (and merged into its neighbours) while
# the tied token it dropped was never a candidate. kvjax's candidates are evicted tokens only.
SPLIT_TIES = {("ctx2_cam_r0.50", 0, 0): (54, 132), ("ctx1_cam_r0.75", 1, 0): (528, 108)}
EXACT_TIES = {("ctx1_cam_r0.50", 0, 0), ("ctx1_cam_r0.75", 1, 0), ("ctx2_cam_r0.50", 0, 0)}


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


def _keep(golden, prefix: str, j: int) -> np.ndarray:
    """[L, T] bool positions kept by compression j."""
    layers, t = int(golden["num_layers"]), len(golden[f"{prefix.split('_')[0]}_ids"])
    return np.unpackbits(golden[f"{prefix}_c{j}_keep"])[:layers * t].reshape(layers, t) > 0


def _row_error(got: np.ndarray, want: np.ndarray) -> float:
    scale = np.maximum(np.linalg.norm(want, axis=-1, keepdims=True), 1e-30)
    return float(np.max(np.abs(got - want) / scale))


def _cases() -> list[str]:
    g = np.load(GOLDEN)
    return sorted(k[:-len("_target")] for k in g.files if k.endswith("_target"))


# --------------------------------------------------------------- the merge on kvpress's inputs


def test_cam_matches_kvpress_on_its_inputs(golden):
    """kvpress's second compression of layer 14 (300-token text, r = 0.75), from its own
    mean scores, attention sums and values: `cam_plan` keeps its positions and picks its 8
    candidates exactly; `merge_probability` gives its probabilities to float32 rounding; with
    its draws `cam_merge_values` gives its merged values to `MERGE_RTOL`."""
    layer = int(golden["merge_layer"])
    prefix = "ctx2_cam_r0.75"
    pre = f"{prefix}_c1_l{layer}"
    v, a = golden[f"{pre}_in_values"], golden[f"{pre}_in_attn"]
    scores, pos = golden[f"{pre}_in_scores"], golden[f"{pre}_in_pos"]
    kvh, n, _ = v.shape
    target = int(golden[f"{prefix}_target"])
    plan = cam_plan(jnp.broadcast_to(jnp.asarray(scores), (1, kvh, n)),
                    jnp.ones((1, kvh, n), bool), jnp.broadcast_to(jnp.asarray(pos), (1, kvh, n)),
                    jnp.array([target]), jnp.array([int(golden["interval"])]), MERGE_BUDGET)
    keep, merge = np.asarray(plan.keep)[0], np.asarray(plan.merge)[0]
    for h in range(kvh):
        np.testing.assert_array_equal(pos[keep[h]], np.flatnonzero(_keep(golden, prefix, 1)[layer]))
        np.testing.assert_array_equal(pos[merge[h]], golden[f"{prefix}_c1_merge"][layer])
    p = np.asarray(merge_probability(jnp.asarray(a)[None], plan))[0][:, merge[0]]
    want_p, u = golden[f"{prefix}_c1_prob"][layer], golden[f"{prefix}_c1_u"][layer]
    assert np.abs(p - want_p).max() < PROB_ATOL
    drawn = np.zeros((kvh, n), bool)
    drawn[:, merge[0]] = u < want_p
    assert drawn.any() and not drawn[:, merge[0]].all(), "the case merges some, not all"
    out = np.asarray(cam_merge_values(jnp.asarray(v)[None], plan, jnp.asarray(drawn)[None]))[0]
    got, want = out[:, keep[0]], golden[f"{pre}_out_values"]
    assert _row_error(got, want) < MERGE_RTOL, _row_error(got, want)
    # the merge moves values far more than the tolerance
    assert _row_error(v[:, keep[0]], want) > 100 * MERGE_RTOL


# ------------------------------------------------------------------------------ end to end


def _break_tie(scores, valid, pos, budget: int, kept_by_kvpress: np.ndarray):
    """`scores` [1, KVH, C] with the slots whose mean score equals the `budget`-th best
    exactly (an exact tie: the same token's layer-0 keys) raised by 1e-3 where kvpress kept
    their position, so kvjax keeps what torch's `topk` picked among them -> (scores, count of
    tied slots)."""
    mean = np.asarray(jnp.mean(scores, axis=1))[0]  # [C], as cam_plan averages
    ok = np.asarray(valid)[0, 0]
    bound = np.sort(mean[ok])[::-1][budget - 1]
    tied = ok & (mean == bound)
    lift = tied & kept_by_kvpress[np.maximum(np.asarray(pos)[0, 0], 0)]
    return scores + 1e-3 * jnp.asarray(lift)[None, None], int(tied.sum())


def _compress_with(layer, budget: int, new_tokens: int, draws: dict, tie_keep=None,
                   split=None):
    """kvjax's CAM compression of one layer (batch 1) -> (layer, kvjax's own plan, the plan
    used, p [KVH, C]); the merge mask is kvpress's draw `u < p` with `draws = {position: u
    [KVH]}` (kvjax's p); with `tie_keep` ([T] kvpress's kept positions) an exact tie at the
    budget goes kvpress's way; `split` = (kvpress's candidate, kvjax's) of a `SPLIT_TIES` row:
    the merge then uses kvpress's candidates (one of them kept), so later steps see kvpress's
    values."""
    scores, _ = knorm_scores(layer, None, None, None)
    valid = layer.pos != kvjax.EMPTY
    if tie_keep is not None:
        scores, tied = _break_tie(scores, valid, layer.pos, budget, tie_keep)
        assert tied > 1, "a named tie that is not one"
    own = plan = cam_plan(scores, valid, layer.pos, jnp.array([budget]),
                          jnp.array([new_tokens]), MERGE_BUDGET)
    pos = np.asarray(layer.pos)[0]
    if split is not None:
        merge = np.asarray(plan.merge).copy()
        merge[..., pos[0] == split[0]], merge[..., pos[0] == split[1]] = True, False
        plan = plan._replace(merge=jnp.asarray(merge))
    p = merge_probability(layer.mass, plan)
    u = np.ones(layer.pos.shape, np.float32)
    for c in np.flatnonzero(np.asarray(plan.merge)[0, 0]):
        u[0, :, c] = draws[int(pos[0, c])]
    v = cam_merge_values(layer.logical_v, plan, jnp.asarray(u) < p)
    out = compact(layer.replace(v=v.astype(layer.v.dtype).reshape(layer.v.shape)), plan.keep)
    return out, own, plan, np.asarray(p)[0]


@pytest.fixture(scope="module")
def runs(smollm2, golden):
    """case -> per compression j: (kept positions [L] lists, candidates [L], p [L, KVH, 8],
    values after compression 0 per layer), kvjax's prefill and steps with kvpress's draws."""
    from models.sampler import extend, prefill_and_compress
    model = smollm2[0]
    interval, new = int(golden["interval"]), int(golden["new"])
    out = {}
    for case in _cases():
        ids = golden[f"{case.split('_')[0]}_ids"].tolist()
        n_ctx = len(ids) - new
        target = int(golden[f"{case}_target"])
        t = cam(budget=target)  # = parse_method(f"cam:budget={target}")
        pre = prefill_and_compress(model, [ids[:n_ctx]], transform=t, room=new)
        assert all(float(jnp.abs(layer.mass).max()) == 0 for layer in pre.cache)  # reset
        result = []
        for j in range(2):
            pre = extend(model, pre, [ids[n_ctx + j * interval: n_ctx + (j + 1) * interval]],
                         transform=t)
            cache, rec = [], {"keep": [], "merge": [], "p": [], "values": []}
            for i, layer in enumerate(pre.cache):
                cand = golden[f"{case}_c{j}_merge"][i]
                u = golden[f"{case}_c{j}_u"][i]
                draws = {int(q): u[:, m] for m, q in enumerate(cand)}
                tie = _keep(golden, case, j)[i] if (case, j, i) in EXACT_TIES else None
                small, own, plan, p = _compress_with(layer, target, interval, _Draws(draws),
                                                     tie, SPLIT_TIES.get((case, j, i)))
                pos = np.asarray(layer.pos)[0]
                keep, merge = np.asarray(own.keep)[0], np.asarray(own.merge)[0]
                used = np.asarray(plan.merge)[0, 0]  # kvpress's candidates in a split tie
                rec["keep"].append([np.sort(pos[h][keep[h]]) for h in range(len(pos))])
                rec["merge"].append([np.sort(pos[h][merge[h]]) for h in range(len(pos))])
                rec["p"].append(p[:, used][:, np.argsort(pos[0][used])])
                if j == 0:
                    vpos = np.asarray(small.pos)[0]
                    vals = np.asarray(small.logical_v)[0]
                    rec["values"].append(np.stack([vals[h][np.argsort(np.where(
                        vpos[h] == kvjax.EMPTY, 1 << 30, vpos[h]))][:target]
                        for h in range(len(vpos))]))
                cache.append(small)
            result.append(rec)
            pre = pre._replace(cache=tuple(cache))
        out[case] = result
    return out


class _Draws(dict):
    """kvpress's uniform per candidate position; a kvjax candidate kvpress did not have draws
    1 (never merges) so that the comparison of candidates, not a KeyError, reports it."""

    def __missing__(self, key):
        return np.ones(3, np.float32)


def _mismatches(golden, runs, case) -> list[tuple]:
    """(compression, layer, what) where kvjax's end-to-end run differs from kvpress's."""
    out = []
    for j, rec in enumerate(runs[case]):
        keep = _keep(golden, case, j)
        for i in range(len(rec["keep"])):
            if any(not np.array_equal(kept, np.flatnonzero(keep[i])) for kept in rec["keep"][i]):
                out.append((j, i, "kept"))
            want = golden[f"{case}_c{j}_merge"][i]
            if (case, j, i) in SPLIT_TIES:
                theirs, ours = SPLIT_TIES[case, j, i]
                assert keep[i, theirs] and not keep[i, ours], "kvpress's candidate was kept"
                ids = golden[f"{case.split('_')[0]}_ids"]
                assert ids[theirs] == ids[ours], "the same token: an exact layer-0 tie"
                want = np.sort(np.where(want == theirs, ours, want))
            if any(not np.array_equal(m, want) for m in rec["merge"][i]):
                out.append((j, i, "candidates"))
    return out


@pytest.mark.parametrize("case", _cases())
def test_cam_matches_kvpress_end_to_end(golden, runs, case):
    """`cam:budget=K` after kvjax's prefill and 8 + 8 single steps (given kvpress's draws):
    kvpress's kept positions and merge candidates in every layer and KV head at both
    compressions (exact; kvpress's candidates with its `SPLIT_TIES` kept token replaced by the
    tied evicted one); outside those rows its merge probabilities to
    `E2E_PROB_ATOL`; the same merge mask from its uniforms; layers 0 and 29's merged values
    after the first compression (300-token text, r = 0.75) to `PREFILL_RTOL` of each row's
    norm."""
    assert _mismatches(golden, runs, case) == []
    for j, rec in enumerate(runs[case]):
        p = np.stack(rec["p"])
        want = golden[f"{case}_c{j}_prob"]
        ok = np.ones(len(p), bool)
        assert np.abs(p - want)[ok].max() < E2E_PROB_ATOL, (case, j, np.abs(p - want).max())
        u = golden[f"{case}_c{j}_u"]
        np.testing.assert_array_equal((u < p)[ok], (u < want)[ok])
    for layer in golden["value_layers"]:
        key = f"{case}_c0_values_l{layer}"
        if key in golden.files:
            got, want = runs[case][0]["values"][layer], golden[key]
            assert _row_error(got, want) < PREFILL_RTOL, (case, layer, _row_error(got, want))


# ----------------------------------------------------------------------------- the tiny model


def _stepped(model, prompts, spec: str, steps: int):
    """Prefill `prompts` under `spec` (the prompt's update), then `steps` more tokens each."""
    from models.sampler import extend, prefill_and_compress
    t = parse_method(spec)
    pre = prefill_and_compress(model, prompts, transform=t, room=steps)
    more = [np.random.default_rng(7 + len(p)).integers(3, 250, steps).tolist() for p in prompts]
    return t, extend(model, pre, more, transform=t)


def test_prompt_update_keeps_everything_and_resets_the_mass(tiny_model):
    """CAMPress leaves the prefill alone and sums attention from the first decode step: the
    prompt's update keeps every token, zeroes the mass and marks the latest position."""
    from models.sampler import prefill_and_compress
    t = parse_method("cam:budget=16")
    pre = prefill_and_compress(tiny_model, [list(range(3, 43))], transform=t, shrink=False)
    for layer in pre.cache:
        assert int((np.asarray(layer.pos) != kvjax.EMPTY).sum(-1).min()) == 40
        assert float(jnp.abs(layer.mass).max()) == 0.0
    assert np.asarray(pre.transform_state.mark).tolist() == [39]
    assert np.asarray(pre.transform_state.layer_budget).min() == 16


def test_update_is_the_plan_and_merge_with_its_own_draws(tiny_model):
    """A later update equals `cam_plan` + `merge_probability` + `cam_merge_values` with the
    draws of `merge_uniforms` (fold of the state's key with the layer), then compaction: the
    golden comparisons above (which give kvjax kvpress's draws) speak for the policy."""
    t, pre = _stepped(tiny_model, [list(range(3, 63))], "cam:budget=24,merge_budget=4", 8)
    state = pre.transform_state
    out, new_state = t.update(pre.cache, state, pre.stats)
    latest = jnp.array([67])
    merged_any = False
    for i, (layer, got) in enumerate(zip(pre.cache, out)):
        scores, _ = knorm_scores(layer, None, None, None)
        valid = layer.pos != kvjax.EMPTY
        plan = cam_plan(scores, valid, layer.pos, jnp.array([24]), jnp.array([8]), 4)
        p = merge_probability(layer.mass, plan)
        u = merge_uniforms(jax.random.fold_in(state.key, i), latest, layer.pos)
        v = cam_merge_values(layer.logical_v, plan, u < p)
        merged_any |= bool(((u < p) & plan.merge).any())
        want = compact(layer.replace(v=v.reshape(layer.v.shape)), plan.keep)
        np.testing.assert_array_equal(np.asarray(got.pos), np.asarray(want.pos))
        np.testing.assert_allclose(np.asarray(got.logical_v), np.asarray(want.logical_v),
                                   rtol=1e-6, atol=1e-6)
        assert int((np.asarray(got.pos) != kvjax.EMPTY).sum(-1).max()) == 24
    assert merged_any, "the case merges something"
    assert np.asarray(new_state.mark).tolist() == [67]


def test_every_head_keeps_the_same_positions_and_the_cache_shrinks(tiny_model):
    """The scores are averaged over KV heads (CAMPress): every head keeps the same `budget`
    positions; `shrink` then holds exactly `budget` slots per head, and the bytes (keys,
    values, positions, mass) are 24/68 of the uncompressed 68 tokens' (the cursors aside)."""
    t, pre = _stepped(tiny_model, [list(range(3, 63))], "cam:budget=24", 8)
    out, _ = t.update(pre.cache, pre.transform_state, pre.stats)
    small = kvjax.shrink(out, room=0)
    for layer in small:
        pos = np.sort(np.asarray(layer.pos)[0], axis=-1)
        assert layer.capacity == 24 and (pos == pos[:1]).all()
    full = kvjax.shrink(pre.cache, room=0)  # 68 tokens
    cursors = sum(np.asarray(layer.length).nbytes for layer in small)
    assert (kvjax.nbytes(small) - cursors) * 68 == (kvjax.nbytes(full) - cursors) * 24


def test_batched_rows_decode_as_alone(tiny_model):
    """Prompts of different lengths in one batch, compressed every 4 steps, generate what each
    generates alone (the draws are keyed by each row's positions, never its batch slot)."""
    from models.sampler import generate
    prompts = [np.random.default_rng(i).integers(3, 250, n).tolist()
               for i, n in enumerate([37, 22])]
    t = parse_method("cam:budget=16,merge_budget=4")
    batch = generate(tiny_model, prompts, max_new_tokens=13, transform=t, compress_every=4,
                     eos_ids=())
    for row, prompt in enumerate(prompts):
        alone = generate(tiny_model, [prompt], max_new_tokens=13, transform=t, compress_every=4,
                         eos_ids=())
        assert batch.tokens[row].tolist() == alone.tokens[0].tolist()


def test_compiles_once_per_shape(tiny_model):
    """Another budget of the same shapes traces nothing: the budget is state."""
    from models.sampler import _compress
    from tests.conftest import TraceCounter
    first, pre = _stepped(tiny_model, [list(range(3, 63))], "cam:budget=24", 8)
    second = parse_method("cam:budget=20")
    state = pre.transform_state
    _compress(first.update, pre.cache, state, pre.stats)
    with TraceCounter() as traces:
        out, _ = _compress(second.update, pre.cache,
                           state._replace(layer_budget=jnp.full_like(state.layer_budget, 20)),
                           pre.stats)
    assert traces.count == 0
    assert int((np.asarray(out[0].pos) != kvjax.EMPTY).sum(-1).max()) == 20


@pytest.mark.parametrize("spec, words", [
    ("cam:merge_budget=0", ("merge_budget", ">= 1", "0")),
    ("cam:merge_budget=1.5", ("merge_budget", "1.5")),
    ("cam:budget=0", ("budget", "0")),
    ("cam:ratio=1.0", ("ratio", "[0, 1)")),
    ("cam:ratio=0.5,budget=8", ("ratio", "budget")),
    ("cam:inner=nope", ("inner", "nope")),
    ("cam:inner=kivi", ("inner", "kivi")),
    ("cam:headwise=true", ("headwise",)),
])
def test_bad_arguments_name_the_argument(spec, words):
    with pytest.raises(ValueError) as e:
        parse_method(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cam_needs_a_plain_cache_before_a_codec():
    """After a codec the values are codes: a clear ValueError, not a silent eviction."""
    cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 32), batch=1, capacity=16)
    k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 8, 32))
    cache = tuple(kvjax.write(layer, k, v, jnp.arange(8)[None]) for layer in cache)
    t = parse_method("quantize:bits=4+cam:budget=4")
    with pytest.raises(ValueError, match="cam: needs plain float token caches"):
        t.update(cache, t.init(cache), None)


def test_kvjax_methods_lists_cam():
    """`kvjax methods` names CAMPress, this test, and a spec that parses once K is given."""
    from kvjax.policies.methods import describe_methods
    m = {m["name"]: m for m in describe_methods()}["cam"]
    assert m["kvpress"] == "CAMPress" and m["proof"] == "tests/test_kvpress_cam.py"
    assert {"inner", "ratio", "budget", "merge_budget"} <= {a["name"] for a in m["arguments"]}
    t = parse_method(m["spec"].replace("=K", "=12"))
    assert t.update.merge_budget == 32 and t.stats.attention_mass
