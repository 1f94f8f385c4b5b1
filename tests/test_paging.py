"""The paged pool: invariants under random alloc/write/fork/release/evict, isolation of
sequences, and a paged model decode equal to the contiguous cache's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import kvjax
from kvjax import EMPTY
from kvjax.backends import pallas as ka
from kvjax.memory.paging import (NULL_PAGE, check_pool, dense_view, drop_lowest_pages, evict_pages,
                                 fork, init_paged_cache, page_scores, release, reserve)
from kvjax.core.stores import PackedTokens, put, read
from models.llama import Llama, LlamaConfig, new_cache

B, KVH, S, NP, P, D = 3, 2, 4, 4, 14, 8


def write_tokens(layers, ids, positions):
    """Write one token per sequence whose key and value are its id in every channel."""
    k = jnp.broadcast_to(jnp.asarray(ids, jnp.float32)[:, None, None, None], (B, KVH, 1, D))
    pos = jnp.asarray(positions, jnp.int32)[:, None]
    return tuple(layer.write(k, -k, pos) for layer in layers)


def check_invariants(pool, layers, shadow):
    """refcounts equal table references; rows hold exactly the tokens written to them."""
    check_pool(pool, layers)  # and every invariant the pool audits (no flag left set)
    layer = layers[0]
    tables, lengths = np.asarray(layer.tables), np.asarray(layer.lengths)
    refs = np.zeros(P, int)
    for b in range(B):
        for h in range(KVH):
            used = -(-lengths[b, h] // S)
            assert NULL_PAGE not in tables[b, h, :used]
            assert np.all(tables[b, h, used:] == NULL_PAGE)
            for page in tables[b, h, :used]:
                refs[page] += 1
            if layer.shared_tables:  # one aligned group of KVH page ids per (sequence, block)
                held = tables[b, h] != NULL_PAGE
                np.testing.assert_array_equal(tables[b, h, held], tables[b, 0, held] + h)
                assert np.all(tables[b, 0, held] % KVH == 0)
    np.testing.assert_array_equal(np.asarray(pool.refcount), refs)
    # the null page stays empty
    assert np.all(np.asarray(layer.pos[NULL_PAGE]) == EMPTY)
    assert np.all(np.asarray(layer.k[NULL_PAGE]) == 0)
    view = dense_view(layer)
    k, pos = np.asarray(view.k).reshape(B, KVH, -1, D), np.asarray(view.pos)
    for b in range(B):
        for h in range(KVH):
            n = lengths[b, h]
            assert len(shadow[b]) == n
            np.testing.assert_array_equal(k[b, h, :n, 0], [t for t, _ in shadow[b]])
            np.testing.assert_array_equal(pos[b, h, :n], [p for _, p in shadow[b]])
            assert np.all(pos[b, h, n:] == EMPTY)


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(1, 6)),
    st.tuples(st.just("release"), st.integers(0, B - 1)),
    st.tuples(st.just("fork"), st.integers(0, B - 1), st.integers(0, B - 1)),
    st.tuples(st.just("evict"), st.integers(0, 2 ** 16))), min_size=4, max_size=14))
@pytest.mark.parametrize("shared_tables", [False, True], ids=["per_head", "shared_tables"])
def test_pool_invariants_under_random_operations(shared_tables, ops):
    pool, layers = init_paged_cache(P, S, B, KVH, NP, D, num_layers=2,
                                    shared_tables=shared_tables)
    shadow = {b: [] for b in range(B)}  # sequence -> [(token id, position)]
    next_id = 1
    for op in ops:
        if op[0] == "write":
            n = op[1]
            lengths = np.asarray(layers[0].lengths)[:, 0]
            refc = np.asarray(pool.refcount)
            tables = np.asarray(layers[0].tables)
            need, fresh = -(-(lengths + n) // S), 0
            for b in range(B):
                have = -(-lengths[b] // S)
                shared = lengths[b] % S and refc[tables[b, 0, have - 1]] > 1
                fresh += KVH * (need[b] - have + bool(shared))
            if shared_tables:  # whole free groups of KVH ids; group 0 holds the null page
                groups = refc[:P // KVH * KVH].reshape(-1, KVH)[1:]
                free = KVH * int(np.all(groups == 0, axis=1).sum())
            else:
                free = (refc == 0).sum() - 1
            fits = fresh <= free and need.max() <= NP
            pool, layers = reserve(pool, layers, jnp.full((B,), n))
            assert bool(pool.overflow) == (not fits)
            if not fits:
                pool = pool.replace(overflow=jnp.zeros((), bool))
                continue
            for _ in range(n):
                ids = [next_id + b for b in range(B)]
                positions = [len(shadow[b]) for b in range(B)]
                layers = write_tokens(layers, ids, positions)
                for b in range(B):
                    shadow[b].append((ids[b], positions[b]))
                next_id += B
        elif op[0] == "release":
            rows = np.arange(B) == op[1]
            pool, layers = release(pool, layers, jnp.asarray(rows))
            shadow[op[1]] = []
        elif op[0] == "fork":
            src, dst = op[1], op[2]
            source = np.full(B, -1)
            source[dst] = src
            ok = len(shadow[dst]) == 0
            pool, layers = fork(pool, layers, jnp.asarray(source, jnp.int32))
            assert bool(pool.overflow) == (not ok)
            assert int(pool.error[0]) == (0 if ok else 4)  # "target is not empty"
            pool = pool.replace(overflow=jnp.zeros((), bool), error=jnp.zeros((4,), jnp.int32))
            if ok:
                shadow[dst] = list(shadow[src])
        else:  # evict pages chosen by the bits of op[1]; the same pages for every head
            bits = np.array([(op[1] >> i) & 1 for i in range(B * NP)], bool).reshape(B, 1, NP)
            drop = np.broadcast_to(bits, (B, KVH, NP))
            lengths = np.asarray(layers[0].lengths)[:, 0]
            pool, layers = evict_pages(pool, layers, jnp.asarray(drop))
            for b in range(B):
                used = -(-lengths[b] // S)
                gone = [j for j in range(used - 1) if drop[b, 0, j]]  # never the last page
                shadow[b] = [x for i, x in enumerate(shadow[b]) if i // S not in gone]
        check_invariants(pool, layers, shadow)
    # nothing leaks: releasing everything frees every page
    pool, layers = release(pool, layers, jnp.ones((B,), bool))
    assert int(pool.refcount.sum()) == 0
    pool, layers = reserve(pool, layers, jnp.full((B,), 2 * S))  # freed pages are reused
    assert not bool(pool.overflow) and int((pool.refcount > 0).sum()) == B * KVH * 2


def test_fork_shares_pages_and_copies_on_first_write():
    pool, layers = init_paged_cache(P, S, B, KVH, NP, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([6, 0, 0]))
    for i in range(6):
        layers = write_tokens(layers, [10 + i, 0, 0], [i, -1, -1])
    pool, layers = release(pool, layers, jnp.array([False, True, True]))
    pool, layers = fork(pool, layers, jnp.array([-1, 0, -1], jnp.int32))
    tables = np.asarray(layers[0].tables)
    np.testing.assert_array_equal(tables[1, :, :2], tables[0, :, :2])  # shared, not copied
    assert np.all(np.asarray(pool.refcount)[tables[0, :, :2]] == 2)
    pool, layers = reserve(pool, layers, jnp.array([1, 1, 0]))
    tables2 = np.asarray(layers[0].tables)
    np.testing.assert_array_equal(tables2[:, :, 0], tables[:, :, 0])  # full page stays shared
    assert np.all(tables2[0, :, 1] != tables2[1, :, 1])  # the partial page was copied
    layers = write_tokens(layers, [99, 77, 0], [6, 6, -1])
    k = np.asarray(dense_view(layers[0]).k).reshape(B, KVH, -1, D)[..., 0]
    np.testing.assert_array_equal(k[0, 0, :7], [10, 11, 12, 13, 14, 15, 99])
    np.testing.assert_array_equal(k[1, 0, :7], [10, 11, 12, 13, 14, 15, 77])


def test_overflow_is_flagged_and_raises_on_the_host():
    pool, layers = init_paged_cache(4, S, 1, 1, 8, D, num_layers=1)  # 3 usable pages
    pool, layers = reserve(pool, layers, jnp.array([3 * S]))
    check_pool(pool)
    # reserved room counts: reserving within it again allocates nothing (no overflow)
    pool, layers = reserve(pool, layers, jnp.array([3 * S]))
    check_pool(pool, layers)
    k = jnp.ones((1, 1, 3 * S, D))
    layers = tuple(l.write(k, k, jnp.arange(3 * S)[None]) for l in layers)  # fill the pages
    pool, layers = reserve(pool, layers, jnp.array([1]))
    assert int(layers[0].tables[0, 0, 3]) == NULL_PAGE  # nothing allocated
    with pytest.raises(ValueError, match="overflow"):
        check_pool(pool)
    with pytest.raises(ValueError, match="null page"):
        init_paged_cache(1, S, 1, 1, 8, D, num_layers=1)


def small_model_and_prompt():
    cfg = LlamaConfig.tiny(num_heads=4, num_kv_heads=2, head_dim=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 11), 0, cfg.vocab_size)
    return cfg, model, tokens


def contiguous_logits(model, cfg, tokens):
    """Prefill 5 tokens, then one at a time, in a contiguous TokenCache: every step's logits."""
    cache, out = new_cache(cfg, tokens.shape[0], 16), []
    for start, end in [(0, 5)] + [(i, i + 1) for i in range(5, tokens.shape[1])]:
        pos = jnp.broadcast_to(jnp.arange(start, end), (tokens.shape[0], end - start))
        logits, cache = model(tokens[:, start:end], pos, cache)
        out.append(logits)
    return np.concatenate(out, 1)


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """Make impl="pallas" run the TPU kernel body in interpret mode on CPU."""
    monkeypatch.setattr(kvjax.backends.dispatch, "pallas_backend", lambda: "tpu")
    monkeypatch.setattr(kvjax.backends.dispatch, "attend_pallas",
                        functools.partial(ka.attend_pallas, interpret=True))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_paged_model_decode_equals_contiguous_cache(impl, request):
    """The tiny model decodes through a paged cache (impl="pallas": the kernel, interpret
    mode) exactly as through a TokenCache, including a prompt shared by fork."""
    if impl == "pallas":
        request.getfixturevalue("kernel_on_cpu")
    cfg, model, tokens = small_model_and_prompt()
    tokens = tokens.at[1, :5].set(tokens[0, :5])  # both sequences share a 5-token prompt
    want = contiguous_logits(model, cfg, tokens)
    pool, layers = init_paged_cache(16, 4, 2, cfg.num_kv_heads, 4, cfg.head_dim, cfg.num_layers)
    # prefill the prompt once (sequence 0), then share its pages with sequence 1
    pool, layers = reserve(pool, layers, jnp.array([5, 0]))
    pos = jnp.stack([jnp.arange(5), jnp.full(5, EMPTY)])
    logits, layers = model(tokens[:, :5], pos, layers, impl=impl)
    pool, layers = release(pool, layers, jnp.array([False, True]))
    pool, layers = fork(pool, layers, jnp.array([-1, 0], jnp.int32))
    outs = [jnp.stack([logits[0], logits[0]])]
    for i in range(5, tokens.shape[1]):  # decode: the first write copies the shared last page
        pool, layers = reserve(pool, layers, jnp.ones((2,), jnp.int32))
        logits, layers = model(tokens[:, i:i + 1], jnp.full((2, 1), i), layers, impl=impl)
        outs.append(logits)
    check_pool(pool)
    np.testing.assert_allclose(np.concatenate(outs, 1), want, rtol=2e-5, atol=2e-5)
    assert int(pool.refcount.max()) == 2  # the prompt's full page is still shared


