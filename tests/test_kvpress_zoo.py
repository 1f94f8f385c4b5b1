"""The kvpress zoo methods on the tiny model: real shrinking, one compile per shape, batching,
argument errors, and the published method table (`kvjax methods`).

Parity with kvpress itself is `tests/test_kvpress_zoo_parity.py` (real model, goldens).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import EMPTY
from kvjax.policies.eviction_compactor import leverage_scores, non_causal_attention
from kvjax.policies.eviction_sequence import in_sequence, unrope
from kvjax.policies.methods import METHODS, describe_methods, parse_method
from models.sampler import _compress, compress, prefill_batch
from tests.conftest import TraceCounter

ZOO = ["keydiff", "lagkv:lag=8", "cur", "leverage", "non_causal_attn:chunk=16",
       "compactor", "block:inner=keydiff,block_size=16", "chunkkv:inner=knorm,chunk_length=16",
       "entropy_chunkkv:inner=knorm,chunk_length=16"]
STATS = kvjax.StatsSpec(window=128)  # every query of the prompts below, RoPE frequencies
PROMPTS = [80, 53]  # tokens of two prompts batched together (left padding)


def _spec(method: str, ratio: float) -> str:
    return f"{method},ratio={ratio}" if ":" in method else f"{method}:ratio={ratio}"


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def _kept_positions(cache, row: int) -> list[list[list[int]]]:
    """[layer][head] sorted positions a batch row kept."""
    out = []
    for layer in cache:
        pos = np.asarray(layer.pos)[row]
        out.append([sorted(p[p != EMPTY].tolist()) for p in pos])
    return out


def _expected_kept(method: str, n: int, ratio: float) -> int:
    if method.startswith("chunkkv"):  # whole chunks of 16: max(1, floor(chunks (1 - r)))
        return max(1, int(-(-n // 16) * (1 - ratio))) * 16
    return int(n * (1 - ratio))


@pytest.fixture(scope="module")
def prefilled(tiny_model):
    """(batch of two prompts of different lengths, each prompt alone), prefilled once."""
    prompts = [_prompt(n, i) for i, n in enumerate(PROMPTS)]
    batch = prefill_batch(tiny_model, prompts, stats=STATS)
    alone = [prefill_batch(tiny_model, [p], stats=STATS) for p in prompts]
    return batch, alone


@pytest.mark.parametrize("method", ZOO)
def test_cache_shrinks_as_the_ratio_says(prefilled, method):
    """Each row keeps floor(n (1 - r)) tokens per layer and head (chunkkv: whole chunks);
    after `shrink`, nbytes falls with them."""
    _, alone = prefilled
    pre = alone[0]
    n = PROMPTS[0]
    full = kvjax.nbytes(kvjax.shrink(pre.cache, room=0))
    for ratio in (0.5, 0.75):
        out = compress(pre, parse_method(_spec(method, ratio)), keep_input=True)
        kept = {len(h) for layer in _kept_positions(out.cache, 0) for h in layer}
        assert kept == {_expected_kept(method, n, ratio)}, (method, ratio, kept)
        share = _expected_kept(method, n, ratio) / n
        assert kvjax.nbytes(out.cache) <= full * share + 64, (
            method, ratio, kvjax.nbytes(out.cache), full)


@pytest.mark.parametrize("method", ZOO)
def test_batched_rows_equal_alone(prefilled, method):
    """Prompts of different lengths in one batch keep what each keeps alone (left padding,
    token order and per-sequence normalisation do not leak between rows)."""
    batch, alone = prefilled
    transform = parse_method(_spec(method, 0.5))
    out = compress(batch, transform, keep_input=True, shrink=False)
    for row in range(len(PROMPTS)):
        one = compress(alone[row], transform, keep_input=True, shrink=False)
        assert _kept_positions(out.cache, row) == _kept_positions(one.cache, 0), (method, row)


@pytest.mark.parametrize("method", [m for m in ZOO if not m.startswith("compactor")])
def test_compiles_once_per_shape(prefilled, method):
    """A second update of the same shapes, at another ratio, traces nothing (Compactor's
    blend is its ratio, so it compiles per ratio: see docs/DECISIONS.md)."""
    batch, _ = prefilled
    first, second = parse_method(_spec(method, 0.5)), parse_method(_spec(method, 0.75))
    _compress(first.update, batch.cache, first.init(batch.cache), batch.stats)
    with TraceCounter() as traces:
        out, _ = _compress(second.update, batch.cache, second.init(batch.cache), batch.stats)
    assert traces.count == 0, (method, traces.count)
    kept = {len(h) for layer in _kept_positions(out, 0) for h in layer}
    assert kept == {_expected_kept(method, PROMPTS[0], 0.75)}, (method, kept)


def test_compactor_blending_is_the_ratio():
    """kvpress's default: blending = compression_ratio (so each ratio is its own scorer)."""
    assert parse_method("compactor:ratio=0.75").update.scorer.blending == 0.75
    assert parse_method("compactor:budget=10").update.scorer.blending == 0.35
    assert parse_method("compactor:ratio=0.5,blending=0.1").update.scorer.blending == 0.1


