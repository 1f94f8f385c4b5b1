"""Paged KIVI (kvjax/memory/paged_kivi.py, issue 20): KIVI groups in pool pages, offloadable.

- every flushed page holds bit for bit the codes and parameters the unpaged KIVI layer stores
  for the same tokens, through a prompt (with left padding) and decode writes;
- attention over the paged layer equals the unpaged layer's (float tolerance: the summation
  runs over a different padding), and over half the pages on the host equals all on device
  bit for bit;
- an eviction after KIVI (codes compacted across groups) is refused with a ValueError;
- the monitor reads a paged KIVI layer (tokens as the unpaged layer, pages per tier).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.memory import tiers
from kvjax.core.cache import EMPTY
from kvjax.memory.paged_kivi import (bodies, flush_tokens, from_residual, unpaged_groups, with_bodies)
from kvjax.memory.paging import check_pool, reserve

B, KVH, D, G, RES = 2, 2, 64, 8, 8
PROMPT, STEPS, CAP = 21, 16, 64


def prompt_cache(key=0):
    """A dense layer of a 21-token prompt; sequence 1 left-padded by 3 (EMPTY positions)."""
    k, v = jax.random.normal(jax.random.key(key), (2, B, KVH, PROMPT, D)) * 3
    pos = jnp.broadcast_to(jnp.arange(PROMPT), (B, PROMPT))
    pos = pos.at[1, :3].set(EMPTY).at[1, 3:].add(-3)
    return (kvjax.write(kvjax.init_cache(B, KVH, CAP, D), k, v, pos),)


def unpaged_body(layer):
    """The unpaged KIVI body as slot arrays [R, Lb, ...] and key tables [R, Lb/G, D]."""
    body, n = layer.body, int(layer.body.length)
    return {"k_words": body.k.words[:, :n], "k_scale": body.k.scale[:, :n // G],
            "k_offset": body.k.offset[:, :n // G], "v_words": body.v.words[:, :n],
            "v_scale": body.v.scale[:, :n], "v_offset": body.v.offset[:, :n],
            "pos": body.pos.reshape(B * KVH, -1)[:, :n]}


groups_of = jax.jit(unpaged_groups)
attend = jax.jit(kvjax.attend)


def assert_same_bits(paged, unpaged):
    want, got = unpaged_body(unpaged), groups_of(paged)
    n = want["pos"].shape[1]
    assert (np.asarray(paged.body.lengths) == n).all()
    valid = np.asarray(want["pos"]) != EMPTY
    np.testing.assert_array_equal(np.asarray(got["pos"])[:, :n], np.asarray(want["pos"]))
    np.testing.assert_array_equal(np.asarray(got["k_live"])[:, :n], valid)
    for name in ("k_words", "v_words", "v_scale", "v_offset"):  # per slot: the valid ones
        np.testing.assert_array_equal(np.asarray(got[name])[:, :n][valid],
                                      np.asarray(want[name])[valid], err_msg=name)
    group_valid = valid.reshape(valid.shape[0], -1, G).any(-1)  # groups holding a token
    for name in ("k_scale", "k_offset"):
        np.testing.assert_array_equal(np.asarray(got[name])[:, :n // G][group_valid],
                                      np.asarray(want[name])[group_valid], err_msg=name)
    assert want["pos"].size and group_valid.any()


@pytest.mark.parametrize("bits", [2, 4])
def test_flushed_pages_bit_identical_to_unpaged_kivi(bits):
    t = kvjax.kivi(bits=bits, group=G, residual=RES)
    unpaged, _ = t.update(prompt_cache(), t.init(prompt_cache()), None)
    npages = CAP // G
    plain = from_residual(unpaged, max_pages=npages, device_pages=B * KVH * npages + 1)
    tiered = from_residual(unpaged, max_pages=npages, device_pages=B * KVH * npages // 2 + 2,
                           host_pages=B * KVH * npages // 2)
    write = jax.jit(lambda l, k, v, p: tuple(kvjax.write(x, k, v, p) for x in l))
    q = jax.random.normal(jax.random.key(9), (B, 1, 2 * KVH, D))
    (p0, l0), (p1, l1) = plain, tiered
    assert_same_bits(l0[0], unpaged[0])
    flushed = 0
    for step in range(STEPS):
        k, v = jax.random.normal(jax.random.key(100 + step), (2, B, KVH, 1, D)) * 3
        pos = jnp.array([[PROMPT + step], [PROMPT - 3 + step]])
        flushed += int(flush_tokens(l0)[0])
        p0, b0 = reserve(p0, bodies(l0), flush_tokens(l0))
        p1, b1 = reserve(p1, bodies(l1), flush_tokens(l1))
        l0, l1 = with_bodies(l0, b0), with_bodies(l1, b1)
        unpaged = write(unpaged, k, v, pos)
        l0, l1 = write(l0, k, v, pos), write(l1, k, v, pos)
        assert_same_bits(l0[0], unpaged[0])
        assert_same_bits(l1[0], unpaged[0])
        # half of the allocated pages to the host (as far as the last pages allow), staged
        n = tiers.tier_counts(p1, l1[0].body)["allocated"] // 2
        p1, b1 = tiers.spill(p1, bodies(l1), tiers.coldest_pages(
            l1[0].body, tiers.recency_scores(l1[0].body), n))
        b1 = tiers.prefetch(b1, tiers.host_pages_in_use(b1[0]))
        l1 = with_bodies(l1, b1)
        if step % 5 == 4:
            check_pool(p0, bodies(l0))
            check_pool(p1, bodies(l1))
        qpos = pos + 1
        want = np.asarray(attend(q, qpos, unpaged[0]))
        got0 = np.asarray(attend(q, qpos, l0[0]))
        got1 = np.asarray(attend(q, qpos, l1[0]))
        np.testing.assert_array_equal(got1, got0)  # offloaded == all on device, bit for bit
        np.testing.assert_allclose(got0, want, rtol=1e-5, atol=1e-5)
    assert flushed >= 2 * G  # the decode flushed pages, not only the prompt
    assert tiers.tier_counts(p1, l1[0].body)["host"] > 0
    assert_same_bits(l1[0], unpaged[0])
    check_pool(p0, bodies(l0))
    check_pool(p1, bodies(l1))
    # the monitor reads a paged KIVI layer: the unpaged layer's tokens, its pages per tier
    from kvjax.tools.monitor import init_monitor
    mu, m0, m1 = (init_monitor(c)[0] for c in (unpaged, l0, l1))
    for m in (m0, m1):
        np.testing.assert_array_equal(np.asarray(m.tokens), np.asarray(mu.tokens))
    body = l1[0].body
    used = np.arange(body.tables.shape[-1]) < np.asarray(body.num_pages_used)[..., None]
    on_host = used & (np.asarray(body.tables) >= body.device_pages)
    np.testing.assert_array_equal(np.asarray(m1.pages_host), on_host.sum(-1))
    np.testing.assert_array_equal(np.asarray(m1.pages_device), (used & ~on_host).sum(-1))
    assert on_host.any()


def test_eviction_after_kivi_cannot_be_paged():
    t = kvjax.chain(kvjax.kivi(bits=4, group=G, residual=RES), kvjax.knorm(ratio=0.5))
    cache = prompt_cache()
    small, _ = t.update(cache, t.init(cache), None)
    with pytest.raises(ValueError, match="eviction after KIVI"):
        from_residual(small, max_pages=8, device_pages=40)
    with pytest.raises(ValueError, match="not an unpaged KIVI layer"):
        from_residual(cache, max_pages=8, device_pages=40)


def test_shared_tables_hold_what_per_head_tables_hold_and_the_kernel_reads_one_table():
    """`from_residual(shared_tables=True)`: after the same flushes into new pages the pool
    passes its audit (aligned groups of KV heads), the body's groups equal the per-head pool's
    bit for bit, the TPU kernel gets one [B, NP] table (head_stride 1) and its attention equals
    the per-head pool's and the reference (interpret mode). A tiered body with shared tables
    spills and stages whole groups, and the kernel reads both its tiers with one table each."""
    from kvjax.backends import pallas as ka
    t = kvjax.kivi(bits=4, group=G, residual=RES)
    unpaged, _ = t.update(prompt_cache(4), t.init(prompt_cache(4)), None)
    def grown(host_pages, shared):  # two writes, each flushing a group into new pages
        pool, layers = from_residual(unpaged, max_pages=CAP // G, device_pages=40,
                                     host_pages=host_pages, shared_tables=shared)
        for step in range(2):
            pool, b = reserve(pool, bodies(layers), flush_tokens(layers))
            layers = with_bodies(layers, b)
            k, v = jax.random.normal(jax.random.key(60 + step), (2, B, KVH, 12, D))
            layers = (layers[0].write(k, v, jnp.broadcast_to(30 + 12 * step + jnp.arange(12),
                                                             (B, 12))),)
        check_pool(pool, bodies(layers))
        return pool, layers

    runs = {shared: grown(0, shared)[1][0] for shared in (False, True)}
    per_head, shared = runs[False], runs[True]
    assert shared.body.shared_tables and int(jnp.max(shared.body.lengths)) == 3 * G
    for name, x in groups_of(per_head).items():
        np.testing.assert_array_equal(np.asarray(groups_of(shared)[name]), np.asarray(x),
                                      err_msg=name)
    inputs = ka.kernel_inputs(shared.body, backend="tpu")
    assert inputs["head_stride"] == 1 and inputs["block_tables"].shape == (B, CAP // G)
    q = jax.random.normal(jax.random.key(7), (B, 1, 3 * KVH, D))
    q_pos = jnp.full((B, 1), 54, jnp.int32)
    run = lambda layer: np.asarray(ka.attend_pallas(q, q_pos, layer, backend="tpu",
                                                    interpret=True))
    want = np.asarray(kvjax.attend(q, q_pos, shared, impl="reference"))
    np.testing.assert_allclose(run(shared), want, rtol=3e-5, atol=3e-5)
    np.testing.assert_array_equal(run(shared), run(per_head))
    pool, layers = grown(8, True)
    b = tiers.spill(pool, bodies(layers), tiers.coldest_pages(
        layers[0].body, tiers.recency_scores(layers[0].body), 1))  # one page: its group
    pool, b = b[0], tiers.prefetch(b[1], tiers.host_pages_in_use(b[1][0]))
    layers = with_bodies(layers, b)
    check_pool(pool, bodies(layers))
    assert tiers.tier_counts(pool, layers[0].body)["host"] == KVH
    for view in ka.tier_views(layers[0].body):
        assert ka.kernel_inputs(view, backend="tpu")["head_stride"] == 1
    want = np.asarray(kvjax.attend(q, q_pos, layers[0], impl="reference"))
    np.testing.assert_allclose(run(layers[0]), want, rtol=3e-5, atol=3e-5)


def test_pages_released_by_one_sequence_are_never_read_by_the_other():
    """Sequence 0's KIVI pages go to the host and are staged, then it releases them; sequence
    1 keeps decoding, its flushes and spills reuse the freed ids. The stage forgets the freed
    pages, the pool audit holds, and sequence 1 reads only positions it wrote."""
    from kvjax.memory.paging import release
    t = kvjax.kivi(bits=4, group=G, residual=RES)
    unpaged, _ = t.update(prompt_cache(), t.init(prompt_cache()), None)
    pool, layers = from_residual(unpaged, max_pages=CAP // G, device_pages=12, host_pages=4)
    write = jax.jit(lambda l, k, v, p: tuple(kvjax.write(x, k, v, p) for x in l))
    for step in range(8):  # a second page per row: the first becomes spillable
        k, v = jax.random.normal(jax.random.key(50 + step), (2, B, KVH, 1, D))
        pool, b = reserve(pool, bodies(layers), flush_tokens(layers))
        layers = write(with_bodies(layers, b), k, v, jnp.array([[21 + step], [18 + step]]))
    pool, b = tiers.spill(pool, bodies(layers), tiers.coldest_pages(
        layers[0].body, tiers.recency_scores(layers[0].body), 4))
    b = tiers.prefetch(b, tiers.host_pages_in_use(b[0]))
    freed = set(np.asarray(b[0].tables)[0].reshape(-1).tolist()) - {0}
    assert freed & set(np.asarray(b[0].stage_ids).tolist())  # staged pages of sequence 0
    pool, b = release(pool, b, jnp.array([True, False]))
    assert not freed & set(np.asarray(b[0].stage_ids).tolist())  # the stage forgot them
    layers = with_bodies(layers, b)
    for step in range(12):
        k, v = jax.random.normal(jax.random.key(step), (2, B, KVH, 1, D))
        pos = jnp.array([[1000 + step], [100 + step]])
        pool, b = reserve(pool, bodies(layers), flush_tokens(layers))
        layers = write(with_bodies(layers, b), k, v, pos)
        n = tiers.tier_counts(pool, layers[0].body)["allocated"] // 2
        pool, b = tiers.spill(pool, bodies(layers), tiers.coldest_pages(
            layers[0].body, tiers.recency_scores(layers[0].body), n))
        layers = with_bodies(layers, b)
    check_pool(pool, bodies(layers))
    reused = set(np.asarray(layers[0].body.tables)[1].reshape(-1).tolist()) & freed
    assert reused  # sequence 1 now holds ids sequence 0 freed
    seen = np.asarray(groups_of(layers[0])["pos"])[KVH:2 * KVH]  # sequence 1's rows
    mine = set(range(PROMPT - 3 + 8)) | set(range(100, 112))
    assert set(seen[seen != EMPTY].tolist()) <= mine


@pytest.mark.parametrize("param_dtype", ["float16", "float32"])
def test_paged_kivi_attends_through_the_tpu_kernel(param_dtype):
    """A paged KIVI layer goes to the TPU kernel part by part (its body's pages, keys read as
    the pool keeps them in `PackedChannelPages`, then the exact part; TPU interpret mode here)
    and gives the reference's attention, with and without a window, before and after a write
    that flushes groups into new pages, and with a tiered body (pages spilled to host memory and
    staged). The GPU kernel does not take the format (the layer attends through XLA there)."""
    from kernels_pallas import page_formats as pf
    from kvjax.backends import pallas as ka
    t = kvjax.kivi(bits=4, group=G, residual=RES, param_dtype=param_dtype)
    cache = prompt_cache(3)
    unpaged, _ = t.update(cache, t.init(cache), None)
    pool, layers = from_residual(unpaged, max_pages=8, device_pages=40)
    assert ka.kernel_layout(layers[0]) == "parts" and ka.supports_pallas(layers[0], "tpu")
    assert not ka.supports_pallas(layers[0], "gpu")
    assert isinstance(ka.kernel_inputs(layers[0].body, backend="tpu")["k_format"],
                      pf.PackedChannelPages)
    q = jax.random.normal(jax.random.key(5), (B, 1, 3 * KVH, D))
    k, v = jax.random.normal(jax.random.key(6), (2, B, KVH, 12, D))
    for step in range(2):
        layer = layers[0]
        q_pos = jnp.full((B, 1), int(jnp.max(layer.view().pos)) + 1, jnp.int32)
        for window in (None, 9):
            got = ka.attend_pallas(q, q_pos, layer, window=window, backend="tpu",
                                   interpret=True, pages_per_split=2)
            want = kvjax.attend(q, q_pos, layer, impl="reference", window=window)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=3e-5, atol=3e-5)
        pool, new = reserve(pool, bodies(layers), flush_tokens(layers))
        layers = with_bodies(layers, new)
        pos = q_pos + jnp.arange(12)
        layers = (layers[0].write(k, v, pos),)
    assert int(jnp.max(layers[0].body.lengths)) > int(jnp.max(layer.body.lengths))
    # a tiered body: its device pages and its stage, two kernel calls (tier_views)
    pool, tiered = from_residual(unpaged, max_pages=8, device_pages=40, host_pages=8)
    for step in range(2):  # groups flushed into more pages: the older ones can spill
        pool, b = reserve(pool, bodies(tiered), flush_tokens(tiered))
        tiered = with_bodies(tiered, b)
        new_pos = jnp.broadcast_to(40 + 12 * step + jnp.arange(12), (B, 12))
        tiered = (tiered[0].write(k, v, new_pos),)
    pool, b = tiers.spill(pool, bodies(tiered), tiers.coldest_pages(
        tiered[0].body, tiers.recency_scores(tiered[0].body), 4))
    b = tiers.prefetch(b, tiers.host_pages_in_use(b[0]))
    (layer,) = with_bodies(tiered, b)
    assert int(tiers.tier_counts(pool, layer.body)["host"]) > 0
    assert ka.supports_pallas(layer, "tpu") and not ka.supports_pallas(layer, "gpu")
    q_pos = jnp.full((B, 1), int(jnp.max(layer.view().pos)) + 1, jnp.int32)
    got = ka.attend_pallas(q, q_pos, layer, backend="tpu", interpret=True)
    want = kvjax.attend(q, q_pos, layer, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=3e-5, atol=3e-5)
