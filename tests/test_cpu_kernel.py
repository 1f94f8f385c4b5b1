"""The CPU decode-attention kernel (kvjax/core/cpu_kernel.py) against the XLA loop it replaces.

Each case traces `kvjax.attend` twice: as shipped (the kernel on this CPU) and under
`cpu_kernel.disabled()` (the blockwise XLA loop), on the same layer and queries. Both
decode the same codes to the same floats and sum in another order, so outputs agree to
float32 rounding of a D-term dot and a softmax over the slots (`TOL`). The few-row matmul
(`cpu_kernel.matmul`, last section) is compared with `jnp.dot`.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.core import cpu_kernel
from kvjax.core.attention import MATVEC_ROWS

from tests.random_layers import make_layer

TOL = 3e-6


def _both(layer, q, q_pos, kernel=True, **kw):
    fn = lambda q, q_pos, layer: kvjax.attend(q, q_pos, layer, **kw)
    lowered = jax.jit(fn).lower(q, q_pos, layer)
    assert (cpu_kernel.TARGET in lowered.as_text()) == kernel, "kernel use"
    with cpu_kernel.disabled():
        plain = jax.jit(lambda q, q_pos, layer: fn(q, q_pos, layer))
        assert cpu_kernel.TARGET not in plain.lower(q, q_pos, layer).as_text()
        want = plain(q, q_pos, layer)
    return np.asarray(lowered.compile()(q, q_pos, layer)), np.asarray(want)


def _queries(b, t, h, d, ctx, seed=1):
    q = jax.random.normal(jax.random.key(seed), (b, t, h, d))
    return q, jnp.broadcast_to(ctx + jnp.arange(t)[None], (b, t)).astype(jnp.int32)


def test_the_kernel_builds_here():
    """CI has a C++ compiler: the kernel must build and register, not fall back silently."""
    assert cpu_kernel.registered()
    assert cpu_kernel.build().exists()


METHODS = ["full", "quantize:bits=4", "quantize:bits=8", "quantize:bits=2,symmetric=true",
           "quantize:bits=8,group=4",  # a bit plane (8 channels) spans two groups: no fused path
           "kivi:bits=4", "kivi:bits=2,group=16,residual=16",
           "random:ratio=0.5+kivi:bits=4,group=16,residual=16",
           "kivi:bits=4,group=16,residual=16+random:ratio=0.5",  # compacted codes: table gathers
           "random:ratio=0.5,headwise=true",  # pooled rows: one row serves every head
           "quantize:bits=4,axis=channel,group=16"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("t", [1, 2])  # 3 and 6 query rows per cache row
def test_kernel_equals_the_xla_loop(method, t):
    b, kvh, h, d, ctx = 2, 2, 6, 32, 1299  # three chunks of CHUNK = 512, the last not 4-aligned
    layer = make_layer(method, b, ctx, 16, 0, kv_heads=kvh, head_dim=d)
    pooled_rows = h * t if "headwise" in method else 0  # a pooled row serves all heads
    got, want = _both(layer, *_queries(b, t, h, d, ctx), kernel=pooled_rows <= MATVEC_ROWS)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("method", ["kivi:bits=4", "kivi:bits=4,param_dtype=bfloat16",
                                    "quantize:bits=4"])
def test_the_kernel_reads_packed_parameters_in_place(method):
    """The kernel takes a KIVI key table (16-bit scale and offset per uint32 word) and per-token
    float16 parameters (uint16 bits) as the store holds them: in the compiled decode step no
    operation but the kernel call (and free bitcasts) reads them, where a dtype view of them was
    a copy every call; and the result still equals the XLA loop."""
    b, kvh, h, d, ctx = 1, 2, 6, 64, 700
    layer = make_layer(method, b, ctx, 16, 0, kv_heads=kvh, head_dim=d)
    q, q_pos = _queries(b, 1, h, d, ctx)
    hlo = jax.jit(lambda q, q_pos, l: kvjax.attend(q, q_pos, l)).lower(q, q_pos, layer)
    lines = hlo.compile().as_text().splitlines()
    params = [line.split(" = ")[0].split()[-1] for line in lines if " parameter(" in line
              and any(f in line for f in ("k_table", "scale", "offset"))]
    assert params, "no parameter arrays found in the program"
    for name in params:
        users = [line for line in lines if f"{name})" in line or f"{name}," in line]
        assert users and all("custom-call" in u or " bitcast(" in u for u in users), users
    got, want = _both(layer, q, q_pos)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d, h", [(64, 9), (128, 4), (48, 5)])  # fixed-size and generic paths
def test_kernel_dtypes_and_head_shapes(dtype, d, h):
    b, ctx = 1, 700
    kvh = 1 if h == 5 else (3 if h == 9 else 2)
    layer = make_layer("full", b, ctx, 16, 0, kv_heads=kvh, head_dim=d, dtype=dtype)
    got, want = _both(layer, *_queries(b, 1, h, d, ctx))
    tol = TOL if dtype == jnp.float32 else 1e-2  # bf16: weights rounded to bf16 (8 bits)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", ["quantize:bits=4", "quantize:bits=8,symmetric=true",
                                    "kivi:bits=4", "kivi:bits=2"])
@pytest.mark.parametrize("d", [64, 128])  # the compiled head dims (the tests above use 32)
def test_packed_formats_at_model_head_dims(method, d):
    b, kvh, h, ctx = 2, 3, 9, 703
    layer = make_layer(method, b, ctx, 16, 0, kv_heads=kvh, head_dim=d)
    got, want = _both(layer, *_queries(b, 1, h, d, ctx))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("method", ["quantize:bits=8", "kivi:bits=4"])
@pytest.mark.parametrize("rows", [1, 5, 8])  # compiled row counts (1, 8) and the generic one (5)
def test_packed_formats_at_each_query_row_count(method, rows):
    """The packed keys' 16-lane tiles and the values' register sums hold up to 8 query rows
    per cache row, with a compiled count or the generic loop."""
    b, kvh, d, ctx = 1, 2, 64, 530
    layer = make_layer(method, b, ctx, 16, 0, kv_heads=kvh, head_dim=d)
    got, want = _both(layer, *_queries(b, 1, kvh * rows, d, ctx))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_kernel_window_softcap_and_padding_queries():
    b, kvh, h, d, ctx = 2, 2, 4, 32, 900
    layer = make_layer("kivi:bits=4", b, ctx, 16, 0, kv_heads=kvh, head_dim=d)
    q, q_pos = _queries(b, 2, h, d, ctx)
    q_pos = q_pos.at[1, 1].set(-1)  # a padding query sees nothing: zeros
    got, want = _both(layer, q * 4, q_pos, window=300, softcap=5.0)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    assert not np.any(got[1, 1])


def test_kernel_on_an_empty_cache_returns_zeros():
    cache = kvjax.init_cache(1, 2, 64, 16)
    got, want = _both(cache, *_queries(1, 1, 4, 16, 0))
    assert not np.any(got) and not np.any(want)


def test_prefill_chunks_and_opt_out_keep_the_xla_loop(monkeypatch):
    layer = make_layer("full", 1, 300, 16, 0, kv_heads=2, head_dim=16)
    q, q_pos = _queries(1, 8, 4, 16, 300)  # 16 query rows per cache row > MATVEC_ROWS
    text = jax.jit(lambda q: kvjax.attend(q, q_pos, layer)).lower(q).as_text()
    assert cpu_kernel.TARGET not in text
    monkeypatch.setenv("KVJAX_CPU_KERNEL", "0")
    q1, p1 = _queries(1, 1, 4, 16, 300)
    assert cpu_kernel.TARGET not in jax.jit(
        lambda q: kvjax.attend(q, p1, layer)).lower(q1).as_text()


def test_a_missing_compiler_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(OSError, match="no-such-compiler"):
        cpu_kernel.build(cxx=os.path.join(str(tmp_path), "no-such-compiler"))


def _bench(name, *args, timeout=600):
    """`python -m experiments.bench.NAME ARGS` in a subprocess (tests import no benchmark
    script): its exit status and output, as a user running it from the repository sees them."""
    import subprocess
    import sys
    from pathlib import Path
    return subprocess.run([sys.executable, "-m", f"experiments.bench.{name}", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])


def test_benchmark_rows_compare_kernel_and_loop(tmp_path):
    """`experiments/bench/cpu_kernel.py`'s rows: the kernel and the XLA loop on the same layers,
    both timed, their outputs equal."""
    out = tmp_path / "rows.json"
    run = _bench("cpu_kernel", "--methods", "kivi:bits=4", "--batch", 1, "--context", 200,
                 "--repeats", 1, "--layers", 2, "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["max_abs_diff"] < 1e-5 and row["kernel_ms"] > 0 and row["xla_loop_ms"] > 0
    assert row["cache_mb"] > 0 and row["layers"] == 2
    bad = _bench("cpu_kernel", "--layers", 0)
    assert bad.returncode == 2 and "--layers must be >= 1" in bad.stderr


# ---- the few-row matmul (cpu_kernel.matmul) against jnp.dot ----

def _matmul_both(x, w):
    lowered = jax.jit(cpu_kernel.matmul).lower(x, w)
    dot = jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return lowered, np.asarray(lowered.compile()(x, w)), np.asarray(dot)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,k,n", [((2,), 576, 1536), ((8, 1), 1536, 576), ((5,), 37, 48),
                                      ((3, 2), 19, 16), ((8,), 4, 192), ((1,), 576, 192),
                                      ((1, 1), 1536, 576)])
def test_matmul_equals_the_dot(dtype, lead, k, n):
    """1-8 rows in the kernel: every shape class (row counts 1-8, K not a multiple of the
    4-row unroll or the 16-row tile, N with a lone 16-column tile) equals the dot to float32
    rounding of a K-term sum (|x| |w| summed, times a few ulps)."""
    x = jax.random.normal(jax.random.key(0), (*lead, k))
    w = jax.random.normal(jax.random.key(1), (k, n)).astype(dtype)
    lowered, got, want = _matmul_both(x, w)
    assert cpu_kernel.MATMUL_TARGET in lowered.as_text()
    assert got.shape == (*lead, n)
    bound = np.asarray(jnp.abs(x.astype(dtype).astype(jnp.float32)) @ jnp.abs(w.astype(jnp.float32)))
    np.testing.assert_array_less(np.abs(got - want), 4 * np.finfo(np.float32).eps * bound + 1e-30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matmuls_are_one_call_equal_to_each_dot(dtype, rows):
    """A layer's q, k, v (two weights above the one-thread size, one below it and a lone
    16-column tile) in one kernel call, each equal to its dot as `matmul` is; weights of two
    dtypes fall back to one dot each."""
    x = jax.random.normal(jax.random.key(0), (rows, 576))
    ws = [jax.random.normal(jax.random.key(i + 1), (576, n)).astype(dtype)
          for i, n in enumerate((576, 192, 16))]
    lowered = jax.jit(cpu_kernel.matmuls).lower(x, ws)
    assert lowered.as_text().count(cpu_kernel.MATMUL_TARGET) == 1
    xs = np.asarray(x.astype(dtype).astype(jnp.float32))
    for got, w in zip(lowered.compile()(x, ws), ws):
        w32 = np.asarray(w.astype(jnp.float32))
        bound = np.abs(xs) @ np.abs(w32)
        want = xs.astype(np.float64) @ w32.astype(np.float64)
        np.testing.assert_array_less(np.abs(got - want), 4 * np.finfo(np.float32).eps * bound + 1e-30)
    mixed = [ws[0], ws[1].astype(jnp.float16)]
    text = jax.jit(cpu_kernel.matmuls).lower(x, mixed).as_text()
    assert cpu_kernel.MATMUL_TARGET not in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,k,n", [((1,), 576, 49152), ((2,), 576, 1003), ((3, 1), 64, 37),
                                      ((4,), 128, 9), ((5,), 16, 700), ((8, 1), 576, 4099),
                                      ((1, 1), 32, 3)])
def test_matmul_t_equals_the_dot(dtype, lead, k, n):
    """x @ w.T with w [N, K] read in place (the tied-embedding logits): every rows class (the
    4-, 2- and 1-row-of-w unrolls and their leftovers: N not a multiple of 4 or 2, N below one
    unroll) and the embedding's real shape equal the dot to float32 rounding of a K-term sum."""
    x = jax.random.normal(jax.random.key(0), (*lead, k))
    w = jax.random.normal(jax.random.key(1), (n, k)).astype(dtype)
    lowered = jax.jit(cpu_kernel.matmul_t).lower(x, w)
    assert cpu_kernel.MATMUL_T_TARGET in lowered.as_text()
    got = np.asarray(lowered.compile()(x, w))
    xs = x.astype(dtype).astype(jnp.float32)
    want = np.asarray(jnp.einsum("...k,nk->...n", xs, w.astype(jnp.float32), precision="highest"))
    assert got.shape == (*lead, n)
    bound = np.asarray(jnp.einsum("...k,nk->...n", jnp.abs(xs), jnp.abs(w.astype(jnp.float32)),
                                  precision="highest"))
    np.testing.assert_array_less(np.abs(got - want), 4 * np.finfo(np.float32).eps * bound + 1e-30)


