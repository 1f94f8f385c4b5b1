"""The GPU (Triton) paged attention kernel, as far as a CPU host can prove it.

- What Triton is given: the kernel is lowered for CUDA on this host and its
  Triton IR (the `tt` dialect module inside the `__gpu$xla.gpu.triton`
  custom call) is read back: both dots take bf16 operands with float32
  accumulation (tensor cores) for bf16 queries and for every page format,
  and query rows are padded only to what `tl.dot` needs.
- Interpret-mode equality with the plain-jnp reference for bf16 operands, at
  a bf16 tolerance, with several pages per loop step.
- Shapes Triton cannot take raise ValueError naming the argument.
- The compiled-mode test switch (`tests/kernel_mode.py`).
Nothing here runs on a GPU; `KVJAX_PALLAS_COMPILED=1` runs the parametrized kernel tests
compiled on one.
"""

import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

import kernel_mode
from kernels_pallas.gpu_lowering import triton_modules
from kernels_pallas import page_formats as pf
from kernels_pallas.paged_attention import (gpu_block_sizes, gpu_launch, paged_attention,
                                            paged_attention_reference)
from test_paged_attention import make_pool, packed_channels, packed_tokens, queries


DOT = re.compile(r"tt\.dot .*: tensor<(\d+)x(\d+)x(\w+)> \* tensor<(\d+)x(\d+)x(\w+)> -> "
                 r"tensor<(\d+)x(\d+)x(\w+)>")

FORMATS = {
    "dense-bf16": (pf.DENSE, pf.DENSE, lambda k, v: (k.astype(jnp.bfloat16),
                                                      v.astype(jnp.bfloat16))),
    "dense-fp8": (pf.DENSE, pf.DENSE, lambda k, v: (k.astype(jnp.float8_e4m3fn),
                                                     v.astype(jnp.float8_e4m3fn))),
    "int8-tokens": (pf.PackedTokens(8, 64), pf.PackedTokens(8, 64),
                    lambda k, v: (packed_tokens(k, 8, 64, False), packed_tokens(v, 8, 64, False))),
    "int4-tokens": (pf.PackedTokens(4, 32), pf.PackedTokens(4, 32),
                    lambda k, v: (packed_tokens(k, 4, 32, False), packed_tokens(v, 4, 32, False))),
    "int4-sym-scores": (pf.PackedTokens(4, 64, True), pf.PackedTokens(4, 32),
                        lambda k, v: (packed_tokens(k, 4, 64, True),
                                      packed_tokens(v, 4, 32, False))),
    "kivi4-keys-int4-values": (pf.PackedChannels(4, 3), pf.PackedTokens(4, 32), lambda k, v: (
        packed_channels(np.random.default_rng(0), k, 4, window=3, symmetric=False),
        packed_tokens(v, 4, 32, False))),
}


def _pool(group=3, t=1, page_size=16, lengths=(70, 128, 5), head_dim=64):
    rng = np.random.default_rng(1)
    k, v, pos, tables, counts = make_pool(rng, batch=len(lengths), kv_heads=2,
                                          page_size=page_size, head_dim=head_dim,
                                          lengths=list(lengths))
    q, q_pos = queries(rng, len(lengths), t, 2 * group, head_dim, list(lengths))
    return q, jnp.maximum(q_pos, 0), k, v, pos, tables, counts


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(FORMATS))
def test_triton_dots_take_bf16_operands(name, head_dim):
    """bf16 queries: every tl.dot of every format takes bf16 x bf16 -> f32 (tensor cores), over
    L = 4 pages x 16 slots = 64 columns a step, on GQA-3 rows padded to 16 (tl.dot's minimum):
    two dots a step, q [16, D] @ k [D, L] and p [16, L] @ v [L, D], on pages decoded in
    registers."""
    kf, vf, encode = FORMATS[name]
    q, q_pos, k, v, pos, tables, counts = _pool(head_dim=head_dim)
    kp, vp = encode(k, v)
    fn = functools.partial(paged_attention, k_format=kf, v_format=vf, backend="gpu",
                           pages_per_split=8)
    (text, launch), = triton_modules(fn, q.astype(jnp.bfloat16), q_pos, kp, vp, pos, tables,
                                     counts)
    dots = DOT.findall(text)
    for m, kdim, a, k2, n, b, m2, n2, acc in dots:
        assert (a, b, acc) == ("bf16", "bf16", "f32"), (a, b, acc)
    shapes = sorted((int(d[0]), int(d[1]), int(d[4])) for d in dots)
    assert shapes == sorted([(16, head_dim, 64), (16, 64, head_dim)]), shapes
    assert launch == dict(zip(("num_warps", "num_stages"), gpu_launch(16, head_dim, 64, kf, vf)))


def test_launch_configs():
    """Dense pages: two stages, 8 warps from [128, 128] tiles; packed pages: one stage (their
    per-channel gathers are staged in shared memory otherwise), 4 warps, 8 for KIVI keys."""
    dense, int4, kivi = pf.DENSE, pf.PackedTokens(4, 32), pf.PackedChannels(4, 3)
    assert gpu_launch(16, 128, 128, dense, dense) == (8, 2)
    assert gpu_launch(16, 64, 64, dense, dense) == (4, 2)
    assert gpu_launch(16, 128, 64, int4, int4) == (4, 1)
    assert gpu_launch(16, 128, 64, kivi, int4) == (8, 1)
    assert gpu_launch(64, 128, 64, int4, int4) == (8, 1)  # prefill chunks of 64 rows


