"""Eviction policies on a tiny random model: budgets, provenance, independence, memory.

Every policy runs through the real pipeline (chunked prefill collecting the
statistics the policy declares, then its first update), so the tests cover
the statistics plumbing as well as the selection.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvjax
from kvjax import EMPTY
from kvjax.policies.eviction import broadcast_heads, earliest, no_protect
from kvjax.core.selection import pyramid_budgets
from models.sampler import generate, prefill_and_compress, prefill_batch

W = 4  # observation window of the window-based policies (tiny prompts)
POLICIES = {
    "streaming_llm": lambda r: kvjax.streaming_llm(sinks=2, ratio=r),
    "snapkv": lambda r: kvjax.snapkv(ratio=r, window=W),
    "tova": lambda r: kvjax.tova(ratio=r),
    "h2o": lambda r: kvjax.h2o(ratio=r),
    "knorm": lambda r: kvjax.knorm(ratio=r),
    "random": lambda r: kvjax.random(ratio=r, seed=3),
    "expected_attention": lambda r: kvjax.expected_attention(ratio=r, sinks=2, n_future=16),
}
HEADWISE = {
    "snapkv_headwise": lambda r: kvjax.snapkv(ratio=r, window=W, headwise=True),
    "knorm_headwise": lambda r: kvjax.knorm(ratio=r, headwise=True),
}


def prompts_of(rng, lengths):
    return [rng.integers(3, 256, n).tolist() for n in lengths]


def compress(model, prompts, transform, chunk=8):
    return prefill_and_compress(model, prompts, transform=transform, chunk=chunk, shrink=False)


def kept(cache):
    """[layer][b][h] sorted kept positions."""
    return [[[sorted(p[p != EMPTY].tolist()) for p in row] for row in np.asarray(layer.pos)]
            for layer in cache]


def budget_of(n, ratio):
    return max(1, math.floor(n * (1 - ratio) + 1e-9))


@pytest.mark.parametrize("name", sorted(POLICIES) + sorted(HEADWISE))
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ratio=st.sampled_from([0.0, 0.25, 0.5, 0.7, 0.9]))
def test_every_policy_keeps_exactly_its_budget_from_the_input(tiny_model, name, seed, ratio):
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(W + 2, 17)), int(rng.integers(W + 2, 17))]
    prompts = prompts_of(rng, lengths)
    transform = {**POLICIES, **HEADWISE}[name](ratio)
    out = compress(tiny_model, prompts, transform).cache
    reference = compress(tiny_model, prompts, kvjax.full()).cache
    for layer, ref, layer_kept in zip(out, reference, kept(out)):
        for b, n in enumerate(lengths):
            counts = [len(p) for p in layer_kept[b]]
            if name in HEADWISE:
                assert sum(counts) == layer.kv_heads * budget_of(n, ratio)
                assert min(counts) >= 1
            else:
                assert counts == [budget_of(n, ratio)] * layer.kv_heads
        # every kept slot holds the key and value that token had in the full cache
        ref_pos, ref_k = np.asarray(ref.pos), np.asarray(ref.logical_k)
        pos, k = np.asarray(layer.pos), np.asarray(layer.logical_k)
        for b, h, s in zip(*np.nonzero(pos != EMPTY)):
            src = np.flatnonzero(ref_pos[b, h] == pos[b, h, s])
            assert len(src) == 1
            np.testing.assert_array_equal(k[b, 0 if layer.pooled else h, s], ref_k[b, h, src[0]])


@pytest.mark.parametrize("name", sorted(POLICIES) + ["snapkv_headwise"])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_a_sequence_does_not_depend_on_its_batch_or_padding(tiny_model, name, seed):
    rng = np.random.default_rng(seed)
    a, longer, other = prompts_of(rng, [11, 16, 9])
    transform = {**POLICIES, **HEADWISE}[name](0.5)
    alone = kept(compress(tiny_model, [a], transform).cache)
    padded = kept(compress(tiny_model, [longer, a, other], transform).cache)  # a is left-padded
    for layer_alone, layer_batched in zip(alone, padded):
        assert layer_batched[1] == layer_alone[0]


def test_policies_protect_what_they_promise(tiny_model):
    rng = np.random.default_rng(1)
    prompts = prompts_of(rng, [16, 12])
    n = [16, 12]
    checks = {
        "snapkv": lambda b, p: set(range(n[b] - W, n[b])) <= set(p),  # the observation window
        "tova": lambda b, p: n[b] - 1 in p,  # the latest token
        "h2o": lambda b, p: set(range(n[b] - budget_of(n[b], 0.5) // 2, n[b])) <= set(p),
        "expected_attention": lambda b, p: {0, 1} <= set(p),  # sinks
        "streaming_llm": lambda b, p: p == [0, 1] + list(range(n[b] - budget_of(n[b], 0.5) + 2, n[b])),
    }
    for name, check in checks.items():
        for layer in kept(compress(tiny_model, prompts, POLICIES[name](0.5)).cache):
            assert all(check(b, p) for b, row in enumerate(layer) for p in row), name


def _pyramid_reference(q_len, ratio, layers, window, beta):
    """kvpress 0.5.5 PyramidKVPress.get_layer_budget, in plain Python floats."""
    max_cap = window + q_len * (1 - ratio)
    min_num = (max_cap - window) / beta
    max_num = (max_cap - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_cap - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return [max(1, round(q_len * (1 - ratio)))] * layers
    steps = (max_num - min_num) / (layers - 1)
    return [round(max_num - i * steps) for i in range(layers)]


@pytest.mark.parametrize("q_len,ratio", [(640, 0.5), (1000, 0.25), (4000, 0.9), (300, 0.75),
                                         (100, 0.5), (2048, 0.6)])
def test_pyramid_budgets_match_kvpress_formula(q_len, ratio):
    got = pyramid_budgets(jnp.array([q_len * (1 - ratio)]), jnp.array([q_len]), 30, 64, 20)
    assert np.asarray(got)[:, 0].tolist() == _pyramid_reference(q_len, ratio, 30, 64, 20)


def test_pyramidkv_gives_layers_their_pyramid_budgets(tiny_model):
    rng = np.random.default_rng(2)
    prompts = prompts_of(rng, [40])
    t = kvjax.pyramidkv(ratio=0.5, window=W)
    cache = compress(tiny_model, prompts, t).cache
    want = _pyramid_reference(40, 0.5, len(cache), W, 20)
    assert [int(kvjax.num_valid(layer)[0, 0]) for layer in cache] == want
    assert want[0] > want[-1]


def test_shrink_leaves_exactly_the_budget_in_memory(tiny_model):
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, [16, 16])
    cfg = tiny_model.config
    d, kvh, b = cfg.head_dim, cfg.num_kv_heads, 2
    budget = budget_of(16, 0.5)
    per_slot = 2 * d * 4 + 4  # k + v float32, int32 position, per KV head
    for transform, slots in ((kvjax.snapkv(ratio=0.5, window=W), b * kvh * budget),
                             (kvjax.knorm(ratio=0.5, headwise=True), b * kvh * budget)):
        cache = prefill_and_compress(tiny_model, prompts, transform=transform, chunk=8).cache
        layer = cache[0]
        if layer.pooled:  # keys shared by the heads, a position per head and slot
            want = b * (kvh * budget) * (2 * d * 4 + kvh * 4) + 4
        else:
            want = slots * per_slot + 4
        assert kvjax.nbytes(layer) == want
        assert kvjax.nbytes(cache) == cfg.num_layers * want


def test_changing_the_ratio_does_not_recompile(tiny_model, count_traces):
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [16, 13])
    compress(tiny_model, prompts, kvjax.snapkv(ratio=0.5, window=W))
    with count_traces() as traces:
        for ratio in (0.25, 0.75, 0.9):
            compress(tiny_model, prompts, kvjax.parse_method(f"snapkv:ratio={ratio},window={W}"))
        compress(tiny_model, prompts, kvjax.snapkv(budget=5, window=W))
    assert traces.count == 0


@dataclasses.dataclass(frozen=True)
class ValueNormScorer:
    """A parameterised user scorer: value norms, the first `sinks` tokens protected."""

    sinks: int = 2

    def __call__(self, layer, stats, budget, key):
        norm = jnp.linalg.norm(layer.v.astype(jnp.float32), axis=-1)  # [R, C]
        return broadcast_heads(norm, layer), earliest(layer.pos, self.sinks)


def test_scorers_equal_by_value_share_one_compilation(tiny_model, count_traces):
    """Parameterised scorers are frozen dataclasses: a policy rebuilt with equal parameters
    (a new scorer object each time) reuses the compiled update, built-in or user-written."""
    rng = np.random.default_rng(7)
    prompts = prompts_of(rng, [16, 13])
    built = [lambda r: kvjax.snapkv(ratio=r, window=W, kernel=3),
             lambda r: kvjax.h2o(ratio=r, recent_fraction=0.25),
             lambda r: kvjax.streaming_llm(sinks=3, ratio=r),
             lambda r: kvjax.scored_policy("vnorm", ValueNormScorer(sinks=3), ratio=r,
                                           budget=None),
             lambda r: kvjax.chain(kvjax.on_layers(kvjax.knorm(ratio=r), [0]),
                                   kvjax.quantize(bits=8, group=8))]  # combinators: by value too
    for make in built:
        compress(tiny_model, prompts, make(0.5))
    assert kvjax.snapkv(ratio=0.5, window=W, kernel=3).update.scorer is not \
        kvjax.snapkv(ratio=0.5, window=W, kernel=3).update.scorer  # new objects, equal values
    with count_traces() as traces:
        for make in built:
            compress(tiny_model, prompts, make(0.25))
    assert traces.count == 0
    with count_traces() as traces:  # a different parameter is a different program
        compress(tiny_model, prompts, kvjax.streaming_llm(sinks=1, ratio=0.5))
    assert traces.count > 0


def test_an_unhashable_scorer_is_refused_when_the_policy_is_built():
    @dataclasses.dataclass  # not frozen: __hash__ is None
    class Mutable:
        sinks: int = 2

        def __call__(self, layer, stats, budget, key):
            return layer.pos.astype(jnp.float32), no_protect(layer)
    with pytest.raises(ValueError, match="mine: scorer .* is not hashable.*frozen dataclass"):
        kvjax.scored_policy("mine", Mutable(), ratio=0.5, budget=None)


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5,window=4", "h2o:ratio=0.5",
                                  "tova:budget=6", "knorm:ratio=0.5,headwise=true",
                                  "expected_attention:ratio=0.5,sinks=2"])
def test_decode_time_compression_holds_the_budget(tiny_model, spec):
    rng = np.random.default_rng(6)
    prompts = prompts_of(rng, [16, 10])
    out = generate(tiny_model, prompts, max_new_tokens=9, chunk=8, eos_ids=(),
                   transform=kvjax.parse_method(spec), compress_every=4)
    budgets = [6, 6] if "budget=6" in spec else [8, 5]
    for layer in out.cache:  # 8 decode steps write a token each; compressed after 4 and 8
        counts = np.asarray(kvjax.num_valid(layer)).sum(-1) if layer.pooled else \
            np.asarray(kvjax.num_valid(layer))[:, 0]
        heads = layer.kv_heads if layer.pooled else 1
        assert counts.tolist() == [heads * bud for bud in budgets]


def test_random_draws_are_fixed_for_life_so_decode_time_eviction_keeps_a_uniform_subset(
        tiny_model):
    """The state's key does not advance: layer i scores with fold_in(key, i) at every update, so
    a token keeps its draw for life. After decode-time compressions each KV head holds its
    budget of best-drawn positions among *every* token seen (prompt and generated), computed
    here from the draws themselves; redrawing at each update would favour recent tokens."""
    prompt = prompts_of(np.random.default_rng(11), [16])
    out = generate(tiny_model, prompt, max_new_tokens=9, chunk=8, eos_ids=(),
                   transform=kvjax.random(ratio=0.5, seed=3), compress_every=4)
    seen, budget = 16 + 8, 8  # 8 decode steps write a token each; the last update after 8
    key = jax.random.key(3)
    for i, layer in enumerate(out.cache):
        for h in range(layer.kv_heads):
            draw = [float(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(
                jax.random.fold_in(key, i), h), p))) for p in range(seen)]
            want = sorted(np.argsort(draw)[::-1][:budget].tolist())
            pos = np.asarray(layer.pos)[0, h]
            assert sorted(pos[pos != EMPTY].tolist()) == want, (i, h)


def test_a_policy_that_ignores_its_key_compiles_no_random_numbers(tiny_model):
    """Keys are derived inside the layer body, where the scorer uses them: SnapKV's compiled
    update holds no threefry code (a key split per update cost ~0.3 s of compile at 30
    layers); the random policy's does."""
    rng = np.random.default_rng(12)
    for spec, draws in (("snapkv:ratio=0.5,window=4", False), ("random:ratio=0.5", True)):
        t = kvjax.parse_method(spec)
        pre = prefill_batch(tiny_model, prompts_of(rng, [20]), stats=t.stats, chunk=8)
        text = jax.jit(t.update).lower(pre.cache, t.init(pre.cache), pre.stats).as_text()
        assert ("threefry" in text) == draws, spec


