"""Regression tests for the paged pool's isolation defects (issue 21), one per defect.

Each test failed before the fix:
- a freed page was not scrubbed: a stale NaN/Inf turned the next owner's attention into NaN;
- a negative count in `reserve` mapped one page into two sequences;
- `write` into a page shared by `fork` (no `reserve` first) let a sequence read its sibling's
  token;
- releasing a padding-only row drove the null page's reference count to -1 (and a released
  row leaked the pages it had reserved but not written);
- `check_pool` noticed none of these.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import EMPTY
from kvjax.backends import pallas as ka
from kvjax.memory.paging import (NULL_PAGE, PoolError, check_pool, evict_pages, fork,
                                 init_paged_cache, release, reserve)

S, D = 4, 8


def write_ids(layers, ids, positions):
    """Write T tokens per sequence: key = id in every channel, value = -id.

    ids, positions: [B, T] (position < 0: padding)."""
    ids = jnp.asarray(ids, jnp.float32)
    b, t = ids.shape
    kvh = layers[0].kv_heads
    k = jnp.broadcast_to(ids[:, None, :, None], (b, kvh, t, D))
    return tuple(l.write(k, -k, jnp.asarray(positions, jnp.int32)) for l in layers)


def readable(layer, b, h=0):
    """What attention reads for row (b, h): keys, values and positions of every slot of its
    in-use pages (exactly the pages `kernel_inputs` hands the kernel), as numpy."""
    n = int(layer.num_pages_used[b, h])
    pages = np.asarray(layer.tables)[b, h, :n]
    return (np.asarray(layer.k)[pages].reshape(-1, D), np.asarray(layer.v)[pages].reshape(-1, D),
            np.asarray(layer.pos)[pages, 0].reshape(-1))


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """Make impl="pallas" run the TPU kernel body in interpret mode on CPU."""
    monkeypatch.setattr(kvjax.backends.dispatch, "pallas_backend", lambda: "tpu")
    monkeypatch.setattr(kvjax.backends.dispatch, "attend_pallas",
                        functools.partial(ka.attend_pallas, interpret=True))


@pytest.mark.parametrize("impl", ["xla", "reference", "pallas"])
def test_reused_page_with_stale_nan_does_not_poison_the_next_owner(impl, request):
    if impl == "pallas":
        request.getfixturevalue("kernel_on_cpu")
    pool, layers = init_paged_cache(num_pages=3, page_size=S, batch=2, kv_heads=1, max_pages=2,
                                    head_dim=D, num_layers=1)
    # sequence 0 fills a page with NaN keys and Inf values (a diverged model), then finishes
    pool, layers = reserve(pool, layers, jnp.array([S, 0]))
    k = jnp.full((2, 1, S, D), jnp.nan)
    layers = tuple(l.write(k, jnp.full_like(k, jnp.inf), jnp.array([[0, 1, 2, 3], [-1] * S]))
                   for l in layers)
    pool, layers = release(pool, layers, jnp.array([True, False]))
    # sequence 1 gets a page (one of the two free ones) and writes one ordinary token
    pool, layers = reserve(pool, layers, jnp.array([0, 1]))
    if int(layers[0].tables[1, 0, 0]) != 1:  # make sure it got the poisoned page
        pool, layers = reserve(pool, layers, jnp.array([0, 0]))
    assert int(layers[0].tables[1, 0, 0]) == 1
    layers = write_ids(layers, [[0.0], [3.0]], [[-1], [0]])
    check_pool(pool, layers)
    q = jnp.ones((2, 1, 2, D), jnp.float32)
    out = np.asarray(kvjax.attend(q, jnp.array([[1], [1]]), layers[0], impl=impl))
    # one visible token: attention returns its value exactly
    np.testing.assert_array_equal(out[1], np.full((1, 2, D), -3.0, np.float32))


def test_freed_pages_are_scrubbed_before_another_sequence_reads_them():
    """Garbage planted in every free page (NaN/Inf keys, valid-looking positions) is never
    readable by the sequence that gets the page next."""
    pool, layers = init_paged_cache(6, S, 2, 2, 3, D, num_layers=2)
    free = np.arange(1, 6)
    layers = tuple(l.replace(k=l.k.at[free].set(jnp.nan), v=l.v.at[free].set(jnp.inf),
                             pos=l.pos.at[free].set(jnp.arange(S, dtype=jnp.int32)))
                   for l in layers)
    pool, layers = reserve(pool, layers, jnp.array([2, 1]))
    layers = write_ids(layers, [[5.0, 6.0], [7.0, -9.0]], [[0, 1], [0, -1]])
    check_pool(pool, layers)
    for layer in layers:
        for h in range(2):
            k, v, pos = readable(layer, 0, h)
            np.testing.assert_array_equal(pos, [0, 1, EMPTY, EMPTY])
            np.testing.assert_array_equal(k[:, 0], [5, 6, 0, 0])
            np.testing.assert_array_equal(v[:, 0], [-5, -6, 0, 0])
            k, v, pos = readable(layer, 1, h)
            np.testing.assert_array_equal(pos, [0, EMPTY, EMPTY, EMPTY])  # padding stays EMPTY
            np.testing.assert_array_equal(k[:, 0], [7, 0, 0, 0])  # ... and holds zeros
            assert np.all(np.isfinite(v))


def test_negative_reserve_count_raises_and_never_aliases_pages():
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([S, 0]))
    layers = write_ids(layers, [[1, 2, 3, 4], [0, 0, 0, 0]], [[0, 1, 2, 3], [-1] * 4])
    with pytest.raises(ValueError, match=r"new_tokens\[0\] = -4"):
        reserve(pool, layers, jnp.array([-4, 4]))  # eager: raises at once
    # under jit the count is a tracer: nothing is allocated, the pool's error flag is set
    pool2, layers2 = jax.jit(reserve)(pool, layers, jnp.array([-4, 4]))
    np.testing.assert_array_equal(np.asarray(layers2[0].tables), np.asarray(layers[0].tables))
    np.testing.assert_array_equal(np.asarray(pool2.refcount), np.asarray(pool.refcount))
    with pytest.raises(ValueError, match=r"reserve: new_tokens\[0\] = -4 is negative"):
        check_pool(pool2)
    tables = np.asarray(layers2[0].tables)
    mine, theirs = set(tables[0, 0]) - {NULL_PAGE}, set(tables[1, 0]) - {NULL_PAGE}
    assert not mine & theirs


@pytest.mark.parametrize("count", [2 ** 31 - 1, 4 * S + 1])
def test_overflowing_reserve_count_is_rejected(count):
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=1)
    with pytest.raises(ValueError, match=rf"new_tokens\[1\] = {count}.*\[0, {4 * S}\]"):
        reserve(pool, layers, np.array([1, count], np.int64))
    if count < 2 ** 31:
        pool, layers = jax.jit(reserve)(pool, layers, jnp.array([1, count]))
        assert int(pool.refcount.sum()) == 0
        with pytest.raises(ValueError, match=rf"new_tokens\[1\] = {count}"):
            check_pool(pool)


def test_write_into_a_forked_page_without_reserve_never_reaches_the_sibling():
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=2)
    pool, layers = reserve(pool, layers, jnp.array([6, 0]))
    layers = write_ids(layers, [[1, 2, 3, 4, 5, 6], [0] * 6], [list(range(6)), [-1] * 6])
    pool, layers = fork(pool, layers, jnp.array([-1, 0], jnp.int32))
    check_pool(pool, layers)
    # both sequences write a token without reserve: the partly filled page 1 is shared
    layers = write_ids(layers, [[100.0], [200.0]], [[6], [6]])
    for layer in layers:
        k0, k1 = readable(layer, 0)[0][:, 0], readable(layer, 1)[0][:, 0]
        assert 200 not in k0 and 100 not in k1
        np.testing.assert_array_equal(k0[:6], [1, 2, 3, 4, 5, 6])  # the shared prefix is intact
        np.testing.assert_array_equal(k1[:6], [1, 2, 3, 4, 5, 6])
    with pytest.raises(PoolError, match="shared by fork"):
        check_pool(pool, layers)
    # the flag reaches the pool at its next operation, so check_pool(pool) sees it too
    pool, layers = reserve(pool, layers, jnp.array([1, 1]))
    with pytest.raises(PoolError, match="shared by fork"):
        check_pool(pool)


def test_fork_then_reserve_then_write_gives_each_sequence_its_own_token():
    """The intended path (reserve copies the shared page) still works and raises nothing."""
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([6, 0]))
    layers = write_ids(layers, [[1, 2, 3, 4, 5, 6], [0] * 6], [list(range(6)), [-1] * 6])
    pool, layers = fork(pool, layers, jnp.array([-1, 0], jnp.int32))
    pool, layers = reserve(pool, layers, jnp.array([1, 1]))
    layers = write_ids(layers, [[100.0], [200.0]], [[6], [6]])
    check_pool(pool, layers)
    np.testing.assert_array_equal(readable(layers[0], 0)[0][:7, 0], [1, 2, 3, 4, 5, 6, 100])
    np.testing.assert_array_equal(readable(layers[0], 1)[0][:7, 0], [1, 2, 3, 4, 5, 6, 200])


def test_releasing_a_padding_only_row_keeps_the_null_page_uncounted():
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([5, 0]))
    layers = write_ids(layers, [[1, 2, 3, 4, 5], [0] * 5], [list(range(5)), [-1] * 5])
    pool, layers = release(pool, layers, jnp.array([False, True]))
    assert int(pool.refcount[NULL_PAGE]) == 0
    assert int(pool.refcount.min()) >= 0
    check_pool(pool, layers)
    # the padding-only row can take pages afterwards like any empty row
    pool, layers = reserve(pool, layers, jnp.array([0, 2]))
    layers = write_ids(layers, [[0, 0], [8, 9]], [[-1, -1], [0, 1]])
    check_pool(pool, layers)
    np.testing.assert_array_equal(readable(layers[0], 1)[0][:2, 0], [8, 9])


def test_release_frees_pages_reserved_but_not_yet_written():
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([3 * S, 0]))  # 3 pages, none written
    assert int((pool.refcount > 0).sum()) == 3
    pool, layers = release(pool, layers, jnp.array([True, False]))
    assert int(pool.refcount.sum()) == 0
    check_pool(pool, layers)


def _filled():
    pool, layers = init_paged_cache(10, S, 2, 2, 3, D, num_layers=2)
    pool, layers = reserve(pool, layers, jnp.array([6, 0]))
    layers = write_ids(layers, [[1, 2, 3, 4, 5, 6], [0] * 6], [list(range(6)), [-1] * 6])
    pool, layers = fork(pool, layers, jnp.array([-1, 0], jnp.int32))
    check_pool(pool, layers)
    return pool, layers


def _corrupt(layers, **changes):
    return tuple(l.replace(**{k: f(l) for k, f in changes.items()}) for l in layers)


@pytest.mark.parametrize("case, message", [
    ("refcount", "reference counts"),
    ("negative", "negative reference count"),
    ("free_listed", "listed in a block table but free"),
    ("null_written", "null page"),
    ("null_counted", "null page"),
    ("cross_head", "mapped twice"),
    ("twice_in_row", "mapped twice"),
    ("stale_slot", "past a row's length"),
    ("empty_not_zero", "EMPTY slot"),
    ("layers_disagree", "layers disagree"),
    ("length", "lengths"),
    ("flag", "overflow"),
])
def test_check_pool_reports_each_broken_invariant(case, message):
    pool, layers = _filled()
    t = np.asarray(layers[0].tables)
    p00 = int(t[0, 0, 0])
    if case == "refcount":
        pool = pool.replace(refcount=pool.refcount.at[p00].add(1))
    elif case == "negative":
        pool = pool.replace(refcount=pool.refcount.at[9].set(-1))
    elif case == "free_listed":  # a free page handed to sequence 1 behind the allocator's back
        free = int(np.nonzero(np.asarray(pool.refcount)[1:] == 0)[0][0]) + 1
        layers = _corrupt(layers, tables=lambda l: l.tables.at[1, 0, 2].set(free))
    elif case == "null_written":
        layers = _corrupt(layers, k=lambda l: l.k.at[NULL_PAGE, 0, 0].set(jnp.nan))
    elif case == "null_counted":
        pool = pool.replace(refcount=pool.refcount.at[NULL_PAGE].set(1))
    elif case == "cross_head":  # head 1 of sequence 1 lists head 0's page
        old = int(t[1, 1, 0])
        layers = _corrupt(layers, tables=lambda l: l.tables.at[1, 1, 0].set(p00))
        pool = pool.replace(refcount=pool.refcount.at[p00].add(1).at[old].add(-1))
    elif case == "twice_in_row":
        old = int(t[0, 0, 1])
        layers = _corrupt(layers, tables=lambda l: l.tables.at[0, 0, 1].set(p00))
        pool = pool.replace(refcount=pool.refcount.at[p00].add(1).at[old].add(-1))
    elif case == "stale_slot":  # a slot past sequence 0's length holds a position
        p = int(t[0, 0, 1])
        layers = _corrupt(layers, pos=lambda l: l.pos.at[p, 0, 3].set(7))
    elif case == "empty_not_zero":
        p = int(t[0, 0, 1])
        layers = _corrupt(layers, v=lambda l: l.v.at[p, 3, 0].set(jnp.inf))
    elif case == "layers_disagree":
        layers = (layers[0], layers[1].replace(lengths=layers[1].lengths.at[1, 0].set(5)))
    elif case == "length":
        layers = _corrupt(layers, lengths=lambda l: l.lengths.at[0, 1].set(3 * S + 1))
    elif case == "flag":
        pool = pool.replace(overflow=jnp.ones((), bool))
    with pytest.raises(PoolError, match=message):
        check_pool(pool, layers)


def test_an_empty_write_changes_nothing():
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=1)
    pool, layers = reserve(pool, layers, jnp.array([3, 0]))
    layer = layers[0].write(jnp.zeros((2, 1, 0, D)), jnp.zeros((2, 1, 0, D)),
                            jnp.zeros((2, 0), jnp.int32))
    assert layer is layers[0]
    check_pool(pool, (layer,))


def test_pool_functions_reject_malformed_arguments():
    pool, layers = init_paged_cache(8, S, 2, 1, 4, D, num_layers=1)
    with pytest.raises(ValueError, match=r"new_tokens.*\[2\]"):
        reserve(pool, layers, jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="new_tokens.*integer"):
        reserve(pool, layers, jnp.array([1.5, 2.0]))
    with pytest.raises(ValueError, match=r"fork: source\[1\] = 2"):
        fork(pool, layers, jnp.array([-1, 2], jnp.int32))
    with pytest.raises(ValueError, match="rows.*bool"):
        release(pool, layers, jnp.array([0, 1]))
    with pytest.raises(ValueError, match="drop.*bool"):
        evict_pages(pool, layers, jnp.zeros((2, 1, 3), bool))
    # under jit a bad fork source is a flag that check_pool raises on
    pool, layers = jax.jit(fork)(pool, layers, jnp.array([-1, 5], jnp.int32))
    with pytest.raises(ValueError, match=r"fork: source\[1\] = 5"):
        check_pool(pool)