LOAD = re.compile(r"tt\.load .*: tensor<(\d+)x(\d+)x!tt\.ptr<i32>>")


@pytest.mark.parametrize("name,head_dim", [("int4-tokens", 128), ("int8-tokens", 128),
                                           ("int8-tokens", 64), ("int4-tokens", 64)])
def test_packed_pages_load_as_whole_channel_tiles(name, head_dim):
    """The loop's i32 loads of a step of 64 slots: the block table entries and positions (one
    row each), then for keys and values, on the decode path, one [D, 64] load of each
    channel's code word and one [D, 64] load of its group's parameter word (16-bit scale and
    offset share a word; one [1, 64] row where a single group's scale goes on the scores):
    channels decode in place, with no [W, 64] tile cut and reshaped
    into channel order (the planes of a word re-read it from cache)."""
    kf, vf, encode = FORMATS[name]
    q, q_pos, k, v, pos, tables, counts = _pool(head_dim=head_dim)
    kp, vp = encode(k, v)
    fn = functools.partial(paged_attention, k_format=kf, v_format=vf, backend="gpu")
    (text, _), = triton_modules(fn, q.astype(jnp.bfloat16), q_pos, kp, vp, pos, tables, counts)
    rows = sorted(int(r) for r, cols in LOAD.findall(text) if cols == "64")
    assert kf.param_dtype != "float32" and not kf.symmetric  # one word per group
    key_params = 1 if kf.scales_scores(head_dim) else head_dim  # one group: on the scores
    assert rows == sorted([1, 1, key_params] + [head_dim] * 3), rows


def test_float32_queries_get_bf16_dots_when_asked():
    """f32 queries keep IEEE f32 dots (exact reference behaviour) unless compute_dtype=bf16."""
    q, q_pos, k, v, pos, tables, counts = _pool()
    kp, vp = packed_tokens(k, 4, 32, False), packed_tokens(v, 4, 32, False)
    fmt = pf.PackedTokens(4, 32)
    for dtype, want in ((None, "f32"), (jnp.bfloat16, "bf16")):
        fn = functools.partial(paged_attention, k_format=fmt, v_format=fmt, backend="gpu",
                               compute_dtype=dtype)
        (text, _), = triton_modules(fn, q, q_pos, kp, vp, pos, tables, counts)
        assert {d[2] for d in DOT.findall(text)} == {want}
        if want == "f32":  # IEEE (the printer omits the default), not TF32
            assert not [line for line in text.splitlines() if "tt.dot" in line and "tf32" in line]


@pytest.mark.parametrize("name,pages_per_block", [
    ("dense-bf16", None), ("int4-tokens", 2), ("int4-sym-scores", 2),
    ("kivi4-keys-int4-values", None)])
def test_bf16_operands_match_the_reference(name, pages_per_block):
    """bf16 queries and pages, several pages per step and splits: equal to the f32 reference on
    the same (encoded) pages within bf16 rounding of the operands (2**-8 relative, summed)."""
    kf, vf, encode = FORMATS[name]
    q, q_pos, k, v, pos, tables, counts = _pool(t=2)
    kp, vp = encode(k, v)
    qb = q.astype(jnp.bfloat16)
    want = paged_attention_reference(qb, q_pos, kp, vp, pos, tables, counts, k_format=kf,
                                     v_format=vf)
    backend, interpret = kernel_mode.mode("gpu")
    got = paged_attention(qb, q_pos, kp, vp, pos, tables, counts, k_format=kf, v_format=vf,
                          backend=backend, interpret=interpret, pages_per_split=4,
                          pages_per_block=pages_per_block)
    # scores round q.k's operands to bf16 (|s| ~ 8 -> ~0.03), p rounds to bf16 before p @ v
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=3e-2, atol=3e-2)
    err = np.abs(np.asarray(got) - np.asarray(want))
    assert err.mean() < 5e-3  # most elements far inside the bound


EIGHT_BIT = {
    "int8-g32": (pf.PackedTokens(8, 32), pf.PackedTokens(8, 32),
                 lambda k, v: (packed_tokens(k, 8, 32, False), packed_tokens(v, 8, 32, False))),
    "int8-sym-g64-int8-g32": (pf.PackedTokens(8, 64, True), pf.PackedTokens(8, 32),
                              lambda k, v: (packed_tokens(k, 8, 64, True),
                                            packed_tokens(v, 8, 32, False))),
    "int8-f32-params": (pf.PackedTokens(8, 32, param_dtype="float32"),
                        pf.PackedTokens(8, 32, param_dtype="bfloat16"),
                        lambda k, v: (packed_tokens(k, 8, 32, False, "float32"),
                                      packed_tokens(v, 8, 32, False, "bfloat16"))),
}


