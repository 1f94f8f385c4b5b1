import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvjax
from kvjax import EMPTY
from kvjax.core.layout import compact
from kvjax.core.selection import keep_top_k


def random_cache(rng, b=2, kvh=2, c=9, d=3):
    cache = kvjax.init_cache(b, kvh, c, d)
    n = int(rng.integers(1, c + 1))
    k = jnp.asarray(rng.standard_normal((b, kvh, n, d)), jnp.float32)
    pos = np.tile(np.arange(n), (b, 1))
    pos[0, : int(rng.integers(0, n))] = EMPTY  # left padding in the first sequence
    return kvjax.write(cache, k, k + 1, jnp.asarray(pos))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(0, 9), capacity=st.integers(1, 12))
def test_compact_keeps_exactly_the_chosen_tokens_in_order(seed, k, capacity):
    rng = np.random.default_rng(seed)
    cache = random_cache(rng)
    valid = cache.pos != EMPTY
    keep = keep_top_k(jnp.asarray(rng.standard_normal(cache.pos.shape)), k, valid)
    out = compact(cache, keep, capacity)
    assert out.pos.shape[-1] == capacity and out.k.shape[1] == capacity
    pos, lk, new_pos, new_k = map(np.asarray, (cache.pos, cache.logical_k, out.pos, out.logical_k))
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            chosen = np.flatnonzero(np.asarray(keep)[b, h])[:capacity]
            n = len(chosen)
            assert n == min(k, valid[b, h].sum(), capacity)
            np.testing.assert_array_equal(new_pos[b, h, :n], pos[b, h, chosen])  # from the input, in order
            np.testing.assert_array_equal(new_k[b, h, :n], lk[b, h, chosen])
            assert np.all(new_pos[b, h, n:] == EMPTY) and np.all(new_k[b, h, n:] == 0)
    assert int(out.length) == int(np.max(np.sum(new_pos != EMPTY, -1)))


def test_attention_after_compaction_equals_masking_the_evicted_slots():
    rng = np.random.default_rng(0)
    cache = random_cache(rng, c=12)
    keep = keep_top_k(jnp.asarray(rng.standard_normal(cache.pos.shape)), 5, cache.pos != EMPTY)
    masked = cache.replace(pos=jnp.where(keep, cache.pos, EMPTY))
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 3)), jnp.float32)
    q_pos = jnp.full((2, 1), 20)
    want = kvjax.attend_reference(q, q_pos, masked)
    got = kvjax.attend_reference(q, q_pos, compact(cache, keep, capacity=6))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert kvjax.nbytes(compact(cache, keep, capacity=6)) < kvjax.nbytes(cache)


def test_keep_top_k_prefers_high_scores_and_never_keeps_invalid():
    scores = jnp.array([[[0.1, 0.9, 0.5, 0.9, -3.0]]])
    valid = jnp.array([[[True, True, True, False, True]]])
    np.testing.assert_array_equal(keep_top_k(scores, 2, valid), [[[False, True, True, False, False]]])
    np.testing.assert_array_equal(keep_top_k(scores, 5, valid), valid)  # fewer valid than k
    with pytest.raises(ValueError, match="k=6"):
        keep_top_k(scores, 6)


def test_compact_is_jittable_and_rejects_bad_masks():
    cache = kvjax.init_cache(1, 2, 8, 4)
    keep = jnp.ones((1, 2, 8), bool)
    out = jax.jit(compact, static_argnums=2)(cache, keep, 4)
    assert out.pos.shape == (1, 2, 4)
    with pytest.raises(ValueError, match="keep mask"):
        compact(cache, keep[:, :1])


def _kept_positions(cache):
    pos = np.asarray(cache.pos)
    return [[sorted(p[p != EMPTY].tolist()) for p in row] for row in pos]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sinks=st.integers(0, 3), window=st.integers(1, 8))
def test_streaming_llm_keeps_sinks_and_last_window(seed, sinks, window):
    rng = np.random.default_rng(seed)
    layer = random_cache(rng, c=12)
    t = kvjax.streaming_llm(sinks=sinks, window=window)
    (out,), _ = jax.jit(t.update)((layer,), t.init((layer,)), None)
    for before, after in zip(_kept_positions(layer), _kept_positions(out)):
        for b, a in zip(before, after):
            want = b if len(b) <= sinks + window else b[:sinks] + b[-window:]
            assert a == want  # exactly the earliest sinks and the latest window, from the input
    assert out.pos.shape == layer.pos.shape  # capacity unchanged: freed slots take new tokens


def test_sliding_window_keeps_exactly_the_last_w_and_rows_are_independent():
    rng = np.random.default_rng(3)
    layer = random_cache(rng, b=2, c=10)
    t = kvjax.sliding_window(3)
    (out,), _ = t.update((layer,), t.init((layer,)), None)
    for before, after in zip(_kept_positions(layer), _kept_positions(out)):
        assert all(a == b[-3:] for b, a in zip(before, after))
    alone = layer.replace(k=layer.k[2:], v=layer.v[2:], pos=layer.pos[1:])  # sequence 1 alone
    (out_alone,), _ = t.update((alone,), t.init((alone,)), None)
    np.testing.assert_array_equal(out_alone.pos, out.pos[1:])
    np.testing.assert_array_equal(out_alone.k, out.k[2:])


def test_streaming_llm_in_generation(tiny_model):
    from models.sampler import generate

    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
    full = generate(tiny_model, prompts, max_new_tokens=8, chunk=4, eos_ids=())
    roomy = generate(tiny_model, prompts, max_new_tokens=8, chunk=4, eos_ids=(),
                     transform=kvjax.parse_method("streaming_llm:sinks=2,window=30"))
    np.testing.assert_array_equal(roomy.tokens, full.tokens)  # nothing to evict: same tokens
    tight = generate(tiny_model, prompts, max_new_tokens=8, chunk=4, eos_ids=(),
                     transform=kvjax.parse_method("streaming_llm:sinks=1,window=3"),
                     compress_every=2)
    # after the last compression (step 6) two more tokens were written at most
    assert int(np.max(kvjax.num_valid(tight.cache[0]))) <= 1 + 3 + 2
    assert tight.tokens.shape == (2, 8)


def test_streaming_llm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="window >= 1"):
        kvjax.streaming_llm(sinks=4, window=0)
    with pytest.raises(ValueError, match="bad arguments"):
        kvjax.parse_method("sliding_window:sinks=3")
