"""Recurrent-state layers (kvjax.policies.recurrent), feature maps, the linear_state / fold transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.core.cache import EMPTY
from kvjax.policies.feature_maps import elu_map, hedgehog, random_features
from kvjax.policies.recurrent import (FoldedLayer, LinearLayer, evicted_mask, hybrid_attend,
                                      init_linear_layer, init_state, resize_window, state_of)
from models.llama import Llama, LlamaConfig

B, KVH, H, D = 2, 2, 4, 8
PAD = 3  # sequence 1 is left-padded by PAD tokens


def _inputs(t: int, seed: int = 0):
    """Random q [B, T, H, D], k, v [B, KVH, T, D] and positions [B, T] (row 1 left-padded)."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, t, H, D))
    k = jax.random.normal(kk, (B, KVH, t, D))
    v = jax.random.normal(kv, (B, KVH, t, D))
    pos = np.stack([np.arange(t), np.r_[[EMPTY] * PAD, np.arange(t - PAD)]]).astype(np.int32)
    return q, k, v, jnp.asarray(pos)


def _features_np(fm, x, head, which):
    """Feature map of x [N, D] for KV head `head`, in float64 numpy (independent of kvjax rows)."""
    x = np.asarray(x, np.float64)
    if fm.kind == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))
    if fm.kind == "prf":
        w = fm.params[0].astype(np.float64)
        xs = x * fm.head_dim ** -0.25
        return np.exp(xs @ w - 0.5 * (xs * xs).sum(-1, keepdims=True)) / np.sqrt(fm.features)
    w, b = (p.astype(np.float64)[head] for p in fm.params[which:which + 2])
    u = x @ w
    return np.exp(np.clip(np.concatenate([u, -u], -1) + b, -20, 20))


def linear_reference(q, k, v, pos, fm, decay):
    """Quadratic masked linear attention, float64, one (sequence, query head, query) at a time."""
    q, k, v, pos = (np.asarray(x, np.float64) for x in (q, k, v, pos))
    b, t, h, d = q.shape
    g = h // KVH
    out = np.zeros(q.shape)
    for bi in range(b):
        for hi in range(h):
            kv = hi // g
            gamma = decay[kv] if len(decay) > 1 else decay[0]
            fq = _features_np(fm, q[bi, :, hi], kv, 0)  # [T, F]
            fk = _features_np(fm, k[bi, kv], kv, 2)
            for ti in range(t):
                if pos[bi, ti] < 0:
                    continue
                w = (fk @ fq[ti]) * gamma ** (pos[bi, ti] - pos[bi])
                w = np.where((pos[bi] >= 0) & (pos[bi] <= pos[bi, ti]), w, 0.0)
                out[bi, ti, hi] = w @ v[bi, kv] / w.sum()
    return out


def _run(layer, q, k, v, pos, chunk):
    """Write and attend `chunk` tokens at a time -> [B, T, H, D]."""
    outs = []
    for s in range(0, q.shape[1], chunk):
        e = min(s + chunk, q.shape[1])
        layer = kvjax.write(layer, k[:, :, s:e], v[:, :, s:e], pos[:, s:e])
        outs.append(kvjax.attend(q[:, s:e], pos[:, s:e], layer))
    return jnp.concatenate(outs, axis=1), layer


MAPS = {"elu": lambda: elu_map(D), "prf": lambda: random_features(D, 16, seed=3),
        "hedgehog": lambda: hedgehog(KVH, D, 8, seed=1)}


