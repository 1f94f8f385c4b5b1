"""The Pallas paged attention kernel against its plain-jnp reference (interpret mode on CPU).

Every case runs the kernel body as written for TPU (`backend="tpu"`, generic
interpret; a few cases with TPU semantics, `pltpu.InterpretParams()`) and for
GPU (`backend="gpu"`), and compares element-wise with
`paged_attention_reference` on the same (encoded) pages. Lowering for real
TPUs and GPUs is checked with `jax.export`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_mode import mode
from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import (EMPTY, decode_pages, merge, paged_attention,
                                            paged_attention_partial, paged_attention_reference)
from kvjax.core.quant import pack, quantize

TOL = dict(rtol=2e-5, atol=2e-5)  # float32 inputs; the kernel and reference sum in different orders


def make_pool(rng, *, batch, kv_heads, page_size, head_dim, lengths, extra_pages=3, dtype=jnp.float32):
    """A shuffled pool: row (b, h) holds lengths[b] contiguous positions in its pages."""
    n_table = max(-(-max(lengths) // page_size), 1)
    n_pages = batch * kv_heads * n_table + extra_pages
    perm = rng.permutation(n_pages)[: batch * kv_heads * n_table]
    tables = perm.reshape(batch, kv_heads, n_table).astype(np.int32)
    pos = np.full((n_pages, 1, page_size), EMPTY, np.int32)
    for b in range(batch):
        for h in range(kv_heads):
            for i in range(lengths[b]):
                pos[tables[b, h, i // page_size], 0, i % page_size] = i
    counts = np.array([[-(-n // page_size)] * kv_heads for n in lengths], np.int32)
    k = jnp.asarray(rng.normal(size=(n_pages, page_size, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(n_pages, page_size, head_dim)), dtype)
    return k, v, jnp.asarray(pos), jnp.asarray(tables), jnp.asarray(counts)


def queries(rng, batch, t, heads, head_dim, lengths):
    q = jnp.asarray(rng.normal(size=(batch, t, heads, head_dim)), jnp.float32)
    q_pos = jnp.asarray([[n - t + i for i in range(t)] for n in lengths], jnp.int32)
    return q, q_pos


def run_both(q, q_pos, k, v, pos, tables, counts, backend, interpret=True, **kw):
    """(kernel, reference) outputs; interpret mode, or compiled with KVJAX_PALLAS_COMPILED=1."""
    backend, interpret = mode(backend, interpret)
    want = paged_attention_reference(q, q_pos, k, v, pos, tables, counts, **kw)
    got = paged_attention(q, q_pos, k, v, pos, tables, counts, backend=backend,
                          interpret=interpret, **kw)
    return np.asarray(got), np.asarray(want)


# lengths cover 0, 1, page-1, page, page+1 and a full table, in ragged batches
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("head_dim,kv_heads,group,page_size", [
    (64, 2, 1, 16), (128, 1, 8, 16), (64, 1, 3, 32), (64, 1, 3, 128)],
    ids=["d64-mha-p16", "d128-gqa8-p16", "d64-gqa3-p32", "d64-gqa3-p128"])
def test_decode_matches_reference(backend, head_dim, kv_heads, group, page_size):
    rng = np.random.default_rng(head_dim + group)
    lengths = [0, 1, page_size - 1, page_size, page_size + 1, 3 * page_size]
    k, v, pos, tables, counts = make_pool(rng, batch=len(lengths), kv_heads=kv_heads,
                                          page_size=page_size, head_dim=head_dim, lengths=lengths)
    q, q_pos = queries(rng, len(lengths), 1, kv_heads * group, head_dim, lengths)
    q_pos = jnp.maximum(q_pos, 0)
    got, want = run_both(q, q_pos, k, v, pos, tables, counts, backend, pages_per_split=2)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.all(got[0] == 0)  # an empty row attends to nothing


def test_tpu_semantics_interpret():
    """TPU interpret mode (DMA and semaphores simulated) on a small ragged batch."""
    rng = np.random.default_rng(7)
    lengths = [5, 16, 17]
    k, v, pos, tables, counts = make_pool(rng, batch=3, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    q, q_pos = queries(rng, 3, 1, 6, 64, lengths)
    got, want = run_both(q, q_pos, k, v, pos, tables, counts, "tpu",
                         interpret=pltpu.InterpretParams(), pages_per_split=1)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_prefill_chunk_is_causal_with_window_and_softcap(backend):
    """T = 5 queries per sequence (a prefill chunk), causal by position, window and soft-cap."""
    rng = np.random.default_rng(3)
    lengths = [9, 33]
    k, v, pos, tables, counts = make_pool(rng, batch=2, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    q, q_pos = queries(rng, 2, 5, 4, 64, lengths)
    q_pos = q_pos.at[0, 0].set(-1)  # a padding query
    got, want = run_both(q, q_pos, k * 4, v, pos, tables, counts, backend, window=7, softcap=5.0)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.all(got[0, 0] == 0)
    # the causal mask matters: attending without it differs
    loose = paged_attention_reference(q, q_pos.at[:, :].add(100), k * 4, v, pos, tables, counts)
    assert not np.allclose(np.asarray(loose), want, atol=1e-3)


def test_splits_merge_to_the_unsplit_result():
    rng = np.random.default_rng(4)
    k, v, pos, tables, counts = make_pool(rng, batch=2, kv_heads=1, page_size=16, head_dim=64,
                                          lengths=[70, 40])
    q, q_pos = queries(rng, 2, 1, 3, 64, [70, 40])
    backend, interpret = mode("tpu")
    outs = [paged_attention(q, q_pos, k, v, pos, tables, counts, pages_per_split=n,
                            backend=backend, interpret=interpret) for n in (1, 2, 5)]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], **TOL)


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams()], ids=["generic", "tpu-dma"])
@pytest.mark.parametrize("pages_per_block,pages_per_split", [(2, 4), (3, 3), (1, 2), (4, 8)])
def test_multi_page_blocks_and_splits(interpret, pages_per_block, pages_per_split):
    """TPU grid steps of several pages (double-buffered DMAs), several blocks per split, splits,
    and partly filled last blocks: every ragged row still matches the reference."""
    rng = np.random.default_rng(pages_per_block * 10 + pages_per_split)
    lengths = [0, 1, 17, 50, 112]  # 0 to 7 pages of 16
    k, v, pos, tables, counts = make_pool(rng, batch=5, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    q, q_pos = queries(rng, 5, 1, 4, 64, lengths)
    q_pos = jnp.maximum(q_pos, 0)
    fmt = pf.PackedTokens(4, 32)
    got, want = run_both(q, q_pos, packed_tokens(k, 4, 32, False), v, pos, tables, counts, "tpu",
                         interpret=interpret, k_format=fmt, pages_per_block=pages_per_block,
                         pages_per_split=pages_per_split)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.all(got[0] == 0)


def test_merge_is_softmax_over_the_union():
    """Attention over two disjoint page sets, merged, equals attention over both."""
    rng = np.random.default_rng(5)
    k, v, pos, tables, counts = make_pool(rng, batch=1, kv_heads=1, page_size=16, head_dim=64,
                                          lengths=[64])
    q, q_pos = queries(rng, 1, 1, 2, 64, [64])
    backend, interpret = mode("tpu")
    part = lambda t: paged_attention_partial(q, q_pos, k, v, pos, t, jnp.full((1, 1), 2, jnp.int32),
                                             backend=backend, interpret=interpret)
    merged = merge(part(tables[..., :2]), part(tables[..., 2:]))
    whole = paged_attention_partial(q, q_pos, k, v, pos, tables, counts, backend=backend,
                                    interpret=interpret)
    np.testing.assert_allclose(merged.acc / merged.l[..., None], whole.acc / whole.l[..., None],
                               **TOL)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_dense_pages_with_slots_last(backend):
    """Dense(slots_last=True) reads [P, D, S] pages: the same attention as [P, S, D]."""
    rng = np.random.default_rng(9)
    lengths = [1, 40, 64]
    k, v, pos, tables, counts = make_pool(rng, batch=3, kv_heads=1, page_size=16, head_dim=64,
                                          lengths=lengths, dtype=jnp.bfloat16)
    q, q_pos = queries(rng, 3, 1, 3, 64, lengths)
    t = lambda x: jnp.swapaxes(x, 1, 2)
    got, want = run_both(q, q_pos, t(k), v, pos, tables, counts, backend, k_format=pf.DENSE_T)
    np.testing.assert_allclose(got, want, **TOL)
    got, want = run_both(q, q_pos, k, t(v), pos, tables, counts, backend, v_format=pf.DENSE_T)
    np.testing.assert_allclose(got, want, **TOL)


def test_bfloat16_pages():
    rng = np.random.default_rng(6)
    k, v, pos, tables, counts = make_pool(rng, batch=2, kv_heads=2, page_size=32, head_dim=128,
                                          lengths=[50, 64], dtype=jnp.bfloat16)
    q, q_pos = queries(rng, 2, 1, 4, 128, [50, 64])
    got, want = run_both(q, q_pos, k, v, pos, tables, counts, "tpu")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # same bf16 inputs, f32 math


def packed_tokens(x, bits, group, symmetric, param_dtype="float16"):
    """x [P, S, D] quantized per token by kvjax.core.quant, in the kernel's page layout."""
    q = quantize(x, bits, group, axis=-1, symmetric=symmetric, param_dtype=jnp.dtype(param_dtype))
    fmt = pf.PackedTokens(bits, group, symmetric, param_dtype)
    return fmt.from_store(pack(q.codes, bits), q.scale, None if symmetric else q.offset)