@pytest.mark.parametrize("spec, words", [
    ("lagkv:ratio=0.5,lag=0", ["lag", "0"]),
    ("cur:ratio=0.5,leverage_type=keys", ["leverage_type", "keys", "kv_product"]),
    ("cur:ratio=0.5,local_window=-1", ["local_window", "-1"]),
    ("non_causal_attn:ratio=0.5,chunk=0", ["chunk", "0"]),
    ("compactor:ratio=0.5,blending=-1", ["blending", "-1"]),
    ("leverage:ratio=0.5,sketch_dim=0", ["sketch_dim", "0"]),
    ("block:inner=kivi,ratio=0.5", ["inner", "kivi"]),
    ("block:inner=nope,ratio=0.5", ["inner", "nope"]),
    ("block:ratio=0.5,block_size=0", ["block_size", "0"]),
    ("chunkkv:ratio=0.5,chunk_length=0", ["chunk_length", "0"]),
    ("chunkkv:inner=fp8,ratio=0.5", ["inner", "fp8"]),
    ("entropy_chunkkv:ratio=0.5,chunk_length=1", ["chunk_length", "1"]),
    ("entropy_chunkkv:ratio=0.5,low_entropy_chunk_length=0", ["low_entropy_chunk_length", "0"]),
    ("entropy_chunkkv:ratio=0.5,chunk_length=8,low_entropy_chunk_length=8",
     ["low_entropy_chunk_length", "8", "[1, 7]"]),
    ("entropy_chunkkv:inner=kivi,ratio=0.5", ["inner", "kivi"]),
    ("entropy_chunkkv:ratio=1.0", ["ratio", "1.0"]),
    ("keydiff:ratio=1.5", ["ratio", "1.5"]),
])
def test_bad_arguments_name_argument_and_value(spec, words):
    with pytest.raises(ValueError) as e:
        parse_method(spec)
    for word in words:
        assert word in str(e.value), (spec, str(e.value))


# ----------------------------------------------------------------------------- the numerics


