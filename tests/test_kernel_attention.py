"""attend(impl="pallas"): token, encoded and KIVI residual layers read by the kernel equal the
XLA reference; on CPU, impl="pallas" falls back to the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kernel_mode import compiled, device_backend, mode
from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import finish
from kvjax.backends import pallas as ka
from kvjax.core.cache import init_cache, write
from tests.test_planner import window_stats

TOL = dict(rtol=3e-5, atol=3e-5)


def filled(seed, n, capacity, batch=2, kvh=2, d=64):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(batch, kvh, n, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, kvh, n, d)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    pos = pos.at[1, :3].set(-1)  # left padding in sequence 1
    layer = write(init_cache(batch, kvh, capacity, d), k, v, pos)
    q = jnp.asarray(rng.normal(size=(batch, 1, 3 * kvh, d)), jnp.float32)
    return layer, q, jnp.full((batch, 1), n, jnp.int32)


def ops_feeding_the_output(jaxpr) -> set[str]:
    """Names of the primitives the outputs of a (flat) jaxpr depend on."""
    needed, names = set(jaxpr.outvars), set()
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            names.add(eqn.primitive.name)
            needed.update(v for v in eqn.invars if not hasattr(v, "val"))  # not literals
    return names


def encode(layer, method):
    (out,), _ = kvjax.parse_method(method).update((layer,), (), None)
    return out


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("method", ["full", "fp8:fmt=e4m3", "quantize:bits=4", "quantize:bits=8,group=64",
                                    "quantize:bits=4,axis=channel", "kivi:bits=2,group=16,residual=16"])
def test_kernel_reads_each_layer_like_the_reference(backend, method):
    layer, q, q_pos = filled(0, 45, capacity=64)
    layer = encode(layer, method)
    assert ka.supports_pallas(layer)
    backend, interpret = mode(backend)
    got = ka.attend_pallas(q, q_pos, layer, backend=backend, interpret=interpret,
                           pages_per_split=1)
    want = kvjax.attend(q, q_pos, layer, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_window_and_softcap_pass_through():
    layer, q, q_pos = filled(1, 40, capacity=48)  # capacity 48: pages of 16
    assert ka.page_size_for(48) == 16 and ka.page_size_for(4128) == 32
    backend, interpret = mode(device_backend() or "tpu")
    got = ka.attend_pallas(q * 3, q_pos, layer, window=9, softcap=4.0, backend=backend,
                           interpret=interpret)
    want = kvjax.attend(q * 3, q_pos, layer, impl="reference", window=9, softcap=4.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_odd_capacities_are_padded_and_a_pooled_part_falls_back():
    """A capacity no page size >= 8 divides (30 slots) is padded to the tile per call (128 slots
    on TPU, 64 on GPU; the new slots EMPTY) and read by the kernel like the reference; a
    residual layer with a pooled and a per-head part (no method makes one) is not read:
    `kernel_refusal` names why and `attend_pallas` raises with it. On a CPU host
    `attend(impl="pallas")` is the XLA path."""
    layer, q, q_pos = filled(2, 10, capacity=30)
    assert ka.page_size_for(30) is None and ka.supports_pallas(layer, "tpu")
    assert ka.tiled_capacity(layer, "tpu") == 128 and ka.tiled_capacity(layer, "gpu") == 64
    for backend in ("tpu", "gpu"):
        if compiled() and device_backend() != backend:
            continue
        backend, interpret = mode(backend)
        got = ka.attend_pallas(q, q_pos, layer, backend=backend, interpret=interpret)
        want = kvjax.attend(q, q_pos, layer, impl="reference")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    pooled = kvjax.ResidualCache(body=kvjax.pool_heads(filled(2, 10, capacity=32)[0]),
                                 recent=filled(2, 10, capacity=32)[0], residual=8, block=8)
    assert ka.kernel_refusal(pooled, "tpu") == \
        "a ResidualCache with a pooled and a per-head part (their rows do not merge)"
    with pytest.raises(ValueError, match="does not read this layer .a ResidualCache with a pool"):
        ka.attend_pallas(q, q_pos, pooled, backend="tpu", interpret=True)
    assert ka.pallas_backend() == device_backend()  # None on a CPU host
    if device_backend() is None:  # no kernel here: impl="pallas" is the XLA path
        got = kvjax.attend(q, q_pos, layer, impl="pallas")
        np.testing.assert_array_equal(np.asarray(got),
                                      np.asarray(kvjax.attend(q, q_pos, layer, impl="xla")))


def test_a_refused_layer_on_a_kernel_backend_warns_with_the_reason(monkeypatch):
    """On a TPU or GPU, `attend(impl="pallas")` over a key/value layer the kernel refuses
    (here a head dim of 48 with the backend set to "gpu": its kernel needs a power of two)
    reads it through XLA and says so: a `KernelFallbackWarning` naming the refusal, an error
    when the user asks for one. A layer the kernel reads, and a layer with no kernel layout
    (recurrent state: it attends itself), do not warn."""
    import warnings
    from kvjax.backends import dispatch
    monkeypatch.setattr(dispatch, "pallas_backend", lambda: "gpu")
    odd, q48, q_pos = filled(2, 10, capacity=32, d=48)
    want = kvjax.attend(q48, q_pos, odd, impl="xla")
    with pytest.warns(kvjax.KernelFallbackWarning, match="the gpu kernel does not read this "
                                                         "layer .the GPU kernel needs a head"):
        got = kvjax.attend(q48, q_pos, odd, impl="pallas")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    layer, q, q_pos = filled(2, 10, capacity=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvjax.KernelFallbackWarning)
        with pytest.raises(kvjax.KernelFallbackWarning, match="power of two, got 48"):
            kvjax.attend(q48, q_pos, odd, impl="pallas")
        state = kvjax.init_linear_layer(2, 2, 64, kvjax.elu_map(64))  # no kernel layout
        assert ka.kernel_layout(state) is None
        kvjax.attend(q, q_pos, state, impl="pallas")  # attends itself: no warning
        monkeypatch.setattr(dispatch, "attend_pallas", lambda *a, **kw: "kernel")
        assert kvjax.attend(q, q_pos, layer, impl="pallas") == "kernel"  # read: no warning


@pytest.mark.parametrize("n, supported", [(12, True), (16, True)])
def test_kivi_layer_with_an_empty_body_reads_its_window_alone(n, supported):
    """A short prompt's KIVI layer keeps every token in its exact window: shrunk, the quantized
    body has 0 slots. The kernel reads the window alone (16 slots; 12 slots padded to the
    tile), never a division by zero."""
    layer, q, q_pos = filled(3, n, capacity=n)
    layer = kvjax.shrink((encode(layer, "kivi:bits=4,group=16,residual=16"),), 0)[0]
    assert layer.body.capacity == 0 and ka.page_size_for(0) is None
    assert ka.supports_pallas(layer, "tpu") is supported
    want = kvjax.attend(q, q_pos, layer, impl="reference")
    if supported:
        backend, interpret = mode("tpu")
        got = ka.attend_pallas(q, q_pos, layer, backend=backend, interpret=interpret)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    else:
        with pytest.raises(ValueError, match="does not read"):
            ka.attend_pallas(q, q_pos, layer, backend="tpu", interpret=True)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kivi_pages_whose_groups_spread_take_the_xla_loop(backend):
    """Eviction can leave a page's slots in groups far apart: the narrow per-page table window
    does not fit, and that layer's body is read by XLA's block loop over the store as it is (a
    whole-table window per page cost ~200 GB of temporaries at 64 x 32k), its softmax state
    merged with the kernel's over the exact part - still equal to the reference. The narrow
    case is the kernel's (the first half, checked by the same comparison)."""
    layer, q, q_pos = filled(3, 45, capacity=48)
    layer = encode(layer, "kivi:bits=4,group=4,residual=8")
    body = layer.body
    page = ka.page_size_for(body.capacity)
    assert pf.window_for(page, 4, body.k.table_rows) < body.k.table_rows  # a narrow window
    assert ka._windows_fit(body, ka.page_size_for(body.capacity), backend) is not None
    assert bool(ka._windows_fit(body, ka.page_size_for(body.capacity), backend))
    ids = body.k.group_id
    spread = body.replace(k=body.k.replace(group_id=ids[:, ::-1]))  # a page spans every group
    assert not bool(ka._windows_fit(spread, ka.page_size_for(body.capacity), backend))
    backend, interpret = mode(backend)
    for case in (layer, layer.replace(body=spread)):
        got = ka.attend_pallas(q, q_pos, case, backend=backend, interpret=interpret,
                               pages_per_split=1)
        want = kvjax.attend(q, q_pos, case, impl="reference")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    # the spread body's state: XLA's loop, padded to the kernel's rows, equal to the kernel's
    # own state where the kernel can read the layer (the unspread body)
    like = jax.eval_shape(lambda: ka.attend_partial(q, q_pos, body, backend=backend,
                                                    interpret=interpret))
    xla = ka._blockwise_partial(q, q_pos, body, like, window=None, softcap=None)
    kernel = ka.attend_partial(q, q_pos, body, backend=backend, interpret=interpret)
    assert xla.acc.shape == kernel.acc.shape and xla.m.shape == kernel.m.shape
    np.testing.assert_allclose(np.asarray(finish(xla, q.shape)),
                               np.asarray(finish(kernel, q.shape)), **TOL)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("method", ["knorm:ratio=0.5,headwise=true",
                                    "quantize:bits=4,group=32+snapkv:ratio=0.4,headwise=true,window=4"])