def packed_channels(rng, x, bits, window, symmetric, param_dtype="float16"):
    """Per-channel codes of x [P, S, D]: random codes, random slot rows of random page windows."""
    n, s, d = x.shape
    codes = jnp.asarray(rng.integers(0, 2 ** bits, size=x.shape), jnp.uint8)
    local = jnp.asarray(rng.integers(0, window, size=(n, 1, s)), jnp.uint32)
    scale = rng.random((n, window, d)) * 0.1
    offset = rng.normal(size=(n, window, d))
    params = scale if symmetric else np.concatenate([scale, offset], axis=1)
    pages = jnp.concatenate([jnp.swapaxes(pack(codes, bits), 1, 2), local], axis=1)
    return pf.lane_flat(pages), pf.lane_flat(pf.pack_rows(jnp.asarray(params, param_dtype),
                                                          param_dtype))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("bits,group,symmetric", [(8, 64, False), (4, 32, False), (2, 16, True)])
def test_packed_token_pages(backend, bits, group, symmetric):
    """int8 / int4 / int2 per-token keys and values, dequantized in the kernel."""
    rng = np.random.default_rng(bits)
    lengths = [1, 17, 48]
    k, v, pos, tables, counts = make_pool(rng, batch=3, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    fmt = pf.PackedTokens(bits, group, symmetric)
    kp, vp = packed_tokens(k, bits, group, symmetric), packed_tokens(v, bits, group, symmetric)
    q, q_pos = queries(rng, 3, 1, 4, 64, lengths)
    got, want = run_both(q, q_pos, kp, vp, pos, tables, counts, backend, k_format=fmt,
                         v_format=fmt)
    np.testing.assert_allclose(got, want, **TOL)
    # the reference decodes what kvjax's own dequantization gives
    dense, _ = run_both(q, q_pos, k, v, pos, tables, counts, backend)
    assert np.abs(dense - want).max() < {8: 0.05, 4: 0.5, 2: 2.0}[bits]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("bits,symmetric", [(4, False), (2, True)])
def test_packed_channel_keys(backend, bits, symmetric):
    """KIVI keys: per-channel codes whose slots name rows of a per-(sequence, head) table."""
    rng = np.random.default_rng(10 + bits)
    lengths = [20, 33]
    k, v, pos, tables, counts = make_pool(rng, batch=2, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    kp = packed_channels(rng, k, bits, window=5, symmetric=symmetric)
    vp = packed_tokens(v, 2, 32, False)
    q, q_pos = queries(rng, 2, 1, 4, 64, lengths)
    got, want = run_both(q, q_pos, kp, vp, pos, tables, counts, backend,
                         k_format=pf.PackedChannels(bits, 5, symmetric),
                         v_format=pf.PackedTokens(2, 32))
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("value_dim,packed", [(32, False), (128, True)], ids=["dense-v32",
                                                                               "int4-v128"])
def test_values_may_have_their_own_head_dim(backend, value_dim, packed):
    """Keys and queries of 64 channels, values of `value_dim` (low-rank latents of different
    ranks, MLA-style heads): the output is [B, T, H, value_dim], equal to a plain numpy
    softmax(q k^T / 8) v over each row's positions (and to the reference)."""
    rng = np.random.default_rng(value_dim)
    lengths = [5, 40]
    k, _, pos, tables, counts = make_pool(rng, batch=2, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    v = jnp.asarray(rng.normal(size=(k.shape[0], 16, value_dim)), jnp.float32)
    q, q_pos = queries(rng, 2, 3, 4, 64, lengths)
    fmt = dict(v_format=pf.PackedTokens(4, 32)) if packed else {}
    v_in = packed_tokens(v, 4, 32, False) if packed else v
    got, want = run_both(q, q_pos, k, v_in, pos, tables, counts, backend, value_dim=value_dim,
                         **fmt)
    assert got.shape == (2, 3, 4, value_dim)
    np.testing.assert_allclose(got, want, **TOL)
    if packed:  # numpy below weighs the decoded codes
        v = decode_pages(pf.PackedTokens(4, 32), v_in, value_dim)
    kn, vn, pn = np.asarray(k), np.asarray(v), np.asarray(pos)
    for b in range(2):
        for hq in range(4):
            pages = np.asarray(tables)[b, hq // 2]
            keys, vals = kn[pages].reshape(-1, 64), vn[pages].reshape(-1, value_dim)
            slot_pos = pn[pages, 0].reshape(-1)
            for t in range(3):
                s = keys @ np.asarray(q)[b, t, hq] / 8.0
                s = np.where((slot_pos >= 0) & (slot_pos <= int(q_pos[b, t])), s, -np.inf)
                p = np.exp(s - s.max())
                np.testing.assert_allclose(got[b, t, hq], p @ vals / p.sum(), **TOL)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_slots_owned_by_heads_are_seen_by_their_heads_only(backend):
    """A pooled pool (head-wise budgets): one KV row per sequence whose slots are each owned by
    one of 3 KV heads (`own_positions`); 6 query heads, two per owner, in one kernel row
    (`slot_owners=3`). Each query head attends only to its owner's slots: equal to a numpy
    softmax over exactly those slots, for 2 query tokens and with a window."""
    from kernels_pallas.paged_attention import own_positions
    rng = np.random.default_rng(21)
    b, kvh, s, n_pages, d = 2, 3, 16, 8, 32
    owner = rng.integers(0, kvh, size=(b, n_pages * s // b))  # each slot's head
    real = np.tile(np.arange(n_pages * s // b), (b, 1))  # slot i holds position i
    pos = np.where(owner[:, None, :] == np.arange(kvh)[None, :, None], real[:, None, :], -1)
    pos[:, :, -5:] = -1  # free slots at the end
    owned = own_positions(jnp.asarray(pos, jnp.int32))  # [B, 1, C]
    pos_pages = owned.reshape(b * n_pages // b, 1, s)  # row b's pages b*4 .. b*4 + 3
    tables = jnp.arange(n_pages, dtype=jnp.int32).reshape(b, 1, n_pages // b)
    counts = jnp.full((b, 1), n_pages // b, jnp.int32)
    k = jnp.asarray(rng.normal(size=(n_pages, s, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(n_pages, s, d)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(b, 2, 6, d)), jnp.float32)
    q_pos = jnp.asarray([[40, 41], [50, 58]], jnp.int32)
    for window in (None, 20):
        got, want = run_both(q, q_pos, k, v, pos_pages, tables, counts, backend,
                             slot_owners=kvh, window=window)
        np.testing.assert_allclose(got, want, **TOL)
        kn, vn = np.asarray(k).reshape(b, -1, d), np.asarray(v).reshape(b, -1, d)
        for bi in range(b):
            for hq in range(6):
                for t in range(2):
                    qp = int(q_pos[bi, t])
                    mine = pos[bi, hq // 2]  # this head's owner's positions, -1 elsewhere
                    seen = (mine >= 0) & (mine <= qp)
                    if window is not None:
                        seen &= qp - mine < window
                    sc = kn[bi] @ np.asarray(q)[bi, t, hq] / np.sqrt(d)
                    p = np.where(seen, np.exp(sc - sc[seen].max()), 0.0)
                    np.testing.assert_allclose(got[bi, t, hq], p @ vn[bi] / p.sum(), **TOL)


def test_tpu_semantics_interpret_quantized():
    """TPU interpret mode over KIVI keys (one-hot table gather) and int4 values."""
    rng = np.random.default_rng(8)
    lengths = [3, 20]
    k, v, pos, tables, counts = make_pool(rng, batch=2, kv_heads=1, page_size=16, head_dim=64,
                                          lengths=lengths)
    kp = packed_channels(rng, k, 4, window=3, symmetric=False)
    q, q_pos = queries(rng, 2, 1, 3, 64, lengths)
    got, want = run_both(q, q_pos, kp, packed_tokens(v, 4, 32, False), pos, tables, counts, "tpu",
                         interpret=pltpu.InterpretParams(), k_format=pf.PackedChannels(4, 3),
                         v_format=pf.PackedTokens(4, 32))
    np.testing.assert_allclose(got, want, **TOL)


def test_bad_inputs_raise():
    rng = np.random.default_rng(0)
    k, v, pos, tables, counts = make_pool(rng, batch=1, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=[5])
    q, q_pos = queries(rng, 1, 1, 4, 64, [5])
    call = functools.partial(paged_attention, interpret=True)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        call(q[:, :, :3], q_pos, k, v, pos, tables, counts)
    with pytest.raises(ValueError, match="num_pages"):
        call(q, q_pos, k, v, pos, tables, counts[:, :1])
    with pytest.raises(ValueError, match="do not match"):
        call(q, q_pos, k[:, :8], v, pos, tables, counts)
    with pytest.raises(ValueError, match="backend"):
        call(q, q_pos, k, v, pos, tables, counts, backend="metal")
    with pytest.raises(ValueError, match="uint32"):
        call(q, q_pos, k, v, pos, tables, counts,
             k_format=pf.PackedTokens(4, 32))
    with pytest.raises(ValueError, match="int32"):
        call(q, q_pos, k, v, pos, tables.astype(jnp.int16), counts)
    with pytest.raises(ValueError, match="slot_owners must be a positive int dividing the 4 "
                                         "query heads, got 3"):
        call(q, q_pos, k, v, pos, tables[:, :1], counts[:, :1], slot_owners=3)
    with pytest.raises(ValueError, match="num_pages must be .B, 1., got 2 KV heads"):
        call(q, q_pos, k, v, pos, tables, counts, slot_owners=2)
    with pytest.raises(ValueError, match=r"q_seq must be int32 \[B=1\]"):
        call(q, q_pos, k, v, pos, tables, counts, q_seq=jnp.zeros((2,), jnp.int32))
    from kernels_pallas.paged_attention import ragged_paged_attention
    with pytest.raises(ValueError, match="cu_q_lens has 2 sequences, num_pages 1"):
        ragged_paged_attention(q[0], q_pos[0], jnp.array([0, 1, 1]), k, v, pos, tables, counts)
    with pytest.raises(ValueError, match="block_tokens must be an int >= 1, got 0"):
        ragged_paged_attention(q[0], q_pos[0], jnp.array([0, 1]), k, v, pos, tables, counts,
                               block_tokens=0)
    with pytest.raises(ValueError, match="value_dim must be a positive int.*got 0"):
        call(q, q_pos, k, v, pos, tables, counts, value_dim=0)
    with pytest.raises(ValueError, match=r"values of value_dim 32: dense pages must be "
                                         r"\[P, S, 32\], got \(5, 16, 64\)"):
        call(q, q_pos, k, v, pos, tables, counts, value_dim=32)  # v holds 64 channels
    with pytest.raises(ValueError, match="power-of-two value_dim >= 16, got 24"):
        call(q, q_pos, k, v[..., :24], pos, tables, counts, value_dim=24, backend="gpu")


FORMATS = {
    "dense-bf16": (pf.DENSE, lambda k: k.astype(jnp.bfloat16)),
    "int4-tokens": (pf.PackedTokens(4, 32), lambda k: packed_tokens(k, 4, 32, False)),
    "int2-kivi-keys": (pf.PackedChannels(2, 4), lambda k: packed_channels(
        np.random.default_rng(0), k, 2, window=4, symmetric=False)),
}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_kernel_lowers_for_tpu_and_gpu(platform, name):
    """jax.export lowers the kernel for a real TPU (Mosaic) and GPU (Triton): interpret mode
    checks semantics, this checks the backend accepts the kernel."""
    rng = np.random.default_rng(1)
    k, v, pos, tables, counts = make_pool(rng, batch=2, kv_heads=2, page_size=64, head_dim=64,
                                          lengths=[70, 128])
    q, q_pos = queries(rng, 2, 1, 6, 64, [70, 128])
    fmt, encode = FORMATS[name]
    backend = "tpu" if platform == "tpu" else "gpu"
    fn = functools.partial(paged_attention, k_format=fmt, backend=backend, softcap=30.0,
                           window=100, pages_per_split=1)
    checks = [] if backend == "tpu" else [
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        q.astype(jnp.bfloat16), q_pos, encode(k), v.astype(jnp.bfloat16), pos, tables, counts)
    text = exported.mlir_module()
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text


def _long_window_pool(rng, page_size, lengths, kv_heads=2, head_dim=64):
    return make_pool(rng, batch=len(lengths), kv_heads=kv_heads, page_size=page_size,
                     head_dim=head_dim, lengths=lengths)


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams(), "gpu"],
                         ids=["tpu-generic", "tpu-dma", "gpu"])
@pytest.mark.parametrize("t", [1, 5])
def test_pages_outside_the_window_are_not_read(interpret, t):
    """Most pages lie before the window: the kernel matches the reference, and poisoning every
    page wholly outside the window (NaN keys and values) changes nothing, so they are not read."""
    rng = np.random.default_rng(20 + t)
    page, window = 16, 20
    lengths = [200, 37, 3, 150]  # 13, 3, 1, 10 pages; the window covers 2-3 of them
    k, v, pos, tables, counts = _long_window_pool(rng, page, lengths)
    q, q_pos = queries(rng, len(lengths), t, 4, 64, lengths)
    backend, interp = mode(*(("gpu", True) if interpret == "gpu" else ("tpu", interpret)))
    kw = dict(window=window, pages_per_split=4, softcap=30.0)
    if backend == "tpu":
        kw["pages_per_block"] = 2
    got, want = run_both(q, q_pos, k, v, pos, tables, counts, backend, interpret=interp, **kw)
    np.testing.assert_allclose(got, want, **TOL)
    # pages whose every slot is at or below min(q_pos) - window: nobody sees them
    outside = np.zeros(k.shape[0], bool)
    for b, n in enumerate(lengths):
        dead_pages = max(int(q_pos[b].min()) - window + 1, 0) // page
        outside[np.asarray(tables)[b, :, :dead_pages].ravel()] = True
    assert outside.sum() >= 20  # most of the 27 listed pages of the long rows
    poison = jnp.asarray(outside)[:, None, None]
    kn, vn = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    poisoned = paged_attention(q, q_pos, kn, vn, pos, tables, counts, backend=backend,
                               interpret=interp, **kw)
    np.testing.assert_array_equal(np.asarray(poisoned), got)


def test_window_start_pages_is_exact_for_any_slot_order():
    """Starts come from the slot positions, not from an assumed order: a row whose first page
    holds its newest tokens starts at 0, a row of old pages before recent ones skips the old."""
    from kernels_pallas.paged_attention import window_start_pages
    s = 4
    pos = np.full((6, 1, s), EMPTY, np.int32)
    pos[0, 0] = [96, 97, 98, 99]  # newest tokens, listed first in row 0
    pos[1, 0] = [0, 1, 2, 3]
    pos[2, 0] = [4, 5, EMPTY, 7]
    pos[3, 0] = [90, 91, 92, EMPTY]
    pos[4, 0] = [EMPTY] * 4  # an evicted page
    tables = jnp.asarray([[[0, 1, 2, 3]], [[1, 4, 2, 3]], [[1, 2, 3, 0]]], jnp.int32)
    counts = jnp.asarray([[4], [4], [2]], jnp.int32)
    q_pos = jnp.asarray([[99, -1], [99, 98], [-1, -1]], jnp.int32)
    starts = window_start_pages(q_pos, jnp.asarray(pos), tables, counts, window=10)
    # row 0: page 0 is visible -> 0; row 1: pages 1, 4, 2 are all <= 98 - 10 -> 3;
    # row 2: no valid query -> every in-use page skipped (2)
    np.testing.assert_array_equal(np.asarray(starts), [[0], [3], [2]])
    assert np.all(np.asarray(window_start_pages(q_pos, jnp.asarray(pos), tables, counts,
                                                window=None)) == 0)


def shared_pool(rng, *, batch, kv_heads, page_size, head_dim, lengths, spare=2):
    """A pool whose KV heads share one table per sequence: head h of a sequence's page i lies at
    table[b, i] + h * stride (head planes of `stride` pages, sequences' pages shuffled in them)."""
    n_table = max(-(-max(lengths) // page_size), 1)
    stride = batch * n_table + spare
    tables = rng.permutation(stride)[: batch * n_table].reshape(batch, n_table).astype(np.int32)
    n_pages = kv_heads * stride
    pos = np.full((n_pages, 1, page_size), EMPTY, np.int32)
    for b, n in enumerate(lengths):
        for h in range(kv_heads):
            for i in range(n):
                pos[tables[b, i // page_size] + h * stride, 0, i % page_size] = i
    counts = np.array([[-(-n // page_size)] * kv_heads for n in lengths], np.int32)
    k = jnp.asarray(rng.normal(size=(n_pages, page_size, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(n_pages, page_size, head_dim)), jnp.float32)
    return k, v, jnp.asarray(pos), jnp.asarray(tables), jnp.asarray(counts), stride


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams(), "gpu"],
                         ids=["tpu-generic", "tpu-dma", "gpu"])
def test_block_tables_shared_by_kv_heads(interpret):
    """[B, NP] tables with a head stride read the same pages as the per-head [B, KVH, NP]
    tables they stand for, and match the reference, with a window and several blocks."""
    from kernels_pallas.paged_attention import per_head_tables
    rng = np.random.default_rng(31)
    lengths = [0, 70, 17, 33]
    k, v, pos, tables, counts, stride = shared_pool(rng, batch=4, kv_heads=3, page_size=16,
                                                    head_dim=64, lengths=lengths)
    q, q_pos = queries(rng, 4, 2, 6, 64, lengths)
    backend, interp = mode(*(("gpu", True) if interpret == "gpu" else ("tpu", interpret)))
    kw = dict(pages_per_split=2, window=40, k_format=pf.PackedTokens(4, 32))
    if backend == "tpu":
        kw["pages_per_block"] = 2
    kp = packed_tokens(k, 4, 32, False)
    got, want = run_both(q, q_pos, kp, v, pos, tables, counts, backend, interpret=interp,
                         head_stride=stride, **kw)
    np.testing.assert_allclose(got, want, **TOL)
    full = per_head_tables(tables, 3, stride)
    assert full.shape == (4, 3, 5) and int(full[1, 2, 0]) == int(tables[1, 0]) + 2 * stride
    per_head = paged_attention(q, q_pos, kp, v, pos, full, counts, backend=backend,
                               interpret=interp, **kw)
    np.testing.assert_array_equal(got, np.asarray(per_head))
    assert np.all(got[0] == 0)


def test_shared_tables_need_a_head_stride():
    rng = np.random.default_rng(0)
    k, v, pos, tables, counts = make_pool(rng, batch=1, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=[5])
    q, q_pos = queries(rng, 1, 1, 4, 64, [5])
    call = functools.partial(paged_attention, interpret=True)
    with pytest.raises(ValueError, match="head_stride is required"):
        call(q, q_pos, k, v, pos, tables[:, 0], counts)
    with pytest.raises(ValueError, match="head_stride is required"):
        call(q, q_pos, k, v, pos, tables, counts, head_stride=1)
    with pytest.raises(ValueError, match="head_stride must be >= 0"):
        call(q, q_pos, k, v, pos, tables[:, 0], counts, head_stride=-1)


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams(), "gpu"],
                         ids=["tpu-generic", "tpu-dma", "gpu"])
@pytest.mark.parametrize("bits,param_dtype,symmetric", [(8, "float16", True),
                                                        (4, "bfloat16", False),
                                                        (2, "float32", False)])
def test_per_token_key_scales_applied_to_the_scores(interpret, bits, param_dtype, symmetric):
    """Per-token keys with one group spanning D: the kernel dots the queries with the codes and
    applies each slot's scale (and offset, times sum(q)) to the scores; equal to the
    reference's dequantized keys."""
    fmt = pf.PackedTokens(bits, 64, symmetric, param_dtype)
    assert fmt.scales_scores(64)
    assert not pf.PackedTokens(bits, 32, symmetric).scales_scores(64)  # two groups per slot
    rng = np.random.default_rng(40 + bits)
    lengths = [1, 40, 75]
    k, v, pos, tables, counts = make_pool(rng, batch=3, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    k = k + 2.0  # a large common offset: sum(q) * offset matters
    kp = packed_tokens(k, bits, 64, symmetric, param_dtype)
    q, q_pos = queries(rng, 3, 2, 4, 64, lengths)
    backend, interp = mode(*(("gpu", True) if interpret == "gpu" else ("tpu", interpret)))
    got, want = run_both(q, q_pos, kp, packed_tokens(v, 4, 32, False), pos, tables, counts,
                         backend, interpret=interp, k_format=fmt, v_format=pf.PackedTokens(4, 32),
                         softcap=20.0, window=50, pages_per_split=2)
    np.testing.assert_allclose(got, want, **TOL)
    # the split decode is the page decode: codes times the slot's scale (plus its offset)
    codes, scale, offset = fmt.decode_codes((kp[0][3],), pf.REFERENCE_OPS, 64)
    assert (offset is None) == symmetric
    split = codes * scale + (0.0 if offset is None else offset)
    np.testing.assert_allclose(np.asarray(split),
                               np.asarray(fmt.decode((kp[0][3],), pf.REFERENCE_OPS, 64)),
                               rtol=1e-6, atol=1e-5)
    assert np.all(np.asarray(codes) == np.round(np.asarray(codes)))
    with pytest.raises(ValueError, match="decode_codes"):
        pf.PackedTokens(bits, 32, symmetric).decode_codes((kp[0][3],), pf.REFERENCE_OPS, 64)


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams()],
                         ids=["tpu-generic", "tpu-dma"])
@pytest.mark.parametrize("bits,group,param_dtype,symmetric", [(4, 32, "float16", False),
                                                              (2, 16, "float32", False),
                                                              (8, 16, "bfloat16", True)])
def test_several_key_groups_applied_to_the_scores(interpret, bits, group, param_dtype,
                                                  symmetric):
    """PackedTokenRows keys with NG = D / group > 1 groups per slot: the TPU kernel dots the
    queries with the codes once per group (other groups' lanes zeroed) and applies each group's
    scale (and offset times that group's sum(q)) to the scores; equal to the reference's
    dequantized keys, and the split decode (codes * scale + offset per group) is the page
    decode."""
    from kernels_pallas.page_formats import expand_groups
    fmt = pf.PackedTokenRows(bits, group, symmetric, param_dtype)
    assert fmt.scales_scores(64)
    rng = np.random.default_rng(60 + bits)
    lengths = [1, 40, 75]
    k, v, pos, tables, counts = make_pool(rng, batch=3, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    # per-group offsets that differ: sum(q_g) * offset_g matters and a one-group sum would not do
    k = k + jnp.repeat(jnp.arange(64 // group, dtype=jnp.float32) * 1.5 - 1.0, group)
    qk = quantize(k, bits, group, axis=-1, symmetric=symmetric,
                  param_dtype=jnp.dtype(param_dtype))
    kp = fmt.from_store(pack(qk.codes, bits), qk.scale, None if symmetric else qk.offset)
    q, q_pos = queries(rng, 3, 2, 4, 64, lengths)
    got, want = run_both(q, q_pos, kp, jnp.swapaxes(v, 1, 2), pos, tables, counts, "tpu",
                         interpret=interpret, k_format=fmt, v_format=pf.DENSE_T, softcap=20.0,
                         window=50, pages_per_split=2)
    np.testing.assert_allclose(got, want, **TOL)
    page = tuple(x[3] for x in kp)
    codes, scale, offset = fmt.decode_codes(page, pf.REFERENCE_OPS, 64)
    assert scale.shape == (64 // group, 16) and (offset is None) == symmetric
    split = codes * expand_groups(scale, group) + (
        0.0 if offset is None else expand_groups(offset, group))
    np.testing.assert_allclose(np.asarray(split),
                               np.asarray(fmt.decode(page, pf.REFERENCE_OPS, 64)),
                               rtol=1e-6, atol=1e-5)
    assert np.all(np.asarray(codes) == np.round(np.asarray(codes)))
    with pytest.raises(ValueError, match="group 48 does not divide head_dim 64"):
        pf.PackedTokenRows(bits, 48, symmetric).decode_codes(page, pf.REFERENCE_OPS, 64)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_mixed_prefill_and_decode_rows_in_one_call(backend):
    """Ragged query lengths in one call: a decode row (1 query) and prefill chunks (3 and 5
    queries) share T = 5 with q_pos = -1 padding; each row equals its own unpadded call."""
    rng = np.random.default_rng(50)
    lengths = [40, 21, 64]
    k, v, pos, tables, counts = make_pool(rng, batch=3, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    q, _ = queries(rng, 3, 5, 4, 64, lengths)
    n_q = [1, 3, 5]
    q_pos = np.full((3, 5), -1, np.int32)
    for b, (n, t) in enumerate(zip(lengths, n_q)):
        q_pos[b, :t] = np.arange(n - t, n)
    q_pos = jnp.asarray(q_pos)
    kw = dict(k_format=pf.PackedTokens(4, 32), window=30, pages_per_split=2)
    kp = packed_tokens(k, 4, 32, False)
    got, want = run_both(q, q_pos, kp, v, pos, tables, counts, backend, **kw)
    np.testing.assert_allclose(got, want, **TOL)
    backend, interpret = mode(backend)
    for b, t in enumerate(n_q):
        alone = paged_attention(q[b:b + 1, :t], q_pos[b:b + 1, :t], kp, v, pos,
                                tables[b:b + 1], counts[b:b + 1], backend=backend,
                                interpret=interpret, **kw)
        np.testing.assert_allclose(got[b, :t], np.asarray(alone)[0], **TOL)
        assert np.all(got[b, t:] == 0)  # padding queries attend to nothing


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_ragged_packed_queries_equal_each_sequence_alone(backend):
    """Packed tokens of four sequences in one call (`ragged_paged_attention`): a decode token,
    a 7-token prefill chunk, a sequence with no token and a 3-token chunk, then 3 padding
    tokens, cut into blocks of 4 tokens of one sequence. Every token equals its sequence's
    own unpadded call (and the reference, with `q_seq`); padding tokens get zeros; int4 keys
    and a window."""
    from kernels_pallas.paged_attention import ragged_blocks, ragged_paged_attention
    rng = np.random.default_rng(60)
    lengths = [40, 21, 64, 17]
    k, v, pos, tables, counts = make_pool(rng, batch=4, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    kp = packed_tokens(k, 4, 32, False)
    n_q = [1, 7, 0, 3]
    cu = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
    n = int(cu[-1]) + 3  # padding tokens at the end
    q = jnp.asarray(rng.normal(size=(n, 4, 64)), jnp.float32)
    q_pos = np.full(n, -1, np.int32)
    for s_, (length, t) in enumerate(zip(lengths, n_q)):
        q_pos[cu[s_]:cu[s_ + 1]] = np.arange(length - t, length)
    token, seq = ragged_blocks(jnp.asarray(cu), n, 4)
    assert np.asarray(seq)[:4].tolist() == [0, 1, 1, 3]  # 1 + 2 + 0 + 1 blocks of 4 tokens
    assert sorted(np.asarray(token)[np.asarray(token) < n].tolist()) == list(range(cu[-1]))
    backend, interpret = mode(backend)
    kw = dict(k_format=pf.PackedTokens(4, 32), window=30, backend=backend, interpret=interpret)
    got = np.asarray(ragged_paged_attention(q, jnp.asarray(q_pos), jnp.asarray(cu), kp, v, pos,
                                            tables, counts, block_tokens=4, **kw))
    assert got.shape == (n, 4, 64) and np.all(got[cu[-1]:] == 0)
    for s_, t in enumerate(n_q):
        if not t:
            continue
        span = slice(cu[s_], cu[s_ + 1])
        alone = paged_attention(q[None, span], jnp.asarray(q_pos)[None, span], kp, v, pos,
                                tables[s_:s_ + 1], counts[s_:s_ + 1], **kw)
        np.testing.assert_allclose(got[span], np.asarray(alone)[0], **TOL)
        want = paged_attention_reference(q[None, span], jnp.asarray(q_pos)[None, span], kp, v,
                                         pos, tables, counts, q_seq=jnp.array([s_], jnp.int32),
                                         k_format=pf.PackedTokens(4, 32), window=30)
        np.testing.assert_allclose(got[span], np.asarray(want)[0], **TOL)


def test_row_pools_equal_the_page_pools_they_stand_for():
    """Row pools (`row_pages`: a cache's own rows, pages DMA'd out of them) give exactly what the
    same data cut into a page pool gives, for dense slot-last, dense row-major and
    PackedTokenRows, with positions as [R, 1, C] or as a cache's [B, KVH, C]; bad row pools
    raise."""
    from kernels_pallas.paged_attention import rows_as_pages
    rng = np.random.default_rng(41)
    b, kvh, c, s, d = 2, 2, 256, 128, 64
    n = c // s
    x = jnp.asarray(rng.normal(size=(2, b * kvh, c, d)), jnp.float32)  # k, v rows [R, C, D]
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b * kvh, 1, c))
    pos = jnp.where(jnp.arange(c) < 200, pos, EMPTY)
    tables = jnp.arange(b, dtype=jnp.int32)[:, None] * (kvh * n) + jnp.arange(n, dtype=jnp.int32)
    counts = jnp.full((b, kvh), n, jnp.int32)
    q, q_pos = queries(rng, b, 1, 2 * kvh, d, [200, 200])
    tok = pf.PackedTokenRows(4, 32)
    q4 = quantize(x[0], 4, 32, axis=-1)
    packed = tok.from_store(pack(q4.codes, 4), q4.scale, q4.offset)
    backend, interp = mode("tpu", pltpu.InterpretParams())
    for fmt, k_rows in ((pf.DENSE_T, jnp.swapaxes(x[0], 1, 2)), (pf.DENSE, x[0]), (tok, packed)):
        v_rows = jnp.swapaxes(x[1], 1, 2)
        kw = dict(k_format=fmt, v_format=pf.DENSE_T, head_stride=n, pages_per_split=1)
        got = paged_attention(q, q_pos, k_rows, v_rows, pos, tables, counts, backend=backend,
                              interpret=interp, row_pages=n, **kw)
        k_tuple = k_rows if isinstance(k_rows, tuple) else (k_rows,)
        p_pos, p_k, p_v = rows_as_pages(pos, k_tuple, (v_rows,), fmt, pf.DENSE_T, n)
        want = paged_attention(q, q_pos, p_k, p_v, p_pos, tables, counts, backend=backend,
                               interpret=interp, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        # positions as a cache holds them, [B, KVH, C]: row r read at [r // KVH, r % KVH]
        by_head = paged_attention(q, q_pos, k_rows, v_rows, pos.reshape(b, kvh, c), tables,
                                  counts, backend=backend, interpret=interp, row_pages=n, **kw)
        np.testing.assert_array_equal(np.asarray(by_head), np.asarray(got))
    with pytest.raises(ValueError, match=r"pos_pages must be \[R / n, n, C\]"):
        paged_attention(q, q_pos, x[0], x[1], pos.reshape(1, 1, -1), tables, counts,
                        head_stride=n, row_pages=n)
    with pytest.raises(ValueError, match="row_pages 3 must divide"):
        paged_attention(q, q_pos, x[0], x[1], pos, tables, counts, head_stride=n, row_pages=3)
    with pytest.raises(ValueError, match="row_pages reads Dense, PackedTokenRows and PackedChannelRows"):
        paged_attention(q, q_pos, x[0], x[1], pos, tables, counts, head_stride=n, row_pages=n,
                        k_format=pf.PackedTokens(4, 32))