@pytest.mark.parametrize("name", sorted(MAPS))
@pytest.mark.parametrize("decay", [(1.0,), (0.8, 0.95)])
def test_recurrent_equals_chunked_equals_quadratic_reference(name, decay):
    fm = MAPS[name]()
    t = 13  # chunks of 5: 5 + 5 + 3 (a short last chunk); row 1 padded across the first chunk
    q, k, v, pos = _inputs(t)
    ref = linear_reference(q, k, v, pos, fm, decay)
    recurrent, _ = _run(init_linear_layer(B, KVH, D, fm, 1, decay), q, k, v, pos, 1)
    chunked, layer = _run(init_linear_layer(B, KVH, D, fm, 5, decay), q, k, v, pos, 5)
    valid = np.asarray(pos >= 0)[:, :, None, None]
    # float32 sums of <= 13 positive terms: relative error a few ulp of the largest term
    np.testing.assert_allclose(np.asarray(recurrent), ref * valid, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(chunked), ref * valid, rtol=2e-5, atol=2e-6)
    assert not np.any(np.asarray(recurrent)[1, :PAD])  # padding queries read nothing
    # the state after the last write folds to the same state however the tokens were chunked
    _, one = _run(init_linear_layer(B, KVH, D, fm, 1, decay), q, k, v, pos, 1)
    for a, b in zip(jax.tree_util.tree_leaves(layer.folded()),
                    jax.tree_util.tree_leaves(one.folded())):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_linear_layer_bytes_are_constant_in_context():
    fm = random_features(64, 128)
    sizes = []
    for context in (1024, 4096, 16384):
        def compress(context=context):
            cache = kvjax.init_cache(1, 3, context, 64)
            t = kvjax.linear_state(fm)
            return t.update((cache,), t.init((cache,)), None)[0]
        sizes.append(kvjax.nbytes(jax.eval_shape(compress)))
    # S [3, 128, 64] + z [3, 128] + at [3] floats/ints + one staged token (k, v, pos)
    expected = 4 * (3 * 128 * 64 + 3 * 128 + 3) + 4 * (2 * 3 * 64 + 3)
    assert sizes == [expected] * 3


def test_resize_window_folds_the_staged_tokens():
    fm = elu_map(D)
    q, k, v, pos = _inputs(6)
    _, layer = _run(init_linear_layer(B, KVH, D, fm, 6, (0.9,)), q, k, v, pos, 6)
    small = resize_window(layer, 1)
    assert small.window == 1 and np.all(np.asarray(small.pos) == EMPTY)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                           small.state, layer.folded())


# ----------------------------------------------------------------------------- fold (LESS)


def _token_layer(t=12, capacity=16, seed=0):
    q, k, v, pos = _inputs(t, seed)
    layer = kvjax.write(kvjax.init_cache(B, KVH, capacity, D), k, v, pos)
    return q, layer


def test_evicted_mask_matches_a_set_difference():
    _, layer = _token_layer()
    keep = jax.random.bernoulli(jax.random.key(5), 0.5, layer.pos.shape)
    after = kvjax.compact(layer, keep)
    got = np.asarray(evicted_mask(layer.pos, after.pos))
    before, kept = np.asarray(layer.pos), np.asarray(after.pos)
    for b in range(B):
        for h in range(KVH):
            gone = set(before[b, h][before[b, h] != EMPTY]) - set(kept[b, h][kept[b, h] != EMPTY])
            assert set(before[b, h][got[b, h]]) == gone


def test_fold_of_evicted_tokens_equals_the_state_recomputed_from_scratch():
    """Two compressions (a budget of 8, then of 5): the folded state is the state of every
    token evicted by either, computed from scratch."""
    fm = random_features(D, 16, seed=1)
    _, layer = _token_layer()
    first = kvjax.fold_evicted(kvjax.knorm(budget=8), fm)
    cache, tstate = first.update((layer,), first.init((layer,)), None)
    folded = cache[0]
    assert isinstance(folded, FoldedLayer)
    second = kvjax.fold_evicted(kvjax.knorm(budget=5), fm)
    cache, _ = second.update(cache, second.init(cache), None)
    kept = np.asarray(cache[0].tokens.pos)
    before = np.asarray(layer.pos)
    gone = np.stack([[np.isin(before[b, h], kept[b, h], invert=True) & (before[b, h] != EMPTY)
                      for h in range(KVH)] for b in range(B)])
    assert gone.sum() == (before != EMPTY).sum() - (kept != EMPTY).sum() > 0
    expect = state_of(layer, fm, jnp.asarray(gone))
    np.testing.assert_allclose(cache[0].state.s, expect.s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache[0].state.z, expect.z, rtol=1e-5, atol=1e-6)


def test_fold_leaves_layers_the_policy_does_not_touch():
    cache = tuple(_token_layer(seed=s)[1] for s in range(2))
    t = kvjax.parse_method("knorm:budget=8,layers=0+fold:map=elu")
    out, _ = t.update(cache, t.init(cache), None)
    assert isinstance(out[0], FoldedLayer) and out[1] is cache[1]


