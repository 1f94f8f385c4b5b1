"""The cache monitor (kvjax/tools/monitor.py, issue 20): every counter equals the value a plain
numpy reference recomputes from the caches before and after the update, for an eviction
policy, a codec, a chain, accumulated attention (H2O) and a tiered paged cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import EMPTY
from kvjax.tools.monitor import (LayerMonitor, dense, find_monitor, init_monitor, monitored,
                                 per_head, refresh, summary)
from kvjax.memory.paging import reserve
from kvjax.memory.tiers import (coldest_pages, host_pages_in_use, init_tiered_cache, prefetch,
                                recency_scores, spill)
from models.llama import Llama, LlamaConfig
from models.sampler import generate, prefill_batch

CFG = LlamaConfig.tiny(head_dim=32, num_layers=2)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(0))


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 250, 70).tolist(), rng.integers(3, 250, 55).tolist()]


def logical(d, field):
    """[B, KVH, C, D] numpy keys/values of a dense view (pooled rows broadcast)."""
    x = np.asarray(getattr(d, f"logical_{field}"), np.float32)
    return np.broadcast_to(x, (*d.pos.shape, x.shape[-1]))


def reference(before, after, stats, layer_index, group):
    """Plain numpy: per (b, h) tokens, evicted, key/value relative error by position, and the
    share of the window queries' attention (softmax over the whole `before` row) kept."""
    db, da = dense(before), dense(after)
    pb, pa = np.asarray(db.pos), np.asarray(da.pos)
    out = {f: np.zeros(pb.shape[:2]) for f in ("tokens", "evicted", "k_error", "v_error",
                                                "mass_retained")}
    kb, ka, vb, va = logical(db, "k"), logical(da, "k"), logical(db, "v"), logical(da, "v")
    for b in range(pb.shape[0]):
        for h in range(pb.shape[1]):
            slot_of = {int(p): i for i, p in enumerate(pb[b, h]) if p != EMPTY}
            kept = [(j, slot_of[int(p)]) for j, p in enumerate(pa[b, h]) if p != EMPTY]
            out["tokens"][b, h] = len(kept)
            out["evicted"][b, h] = len(slot_of) - len(kept)
            for f, xb, xa in (("k_error", kb, ka), ("v_error", vb, va)):
                num = sum(float(((xa[b, h, j] - xb[b, h, i]) ** 2).sum()) for j, i in kept)
                den = sum(float((xb[b, h, i] ** 2).sum()) for j, i in kept)
                out[f][b, h] = np.sqrt(num / den) if den else 0.0
            if stats is None:
                out["mass_retained"][b, h] = np.nan
                continue
            q = np.asarray(stats[layer_index].queries)[b]  # [W, H, D]
            qpos = np.asarray(stats[layer_index].query_pos)[b]
            mass = np.zeros(pb.shape[-1])
            for t in range(q.shape[0]):
                if qpos[t] < 0:
                    continue
                for hq in range(h * group, (h + 1) * group):
                    s = kb[b, h] @ q[t, hq] / np.sqrt(q.shape[-1])
                    ok = (pb[b, h] != EMPTY) & (pb[b, h] <= qpos[t])
                    p = np.where(ok, np.exp(s - s[ok].max()), 0.0)
                    mass += p / p.sum()
            keep = np.isin(pb[b, h], pa[b, h][pa[b, h] != EMPTY]) & (pb[b, h] != EMPTY)
            out["mass_retained"][b, h] = mass[keep].sum() / mass.sum()
    return out


@pytest.mark.parametrize("method", ["snapkv:ratio=0.5", "kivi:bits=2,group=16,residual=16",
                                    "snapkv:ratio=0.3+kivi:bits=4,group=16,residual=16",
                                    "streaming_llm:sinks=4,window=20+quantize:bits=4,group=16"])