def test_unrope_inverts_rope():
    """Keys rotated by RoPE at their positions and rotated back are the keys again."""
    from models.llama import LlamaConfig, rope_frequencies
    inv = jnp.asarray(rope_frequencies(LlamaConfig.tiny()))
    k = jax.random.normal(jax.random.key(0), (2, 5, 16))
    pos = jnp.arange(10).reshape(2, 5) * 37
    angles = pos[..., None].astype(jnp.float32) * inv
    cos, sin = (jnp.concatenate([f(angles)] * 2, -1) for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(k, 2, -1)
    rotated = k * cos + jnp.concatenate([-x2, x1], -1) * sin
    np.testing.assert_allclose(unrope(rotated, pos, inv), k, atol=1e-5)


def test_leverage_scores_match_numpy():
    """diag(X (X'X + 0.01 I)^-1 X') of the centred, sketched keys, against float64 numpy."""
    keys = jax.random.normal(jax.random.key(1), (1, 2, 12, 8))
    valid = jnp.arange(12)[None, None] < jnp.array([[12, 9]])[..., None]
    sketch = jax.random.normal(jax.random.key(2), (2, 8, 4))
    got = np.asarray(leverage_scores(keys, valid, sketch))
    for h, n in enumerate((12, 9)):
        k = np.asarray(keys[0, h, :n], np.float64)
        x = (k - k.mean(0)) @ (np.asarray(sketch[h], np.float64) / 2)
        want = np.einsum("ij,jk,ik->i", x, np.linalg.inv(x.T @ x + 0.01 * np.eye(4)), x)
        np.testing.assert_allclose(got[0, h, :n], want, rtol=1e-4)


def test_non_causal_attention_matches_numpy_with_kvpress_padding():
    """Chunks from token 0; in the last chunk padding keys get logit -1e-9 and padding
    queries (zero) attend uniformly, as kvpress computes it."""
    n, chunk = 10, 4
    q = jax.random.normal(jax.random.key(3), (1, 1, 12, 2, 3))  # [B, KVH, C, G, D]
    k = jax.random.normal(jax.random.key(4), (1, 1, 12, 3))
    valid = np.arange(12) < n
    q = q * valid[None, None, :, None, None]
    k = k * valid[None, None, :, None]
    got = np.asarray(non_causal_attention(q, k, jnp.array([[n]]), chunk))[0, 0]  # [G, C]
    want = np.zeros((2, 12))
    qn, kn = np.asarray(q, np.float64)[0, 0], np.asarray(k, np.float64)[0, 0]
    for g in range(2):
        for start in range(0, 12, chunk):
            idx = np.arange(start, start + chunk)
            logits = qn[idx, g] @ kn[idx].T
            logits[:, idx >= n] = -1e-9
            p = np.exp(logits - logits.max(1, keepdims=True))
            want[g, idx] = (p / p.sum(1, keepdims=True)).sum(0)
    np.testing.assert_allclose(got[:, :n], want[:, :n], rtol=1e-5)


def test_in_sequence_orders_by_position():
    layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=5, head_dim=2)
    layer = layer.replace(pos=jnp.array([[[7, EMPTY, 2, 9, EMPTY]]]))
    seq = in_sequence(layer)
    assert seq.order[0, 0, :3].tolist() == [2, 0, 3] and seq.n.tolist() == [[3]]


# ----------------------------------------------------------------------------- kvjax methods


def test_every_method_is_described():
    described = {m["name"]: m for m in describe_methods()}
    assert set(described) == set(METHODS)
    for name in ("keydiff", "lagkv", "cur", "leverage", "non_causal_attn", "compactor", "block",
                 "chunkkv", "entropy_chunkkv"):
        m = described[name]
        assert m["description"] and m["paper"] and m["kvpress"].endswith("Press"), m
        assert m["spec"].format(r=0.5) and parse_method(m["spec"].format(r=0.5)), m
        assert any(a["name"] == "ratio" for a in m["arguments"]), m


def test_methods_command_json(capsys):
    from experiments.cli.main import main
    assert main(["methods", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed["keydiff"]["kvpress"] == "KeyDiffPress"
    assert listed["keydiff"]["spec"] == "keydiff:ratio={r}"
    assert main(["methods", "lagkv"]) == 0
    assert "LagKVPress" in capsys.readouterr().out
    assert main(["methods", "nope"]) == 2


def test_rerotate_moves_kept_keys_to_contiguous_positions():
    """After eviction, token at position p (n-th kept) holds RoPE(k, n) and pos n."""
    from kvjax.policies.eviction_wrappers import rerotate_layer, rotate
    from models.llama import LlamaConfig, rope_frequencies
    inv = jnp.asarray(rope_frequencies(LlamaConfig.tiny()))
    raw = jax.random.normal(jax.random.key(5), (1, 1, 6, 16))  # pre-RoPE keys [B, KVH, C, D]
    pos = jnp.array([[[9, 2, EMPTY, 5, 11, EMPTY]]])
    roped = rotate(raw, jnp.maximum(pos, 0), inv)
    layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=6, head_dim=16)
    layer = layer.replace(k=roped.reshape(layer.k.shape), pos=pos)
    out = rerotate_layer(layer, inv)
    assert out.pos[0, 0].tolist() == [2, 0, EMPTY, 1, 3, EMPTY]
    want = rotate(raw, jnp.maximum(out.pos, 0), inv)
    valid = np.asarray(pos != EMPTY)[0, 0]
    np.testing.assert_allclose(np.asarray(out.logical_k)[0, 0][valid],
                               np.asarray(want)[0, 0][valid], atol=2e-5)


def test_rerotate_refuses_encoded_caches():
    with pytest.raises(ValueError, match="rerotate"):
        from kvjax.policies.eviction_wrappers import rerotate_layer
        layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=4, head_dim=8)
        rerotate_layer(layer.replace(k=layer.k.astype(jnp.int8)), jnp.ones(4))
