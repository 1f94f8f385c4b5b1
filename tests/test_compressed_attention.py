"""Attention over compressed layers read block by block (no whole-cache decode).

`attend` (impl="xla", `attend_blockwise`) on an encoded or residual layer must
equal `attend_reference` on the same layer, which decodes it whole with
`kvjax.view`: same slots, same decoded floats, only the summation order
differs, so the tolerance is float32 rounding of a D-term dot and a softmax.

On a one-device CPU a decode step's parts go through the C++ kernel
(`kvjax.core.cpu_kernel`) wherever it reads their format; everywhere else (a multi-device run,
`jax.export`, a TPU or GPU) through XLA's block-by-block loop. Both paths are checked: each
case runs once as the process chooses (`cpu_kernel`, and the compiled program must call the
kernel where it serves) and once under `cpu_kernel.disabled()` (`xla_loop`, and the program
must not call it).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.core import cpu_kernel
from kvjax.core.attention import MATVEC_ROWS, _scores
from kvjax.core.stores import PackedChannels, read

from tests.random_layers import make_layer

B, KVH, H, D = 2, 2, 6, 32
TOL = 2e-6  # float32: outputs are O(1) averages of O(1) values


def _layer(method: str, ctx: int, room: int = 8, dtype=jnp.float32, seed: int = 0):
    """One layer holding `ctx` random tokens, compressed by `method` and shrunk (as decode sees it)."""
    return make_layer(method, B, ctx, room, seed, kv_heads=KVH, head_dim=D, dtype=dtype)


def _queries(t: int, ctx: int, seed: int = 1):
    q = jax.random.normal(jax.random.key(seed), (B, t, H, D))
    q_pos = jnp.broadcast_to(ctx + jnp.arange(t)[None], (B, t)).astype(jnp.int32)
    return q, q_pos


METHODS = [("quantize:bits=4", 1), ("quantize:bits=2,symmetric=true", 5),
           ("kivi:bits=4,group=16,residual=32", 1), ("kivi:bits=2,group=16,residual=16", 12),
           ("random:ratio=0.5+kivi:bits=4,group=16,residual=16", 1),  # evict, then quantize
           ("kivi:bits=4,group=16,residual=16+random:ratio=0.5", 1),  # codes compacted: gathers
           ("fp8", 1), ("random:ratio=0.75", 1),
           ("random:ratio=0.5,headwise=true+quantize:bits=4", 1),
           ("quantize:bits=4,axis=channel,group=16", 1)]


PATHS = ["cpu_kernel", "xla_loop"]
KERNEL_READS = {"quantize:bits=4", "quantize:bits=2,symmetric=true",
                "kivi:bits=4,group=16,residual=32", "random:ratio=0.5+kivi:bits=4,group=16,residual=16",
                "kivi:bits=4,group=16,residual=16+random:ratio=0.5", "random:ratio=0.75",
                "random:ratio=0.5,headwise=true+quantize:bits=4",
                "quantize:bits=4,axis=channel,group=16"}
"""The layers of METHODS whose decode step (t = 1) the C++ kernel reads, at least in part
(fp8 pages and prefill chunks stay in the loop)."""


def _on_path(path: str):
    assert path in PATHS
    return cpu_kernel.disabled() if path == "xla_loop" else contextlib.nullcontext()


def _compiled_on(path: str, fn, *args):
    """`fn` jitted and traced on `path`, and whether its program calls the kernel. A new
    function each time: `jax.jit` keys its trace cache on the function, not on the path."""
    with _on_path(path):
        lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
    return lowered.compile(), cpu_kernel.TARGET in lowered.as_text()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method, t", METHODS)  # t = 12: more query rows than MATVEC_ROWS
def test_blockwise_over_compressed_layer_equals_reference_on_its_view(method, t, path):
    ctx = 150
    layer = _layer(method, ctx)
    q, q_pos = _queries(t, ctx)
    want = kvjax.attend_reference(q, q_pos, layer)
    for block in (48, None):  # blocks across groups; the default (the whole layer here)
        step, calls_kernel = _compiled_on(
            path, lambda q, p, c: kvjax.attend_blockwise(q, p, c, block=block), q, q_pos, layer)
        decode_step = t * (H // KVH) <= MATVEC_ROWS  # query rows per cache row
        assert calls_kernel == (path == "cpu_kernel" and decode_step
                                and method in KERNEL_READS), (path, method, t)
        got = step(q, q_pos, layer)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("path", PATHS)
def test_residual_layer_with_bf16_exact_part_is_read_as_float32(path):
    """The exact part of a bf16 KIVI layer is widened, as `view` widens it (no bf16 dots)."""
    layer = _layer("kivi:bits=4,group=16,residual=32", 120, dtype=jnp.bfloat16)
    assert layer.recent.k.dtype == jnp.bfloat16
    q, q_pos = _queries(1, 120)
    step, calls_kernel = _compiled_on(path, kvjax.attend, q, q_pos, layer)
    assert calls_kernel == (path == "cpu_kernel")
    np.testing.assert_allclose(np.asarray(step(q, q_pos, layer)),
                               np.asarray(kvjax.attend_reference(q, q_pos, layer)),
                               rtol=TOL, atol=TOL)


@pytest.mark.parametrize("method, in_order", [("kivi:bits=4,group=16,residual=16", True),
                                              ("kivi:bits=4,group=16,residual=16+random:ratio=0.5",
                                               False)])
def test_channel_store_blocks_decode_like_the_whole_store(method, in_order):
    """`read_slots` (per-group broadcast or per-slot gather) == a slice of `read`, bit for bit."""
    body = _layer(method, 200).body
    store = body.k
    assert isinstance(store, PackedChannels)
    gid = np.asarray(store.group_id)[:, :int(body.length)]
    assert (gid == np.arange(gid.shape[1]) // store.group).all() == in_order
    whole = np.asarray(read(store))
    n = store.shape[1]
    for start, size in [(0, 16), (5, 16), (16, 48), (n - 40, 40), (0, n)]:
        got = store.read_slots(jnp.int32(start), size, body.length)
        np.testing.assert_array_equal(np.asarray(got)[:, :int(body.length) - start],
                                      whole[:, start:int(body.length)][:, :size])


def test_decode_scores_as_matrix_vector_products_equal_the_dot():
    qg = jax.random.normal(jax.random.key(0), (4, MATVEC_ROWS, D))
    k = jax.random.normal(jax.random.key(1), (4, 40, D))
    want = np.einsum("nqd,nsd->nqs", np.asarray(qg, np.float64), np.asarray(k, np.float64))
    np.testing.assert_allclose(np.asarray(_scores(qg, k)), want, rtol=1e-5, atol=1e-5)


def _largest_f32_temp(fn, *args) -> int:
    """Elements of the largest float32 array in the compiled program (parameters excluded)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    import re
    sizes = [np.prod([int(x) for x in dims.split(",") if x])
             for line in text.splitlines() if "parameter(" not in line
             for dims in re.findall(r"f32\[([\d,]*)\]", line)]
    return int(max(sizes))


@pytest.mark.parametrize("method", ["kivi:bits=4,group=16,residual=16", "quantize:bits=4"])
def test_decode_never_decodes_the_whole_layer(method):
    """No float32 array in the compiled decode step is as large as the decoded keys: the
    codes are decoded one block at a time (before: view() built [R, C, D] float32).
    Blocks hold at most 1024 slots (`decode_block`), an eighth of these 8192."""
    ctx = 8192
    layer = _layer(method, ctx)
    q, q_pos = _queries(1, ctx)
    decoded = B * KVH * ctx * D
    biggest = _largest_f32_temp(lambda q, p, c: kvjax.attend(q, p, c), q, q_pos, layer)
    assert biggest <= decoded // 4, (biggest, decoded)