def test_attention_never_reads_pages_outside_the_block_table(kernel_on_cpu):
    """Plant huge keys/values in every page sequence 0 does not list: its output is unchanged."""
    rng = np.random.default_rng(0)
    pool, layers = init_paged_cache(12, 4, 2, 1, 4, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([7, 7]))
    k = jnp.asarray(rng.normal(size=(2, 1, 7, D)), jnp.float32)
    layer = layers[0].write(k, k * 2, jnp.broadcast_to(jnp.arange(7), (2, 7)))
    q = jnp.asarray(rng.normal(size=(2, 1, 2, D)), jnp.float32)
    q_pos = jnp.full((2, 1), 7, jnp.int32)
    before = kvjax.attend(q, q_pos, layer, impl="pallas")
    mine = np.asarray(layer.tables[0, 0, :2])
    others = np.setdiff1d(np.arange(12), mine)
    layer = layer.replace(k=layer.k.at[others].set(1e4), v=layer.v.at[others].set(-1e4),
                          pos=layer.pos.at[others].set(0))
    after = kvjax.attend(q, q_pos, layer, impl="pallas")
    np.testing.assert_array_equal(np.asarray(after[0]), np.asarray(before[0]))
    assert not np.allclose(np.asarray(after[1]), np.asarray(before[1]))  # sequence 1 sees them


