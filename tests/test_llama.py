import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.core import cpu_kernel
from models.llama import Llama, LlamaConfig, RopeScaling, apply_rope, new_cache, rope_frequencies


def full_forward(model, tokens):
    """One pass over the whole sequence in a fresh cache: the uncached reference."""
    b, t = tokens.shape
    logits, _ = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), new_cache(model.config, b, t))
    return logits


@pytest.mark.parametrize("cfg", [
    LlamaConfig.tiny(),
    LlamaConfig.tiny(num_kv_heads=4, tie_embeddings=False, attention_bias=True),
    LlamaConfig.tiny(num_kv_heads=1, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
], ids=["gqa-tied", "mha-untied-bias", "mqa-llama3-rope"])
def test_decode_step_by_step_equals_full_forward(cfg):
    model = Llama(cfg, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    want = full_forward(model, tokens)
    cache = new_cache(cfg, 2, 16)
    got = []
    for start, end in [(0, 5), (5, 6), (6, 7), (7, 12)]:  # a prefill chunk, single steps, a chunk
        pos = jnp.broadcast_to(jnp.arange(start, end), (2, end - start))
        logits, cache = model(tokens[:, start:end], pos, cache)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=1e-5, atol=1e-5)
    assert int(cache[0].length) == 12


def test_left_padding_does_not_change_a_sequence():
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(2))
    tokens = jax.random.randint(jax.random.key(1), (1, 7), 0, cfg.vocab_size)
    want = full_forward(model, tokens)
    padded = jnp.concatenate([jnp.full((1, 3), 9), tokens], 1)
    pos = jnp.concatenate([jnp.full((1, 3), kvjax.EMPTY), jnp.arange(7)[None]], 1)
    got, _ = model(padded, pos, new_cache(cfg, 1, 10))
    np.testing.assert_allclose(got[:, 3:], want, rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_track_float32():
    cfg = LlamaConfig.tiny()
    m32 = Llama(cfg, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    state = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), nnx.state(m32))
    m16 = nnx.merge(graphdef, state)  # the same weights, rounded to bfloat16
    assert m16.embed[...].dtype == jnp.bfloat16
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, cfg.vocab_size)
    a, b = full_forward(m32, tokens), full_forward(m16, tokens)
    assert b.dtype == jnp.float32
    # bf16 weights carry ~3 significant digits: logits agree to a few percent of their range
    np.testing.assert_allclose(b, a, atol=0.03 * float(jnp.abs(a).max()))
    assert float(jnp.mean(jnp.argmax(a, -1) == jnp.argmax(b, -1))) >= 0.9


def test_rope_rotates_pairs_of_halves_and_keeps_norm():
    cfg = LlamaConfig.tiny(head_dim=4, rope_theta=100.0)
    x = jnp.array([[[[1.0, 2.0, 3.0, 4.0]]]])
    inv = rope_frequencies(cfg)  # [1, 1/10]
    np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-6)
    y = apply_rope(x, jnp.array([[3]]), inv)
    a = 3 * inv
    want = [1 * np.cos(a[0]) - 3 * np.sin(a[0]), 2 * np.cos(a[1]) - 4 * np.sin(a[1]),
            3 * np.cos(a[0]) + 1 * np.sin(a[0]), 4 * np.cos(a[1]) + 2 * np.sin(a[1])]
    np.testing.assert_allclose(np.asarray(y)[0, 0, 0], want, rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(y), jnp.linalg.norm(x), rtol=1e-6)


def test_llama3_rope_scaling_matches_formula():
    cfg = LlamaConfig.tiny(head_dim=64, rope_theta=500000.0,
                           rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192))
    inv = rope_frequencies(cfg)
    base = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    wavelen = 2 * np.pi / base
    assert np.allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high freq untouched
    assert np.allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8)  # low freq divided
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and np.all(inv[mid] < base[mid]) and np.all(inv[mid] > base[mid] / 8)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="even"):
        LlamaConfig.tiny(head_dim=15)


def test_wrong_cache_raises_at_trace_time():
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 3), jnp.int32)
    pos = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="layers"):
        model(tokens, pos, new_cache(cfg, 2, 8)[:1])
    with pytest.raises(ValueError, match="batch=2"):
        model(tokens, pos, new_cache(cfg, 1, 8))
    with pytest.raises(ValueError, match="kv_heads"):
        model(tokens, pos, new_cache(LlamaConfig.tiny(num_kv_heads=4), 2, 8))
    with pytest.raises(ValueError, match="positions"):
        model(tokens, pos[:, :2], new_cache(cfg, 2, 8))