@pytest.mark.parametrize("name", list(EIGHT_BIT))
def test_per_channel_gathers_match_float32(name):
    """The GPU decode (each channel's word and group parameters gathered per channel) at
    float32: equal to the reference that unpacks every page with `unpack_planes`, to float32
    rounding; 8-bit pages of D = 128, symmetric or not, 16/32-bit parameters, one or two
    groups a slot's 32-channel planes, ragged rows."""
    kf, vf, encode = EIGHT_BIT[name]
    rng = np.random.default_rng(7)
    lengths = [0, 1, 17, 50, 112]
    k, v, pos, tables, counts = make_pool(rng, batch=5, kv_heads=2, page_size=16,
                                          head_dim=128, lengths=lengths)
    q, q_pos = queries(rng, 5, 1, 4, 128, lengths)
    kp, vp = encode(k, v)
    want = paged_attention_reference(q, q_pos, kp, vp, pos, tables, counts, k_format=kf,
                                     v_format=vf)
    backend, interpret = kernel_mode.mode("gpu")
    got = paged_attention(q, q_pos, kp, vp, pos, tables, counts, k_format=kf, v_format=vf,
                          backend=backend, interpret=interpret, pages_per_block=2,
                          pages_per_split=3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_gpu_shapes_the_backend_cannot_take_raise():
    q, q_pos, k, v, pos, tables, counts = _pool()
    call = functools.partial(paged_attention, backend="gpu", interpret=True)
    with pytest.raises(ValueError, match=r"power-of-two page size \(pos_pages.shape\[-1\]\), "
                                         r"got 12"):
        call(q, q_pos, k[:, :12], v[:, :12], pos[..., :12], tables, counts)
    with pytest.raises(ValueError, match=r"head_dim >= 16 \(q.shape\[-1\]\), got 48"):
        call(q[..., :48], q_pos, k[..., :48], v[..., :48], pos, tables, counts)
    with pytest.raises(ValueError, match="pages_per_block, got 3"):
        call(q, q_pos, k, v, pos, tables, counts, pages_per_block=3)
    # the TPU backend takes those shapes
    paged_attention(q, q_pos, k[:, :12], v[:, :12], pos[..., :12], tables, counts,
                    backend="tpu", interpret=True)


def test_gpu_block_sizes():
    assert gpu_block_sizes(512, 64, 8, None) == (1, 8, 64)  # 64 slots a step
    assert gpu_block_sizes(512, 16, 8, None) == (4, 8, 64)  # 4 pages of 16
    assert gpu_block_sizes(3, 16, 8, None) == (4, 4, 1)  # capped at the table's next pow2
    assert gpu_block_sizes(1, 8, 1, None) == (2, 2, 1)  # >= 16 slots for tl.dot
    assert gpu_block_sizes(100, 16, 5, 4) == (4, 8, 13)  # splits a multiple of the step


def test_compiled_mode_switch(monkeypatch):
    """Default: interpret as asked. KVJAX_PALLAS_COMPILED=1: compiled on the present chip; the
    other backend's cases are skipped; without a chip it is an error, not a silent interpret."""
    monkeypatch.delenv(kernel_mode.ENV, raising=False)
    assert kernel_mode.mode("gpu") == ("gpu", True)
    monkeypatch.setenv(kernel_mode.ENV, "1")
    assert kernel_mode.compiled()
    monkeypatch.setattr(kernel_mode, "device_backend", lambda: "gpu")
    assert kernel_mode.mode("gpu", True) == ("gpu", False)
    with pytest.raises(pytest.skip.Exception, match=r"^\[optional\]"):
        kernel_mode.mode("tpu")
    monkeypatch.setattr(kernel_mode, "device_backend", lambda: None)
    with pytest.raises(RuntimeError, match="needs a TPU or GPU"):
        kernel_mode.mode("gpu")


@pytest.mark.parametrize("pages_per_block,pages_per_split", [(1, 2), (2, 3), (4, 4)])
def test_steps_of_several_pages_match_float32(pages_per_block, pages_per_split):
    """float32 operands, steps of 1-4 pages with partly used last steps and splits rounded up to
    whole steps: equal to the reference at float32 tolerance (KIVI keys, int4 values)."""
    rng = np.random.default_rng(pages_per_block)
    lengths = [0, 1, 17, 50, 112]  # 0 to 7 pages of 16
    k, v, pos, tables, counts = make_pool(rng, batch=5, kv_heads=2, page_size=16, head_dim=64,
                                          lengths=lengths)
    q, q_pos = queries(rng, 5, 1, 4, 64, lengths)
    q_pos = jnp.maximum(q_pos, 0)
    kf, vf, encode = FORMATS["kivi4-keys-int4-values"]
    kp, vp = encode(k, v)
    want = paged_attention_reference(q, q_pos, kp, vp, pos, tables, counts, k_format=kf,
                                     v_format=vf)
    backend, interpret = kernel_mode.mode("gpu")
    got = paged_attention(q, q_pos, kp, vp, pos, tables, counts, k_format=kf, v_format=vf,
                          backend=backend, interpret=interpret, pages_per_block=pages_per_block,
                          pages_per_split=pages_per_split)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[0] == 0)