def test_evicting_low_pages_frees_them_and_attention_follows(kernel_on_cpu):
    rng = np.random.default_rng(1)
    pool, layers = init_paged_cache(12, 4, 1, 1, 4, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([14]))
    k = jnp.asarray(rng.normal(size=(1, 1, 14, D)), jnp.float32)
    layers = (layers[0].write(k, k + 1, jnp.arange(14)[None]),)
    norms = jnp.linalg.norm(layers[0].k, axis=-1)  # [P, S] key norm per slot
    scores = page_scores(layers[0], norms)
    drop = drop_lowest_pages(layers[0], scores, keep=1)
    assert int(drop.sum()) == 2  # 4 pages used: the last and the best other stay
    dropped = np.asarray(layers[0].tables)[np.asarray(drop)]
    pool2, layers2 = evict_pages(pool, layers, drop)
    assert np.all(np.asarray(pool2.refcount)[dropped] == 0)
    assert int(layers2[0].lengths[0, 0]) == 14 - 2 * 4
    q = jnp.asarray(rng.normal(size=(1, 1, 2, D)), jnp.float32)
    got = kvjax.attend(q, jnp.array([[14]]), layers2[0], impl="pallas")
    want = kvjax.attend(q, jnp.array([[14]]), dense_view(layers2[0]), impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_int4_pages_hold_what_the_int4_store_holds():
    """A paged layer with bits=4 quantizes each token exactly as a PackedTokens store does."""
    rng = np.random.default_rng(2)
    pool, layers = init_paged_cache(8, 4, 1, 2, 4, 32, num_layers=1, bits=4, group=16)
    pool, layers = reserve(pool, layers, jnp.array([6]))
    x = jnp.asarray(rng.normal(size=(1, 2, 6, 32)), jnp.float32)
    layer = layers[0].write(x, x, jnp.arange(6)[None])
    store = put(PackedTokens.empty(2, 6, 32, 4, 16), x.reshape(2, 6, 32), 0)
    got = np.asarray(dense_view(layer).k)[:, :6]
    np.testing.assert_array_equal(got, np.asarray(read(store)))


@pytest.mark.parametrize("bits,group,symmetric,param_dtype", [
    (4, 32, False, "float16"), (8, 96, True, "bfloat16"), (2, 32, False, "float32"),
    (4, 32, True, "float16")])
def test_token_pages_hold_packed_tokens_bit_for_bit(bits, group, symmetric, param_dtype):
    """`TokenPages` (a pool's lane-flat pages) holds the codes and parameters a `PackedTokens`
    store encodes, bit for bit, whole pages or one slot at a time (`put_slots`, which leaves
    every other slot as it was); `read` decodes them as `PackedTokens` does. Head dim 96 with
    groups of 32: an odd parameter count, so a 16-bit page pads half a word."""
    from kvjax.memory.paging import TokenPages
    rng = np.random.default_rng(3)
    p, s, d = 3, 16, 96
    x = jnp.asarray(rng.normal(size=(p, s, d)) * 4, jnp.float32)
    empty = TokenPages.empty(p, s, d, bits, group, symmetric, jnp.dtype(param_dtype))
    assert empty.shape == (p, s, d) and empty.param_dtype == param_dtype
    want = PackedTokens.empty(p, s, d, bits, group, symmetric, jnp.dtype(param_dtype)).encode(x)
    pages = empty.replace(pages=empty.encode_pages(x))
    for f in ("words", "scale", "offset"):
        a, b = getattr(pages.to_packed(), f), getattr(want, f)
        assert (a is None) == (b is None) == (f == "offset" and symmetric)
        if a is not None:
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(pages.read()), np.asarray(read(want)))
    # one slot per page written in place: (page 2, slot 5) and (page 0, slot 15)
    one = empty.put_slots(jnp.array([2, 0, p]), jnp.array([5, 15, 0]), x[jnp.array([2, 0, 0]),
                                                                       jnp.array([5, 15, 0])])
    got = np.array(one.read())
    np.testing.assert_array_equal(got[2, 5], np.asarray(read(want))[2, 5])
    np.testing.assert_array_equal(got[0, 15], np.asarray(read(want))[0, 15])
    got[2, 5] = got[0, 15] = 0
    assert not got.any()  # nothing else written; page p (out of range) dropped