def test_monitor_counters_equal_a_plain_reference(model, method):
    t = kvjax.parse_method(method)
    pre = prefill_batch(model, prompts(), stats=t.stats, room=4)
    mt = monitored(t)
    assert monitored(t) is mt  # one wrapper per transform: jitted code compiles once
    cache, (inner, mon) = jax.jit(mt.update)(pre.cache, mt.init(pre.cache), pre.stats)
    group = CFG.num_heads // CFG.num_kv_heads
    for i, (m, before, after) in enumerate(zip(mon, pre.cache, cache)):
        want = reference(before, after, pre.stats if t.stats.window else None, i, group)
        np.testing.assert_array_equal(np.asarray(m.tokens), want["tokens"])
        np.testing.assert_array_equal(np.asarray(m.evicted), want["evicted"])
        # float32 sums in another order: a few ulps of the error itself
        for f in ("k_error", "v_error", "mass_retained"):
            np.testing.assert_allclose(np.asarray(getattr(m, f)), want[f], rtol=2e-5,
                                       atol=1e-6, equal_nan=True)
        np.testing.assert_array_equal(np.asarray(m.capacity), dense(after).pos.shape[-1])
        np.testing.assert_array_equal(np.asarray(m.slots_used), np.asarray(
            after.length if hasattr(after, "length") else after.body.length + after.recent.length))
    s = summary(mon)
    assert s["tokens"] == int(sum(np.asarray(m.tokens).sum() for m in mon))
    codec = "kivi" in method or "quantize" in method
    evicts = method.split(":")[0] in ("snapkv", "streaming_llm")
    assert (s["k_error"] > 1e-3) == codec and (s["evicted"] > 0) == evicts
    assert (s["mass_retained"] is not None) == (method.split(":")[0] == "snapkv")


def test_accumulated_attention_mass_h2o(model):
    t = kvjax.parse_method("h2o:ratio=0.5")
    pre = prefill_batch(model, prompts(), stats=t.stats, room=4)
    mt = monitored(t)
    cache, (_, mon) = mt.update(pre.cache, mt.init(pre.cache), pre.stats)
    for m, before, after in zip(mon, pre.cache, cache):
        mass, pb, pa = (np.asarray(x) for x in (before.mass, before.pos, after.pos))
        for b in range(pb.shape[0]):
            for h in range(pb.shape[1]):
                keep = np.isin(pb[b, h], pa[b, h][pa[b, h] != EMPTY]) & (pb[b, h] != EMPTY)
                want = mass[b, h][keep].sum() / mass[b, h].sum()
                np.testing.assert_allclose(float(m.mass_retained[b, h]), want, rtol=1e-5)


def test_generate_returns_the_monitor_with_the_cache(model):
    t = monitored(kvjax.parse_method("snapkv:ratio=0.5"))
    out = generate(model, prompts(), max_new_tokens=5, transform=t)
    mon = find_monitor(out.transform_state)
    assert mon is not None and len(mon) == CFG.num_layers
    mon = refresh(mon, out.cache)  # tokens the decode loop added
    for m, layer in zip(mon, out.cache):
        pos = np.asarray(dense(layer).pos)
        np.testing.assert_array_equal(np.asarray(m.tokens), (pos != EMPTY).sum(-1))
    plain = generate(model, prompts(), max_new_tokens=5, transform=kvjax.parse_method(
        "snapkv:ratio=0.5"))
    np.testing.assert_array_equal(out.tokens, plain.tokens)  # watching changes nothing


def test_monitor_of_a_tiered_paged_cache():
    pool, layers = init_tiered_cache(20, 10, 4, 2, 2, 6, 8, num_layers=2)
    pool, layers = reserve(pool, layers, jnp.array([15, 15]))
    k = jax.random.normal(jax.random.key(0), (2, 2, 15, 8))
    pos = jnp.array([list(range(15)), [-1] * 6 + list(range(9))])
    layers = tuple(l.write(k, k, pos) for l in layers)
    pool, layers = spill(pool, layers, coldest_pages(layers[0], recency_scores(layers[0]), 5))
    staged = prefetch(layers, host_pages_in_use(layers[0]).at[0].set(-1))  # one left unstaged
    staged = tuple(l.write(k[:, :, :1], k[:, :, :1], jnp.array([[15], [9]])) for l in staged)
    mon = init_monitor(staged)
    tables = np.asarray(staged[0].tables)
    used = np.arange(6) < np.asarray(staged[0].num_pages_used)[..., None]
    for m, layer in zip(mon, staged):
        np.testing.assert_array_equal(np.asarray(m.pages_host), (used & (tables >= 20)).sum(-1))
        np.testing.assert_array_equal(np.asarray(m.pages_device),
                                      (used & (tables < 20)).sum(-1))
        assert int(m.pages_host.sum()) == 5 and int(m.prefetch_misses.sum()) >= 1
        np.testing.assert_array_equal(np.asarray(m.slots_used), np.asarray(layer.lengths))
        np.testing.assert_array_equal(np.asarray(m.tokens), [[16, 16], [10, 10]])
    assert per_head(mon, "pages_host").shape == (2, 2, 2)
    with pytest.raises(ValueError, match="unknown field 'pages'"):
        per_head(mon, "pages")
    assert LayerMonitor._fields[0] == "tokens"