def test_query_agnostic_context_then_prompt(tiny_model):
    rng = np.random.default_rng(8)
    contexts, questions = prompts_of(rng, [20, 14]), prompts_of(rng, [5, 3])
    whole = [c + q for c, q in zip(contexts, questions)]
    full = generate(tiny_model, whole, max_new_tokens=5, chunk=8, eos_ids=())
    split = generate(tiny_model, questions, contexts=contexts, max_new_tokens=5, chunk=8,
                     eos_ids=())
    np.testing.assert_array_equal(split.tokens, full.tokens)  # full cache: the split is exact
    t = kvjax.snapkv(ratio=0.5, window=W)
    out = generate(tiny_model, questions, contexts=contexts, max_new_tokens=5, chunk=8,
                   eos_ids=(), transform=t)
    for layer in out.cache:  # context cut to its budget; then the question and 4 decode writes
        got = np.asarray(kvjax.num_valid(layer))[:, 0].tolist()
        assert got == [10 + 5 + 4, 7 + 3 + 4]


def test_on_layers_and_layer_specs(tiny_model):
    rng = np.random.default_rng(9)
    prompts = prompts_of(rng, [16])
    t = kvjax.parse_method("knorm:ratio=0.5,layers=1")
    cache = compress(tiny_model, prompts, t).cache
    assert [int(kvjax.num_valid(layer)[0, 0]) for layer in cache] == [16, 8]
    mixed = kvjax.parse_method("streaming_llm:ratio=0.75,sinks=1,layers=0+knorm:budget=3,layers=1")
    cache = compress(tiny_model, prompts, mixed).cache
    assert kept(cache)[0][0][0] == [0, 13, 14, 15]
    assert [int(kvjax.num_valid(layer)[0, 0]) for layer in cache] == [4, 3]
    with pytest.raises(ValueError, match="layers"):
        kvjax.parse_method("knorm:ratio=0.5,layers=a-b")


@pytest.mark.parametrize("bad", ["snapkv", "snapkv:ratio=0.5,budget=3", "knorm:ratio=1.0",
                                 "knorm:budget=0", "h2o:heavy=3", "knorm:ratio=0.5,schedule=wide"])
def test_bad_budgets_raise(bad):
    with pytest.raises(ValueError):
        kvjax.parse_method(bad)


def test_policies_that_need_statistics_say_so():
    layer = kvjax.init_cache(1, 2, 8, 4)
    for t, match in ((kvjax.snapkv(ratio=0.5), "queries"), (kvjax.h2o(ratio=0.5), "mass"),
                     (kvjax.expected_attention(ratio=0.5), "moments")):
        with pytest.raises(ValueError, match=match):
            t.update((layer,), t.init((layer,)), None)