def test_matmul_t_outside_the_kernel_calls_otherwise():
    """K not a multiple of 16, more than 8 rows and `disabled()` run `otherwise` (the einsum by
    default), exactly."""
    for x, w in ((jnp.ones((2, 40)), jnp.ones((24, 40))), (jnp.ones((9, 64)), jnp.ones((24, 64)))):
        lowered = jax.jit(cpu_kernel.matmul_t).lower(x, w)
        assert cpu_kernel.MATMUL_T_TARGET not in lowered.as_text()
        np.testing.assert_array_equal(lowered.compile()(x, w), x @ w.T)
    x, w = jnp.ones((2, 64)), jnp.ones((24, 64))
    with cpu_kernel.disabled():
        got = jax.jit(lambda x, w: cpu_kernel.matmul_t(x, w, otherwise=lambda x, w: -x @ w.T))(x, w)
    np.testing.assert_array_equal(got, -x @ w.T)


@pytest.mark.parametrize("shape,n,dtype", [((9, 64), 32, jnp.float32), ((4, 64), 40, jnp.float32),
                                           ((4, 64), 32, jnp.float16)])
def test_matmul_outside_the_kernel_is_the_dot(shape, n, dtype):
    """More than 8 rows, N not a multiple of 16 and float16 weights keep jnp.dot."""
    x = jax.random.normal(jax.random.key(0), shape)
    w = jax.random.normal(jax.random.key(1), (shape[-1], n)).astype(dtype)
    lowered, got, want = _matmul_both(x, w)
    assert cpu_kernel.MATMUL_TARGET not in lowered.as_text()
    np.testing.assert_array_equal(got, want)