def test_inspect_draws_the_three_panels(model, tmp_path):
    from experiments.cli.inspect_cmd import draw, inspect, kept_matrix
    ids = prompts()[0]
    before, after, mon = inspect(model, ids, "snapkv:ratio=0.5+quantize:bits=4,group=16")
    kept, err = kept_matrix(before[0], after[0])
    pos = np.asarray(dense(after[0]).pos)[0]
    for h in range(CFG.num_kv_heads):  # kept = the positions the compressed cache holds
        assert sorted(np.nonzero(kept[h])[0].tolist()) == sorted(pos[h][pos[h] != EMPTY].tolist())
    assert np.isnan(err[~kept]).all() and (err[kept] > 0).all()
    out = tmp_path / "x.png"
    draw(before, after, mon, "test", out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "q", "--out", "x.jpg"], "--out x.jpg: must name a .png file"),
    (["--prompt", "q", "--out", "x.png", "--max-tokens", "1"], "--max-tokens 1: must be"),
    (["--prompt", "q", "--out", "x.png", "--method", "snapkv:ratoi=0.5"], "ratoi"),
    (["--prompt", "q", "--out", "x.png", "--context-file", "/nonexistent"], "file not found"),
])
def test_inspect_bad_input_exits_2_before_loading(argv, message, capsys):
    from experiments.cli.main import main
    assert main(["inspect", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_linear_state_layer_is_reported_not_refused(model):
    """Methods whose layers hold no tokens (linear_state) still run monitored (eval rows)."""
    t = kvjax.parse_method("linear_state:map=elu")
    out = generate(model, prompts(), max_new_tokens=3, transform=monitored(t))
    mon = refresh(find_monitor(out.transform_state), out.cache)
    plain = generate(model, prompts(), max_new_tokens=3, transform=t)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert summary(mon)["layers"] == CFG.num_layers


def kivi_error_reference(layer, exact_k, exact_v):
    """[B, KVH] relative errors of a KIVI layer's held keys and values against the exact ones
    (`exact_*[b, h, position]`), recomputed in numpy from the decoded cache."""
    d = kvjax.view(layer)
    pos = np.asarray(d.pos)
    out = []
    for stored, exact in ((logical(d, "k"), exact_k), (logical(d, "v"), exact_v)):
        err = np.zeros(pos.shape[:2])
        for b, h in np.ndindex(*pos.shape[:2]):
            held = pos[b, h] != EMPTY
            s, e = stored[b, h][held].astype(np.float64), exact[b, h][pos[b, h][held]]
            err[b, h] = np.sqrt(((s - e) ** 2).sum() / (e ** 2).sum())
        out.append(err)
    return out


def test_flush_error_equals_a_numpy_recomputation():
    """KIVI flushes tokens into its quantized body during decode: the monitor's key/value
    errors, updated at each flush (`observe_flush`), equal the error of the held tokens
    recomputed from the decoded cache against the exact keys and values."""
    from kvjax.tools.monitor import observe_flush
    b, kvh, d, n, steps = 2, 2, 32, 20, 20
    k, v = (np.asarray(x) for x in jax.random.normal(jax.random.key(0), (2, b, kvh, n + steps, d)))
    t = monitored(kvjax.kivi(bits=2, group=8, residual=8))
    cache = (kvjax.write(kvjax.init_cache(b, kvh, 64, d), k[:, :, :n], v[:, :, :n],
                         jnp.broadcast_to(jnp.arange(n), (b, n))),)
    cache, (_, mon) = t.update(cache, t.init(cache), None)
    ref_k, ref_v = kivi_error_reference(cache[0], k, v)
    np.testing.assert_allclose(np.asarray(mon[0].k_error), ref_k, rtol=1e-5)

    @jax.jit
    def step(cache, mon, k, v, pos):
        new = tuple(kvjax.write(layer, k, v, pos) for layer in cache)
        return new, observe_flush(mon, cache, new)

    body = int(cache[0].body.length)
    for i in range(n, n + steps):
        cache, mon = step(cache, mon, k[:, :, i:i + 1], v[:, :, i:i + 1], jnp.full((b, 1), i))
        ref_k, ref_v = kivi_error_reference(cache[0], k, v)
        np.testing.assert_allclose(np.asarray(mon[0].k_error), ref_k, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(mon[0].v_error), ref_v, rtol=1e-5)
    assert int(cache[0].body.length) >= body + 16  # two groups flushed during the decode
    assert (ref_k > 0.05).all()


def test_generate_updates_the_kivi_error_at_flushes(model):
    """`generate` with a monitored KIVI transform: layer 0's keys depend on the token and its
    position only, so the exact keys of every held token are those of a full-cache prefill of
    the same tokens; the monitor's layer-0 error equals the numpy recomputation."""
    ids = prompts()[0][:40]
    t = kvjax.parse_method("kivi:bits=2,group=8,residual=8")
    out = generate(model, [ids], max_new_tokens=24, transform=monitored(t))
    mon = find_monitor(out.transform_state)
    held = ids + out.tokens[0, :-1].tolist()  # the last token is emitted, not written
    exact = prefill_batch(model, [held]).cache[0]
    ek, ev = (np.asarray(x).reshape(1, CFG.num_kv_heads, len(held), -1)
              for x in (exact.k, exact.v))
    ref_k, ref_v = kivi_error_reference(out.cache[0], ek, ev)
    assert int(out.cache[0].body.length) > 32  # decode flushed beyond the prompt's groups
    np.testing.assert_allclose(np.asarray(mon[0].k_error), ref_k, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(mon[0].v_error), ref_v, rtol=1e-3)


def test_the_monitored_state_is_named_and_watched_wherever_the_monitor_sits(model):
    """`monitored` keeps a MonitoredState (never a bare pair recognised by its shape) and
    watches decode writes through `after_write`, which `chain` and `on_layers` pass on: the
    sampler knows nothing about monitors."""
    from kvjax.tools.monitor import MonitoredState

    t = monitored(kvjax.parse_method("kivi:bits=2,group=8,residual=8"))
    cache = prefill_batch(model, [prompts()[0][:40]]).cache
    state = t.init(cache)
    assert type(state) is MonitoredState and find_monitor(state) is state.monitor
    assert find_monitor((state.inner, state.monitor)) is None  # a plain pair is no monitor
    assert t.after_write is not None and kvjax.full().after_write is None
    ids = prompts()[0][:40]
    alone = generate(model, [ids], max_new_tokens=24, transform=t)
    chained = generate(model, [ids], max_new_tokens=24, transform=kvjax.chain(t, kvjax.full()))
    assert chained.tokens.tolist() == alone.tokens.tolist()
    a, c = find_monitor(alone.transform_state), find_monitor(chained.transform_state[0])
    assert float(a[0].k_err_sq.sum()) > 0  # the flushes of the decode were measured ...
    for la, lc in zip(a, c):  # ... the same inside a chain
        np.testing.assert_array_equal(np.asarray(la.k_error), np.asarray(lc.k_error))


def test_monitoring_a_compression_costs_at_most_one_more_cache_in_temporaries():
    """`memory_analysis` of the compiled compression, monitored against plain, on an 8-layer
    model: the monitor's error sums go one (sequence, KV head) row at a time. Gathering every
    row of every layer at once had cost 1.65 caches more here (two caches more on SmolLM2,
    where a 5 x 4k RULER group passed its memory bound); now 0.75 (the compressed cache the
    monitor reads before it is stacked)."""
    from models.sampler import _compress_stacked, _prefill, for_full_layers, prefill_inputs
    deep = Llama(LlamaConfig.tiny(head_dim=32, num_layers=8), rngs=nnx.Rngs(0))
    ids = [[3 + i % 250 for i in range(448)]] * 4
    temps = {}
    for name, transform in (("plain", kvjax.snapkv(ratio=0.5)),
                            ("monitored", monitored(kvjax.snapkv(ratio=0.5)))):
        transform = for_full_layers(deep, transform)
        args, _ = prefill_inputs(deep, ids, stats=transform.stats, room=64)
        _, cache, stats = jax.eval_shape(lambda *a: _prefill(deep, *a, args[4]), *args[:4])
        state = jax.eval_shape(transform.init, cache)
        compiled = _compress_stacked.lower(transform.update, cache, state, stats).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
    assert temps["monitored"] - temps["plain"] <= cache_bytes, (temps, cache_bytes)