def test_bfloat16_model_is_float32_on_bfloat16_rounded_operands(monkeypatch):
    """What bf16 weights compute, exactly: every matmul takes its operands rounded to bf16
    (weights stored so, activations cast by `cpu_kernel.matmuls`) and accumulates in float32, where a
    product of two bf16 numbers (8-bit significands) is exact. So the bf16 model equals a
    float32 model on bf16-rounded weights whose matmuls round their inputs to bf16, up to
    float32 summation order (the same 1e-5 as the float32 tests above), not "a few percent"."""
    cfg = LlamaConfig.tiny()
    m32 = Llama(cfg, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    m16 = nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16),
                                                     nnx.state(m32)))
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, cfg.vocab_size)
    got, exact = full_forward(m16, tokens), full_forward(m32, tokens)
    graphdef, state = nnx.split(m32)
    rounded = nnx.merge(graphdef, jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), state))
    bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    monkeypatch.setattr(cpu_kernel, "matmuls", lambda x, ws: tuple(jnp.dot(
        bf16(x), w, preferred_element_type=jnp.float32) for w in ws))
    monkeypatch.setattr(Llama, "logits", lambda self, h: jnp.einsum(
        "...d,vd->...v", bf16(h), self.embed[...], preferred_element_type=jnp.float32))
    want = full_forward(rounded, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    tol = 1e-5 * float(jnp.abs(want).max())
    assert np.abs(np.asarray(got) - np.asarray(exact)).max() > 100 * tol  # bf16 really differs


@pytest.mark.parametrize("lead", [(1,), (2,), (8,), (2, 3), (9,), (33,)], ids=str)
def test_tied_logits_equal_the_embedding_dot_for_any_rows(lead):
    """`Llama.logits` runs 1-8 rows on CPU in kvjax's few-row kernel (`cpu_kernel.matmul_t`),
    multiply-reduces 9..FEW_ROWS rows and dots the rest; each equals the plain einsum up to
    float32 summation order over the hidden axis."""
    import models.llama as llama
    cfg = LlamaConfig.tiny(vocab_size=300, hidden_size=96)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    h = jax.random.normal(jax.random.key(1), (*lead, cfg.hidden_size))
    emb = np.asarray(model.embed[...], np.float64)
    want = np.asarray(h, np.float64) @ emb.T
    got = np.asarray(jax.jit(model.logits)(h))
    assert got.shape == (*lead, cfg.vocab_size) and got.dtype == np.float32
    # float32 rounding of a D-term dot: D * eps * sum |h_d e_vd| bounds each entry
    bound = cfg.hidden_size * np.finfo(np.float32).eps * (np.abs(np.asarray(h, np.float64)) @ np.abs(emb).T)
    assert np.all(np.abs(got - want) <= bound)
    hlo = jax.jit(model.logits).lower(h).as_text()
    rows, on_cpu = int(np.prod(lead)), jax.default_backend() == "cpu"
    kernel = on_cpu and rows <= cpu_kernel.MATMUL_ROWS[1]
    few = on_cpu and 2 <= rows <= llama.FEW_ROWS and not kernel
    assert (cpu_kernel.MATMUL_T_TARGET in hlo) == kernel  # the path really taken
    assert ("dot_general" in hlo) == (not kernel and not few)


def test_tied_logits_export_with_a_symbolic_batch():
    """A symbolic batch (models.export) cannot be compared with FEW_ROWS: it keeps the dot."""
    from jax import export
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    b, = export.symbolic_shape("b")
    exported = export.export(jax.jit(model.logits))(jax.ShapeDtypeStruct((b, 64), jnp.float32))
    h = jax.random.normal(jax.random.key(1), (3, 64))
    np.testing.assert_allclose(exported.call(h), model.logits(h), rtol=1e-5, atol=1e-5)


def test_layers_lower_to_one_shared_body_with_the_inline_loops_outputs(monkeypatch):
    """`Llama.forward` calls each layer through one jitted `_block` per trace (`models.llama._shared_block`): the lowered
    program holds one layer body called once per layer (so tracing and lowering do not grow
    with the layer count), and logits and cache equal, element for element, those of the
    inline per-layer loop (`SHARED_LAYER_PROGRAM = False`; XLA inlines the calls)."""
    import re

    import models.llama as llama
    cfg = LlamaConfig.tiny(num_layers=3)
    model = Llama(cfg, rngs=nnx.Rngs(4))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))

    def run(shared):
        monkeypatch.setattr(llama, "SHARED_LAYER_PROGRAM", shared)
        step = jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s)(t, p, c))  # a fresh trace
        args = (state, tokens, pos, new_cache(cfg, 2, 8))
        text = step.lower(*args).as_text()
        return step(*args), text

    (logits, cache), text = run(True)
    assert len(re.findall(r"func\.func private @_block\b", text)) == 1
    assert len(re.findall(r"call @_block\b", text)) == cfg.num_layers
    (want_logits, want_cache), inline_text = run(False)
    assert "@_block" not in inline_text
    np.testing.assert_array_equal(logits, want_logits)
    for got, want in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(want_cache)):
        np.testing.assert_array_equal(got, want)


def test_the_residual_stream_stays_two_dimensional_in_the_layer_body():
    """Each layer's residual stream is [B*T, hidden], the shape of the kernels' inputs and
    outputs: no reshape to [B, T, hidden] around its adds. Reshapes there made XLA's
    reshape-mover sink one reshape past one add per simplification round, so a 30-layer decode
    step ran the simplification pipelines to their 25-round cap (DECISIONS "Compile: the
    residual stream in 2-D")."""
    import re

    cfg = LlamaConfig.tiny(num_layers=2)
    model = Llama(cfg, rngs=nnx.Rngs(4))
    graphdef, state = nnx.split(model)
    b, t, hidden = 2, 6, cfg.hidden_size
    step = jax.jit(lambda s, tok, p, c: nnx.merge(graphdef, s)(tok, p, c))
    text = step.lower(state, jnp.zeros((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)),
                      new_cache(cfg, b, 8)).as_text()
    body = text[text.index("func.func private @_block"):]
    body = body[:body.index("\n  }\n")]  # the shared layer body's function
    signature = body.splitlines()[0]
    assert f"tensor<{b * t}x{hidden}xf32>" in signature
    assert f"tensor<{b}x{t}x{hidden}xf32>" not in body
    adds = re.findall(r"stablehlo\.add .*: tensor<([0-9x]+)xf32>", body)
    assert f"{b * t}x{hidden}" in adds  # the residual adds, in 2-D