def test_matmul_opt_out_keeps_the_dot(monkeypatch):
    """`disabled()` (what models/export.py traces under) and KVJAX_CPU_KERNEL=0 keep the dot."""
    x, w = jnp.ones((4, 64)), jnp.ones((64, 32))
    assert cpu_kernel.MATMUL_TARGET in jax.jit(lambda x, w: cpu_kernel.matmul(x, w)).lower(x, w).as_text()
    with cpu_kernel.disabled():
        text = jax.jit(lambda x, w: cpu_kernel.matmul(x, w)).lower(x, w).as_text()
    assert cpu_kernel.MATMUL_TARGET not in text
    monkeypatch.setenv("KVJAX_CPU_KERNEL", "0")
    text = jax.jit(lambda x, w: cpu_kernel.matmul(x, w)).lower(x, w).as_text()
    assert cpu_kernel.MATMUL_TARGET not in text


def test_kernel_ab_benchmark_runs_another_source_beside_the_shipped(tmp_path):
    """`experiments/bench/kernel_ab.py --tiny`: a source without `matmul_t` (as before it
    existed) gets XLA's logits in its program; both steps' logits agree to float32 rounding.
    Its products take one weight per call unless `--several-weights` (one call for q/k/v, one
    for gate/up, as the shipped program). `--method` compresses the step's cache."""
    source = cpu_kernel.SOURCE.read_text()
    cut = source.index("XLA_FFI_DEFINE_HANDLER_SYMBOL(\n    KvjaxFewRowsMatmulT")
    (tmp_path / "other.cc").write_text(source[:cut])
    rows = {}
    for name, flags in (("one", []), ("several", ["--several-weights", "--method",
                                                  "quantize:bits=8,group=8"])):
        out = tmp_path / f"{name}.json"
        run = _bench("kernel_ab", "--other", tmp_path / "other.cc", "--tiny", "--batch", 2,
                     "--context", 64, "--repeats", 1, "--out", out, *flags)
        assert run.returncode == 0, run.stderr[-3000:]
        rows[name] = row = json.loads(out.read_text())
        assert row["missing_in_other"] == ["MATMUL_T_TARGET"]
        assert row["shipped_ms"] > 0 and row["other_ms"] > 0
        assert 0 < row["max_abs_logits_diff"] < 1e-5
        assert row["cache_tokens"] == 56  # context - 8: room for the steps
    # in the layer body q/k/v are 3 calls instead of 1, gate/up 2 instead of 1; logits: XLA's
    one, several = rows["one"], rows["several"]
    assert one["other_kernel_call_sites"] == one["shipped_kernel_call_sites"] + 3 - 1
    assert several["other_kernel_call_sites"] == several["shipped_kernel_call_sites"] - 1
    # `--method`: both programs decode a cache whose every layer the method compressed (8-bit
    # codes with a scale and offset per 8 channels: under half of the full float32 cache)
    assert several["method"] == "quantize:bits=8,group=8" and one["method"] == "full"
    assert several["cache_mb"] < 0.5 * one["cache_mb"]