def test_hybrid_attention_is_one_softmax_shaped_ratio():
    """Kept tokens by softmax, evicted ones by the state: (sum_K e^s v + phi^T S) /
    (sum_K e^s + phi^T z), checked in float64 without the max shift."""
    fm = random_features(D, 32, seed=2)
    q, layer = _token_layer()
    keep = jnp.asarray(np.arange(16) % 3 != 0)[None, None].repeat(B, 0).repeat(KVH, 1)
    kept = kvjax.compact(layer, keep)
    state = state_of(layer, fm, ~keep & (layer.pos != EMPTY))
    q_last, qp = q[:, -1:], layer.pos[:, 0, -5:-4].max(axis=1, keepdims=True) * 0 + 11
    out = np.asarray(hybrid_attend(q_last, qp, kept, state, fm))

    g = H // KVH
    kpos, kk, vv = (np.asarray(x, np.float64) for x in (kept.pos, kept.k, kept.v))
    for b in range(B):
        for hi in range(H):
            kv = hi // g
            row = b * KVH + kv
            qv = np.asarray(q_last[b, 0, hi], np.float64)
            e = np.exp(kk[row] @ qv / np.sqrt(D)) * (kpos[b, kv] != EMPTY)
            fq = _features_np(fm, qv[None], kv, 0)[0]
            num = e @ vv[row] + fq @ np.asarray(state.s[row], np.float64)
            den = e.sum() + fq @ np.asarray(state.z[row], np.float64)
            np.testing.assert_allclose(out[b, 0, hi], num / den, rtol=1e-5, atol=1e-6)


def test_hybrid_without_evictions_is_softmax_attention():
    fm = random_features(D, 16)
    q, layer = _token_layer()
    empty = init_state(B * KVH, fm.features, D)
    got = FoldedLayer(tokens=layer, state=empty, feature_map=fm).attend(q, _inputs(12)[3])
    want = kvjax.attend_reference(q, _inputs(12)[3], layer)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_prf_features_are_unbiased_for_the_softmax_kernel():
    """E[phi(q).phi(k)] = exp(q.k/sqrt d): the mean over 64 seeds x 256 features is within
    5 standard errors of it."""
    x = jax.random.normal(jax.random.key(0), (2, 1, D)) * 0.7
    est = []
    for seed in range(64):
        fm = random_features(D, 256, seed)
        f = fm.query(x, 1)
        est.append(float((f[0, 0] * f[1, 0]).sum()))
    exact = float(np.exp(np.dot(x[0, 0], x[1, 0]) / np.sqrt(D)))
    est = np.asarray(est)
    assert abs(est.mean() - exact) < 5 * est.std() / np.sqrt(len(est))


# ----------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


SPECS = ["linear_state:map=prf,features=16,layers=1",
         "linear_state:map=elu,decay=0.9",
         "snapkv:ratio=0.5,window=4+fold:map=prf,features=16",
         "knorm:ratio=0.5+fold:map=elu"]


@pytest.mark.parametrize("spec", SPECS)
def test_generate_with_state_layers(model, spec, count_traces):
    from models.sampler import generate
    t = kvjax.parse_method(spec)
    prompts = [list(range(3, 20)), list(range(5, 14))]
    out = generate(model, prompts, max_new_tokens=6, transform=t, chunk=8)
    assert out.tokens.shape == (2, 6)
    kinds = {type(layer).__name__ for layer in out.cache}
    assert kinds & {"LinearLayer", "FoldedLayer"}
    with count_traces() as traces:
        again = generate(model, prompts, max_new_tokens=6, transform=kvjax.parse_method(spec),
                         chunk=8)
    assert traces.count == 0  # the same spec: nothing recompiles
    np.testing.assert_array_equal(again.tokens, out.tokens)


def test_generate_with_fold_and_decode_compression(model):
    from models.sampler import generate
    t = kvjax.parse_method("snapkv:ratio=0.5,window=4+fold:map=prf,features=16")
    out = generate(model, [list(range(3, 30))], max_new_tokens=8, transform=t, chunk=8,
                   compress_every=2)
    assert all(isinstance(layer, FoldedLayer) for layer in out.cache)
    assert float(jnp.abs(out.cache[0].state.z).sum()) > 0


def test_linear_model_prefill_matches_token_by_token_decode(model):
    """A cache of linear layers from the start: chunked prefill (8 tokens per write) and one
    token per step give the same logits (chunked parallel form == recurrent form)."""
    cfg = model.config
    fm = random_features(cfg.head_dim, 16)
    tokens = jnp.asarray([list(range(3, 19))])
    pos = jnp.arange(16)[None]
    layers = lambda w: tuple(init_linear_layer(1, cfg.num_kv_heads, cfg.head_dim, fm, w)
                             for _ in range(cfg.num_layers))
    chunked, cache = [], layers(8)
    for s in (0, 8):
        logits, cache = model(tokens[:, s:s + 8], pos[:, s:s + 8], cache)
        chunked.append(logits)
    step, cache = [], layers(1)
    for s in range(16):
        logits, cache = model(tokens[:, s:s + 1], pos[:, s:s + 1], cache)
        step.append(logits)
    np.testing.assert_allclose(np.concatenate(chunked, 1), np.concatenate(step, 1),
                               rtol=1e-4, atol=1e-4)


