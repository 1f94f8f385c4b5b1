"""The Mosaic GPU paged attention kernel (kernels_pallas/paged_attention_mgpu.py), proven on CPU.

- GPU interpret mode (jax's simulation of GMEM/SMEM, TMA copies, barriers and
  wgmma, `InterpretGPUParams`) against the plain-jnp `paged_attention_reference`
  on the same pages, element-wise: dense bf16 pages (keys slots-last and
  slots-first) and 4-bit per-token pages (asymmetric groups of 32 with float16
  parameters; symmetric, one group per token), GQA, ragged lengths including 0,
  several pages per pipeline step and several splits. Tolerances come from the
  one rounding the kernel adds: p (and p * scale for packed values) to bf16
  before the p @ v wgmma, relative 2**-8 of the values the products sum.
- Lowering for CUDA on this CPU host: the `mosaic_gpu` custom call's module
  holds `wgmma.mma_async ... f32.bf16.bf16` (tensor cores, bf16 operands, f32
  accumulators) and TMA tensor copies (`cp.async.bulk.tensor`) with mbarriers.
- Shapes the kernel does not take raise ValueError naming the argument.
Nothing here runs on a GPU; with KVJAX_PALLAS_COMPILED=1 on a GPU the equality
tests run the kernel compiled.
"""

import collections
import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

import kernel_mode
from kernels_pallas import page_formats as pf
from kernels_pallas import paged_attention_mgpu as mgpu
from kernels_pallas.gpu_lowering import cuda_custom_calls
from kernels_pallas.paged_attention import decode_pages, paged_attention_reference
from test_paged_attention import make_pool, packed_tokens, queries

PAGE, DIM = 64, 64


@pytest.fixture(autouse=True, scope="module")
def _transposed_operands():
    """The interpreter fix for transposed wgmma operands (interpret mode only: hardware wgmma
    reads them natively, and the fix reaches into the interpreter of jax 0.10.2)."""
    undo = (lambda: None) if kernel_mode.compiled() else mgpu.interpret_transposed_wgmma()
    yield
    undo()


def _mode():
    """interpret= for a kernel call: GPU interpret mode, or compiled (KVJAX_PALLAS_COMPILED=1)."""
    _, interpret = kernel_mode.mode("gpu")
    return mgpu.INTERPRET if interpret else False


def _pool(lengths=(0, 70, 150), kv_heads=1, group=3, seed=0):
    rng = np.random.default_rng(seed)
    k, v, pos, tables, counts = make_pool(rng, batch=len(lengths), kv_heads=kv_heads,
                                          page_size=PAGE, head_dim=DIM, lengths=list(lengths),
                                          extra_pages=1)
    q, q_pos = queries(rng, len(lengths), 1, kv_heads * group, DIM, list(lengths))
    return q.astype(jnp.bfloat16), jnp.maximum(q_pos, 0), k, v, pos, tables, counts


FORMATS = {
    "dense-keys-slots-first": (pf.DENSE, pf.DENSE, lambda k, v: (
        k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))),
    "int4-tokens-g32": (pf.PackedTokens(4, 32), pf.PackedTokens(4, 32), lambda k, v: (
        packed_tokens(k, 4, 32, False), packed_tokens(v, 4, 32, False))),
    "int4-tokens-sym-g64": (pf.PackedTokens(4, 64, True), pf.PackedTokens(4, 64, True),
                            lambda k, v: (packed_tokens(k, 4, 64, True),
                                          packed_tokens(v, 4, 64, True))),
}


# keys slots-last ([P, D, S], wgmma's B operand as stored): the shared-tables test below
@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_reference(name):
    """Ragged rows of 0, 2 and 3 pages of 64 slots, GQA-3, 2 pages a step, 2 pages a split:
    the kernel's output equals the f32 reference on the same pages within the bf16 rounding
    of p (and of p * scale for packed values) before p @ v."""
    kf, vf, encode = FORMATS[name]
    q, q_pos, k, v, pos, tables, counts = _pool()
    kp, vp = encode(k, v)
    want = np.asarray(paged_attention_reference(q, q_pos, kp, vp, pos, tables, counts,
                                                k_format=kf, v_format=vf))
    got = np.asarray(mgpu.paged_attention_mgpu(q, q_pos, kp, vp, pos, tables, counts,
                                               k_format=kf, v_format=vf, interpret=_mode(),
                                               pages_per_step=2, pages_per_split=2))
    values = np.abs(np.asarray(decode_pages(vf, vp if isinstance(vp, tuple) else (vp,),
                                                  DIM))).max()
    # packed values: the kernel sums (p * scale) * codes = p * (v - offset), |v - offset| <= 2|v|
    bound = 2.0 ** -8 * values * (1 if isinstance(vf, pf.Dense) else 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=bound + 1e-5)
    assert np.abs(got - want).mean() < bound / 8  # most elements far inside the bound
    assert np.all(got[0] == 0)  # a row with no pages attends to nothing