# --- RMS norm and RoPE (a decoder layer's element-wise glue: compiled in microseconds) ---

F32_EPS = float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("rows", [1, 8, 256])
@pytest.mark.parametrize("k", [576, 60])  # SmolLM2's hidden size; one not a multiple of 16
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # at 1e-3, mean(x^2) ~ 1e-6 < eps: eps matters
def test_rms_norm_equals_float64_reference(rows, k, wdtype, scale):
    """One kernel call; equal to the norm computed in float64 within the float32 bound of a
    K-term sum of squares (relative K * eps) plus the products' rounding."""
    x = scale * jax.random.normal(jax.random.key(0), (rows, k))
    w = (1 + jax.random.normal(jax.random.key(1), (k,))).astype(wdtype)
    eps = 1e-5
    f = jax.jit(lambda x, w: cpu_kernel.rms_norm(x, w, eps))
    assert cpu_kernel.NORM_TARGET in f.lower(x, w).as_text()
    got = np.asarray(f(x, w))
    x64, w64 = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * w64
    np.testing.assert_allclose(got, want, rtol=(k + 4) * F32_EPS, atol=0)
    with cpu_kernel.disabled():  # the jnp norm where the kernel does not serve
        plain = jax.jit(lambda x, w: cpu_kernel.rms_norm(x, w, eps))
        assert cpu_kernel.NORM_TARGET not in plain.lower(x, w).as_text()
        np.testing.assert_allclose(np.asarray(plain(x, w)), want, rtol=(k + 4) * F32_EPS)