def test_exported_decode_step_takes_linear_and_folded_layers(model):
    from models.export import export_decode_step, params_dict
    for spec in ("linear_state:map=prf,features=16", "knorm:ratio=0.5+fold:map=elu"):
        t = kvjax.parse_method(spec)
        exported = export_decode_step(model, batch=1, capacity=8, transform=t)
        step = jax.export.deserialize(exported.serialize())
        empty = kvjax.init_model_cache(model.config.cache_spec, 1, 8)
        cache = t.update(empty, t.init(empty), None)[0]
        params = params_dict(model)
        tok, pos = jnp.full((1, 1), 7), jnp.zeros((1, 1), jnp.int32)
        a, _ = exported.call(params, tok, pos, cache)
        b, restored = step.call(params, tok, pos, cache)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert type(restored[0]) is type(cache[0])


def test_shard_cache_places_state_layers(model):
    mesh = jax.make_mesh((1, 1), ("batch", "kv"))
    cache = kvjax.init_model_cache(model.config.cache_spec, 1, 8)
    t = kvjax.parse_method("linear_state:map=elu,layers=0")
    cache, _ = t.update(cache, t.init(cache), None)
    placed = kvjax.shard_cache(cache, mesh)
    assert isinstance(placed[0], LinearLayer)
    jax.tree_util.tree_map(np.testing.assert_array_equal, placed, cache)


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("spec, message", [
    ("linear_state:map=nope", "unknown feature map 'nope'"),
    ("linear_state:map=prf,features=0", "features must be an int >= 1"),
    ("linear_state:decay=1.5", "decay must be a number in"),
    ("fold:map=elu", "put an eviction policy first"),
    ("snapkv:ratio=0.5+fold:map=elu,features=-3", "features must be an int >= 1"),
    ("snapkv:ratio=0.5+fold:map=elu,layers=0-1", "fold: takes no layers"),
])
def test_bad_arguments_raise_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        kvjax.parse_method(spec)


def test_bad_layer_arguments_raise():
    with pytest.raises(ValueError, match="staging window"):
        kvjax.write(init_linear_layer(1, 1, D, elu_map(D), 2), *[jnp.zeros((1, 1, 3, D))] * 2,
                    jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="features must be even"):
        hedgehog(2, D, 7)
    with pytest.raises(ValueError, match="window must be a positive int"):
        init_linear_layer(1, 1, D, elu_map(D), 0)


# ----------------------------------------------------------------------------- learned maps


@pytest.fixture(scope="module")
def trained(model):
    from models.train_state import train_feature_maps
    rng = np.random.default_rng(0)
    windows = rng.integers(3, 250, (6, 48)).tolist()
    return train_feature_maps(model, windows[:4], windows[4:], features=8, steps=40, lr=3e-2,
                              queries=16, batch=2, progress=False)


def test_optax_training_lowers_the_loss(trained):
    first, last = np.mean(trained.losses[:5]), np.mean(trained.losses[-5:])
    assert last < 0.9 * first, (first, last)
    assert set(trained.heldout) == {"learned", "prf8", "elu"}
    assert all(np.isfinite(v).all() for v in trained.heldout.values())


def test_learned_maps_round_trip_through_orbax(trained, model, tmp_path):
    from models.sampler import generate
    from models.train_state import plot_losses
    path = kvjax.save_maps(tmp_path / "maps", trained.maps)
    restored = kvjax.load_maps(str(path))
    assert restored == trained.maps  # content equality, hence the same static jit key
    for a, b in zip(restored, trained.maps):
        for x, y in zip(a.params, b.params):
            np.testing.assert_array_equal(x, y)
    spec = f"snapkv:ratio=0.5,window=4+fold:map={path}"
    out = generate(model, [list(range(3, 25))], max_new_tokens=4,
                   transform=kvjax.parse_method(spec), chunk=8)
    assert out.cache[0].feature_map == trained.maps[0]
    assert out.cache[1].feature_map == trained.maps[1]
    assert plot_losses(trained.losses, tmp_path / "loss.png", trained.heldout).stat().st_size > 0
    with pytest.raises(ValueError, match="unknown feature map"):
        kvjax.parse_method(f"linear_state:map={tmp_path / 'missing'}")