def test_pooled_layers_attend_through_the_kernel(backend, method):
    """Head-wise budgets leave a pooled layer: one row of slots per sequence, each slot owned by
    one KV head (its positions EMPTY for the others). The kernel reads it as one KV row holding
    all six query heads, each query row seeing its own KV head's slots (`slot_owners`): equal
    to the reference for decode, a 3-token chunk and a window, dense and int4 (after SnapKV,
    whose kept slots differ per head); and every page is listed once per sequence."""
    layer, _, _ = filled(12, 100, capacity=128)
    t = kvjax.parse_method(method)
    stats = None
    if "snapkv" in method:
        queries = np.random.default_rng(13).normal(size=(2, 4, 6, 64)).astype(np.float32)
        stats = (window_stats(queries, jnp.broadcast_to(jnp.arange(96, 100), (2, 4))),)
    (pooled,), _ = t.update((layer,), t.init((layer,)), stats)
    assert pooled.pooled and ka.row_heads(pooled) == 1
    held = np.asarray(pooled.pos != -1)  # [B, KVH, C]: each slot owned by at most one head
    assert held.sum(1).max() == 1 and (held[:, 0] != held[:, 1]).any()
    assert ka.kernel_refusal(pooled, backend) is None
    inputs = ka.kernel_inputs(ka.pooled_view(pooled), backend=backend)
    assert inputs["num_pages"].shape == (2, 1)
    backend, interpret = mode(backend)
    rng = np.random.default_rng(14)
    for t_q, window in ((1, None), (3, None), (1, 30)):
        q = jnp.asarray(rng.normal(size=(2, t_q, 6, 64)), jnp.float32)
        q_pos = jnp.broadcast_to(jnp.arange(100 - t_q, 100), (2, t_q))
        got = ka.attend_pallas(q, q_pos, pooled, backend=backend, interpret=interpret,
                               window=window)
        want = kvjax.attend(q, q_pos, pooled, impl="reference", window=window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def low_rank_layer(layer, key_rank: int, value_rank: int):
    """`layer` stored as low-rank coordinates on bases calibrated from itself."""
    from kvjax.policies.low_rank import accumulate_moments, basis_from_moments, low_rank
    basis = basis_from_moments(accumulate_moments(None, (layer,)))
    t = low_rank(basis, rank=value_rank, key_rank=key_rank)
    (out,), _ = t.update((layer,), t.init((layer,)), None)
    return out


def thinned_layer(layer, pruned: int, seed: int):
    """`layer` as ThinK leaves it: the keys so far on their kept channels (a per-row 0/1
    basis, `Latent`), in the body of a never-flushing residual layer."""
    from kvjax.policies.eviction_think import think_layer
    b, d = layer.batch, layer.head_dim
    queries = np.random.default_rng(seed).normal(size=(b, 4, 6, d)).astype(np.float32)
    stats = window_stats(queries, jnp.broadcast_to(jnp.arange(4), (b, 4)))
    return think_layer(layer, stats, pruned, window=4)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("key_rank, value_rank", [(32, 32), (32, 16), (16, 64)])
def test_low_rank_layers_attend_through_the_kernel_over_their_latents(backend, key_rank,
                                                                      value_rank):
    """A low-rank layer (`Latent` keys and values) is read by the kernel over its latent
    coordinates: queries projected on each head's key basis, the kernel's value dim the value
    rank (different from the key rank in two cases), the accumulator lifted by the value
    basis. Equal to the reference, which scores and lifts in float32, within float32 rounding;
    and the kernel's operands are the latents themselves, not reconstructed keys or values.
    (On 8 devices: `tests/test_sharding.py::test_pallas_kernel_under_shard_map_matches_the_reference_on_8_devices`.)"""
    layer, q, q_pos = filled(8, 200, capacity=256, d=64)
    layer = low_rank_layer(layer, key_rank, value_rank)
    assert ka.kernel_refusal(layer, "tpu") is None and ka.kernel_refusal(layer, "gpu") is None
    view = ka.latent_view(layer)
    assert view.k is layer.k.z and view.v is layer.v.z
    assert ka.value_dim(layer) == value_rank
    inputs = ka.kernel_inputs(view, backend="tpu")
    assert inputs["k_pages"][0].shape[-2:] in ((256, key_rank), (key_rank, 256))
    backend, interpret = mode(backend)
    got = ka.attend_pallas(q, q_pos, layer, backend=backend, interpret=interpret,
                           pages_per_split=1)
    want = kvjax.attend(q, q_pos, layer, impl="reference")
    assert got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_thinned_keys_attend_through_the_kernel(backend):
    """ThinK's layer -- the prompt's keys on their kept channels (a per-row basis), later keys
    whole in the exact part -- attends through two kernel calls: the body with the queries on
    each row's kept channels (keys of 32 channels, values of 64: the kernel's value_dim), the
    exact part as it is. Equal to the reference; a prefill chunk of 3 tokens too."""
    layer, _, _ = filled(9, 120, capacity=128, d=64)
    thin = thinned_layer(layer, pruned=32, seed=9)
    assert isinstance(thin.body.k, kvjax.core.stores.Latent)
    assert thin.body.k.basis.shape == (2 * 2, 64, 32)  # one basis per storage row
    k_new = jnp.asarray(np.random.default_rng(10).normal(size=(2, 2, 3, 64)), jnp.float32)
    thin = thin.write(k_new, -k_new, jnp.broadcast_to(jnp.arange(120, 123), (2, 3)))
    assert ka.kernel_refusal(thin, backend) is None
    q = jnp.asarray(np.random.default_rng(11).normal(size=(2, 3, 6, 64)), jnp.float32)
    q_pos = jnp.broadcast_to(jnp.arange(120, 123), (2, 3))
    backend, interpret = mode(backend)
    got = ka.attend_pallas(q, q_pos, thin, backend=backend, interpret=interpret)
    want = kvjax.attend(q, q_pos, thin, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_low_rank_ranks_the_gpu_kernel_cannot_tile_are_refused_by_name():
    """The Triton kernel tiles power-of-two dims >= 16: a value rank of 24 is refused for it
    (named), read by the TPU kernel."""
    layer, q, q_pos = filled(8, 40, capacity=64, d=64)
    layer = low_rank_layer(layer, 32, 24)
    assert ka.kernel_refusal(layer, "tpu") is None
    assert ka.kernel_refusal(layer, "gpu") == \
        "the GPU kernel needs a value head dim >= 16 that is a power of two, got 24"
    with pytest.raises(ValueError, match="value head dim >= 16"):
        ka.attend_pallas(q, q_pos, layer, backend="gpu", interpret=True)


def test_token_cache_pages_use_one_table_per_sequence():
    """A TokenCache's KV heads share their sequence's block table ([B, C/S] with a head stride of
    C/S pages), and the shared table names exactly the pages per-head tables would."""
    from kernels_pallas.paged_attention import per_head_tables
    layer, q, q_pos = filled(4, 40, capacity=48, batch=2, kvh=3)
    inputs = ka.kernel_inputs(layer)
    page = ka.page_size_for(48)
    assert inputs["block_tables"].shape == (2, 48 // page)
    assert inputs["head_stride"] == 48 // page
    per_head = per_head_tables(inputs["block_tables"], 3, inputs["head_stride"])
    np.testing.assert_array_equal(np.asarray(per_head).ravel(), np.arange(2 * 3 * 48 // page))
    for backend in ("tpu", "gpu"):
        if compiled() and device_backend() != backend:
            continue  # compiled mode: only the present chip's kernel
        backend, interpret = mode(backend)
        got = ka.attend_pallas(q, q_pos, layer, window=20, backend=backend, interpret=interpret,
                               pages_per_split=1)
        want = kvjax.attend(q, q_pos, layer, impl="reference", window=20)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_gpu_kernel_takes_power_of_two_shapes_only():
    """A head dim that is not a power of two: the TPU kernel reads the layer, the GPU (Triton)
    kernel does not (impl="pallas" takes the XLA path there), and asking for it is an error."""
    layer, q, q_pos = filled(5, 10, capacity=32, d=48)
    assert ka.supports_pallas(layer, "tpu") and not ka.supports_pallas(layer, "gpu")
    assert ka.supports_pallas(filled(5, 10, capacity=32)[0], "gpu")
    with pytest.raises(ValueError, match="power of two"):
        ka.attend_pallas(q, q_pos, layer, backend="gpu", interpret=True)


@pytest.mark.parametrize("d,dtype", [(64, jnp.float32), (128, jnp.bfloat16)])
def test_dense_token_cache_is_read_in_place(d, dtype):
    """A dense TokenCache whose pages are lane-aligned (S = 256 here) goes to the TPU kernel as its
    own rows (`row_pages`: no page pool is built; [R, D, C] slot-last below 128 lanes, [R, C, D]
    otherwise; positions as the cache's [B, KVH, C]) and the kernel's pages, DMA'd out of the
    rows, give the reference's attention."""
    layer, q, q_pos = filled(6, 300, capacity=512, kvh=2, d=d)
    layer = layer.replace(k=layer.k.astype(dtype), v=layer.v.astype(dtype))
    inputs = ka.kernel_inputs(layer, backend="tpu")
    assert inputs["row_pages"] == 2 and inputs["head_stride"] == 2
    rows = (4, d, 512) if d % 128 else (4, 512, d)
    assert inputs["k_pages"][0].shape == rows
    assert inputs["pos_pages"] is layer.pos  # [B, KVH, C] as the cache holds them
    assert "row_pages" not in ka.kernel_inputs(layer, backend="gpu")  # GPU: page pools
    backend, interpret = mode("tpu")
    if compiled() and device_backend() != "tpu":
        pytest.skip("[optional] compiled mode: the TPU kernel needs a TPU")
    # the reference over the same stored numbers in f32 (its bf16 path rounds its own dots)
    exact = layer.replace(k=layer.k.astype(jnp.float32), v=layer.v.astype(jnp.float32))
    for window in (None, 200):
        got = ka.attend_pallas(q, q_pos, layer, window=window, backend=backend,
                               interpret=interpret, pages_per_split=1)
        want = kvjax.attend(q, q_pos, exact, impl="reference", window=window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("method", ["quantize:bits=4", "quantize:bits=2,group=32,symmetric=true",
                                    "quantize:bits=8,group=64,symmetric=true",
                                    "quantize:bits=4,group=64,param_dtype=bfloat16"])
def test_packed_token_cache_codes_are_read_in_place(method):
    """A PackedTokens TokenCache with pages of 256 slots: the TPU kernel reads its code words as
    row pools (`PackedTokenRows`, `row_pages`) and gives the reference's attention (g = D cases:
    scales applied on the scores)."""
    layer, q, q_pos = filled(7, 300, capacity=512, kvh=2, d=64)
    layer = encode(layer, method)
    inputs = ka.kernel_inputs(layer, backend="tpu")
    assert inputs["row_pages"] == 2 and isinstance(inputs["k_format"], pf.PackedTokenRows)
    assert inputs["k_pages"][0].shape == (4, 64 * layer.k.bits // 32, 512)
    if compiled() and device_backend() != "tpu":
        pytest.skip("[optional] compiled mode: the TPU kernel needs a TPU")
    backend, interpret = mode("tpu")
    got = ka.attend_pallas(q, q_pos, layer, window=250, backend=backend, interpret=interpret,
                           pages_per_split=1)
    want = kvjax.attend(q, q_pos, layer, impl="reference", window=250)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("param_dtype", ["float16", "bfloat16"])
def test_packed_paged_layer_reads_like_the_reference(param_dtype):
    """A PagedLayer's per-token pages are held lane-flat (`TokenPages`), the kernel's own
    `pf.PackedTokens` layout: the kernel gets the pool's array itself, no view or conversion
    per call, with bfloat16 or float16 (as its bits) parameters, and gives the reference's
    attention over its dense view. A param_dtype no kernel reads is refused when the pool is
    made."""
    from kvjax.memory.paging import TokenPages, dense_view, init_paged_cache, reserve
    rng = np.random.default_rng(8)
    pool, layers = init_paged_cache(12, 16, 2, 2, 4, 64, num_layers=1, bits=4, group=32,
                                    param_dtype=param_dtype)
    pool, (layer,) = reserve(pool, layers, jnp.array([40, 29]))
    k = jnp.asarray(rng.normal(size=(2, 2, 40, 64)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40)).at[1, 29:].set(-1)
    layer = layer.write(k, -k, pos)
    assert isinstance(layer.k, TokenPages) and isinstance(layer.v, TokenPages)
    assert layer.k.param_dtype == param_dtype and layer.v.param_dtype == param_dtype
    stored = jnp.uint16 if param_dtype == "float16" else param_dtype  # float16 as its bits
    assert layer.k.to_packed().scale.dtype == stored
    assert layer.v.to_packed().offset.dtype == stored
    inputs = ka.kernel_inputs(layer, backend="tpu")
    assert inputs["k_format"] == pf.PackedTokens(4, 32, False, param_dtype)
    # the pool reaches the kernel as it is: no op between the store and the kernel's argument
    pages_in = jax.make_jaxpr(lambda l: ka.kernel_inputs(l, backend="tpu")["k_pages"][0])(layer)
    assert ops_feeding_the_output(pages_in.jaxpr) == set()
    with pytest.raises(ValueError, match="param_dtype must be float16, bfloat16 or float32, "
                                         "got int8"):
        init_paged_cache(12, 16, 2, 2, 4, 64, num_layers=1, bits=4, param_dtype=jnp.int8)
    if compiled() and device_backend() != "tpu":
        pytest.skip("[optional] compiled mode: the TPU kernel needs a TPU")
    q = jnp.asarray(rng.normal(size=(2, 1, 6, 64)), jnp.float32)
    q_pos = jnp.array([[40], [29]], jnp.int32)
    backend, interpret = mode("tpu")
    got = ka.attend_pallas(q, q_pos, layer, backend=backend, interpret=interpret)
    want = kvjax.attend(q, q_pos, dense_view(layer), impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def _paged_pair_history(shared_tables, bits):
    """One history (reserve, write, fork, copy-on-write, evict) run on a PagedLayer pool."""
    from kvjax.memory.paging import check_pool, evict_pages, fork, init_paged_cache, reserve
    rng = np.random.default_rng(9)
    b, kvh, s, d = 3, 2, 16, 64
    pool, layers = init_paged_cache(30, s, b, kvh, 4, d, num_layers=1, bits=bits,
                                    shared_tables=shared_tables)
    k = jnp.asarray(rng.normal(size=(b, kvh, 40, d)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(40), (b, 40)).at[1, 29:].set(-1).at[2].set(-1)
    pool, layers = reserve(pool, layers, jnp.array([40, 40, 0]))
    layers = (layers[0].write(k, -k, pos),)
    pool, layers = fork(pool, layers, jnp.array([-1, -1, 0]))  # sequence 2 shares 0's pages
    pool, layers = reserve(pool, layers, jnp.array([5, 0, 7]))  # 0 and 2 copy the shared last page
    k2 = jnp.asarray(rng.normal(size=(b, kvh, 7, d)), jnp.float32)
    pos2 = jnp.broadcast_to(40 + jnp.arange(7), (b, 7)).at[0, 5:].set(-1).at[1].set(-1)
    layers = (layers[0].write(k2, 2 * k2, pos2),)
    drop = np.zeros((b, kvh, 4), bool)
    drop[0, :, 1] = True  # the same page for both heads
    pool, layers = evict_pages(pool, layers, jnp.asarray(drop))
    check_pool(pool, layers)
    return pool, layers[0]


@pytest.mark.parametrize("bits", [None, 4], ids=["dense", "int4"])
def test_shared_table_paged_layer_equals_the_per_head_pool(bits):
    """`init_paged_cache(shared_tables=True)`: after the same reserve/write/fork/copy-on-write/
    evict history the layer holds exactly what the per-head pool holds (dense views equal
    element-wise), its table entries are aligned groups (head h = head 0's page + h), the kernel
    gets one [B, NP] table with head_stride 1, and its attention equals the per-head pool's
    kernel output and the reference."""
    from kernels_pallas.paged_attention import per_head_tables
    from kvjax.memory.paging import dense_view
    from kvjax.core.stores import read
    _, per_head = _paged_pair_history(False, bits)
    _, shared = _paged_pair_history(True, bits)
    a, b = dense_view(per_head), dense_view(shared)
    np.testing.assert_array_equal(np.asarray(a.pos), np.asarray(b.pos))
    np.testing.assert_array_equal(np.asarray(read(a.k)),
                                  np.asarray(read(b.k)))
    np.testing.assert_array_equal(np.asarray(read(a.v)),
                                  np.asarray(read(b.v)))
    tables = np.asarray(shared.tables)
    held = tables != 0
    np.testing.assert_array_equal(tables[:, 1][held[:, 1]], tables[:, 0][held[:, 0]] + 1)
    inputs = ka.kernel_inputs(shared, backend="tpu")
    assert inputs["head_stride"] == 1 and inputs["block_tables"].shape == (3, 4)
    used = np.arange(4) < np.asarray(shared.num_pages_used)[..., None]
    expanded = np.asarray(per_head_tables(inputs["block_tables"], 2, 1))
    np.testing.assert_array_equal(expanded[used], tables[used])
    rng = np.random.default_rng(10)
    q = jnp.asarray(rng.normal(size=(3, 1, 6, 64)), jnp.float32)
    q_pos = jnp.array([[45], [29], [47]], jnp.int32)
    want = kvjax.attend(q, q_pos, dense_view(shared), impl="reference")
    for backend in ("tpu", "gpu"):
        if compiled() and device_backend() != backend:
            continue  # compiled mode: only the present chip's kernel
        backend, interpret = mode(backend)
        got = ka.attend_pallas(q, q_pos, shared, backend=backend, interpret=interpret,
                               pages_per_split=1)
        ref = ka.attend_pallas(q, q_pos, per_head, backend=backend, interpret=interpret,
                               pages_per_split=1)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("backend,bits,staged", [("tpu", None, True), ("tpu", 4, True),
                                                  ("tpu", 4, False), ("gpu", None, True)])
def test_tiered_layer_reads_both_tiers_through_the_kernel(backend, bits, staged):
    """A tiered layer (pages spilled to host memory, `kvjax.memory.tiers`) attends through the
    kernel as two page pools, its device pages and its stage (`tier_views`), merged: equal to
    the reference over both tiers. With a host page not staged (a prefetch miss) the step
    reads XLA's view, which fetches it; the kernel alone would have missed that page, so its
    result differs there (the fallback is what made it right)."""
    from kvjax.core.branches import usual_branches_only
    from kvjax.memory import tiers
    from kvjax.memory.paging import reserve
    if compiled() and device_backend() != backend:
        pytest.skip("[optional] compiled mode: only the present chip's kernel")
    rng = np.random.default_rng(11)
    b, kvh, s, d = 2, 2, 16, 64
    pool, layers = tiers.init_tiered_cache(20, 8, s, b, kvh, 4, d, num_layers=1, bits=bits)
    pool, layers = reserve(pool, layers, jnp.array([40, 29]))
    k = jnp.asarray(rng.normal(size=(b, kvh, 40, d)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(40), (b, 40)).at[1, 29:].set(-1)
    layers = (layers[0].write(k, -k, pos),)
    pool, layers = tiers.spill(pool, layers, tiers.coldest_pages(
        layers[0], tiers.recency_scores(layers[0]), 5))
    host = tiers.host_pages_in_use(layers[0])  # [5 ids], some possibly past the end
    layers = tiers.prefetch(layers, host if staged else host.at[0].set(-1))
    (layer,) = layers
    assert ka.supports_pallas(layer, backend)
    device, stage = ka.tier_views(layer)
    misses = int(tiers.stage_misses(layer).sum())
    assert (misses == 0) == staged
    np.testing.assert_array_equal(  # every page in use is listed once, in one pool or missed
        np.asarray(device.num_pages_used + stage.num_pages_used + tiers.stage_misses(
            layer).sum(-1)), np.asarray(layer.num_pages_used))
    q = jnp.asarray(rng.normal(size=(b, 1, 3 * kvh, d)), jnp.float32)
    q_pos = jnp.array([[40], [29]], jnp.int32)
    backend, interpret = mode(backend)
    run = lambda: ka.attend_pallas(q, q_pos, layer, backend=backend, interpret=interpret,
                                   window=33)
    want = kvjax.attend(q, q_pos, layer, impl="reference", window=33)
    np.testing.assert_allclose(np.asarray(run()), np.asarray(want), **TOL)
    with usual_branches_only():  # the two kernel calls alone
        kernel_only = np.asarray(run())
    if staged:
        np.testing.assert_allclose(kernel_only, np.asarray(want), **TOL)
    else:
        assert not np.allclose(kernel_only, np.asarray(want), **TOL)
    if backend == "tpu" and bits is None:  # host pages are not split over a mesh: XLA's path
        from kvjax.backends.sharded import PallasOnMesh
        assert ka.has_host_tier(layer)
        mesh = jax.make_mesh((1, 1), ("batch", "kv"))
        on_mesh = kvjax.attend(q, q_pos, layer, impl=PallasOnMesh(mesh, backend="tpu",
                                                                   interpret=interpret),
                               window=33)
        np.testing.assert_array_equal(np.asarray(on_mesh), np.asarray(
            kvjax.attend(q, q_pos, layer, impl="xla", window=33)))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_long_query_blocks_are_split_into_calls_within_the_row_limit(backend, monkeypatch):
    """A prefill chunk of 50 query tokens x 3 query heads per KV head (150 rows) is attended in
    kernel calls of at most MAX_QUERY_ROWS rows (a 256-token chunk asked an H200 for 834 KiB of
    shared memory in one call), over consecutive tokens, causally: equal to the reference."""
    monkeypatch.setitem(ka.MAX_QUERY_ROWS, backend, 64)  # 21 tokens a call: 3 calls
    layer, _, _ = filled(5, 60, capacity=64)
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.normal(size=(2, 50, 6, 64)), jnp.float32)
    q_pos = jnp.broadcast_to(jnp.arange(10, 60, dtype=jnp.int32), (2, 50))
    rows, kernel = [], ka.paged_attention_partial

    def counted(q, *args, **kwargs):
        rows.append(q.shape[1] * q.shape[2] // 2)  # query rows per KV head in this call
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(ka, "paged_attention_partial", counted)
    backend, interpret = mode(backend)
    got = ka.attend_pallas(q, q_pos, layer, backend=backend, interpret=interpret)
    assert rows == [63, 63, 24]
    want = kvjax.attend(q, q_pos, layer, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    with pytest.raises(ValueError, match="backend must be one of"):
        ka.query_tokens_per_call(3, "cuda")


@pytest.mark.parametrize("method", ["kivi:bits=4,group=32,residual=32",
                                    "kivi:bits=2,group=16,residual=16,param_dtype=bfloat16",
                                    "kivi:bits=4,group=32,residual=32,param_dtype=float32"])
def test_kivi_keys_are_read_in_place(method):
    """A KIVI body with pages of 128 slots goes to the TPU kernel as its own rows: the key codes
    and the lane-flat parameter table are the store's own arrays (`PackedChannelRows`, no page
    pool; the table reaches the kernel through a reshape alone, or a bitcast for float32;
    only the ids are built per call) and the attention equals the reference's, with and
    without a window. 8 rows: ids and table are read a row a sublane (`pf.row_tile`). A body
    whose groups eviction spread past a page's window takes XLA's loop (still the reference's
    numbers)."""
    layer, q, q_pos = filled(9, 600, capacity=640, batch=4, kvh=2, d=64)
    layer = encode(layer, method)
    body = layer.body
    inputs = ka.kernel_inputs(body, backend="tpu")
    assert isinstance(inputs["k_format"], pf.PackedChannelRows)
    assert inputs["k_pages"][0].shape == (8, 64 * body.k.bits // 32, body.capacity)
    table_in = jax.make_jaxpr(lambda b: ka.kernel_inputs(b, backend="tpu")["k_pages"][2])(body)
    assert ops_feeding_the_output(table_in.jaxpr) <= {"reshape", "bitcast_convert_type"}
    np.testing.assert_array_equal(
        np.asarray(inputs["k_pages"][2]).reshape(8, -1),
        np.asarray(ka.kernel_table(body.k)))
    assert inputs["k_pages"][1].shape == (1, 8, body.capacity)  # ids, [R / 8, 8, C]
    assert inputs["table_windows"].shape == (8 * inputs["row_pages"] // 2,)  # two per word
    assert bool(ka._windows_fit(body, ka.page_size_for(body.capacity), "tpu"))
    if compiled() and device_backend() != "tpu":
        pytest.skip("[optional] compiled mode: the TPU kernel needs a TPU")
    backend, interpret = mode("tpu")
    spread = layer.replace(body=body.replace(k=body.k.replace(group_id=body.k.group_id[:, ::-1])))
    assert not bool(ka._windows_fit(spread.body, ka.page_size_for(body.capacity), "tpu"))
    for case, window in ((layer, None), (layer, 300), (spread, None)):
        got = ka.attend_pallas(q, q_pos, case, window=window, backend=backend,
                               interpret=interpret, pages_per_split=2)
        want = kvjax.attend(q, q_pos, case, impl="reference", window=window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