@pytest.mark.parametrize("shape", [(1, 1, 9, 64), (2, 5, 3, 64), (1, 256, 3, 16)])
def test_rope_equals_float64_reference(shape):
    """One kernel call per tensor; equal to the rotation by float64 sines and cosines of the
    float32 angles (as both paths form them) within a few float32 roundings. Positions up to
    8191 (SmolLM2's context), padding (-1) included."""
    b, t, n, d = shape
    x = jax.random.normal(jax.random.key(0), shape)
    pos = jax.random.randint(jax.random.key(1), (b, t), -1, 8192).at[0, 0].set(0)
    inv = 1.0 / (100_000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    f = jax.jit(lambda x, pos: cpu_kernel.rope(x, pos, inv))
    assert cpu_kernel.ROPE_TARGET in f.lower(x, pos).as_text()
    got = np.asarray(f(x, pos))
    angles = (np.asarray(pos, np.float32)[..., None] * inv).astype(np.float64)[:, :, None]
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    want = np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                           x2 * np.cos(angles) + x1 * np.sin(angles)], -1)
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * F32_EPS * np.abs(want).max())
    np.testing.assert_array_equal(got[0, 0], np.asarray(x)[0, 0])  # position 0: not turned


def _tokens_to_quantize(seed: int) -> np.ndarray:
    """[4, 6, 64] float32 tokens: magnitudes from 1e-9 to 1e5 per token (subnormal and
    saturating float16 parameters), a constant group, zeros, tiny negatives, +-inf."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 6, 64)) * 10.0 ** rng.integers(-9, 6, (4, 6, 1))
    x[0, 0, :8] = 3.0
    x[0, 1] = 0.0
    x[1, 0] = 7e4
    x[1, 1, :8] = -1e5
    x[2, 0, ::3] = -1e-9
    x[3, 0, 5], x[3, 1, 9] = np.inf, -np.inf
    return x.astype(np.float32)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("param_dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_quantize_packed_equals_quantize_and_pack_bit_for_bit(bits, symmetric, param_dtype):
    """One kernel call; its words, scales and offsets equal `quantize` + `pack` (XLA) bit for
    bit -- the parameters' outward rounding into float16 / bfloat16 included -- per token
    (groups of 8, 32, 64 channels) and per channel (groups of 2 and 3 tokens, with and without
    a mask of valid tokens, one group all invalid), also under `jax.vmap`. Infinite elements
    included (their group's scale saturates, its reciprocal is subnormal: XLA flushes it to 0,
    and so does the kernel)."""
    from kvjax.core.quant import pack, quantize
    x = jnp.asarray(_tokens_to_quantize(bits))  # [4, 6, 64]
    valid = jnp.asarray(np.random.default_rng(bits).random((4, 6)) < 0.7).at[0, :3].set(False)
    cases = [(-1, group, None) for group in (8, 32, 64)]
    cases += [(1, group, mask) for group in (2, 3) for mask in (None, valid)]
    for axis, group, mask in cases:
        def plain(x, mask=None):
            full = None if mask is None else jnp.broadcast_to(mask[..., None], x.shape)
            q = quantize(x, bits, group, axis=axis, symmetric=symmetric, param_dtype=param_dtype,
                         valid=full)
            return pack(q.codes, bits), q.scale, None if symmetric else q.offset

        def kernel(x, mask=None):
            return cpu_kernel.quantize_packed(x, bits, group, axis, symmetric, param_dtype, plain,
                                              valid=mask)

        args = (x,) if mask is None else (x, mask)
        f = jax.jit(kernel)
        assert cpu_kernel.QUANTIZE_TARGET in f.lower(*args).as_text()
        got, want = f(*args), jax.jit(plain)(*args)
        stacked = [jnp.stack([a, a[::-1]]) for a in args]  # vmap over a new leading axis
        batched = jax.jit(jax.vmap(kernel))(*stacked)
        for name, a, b, c in zip(("words", "scale", "offset"), got, want, batched):
            where = f"{name}, axis {axis}, group {group}, mask {mask is not None}"
            if b is None:
                assert a is None and c is None, where
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, where
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8), err_msg=where)
            np.testing.assert_array_equal(np.asarray(c[0]).view(np.uint8),
                                          np.asarray(b).view(np.uint8), err_msg="vmap " + where)


def test_quantize_packed_leaves_what_it_cannot_take_to_otherwise():
    """Shapes the kernel does not take (a group that does not divide its axis, channels that
    do not fill 32-bit words, 1-bit codes) run `otherwise`, so a bad shape gets the XLA code's
    error at trace time, naming the sizes -- never a kernel error at run time."""
    seen = []

    def otherwise(x, valid=None):
        seen.append(x.shape)
        return x, x, x

    for shape, bits, group, axis in [((3, 48), 4, 32, -1), ((3, 36), 4, 4, -1),
                                     ((3, 64), 1, 32, -1), ((2, 30, 64), 4, 32, 1)]:
        cpu_kernel.quantize_packed(jnp.zeros(shape), bits, group, axis, False, jnp.float16,
                                   otherwise)
    assert seen == [(3, 48), (3, 36), (3, 64), (2, 30, 64)]
    from kvjax.core.stores import PackedTokens
    store = PackedTokens.empty(3, 1, 64, bits=8, group=64)
    with pytest.raises(ValueError, match="48 is not a multiple of the group size 64"):
        store.encode(jnp.zeros((3, 1, 48)))


def test_packed_stores_quantize_in_one_kernel_call():
    """`PackedTokens.encode` (an int8 cache's or KIVI's values' write) and
    `PackedChannels.put_groups` (KIVI's keys) are one kernel call on the CPU, the XLA
    quantization under the opt-out, with equal stores."""
    from kvjax.core.stores import PackedChannels, PackedTokens
    tokens = PackedTokens.empty(3, 1, 64, bits=8, group=64)
    channels = PackedChannels.empty(3, 8, 64, bits=4, group=4)
    x = jnp.asarray(_tokens_to_quantize(0)[:3])  # [3, 6, 64]
    valid = jnp.ones((3, 4), bool).at[1, 2].set(False)
    writes = {"tokens": (lambda x: tokens.encode(x[:, :1]), (x,)),
              "channels": (lambda x, valid: channels.put_groups(x[:, :4], valid, 0, None),
                           (x, valid))}
    for name, (write, args) in writes.items():
        assert cpu_kernel.QUANTIZE_TARGET in jax.jit(write).lower(*args).as_text(), name
        got = jax.jit(write)(*args)
        with cpu_kernel.disabled():
            plain = lambda *args: write(*args)
            assert cpu_kernel.QUANTIZE_TARGET not in jax.jit(plain).lower(*args).as_text()
            want = jax.jit(plain)(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_model_layers_call_norm_and_rope_kernels():
    """A decode step of the model on the CPU: two norms per layer plus the final one, and
    q's and k's rotation per layer, each one kernel call (none under the opt-out)."""
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    cache = kvjax.init_model_cache(cfg.cache_spec, 1, 16)
    step = lambda tokens, pos, cache: model(tokens, pos, cache)[0]
    ids, pos = jnp.array([[5]]), jnp.array([[0]])
    text = jax.jit(step).lower(ids, pos, cache).compile().as_text()
    calls = lambda target: text.count(f'custom_call_target="{target}"')
    assert calls(cpu_kernel.NORM_TARGET) == 2 * cfg.num_layers + 1
    assert calls(cpu_kernel.ROPE_TARGET) == 2 * cfg.num_layers
    with cpu_kernel.disabled():  # a new function: jit would reuse the first trace
        plain = lambda tokens, pos, cache: model(tokens, pos, cache)[0]
        text = jax.jit(plain).lower(ids, pos, cache).compile().as_text()
        assert cpu_kernel.NORM_TARGET not in text and cpu_kernel.ROPE_TARGET not in text


CPU_FLAGS = cpu_kernel._cpu_id().split()


@pytest.mark.skipif("avx2" not in CPU_FLAGS, reason="[optional] needs an x86-64 CPU with AVX2")
@pytest.mark.skipif("avx2" in CPU_FLAGS and "avx512f" not in CPU_FLAGS,
                    reason="[optional] this machine has no AVX-512: its own build is the AVX2 "
                           "path, which the rest of this file tests")
def test_the_avx2_build_passes_the_kernel_equality_tests():
    """The kernel compiled for AVX2 (`KVJAX_CPU_KERNEL_MARCH=x86-64-v3`: 16-lane vectors as two
    8-lane halves, the other register budgets) passes this file's equality tests for attention
    (every method at 3 query rows per KV head, as SmolLM2's decode; the head dims 64 and 128;
    the packed formats at 1, 5 and 8 rows),
    the matmuls, RMSNorm, RoPE and the caches' quantization -- on an AVX-512 machine too, where the default build takes
    the other path."""
    import subprocess
    import sys
    tests = ["test_packed_formats_at_model_head_dims", "test_kernel_dtypes_and_head_shapes",
             "test_packed_formats_at_each_query_row_count",
             "test_matmul_equals_the_dot", "test_matmuls_are_one_call_equal_to_each_dot",
             "test_matmul_t_equals_the_dot", "test_rms_norm_equals_float64_reference",
             "test_rope_equals_float64_reference",
             "test_quantize_packed_equals_quantize_and_pack_bit_for_bit",
             "test_the_kernel_builds_here"]
    cases = [f"{__file__}::{name}" for name in tests] + [
        f"{__file__}::test_kernel_equals_the_xla_loop[1-{m}]" for m in METHODS]
    env = dict(os.environ, KVJAX_CPU_KERNEL_MARCH="x86-64-v3")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *cases],
                         env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]  # e.g. "87 passed in 95.1s"
    assert "skipped" not in summary and int(summary.split()[0]) >= len(cases), summary


def test_the_march_setting_is_checked(monkeypatch):
    monkeypatch.setenv("KVJAX_CPU_KERNEL_MARCH", "x86-64-v3")
    assert cpu_kernel.flags()[0] == "-march=x86-64-v3"
    monkeypatch.setenv("KVJAX_CPU_KERNEL_MARCH", "native; rm -rf /")
    with pytest.raises(ValueError, match="KVJAX_CPU_KERNEL_MARCH"):
        cpu_kernel.flags()