def test_several_kv_heads_shared_tables_and_window():
    """Two KV heads reading one shared [B, NP] table with head_stride, a sliding window that
    skips whole pages, one page a step (three steps, one split): equal to the reference."""
    rng = np.random.default_rng(3)
    lengths, per_row = [130, 192], 3
    b, kvh = len(lengths), 2
    k, v, pos, _, _ = make_pool(rng, batch=b, kv_heads=kvh, page_size=PAGE, head_dim=DIM,
                                lengths=[192] * b, extra_pages=0)
    # pool rows laid out as a TokenCache: row (b, h) owns pages (b*KVH + h)*3 .. +2
    pos = np.full((b * kvh * per_row, 1, PAGE), -1, np.int32)
    for bi, n in enumerate(lengths):
        for h in range(kvh):
            for i in range(n):
                pos[(bi * kvh + h) * per_row + i // PAGE, 0, i % PAGE] = i
    pos = jnp.asarray(pos)
    tables = jnp.asarray(np.arange(b)[:, None] * kvh * per_row + np.arange(per_row), jnp.int32)
    counts = jnp.asarray([[-(-n // PAGE)] * kvh for n in lengths], jnp.int32)
    q, q_pos = queries(rng, b, 1, 2 * kvh, DIM, lengths)
    q = q.astype(jnp.bfloat16)
    kp, vp = jnp.swapaxes(k, 1, 2).astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    kw = dict(k_format=pf.DENSE_T, v_format=pf.DENSE, head_stride=per_row, window=70)
    want = np.asarray(paged_attention_reference(q, q_pos, kp, vp, pos, tables, counts, **kw))
    got = np.asarray(mgpu.paged_attention_mgpu(q, q_pos, kp, vp, pos, tables, counts,
                                               interpret=_mode(), pages_per_step=1,
                                               pages_per_split=4, **kw))
    bound = 2.0 ** -8 * float(np.abs(np.asarray(v, np.float32)).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=bound + 1e-5)


def mosaic_ops(fn, *args) -> collections.Counter:
    """PTX/NVVM operations of the Mosaic GPU module(s) `jax.jit(fn)` lowers to for CUDA."""
    import jax.experimental.mosaic.gpu as mosaic
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    calls = cuda_custom_calls(fn, *args, target="mosaic_gpu")
    ops = collections.Counter()
    for call in calls:
        ctx = mlir.make_ir_context()
        mosaic.dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        with ctx:
            text = str(ir.Module.parse(call.attributes["mhlo.backend_config"]["module"]
                                       .value_bytes))
        ops.update(re.findall(r"(wgmma\.[\w.]+|cp\.async\.bulk\.tensor\.[\w.]+|mbarrier\.[\w.]+)",
                              text))
    ops["custom_calls"] = len(calls)
    return ops


def test_lowers_for_cuda_with_wgmma_and_tma():
    """Lowered for CUDA on this CPU host: one Mosaic GPU kernel whose dots are Hopper wgmma
    m64n64k16 with bf16 operands and f32 accumulators (q.k: 64 rows x 64 slots, K = D in
    4 k-steps; p.v: 64 rows x D, K = S in 4), and whose page copies are TMA tensor loads
    completed on mbarriers (the pipeline's GMEM -> SMEM copies)."""
    kf, vf, encode = FORMATS["dense-keys-slots-first"]
    q, q_pos, k, v, pos, tables, counts = _pool()
    kp, vp = encode(k, v)
    fn = functools.partial(mgpu.paged_attention_mgpu, k_format=kf, v_format=vf,
                           pages_per_step=1, pages_per_split=2)
    ops = mosaic_ops(fn, q, q_pos, kp, vp, pos, tables, counts)
    assert ops["custom_calls"] == 1
    wgmma = {op: c for op, c in ops.items() if op.startswith("wgmma.mma_async")}
    assert set(wgmma) == {"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"}, ops
    assert ops["cp.async.bulk.tensor.shared.cluster.global"] > 0, ops  # TMA GMEM -> SMEM
    assert ops["mbarrier.arrive.expect_tx"] > 0 and ops["wgmma.wait.group.sync.aligned"] > 0


def test_shapes_the_kernel_cannot_take_raise():
    q, q_pos, k, v, pos, tables, counts = _pool(lengths=(5,))
    call = functools.partial(mgpu.paged_attention_mgpu, interpret=mgpu.INTERPRET)
    with pytest.raises(ValueError, match=r"head_dim \(q.shape\[-1\]\) must be a multiple of 64, "
                                         r"got 48"):
        call(q[..., :48], q_pos, k[..., :48], v[..., :48], pos, tables, counts)
    with pytest.raises(ValueError, match=r"page size \(pos_pages.shape\[-1\]\) .* got 32"):
        call(q, q_pos, k[:, :32], v[:, :32], pos[..., :32], tables, counts)
    with pytest.raises(ValueError, match="query rows per KV head .* <= 64, got 96"):
        call(jnp.tile(q, (1, 1, 32, 1)), q_pos, k, v, pos, tables, counts)
    with pytest.raises(ValueError, match="pages_per_step must be >= 1, got 0"):
        call(q, q_pos, k, v, pos, tables, counts, pages_per_step=0)
    kivi = pf.PackedChannels(4, 3)
    with pytest.raises(ValueError, match="k_format must be Dense or PackedTokens"):
        mgpu.check_mgpu_shapes(64, 64, 3, kivi, pf.DENSE, 1, 2)
    with pytest.raises(ValueError, match="multiple of 8 rows"):  # 2-bit codes of D = 64: 4 rows
        mgpu.check_mgpu_shapes(64, 64, 3, pf.PackedTokens(2, 32), pf.DENSE, 1, 2)