def test_a_codec_over_an_encoded_pool_keeps_its_own_pages_and_refuses_others():
    """A per-token codec applied to a pool it already encodes (int4 pages, groups of 16) leaves
    the layer as it is; another codec is refused by name, not a KeyError on the page store."""
    pool, layers = init_paged_cache(8, 4, 1, 1, 4, 32, num_layers=1, bits=4, group=16)
    pool, layers = reserve(pool, layers, jnp.array([6]))
    x = jnp.ones((1, 1, 6, 32))
    layers = (layers[0].write(x, x, jnp.arange(6)[None]),)
    same = kvjax.parse_method("quantize:bits=4,group=16")
    (out,), _ = same.update(layers, same.init(layers), None)
    assert out is layers[0]
    other = kvjax.parse_method("quantize:bits=8")
    with pytest.raises(ValueError, match="already encoded by another codec"):
        other.update(layers, other.init(layers), None)


def test_generate_with_the_kernel_matches_xla(kernel_on_cpu):
    """generate(impl="pallas") threads the kernel through prefill and the decode loop."""
    from models.sampler import generate
    cfg, model, tokens = small_model_and_prompt()
    prompts = [tokens[0, :9].tolist(), tokens[1, :6].tolist()]
    want = generate(model, prompts, max_new_tokens=6, capacity=48, chunk=8)
    got = generate(model, prompts, max_new_tokens=6, capacity=48, chunk=8, impl="pallas")
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_shared_tables_reject_bad_input_and_the_audit_catches_misaligned_tables():
    """shared_tables: a pool too small for one page group, and an evict mask that differs
    between the heads of a sequence, raise ValueErrors naming the argument; a table whose head 1
    does not list head 0's page + 1 fails `check_pool`."""
    from kvjax.memory.paging import PoolError
    with pytest.raises(ValueError, match="num_pages >= 2 \\* kv_heads"):
        init_paged_cache(3, S, B, KVH, NP, D, num_layers=1, shared_tables=True)
    pool, layers = init_paged_cache(P, S, B, KVH, NP, D, num_layers=1, shared_tables=True)
    pool, layers = reserve(pool, layers, jnp.full((B,), 2 * S))
    assert int(jnp.sum(pool.refcount)) == B * KVH * 2
    drop = np.zeros((B, KVH, NP), bool)
    drop[0, 1, 0] = True
    with pytest.raises(ValueError, match=r"evict_pages: .*drop\[0, 1, 0\]"):
        evict_pages(pool, layers, jnp.asarray(drop))
    check_pool(pool, layers)
    t = layers[0].tables
    bad = t.at[0, 1, 0].set(t[0, 1, 1]).at[0, 1, 1].set(t[0, 1, 0])  # swapped: refcounts hold
    with pytest.raises(PoolError, match="head alignment"):
        check_pool(pool, (layers[0].replace(tables=bad),))
