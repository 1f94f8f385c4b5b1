"""`auto:budget=F` / `auto:bytes=N` (kvjax.policies.planner): the budget holds as measured
with `kvjax.nbytes`, arguments are checked at parse time, and the plan follows its signals."""

import itertools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import parse_method
from kvjax.core.stats import LayerStats, StatsSpec, init_stats
from kvjax.policies import planner

README = Path(__file__).resolve().parents[1] / "README.md"  # a file that is no calibration

@pytest.fixture(scope="module")
def long_tiny():
    """The tiny random Llama with room for 8k positions."""
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    return Llama(LlamaConfig.tiny(max_position=8192), rngs=nnx.Rngs(0))


def bf16_budget(model, batch: int, tokens: int, fraction: float) -> float:
    """F x nbytes of an uncompressed bf16 cache of `batch` rows of `tokens` (independent of
    the planner's own formula: measured on the shapes)."""
    shapes = jax.eval_shape(lambda: kvjax.init_model_cache(model.config.cache_spec, batch,
                                                           tokens, jnp.bfloat16))
    return fraction * kvjax.nbytes(shapes)


def held_bytes(cache) -> int:
    """What the cache holds: every layer cut to its written slots."""
    return kvjax.nbytes(kvjax.shrink(cache, 0))


def unused(t, model, batch: int = 1) -> int:
    """The most budget a plan may leave: per layer and row, a head-slot per KV head (the
    floors), and for per-channel keys a group per head (whole groups) and the spare parameter
    rows counted in its fixed bytes."""
    c = model.config
    group = np.gcd(32, c.head_dim)
    cache = [kvjax.init_cache(batch, c.num_kv_heads, 1, c.head_dim)] * c.num_layers
    total = 0
    for choice in t.update.plan(cache):
        fixed, slot = planner.layer_bytes(batch, c.num_kv_heads, c.head_dim, "float32",
                                          choice.bits, choice.keys)
        heads = 2 * c.num_kv_heads + (choice.keys == "channel") * c.num_kv_heads * group
        total += batch * heads * slot + (choice.keys == "channel") * fixed
    return total


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("spec, words", [
    ("auto:budget=0", ["budget=0", "[0.00586, 1]"]),
    ("auto:budget=-0.5", ["budget=-0.5", "[0.00586, 1]"]),
    ("auto:budget=1.5", ["budget=1.5", "[0.00586, 1]"]),
    ("auto:budget=0.001", ["budget=0.001", "int2"]),
    ("auto:budget=nan", ["budget="]),
    ("auto:budget=half", ["budget='half'"]),
    ("auto:bytes=0", ["bytes=0", "positive int"]),
    ("auto:bytes=1.5", ["bytes=1.5", "positive int"]),
    ("auto:bytes=-3", ["bytes=-3", "positive int"]),
    ("auto", ["exactly one of budget"]),
    ("auto:budget=0.5,bytes=100", ["exactly one of budget"]),
    ("auto:budget=0.5,table=mine", ["table='mine'"]),
    ("auto:budget=0.5,keys=rows", ["keys='rows'", "channel"]),
    ("auto:budget=0.5,score=mass", ["score='mass'", "expected_attention"]),
    ("auto:budget=0.5,calibration=no/such.json", ["calibration='no/such.json'", "not a file"]),
    (f"auto:budget=0.5,table=prior,calibration={README}", ["calibration=", "not prior"]),
    (f"auto:budget=0.5,calibration={README}", ["README.md", "not a planner calibration"]),
])
def test_bad_arguments_are_named_at_parse_time(spec, words):
    with pytest.raises(ValueError) as e:
        parse_method(spec)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_damage_tables_come_from_the_calibration_in_order(tmp_path, monkeypatch):
    """"auto" plans with the end-to-end (KL) table, then the attention-output table, then the
    prior; each named table is that table or the prior; a file without a KL entry (an older
    calibration) plans with its attention-output table."""
    import json
    cal = json.loads(planner.CALIBRATION.read_text())
    kl, attention = np.asarray(cal["kl"]["damage"]), np.asarray(cal["damage"])
    layers = len(attention)
    assert kl.shape == attention.shape == (layers, len(planner.CONFIGS))
    assert not np.allclose(kl, attention)
    for source, want in (("auto", kl), ("kl", kl), ("table", attention)):
        np.testing.assert_array_equal(planner.damage_table(layers, source)[0], want)
    assert planner.plan_source(layers).startswith("end-to-end table")
    assert planner.plan_source(layers + 1, "kl").startswith("prior")
    older = tmp_path / "calibration.json"
    older.write_text(json.dumps({k: v for k, v in cal.items() if k not in ("kl", "shape")}))
    monkeypatch.setattr(planner, "CALIBRATION", older)
    np.testing.assert_array_equal(planner.damage_table(layers, "auto")[0], attention)
    assert planner.plan_source(layers, "kl").startswith("prior")
    # a file without `shape` (older) matches on layers alone; the shipped one on all three
    assert planner.plan_source(layers, "auto", 4, 128).startswith("calibrated table")
    monkeypatch.undo()
    shape = cal["shape"]
    assert planner.plan_source(layers, "auto", shape["kv_heads"], shape["head_dim"]) \
        .startswith("end-to-end table")
    for heads, dim in ((shape["kv_heads"] + 1, shape["head_dim"]),
                       (shape["kv_heads"], 2 * shape["head_dim"])):
        assert planner.plan_source(layers, "auto", heads, dim).startswith("prior")


def calibration_file(path, layers: int, heads: int, dim: int, damage) -> str:
    """A calibration file with one end-to-end table `damage` [layers, configs]."""
    import json
    path.write_text(json.dumps({
        "shape": {"layers": layers, "kv_heads": heads, "head_dim": dim},
        "configs": [list(c) for c in planner.CONFIGS],
        "kl": {"source": f"a test table for {path.name}", "damage": np.asarray(damage).tolist()}}))
    return str(path)


def test_a_calibration_file_plans_its_model_and_only_its_model(tiny_model, tmp_path):
    """`calibration=F`: the plan follows F's table (a table where one config costs nothing
    plans it in every layer; rewritten, the next plan follows the new table), the budget
    holds, the eval rows name F's table, and a cache of another shape is refused naming the
    argument and both shapes."""
    from experiments.eval.planner_view import plan_summary
    from models.sampler import prefill_and_compress
    cfg = tiny_model.config
    shape = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    free = ((0.25, 4, "channel"), (0.125, 8, "token"))  # the config that costs nothing
    path = tmp_path / "mine.json"
    ids = np.random.default_rng(5).integers(3, cfg.vocab_size, 300).tolist()
    for choice in free:
        damage = np.ones((cfg.num_layers, len(planner.CONFIGS)))
        damage[:, planner.CONFIGS.index(choice)] = 0.0
        spec = f"auto:budget=0.125,calibration={calibration_file(path, *shape, damage)}"
        if choice == free[0]:
            first = path.stat()
        else:  # rewritten at the same size and time stamp: only the contents tell
            os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))
            assert path.stat().st_size == first.st_size
        t = parse_method(spec)
        assert {(c.keep, c.bits, c.keys) for c in t.update.plan_for(*shape)} == {choice}
        summary = plan_summary(spec, tiny_model)
        assert summary["source"] == f"end-to-end table (a test table for {path.name})"
        pre = prefill_and_compress(tiny_model, [ids], transform=t)
        assert held_bytes(pre.cache) <= bf16_budget(tiny_model, 1, len(ids), 0.125)
    other = parse_method(f"auto:budget=0.125,calibration={path}")
    with pytest.raises(ValueError) as e:
        other.update.plan_for(cfg.num_layers + 1, *shape[1:])
    assert f"calibration={str(path)!r}" in str(e.value) and \
        f"{cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x head dim {cfg.head_dim}" in \
        str(e.value), str(e.value)
    with pytest.raises(ValueError, match="has no table for table=table"):
        parse_method(f"auto:budget=0.125,table=table,calibration={path}").update.plan_for(*shape)


def test_calibrating_another_model_measures_its_own_tables(tiny_model, tmp_path):
    """`calibrate_planner.calibration` on the tiny random model (one window of 64 + 16
    tokens): both tables are [layers, configs], finite and >= 0, and in every layer storing
    1/32 of the tokens as int2 codes damages more than keeping all at 8 bits; the file
    records the model's shape, `auto` plans with it, and extending it with a model of
    another shape is refused."""
    import json
    from flax import nnx
    from experiments.eval.calibrate_planner import calibration
    from models.llama import Llama, LlamaConfig
    cfg = tiny_model.config
    ids = [np.random.default_rng(6).integers(3, cfg.vocab_size, 80).tolist()]
    out = calibration(tiny_model, ids, "kl", prefix=64, window=8, source="tiny")
    out = calibration(tiny_model, ids, "attention", prefix=64, window=8, source="tiny",
                      existing=out)
    assert out["shape"] == {"layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads,
                            "head_dim": cfg.head_dim}
    best, worst = (planner.CONFIGS.index((k, b, "token")) for k, b in ((1.0, 8), (0.03125, 2)))
    for table in (np.asarray(out["kl"]["damage"]), np.asarray(out["damage"])):
        assert table.shape == (cfg.num_layers, len(planner.CONFIGS))
        assert np.isfinite(table).all() and (table >= 0).all()
        assert (table[:, worst] > table[:, best]).all(), table[:, [best, worst]]
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(out))
    t = parse_method(f"auto:budget=0.25,calibration={path}")
    assert t.update.source(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == \
        "end-to-end table (tiny)"
    wider = Llama(LlamaConfig.tiny(num_kv_heads=4, num_heads=4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tables of a model of shape"):
        calibration(wider, ids, "kl", prefix=64, window=8, existing=out)
    with pytest.raises(ValueError, match="positions"):
        calibration(tiny_model, [ids[0] * 8], "kl", prefix=64, window=8)
    with pytest.raises(ValueError, match="target must be 'kl' or 'attention', got 'mse'"):
        calibration(tiny_model, ids, "mse", prefix=64, window=8)


def test_bytes_below_the_fixed_overhead_is_an_error(tiny_model):
    from models.sampler import prefill_and_compress
    with pytest.raises(ValueError, match="bytes=3 is below"):
        prefill_and_compress(tiny_model, [list(range(3, 40))],
                             transform=parse_method("auto:bytes=3"))


# ----------------------------------------------------------------------------- the budget holds


@pytest.mark.parametrize("fraction", [0.5, 0.125, 1 / 16])
def test_budget_holds_from_one_token_to_thousands(long_tiny, fraction):
    from models.sampler import prefill_and_compress
    t = parse_method(f"auto:budget={fraction}")
    rng = np.random.default_rng(0)
    for n in (1, 5, 97, 700, 2500):
        ids = rng.integers(3, 256, n).tolist()
        pre = prefill_and_compress(long_tiny, [ids], transform=t, chunk=256)
        held, budget = held_bytes(pre.cache), bf16_budget(long_tiny, 1, n, fraction)
        assert held <= budget, (n, held, budget)
        if n >= 700:  # a long prompt uses its budget: what is left is less than a slot a layer
            assert held >= budget - unused(t, long_tiny), (n, held, budget)


def test_budget_holds_at_8k_tokens_beside_a_short_row(long_tiny):
    """The longest prompts the budget is promised for: 8,192 tokens at 1/8 of bf16, batched
    with a 40-token row. A batch is one dense cache, so it holds at most the budget of two
    8k rows and uses it (less than a slot a layer and row left); the short row keeps only
    its own tokens."""
    from models.sampler import prefill_and_compress
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (8192, 40)]
    t = parse_method("auto:budget=0.125")
    pre = prefill_and_compress(long_tiny, prompts, transform=t, chunk=512)
    held, budget = held_bytes(pre.cache), bf16_budget(long_tiny, 2, 8192, 0.125)
    assert budget - unused(t, long_tiny, 2) <= held <= budget, (held, budget)
    pos = np.asarray(pre.cache[0].pos)  # [B, KVH, slots]
    assert (pos[1] != kvjax.EMPTY).sum() <= 40 * long_tiny.config.num_kv_heads


def test_bytes_budget_holds_and_is_used(long_tiny):
    from models.sampler import prefill_and_compress
    ids = np.random.default_rng(1).integers(3, 256, 900).tolist()
    for n_bytes in (20_000, 60_000):
        t = parse_method(f"auto:bytes={n_bytes}")
        pre = prefill_and_compress(long_tiny, [ids], transform=t, chunk=256)
        held = held_bytes(pre.cache)
        assert n_bytes - unused(t, long_tiny) <= held <= n_bytes


def test_budget_holds_for_a_batch_of_mixed_lengths(long_tiny):
    from models.sampler import prefill_and_compress
    rng = np.random.default_rng(2)
    lengths = (3, 260, 1100)
    prompts = [rng.integers(3, 256, n).tolist() for n in lengths]
    pre = prefill_and_compress(long_tiny, prompts, transform=parse_method("auto:budget=0.125"),
                               chunk=256)
    held = held_bytes(pre.cache)
    assert held <= bf16_budget(long_tiny, len(lengths), max(lengths), 0.125)
    # the short rows keep only their own tokens
    pos = np.asarray(pre.cache[0].pos)  # [B, KVH, slots] pooled
    assert (pos[0] != kvjax.EMPTY).sum() <= 3 * long_tiny.config.num_kv_heads


@pytest.mark.parametrize("keys", ["token", "channel"])
def test_budget_holds_with_compress_every(long_tiny, keys):
    """Decoding with re-planning every 4 steps: the last re-plan's budget is that of the
    context then, and the cache holds at most it plus the tokens decoded since (< 4)."""
    from models.sampler import generate
    ids = np.random.default_rng(3).integers(3, 256, 300).tolist()
    t = parse_method(f"auto:budget=0.25,keys={keys}")
    assert {c.keys for c in t.update.plan(
        [kvjax.init_cache(1, 2, 1, 16)] * long_tiny.config.num_layers)} == {keys}
    for steps in (8, 16):  # ends right after a re-plan (step % 4 == 0)
        out = generate(long_tiny, [ids], max_new_tokens=steps, transform=t, compress_every=4,
                       eos_ids=())
        n = len(ids) + steps
        state = out.transform_state
        assert float(state.budget_bytes) <= bf16_budget(long_tiny, 1, n, 0.25)
        assert held_bytes(out.cache) <= float(state.budget_bytes) + \
            4 * _bytes_per_new_token(t, out.cache)


def _bytes_per_new_token(t, cache) -> int:
    """A decoded token takes one slot per KV head in every layer: coded, or exact in a
    per-channel layer until its group fills."""
    c = cache[0]
    slot = lambda choice: planner.exact_slot_bytes(1, c.kv_heads, c.head_dim, "float32") \
        if choice.keys == "channel" else \
        planner.layer_bytes(1, c.kv_heads, c.head_dim, "float32", choice.bits)[1]
    return sum(c.kv_heads * slot(choice) for choice in t.update.plan(cache))


def test_per_channel_layers_code_whole_groups_per_head(long_tiny):
    """`keys=channel`: every layer holds KIVI keys (per channel) and per-token values; each
    head keeps the same count: whole groups of tokens coded for the longest row, plus what
    the bytes of a group left buy as exact tokens (fewer than a group); a shorter row within
    them; the budget holds from one token."""
    from kvjax.core.cache import ResidualCache
    from kvjax.core.stores import PackedChannels, PackedTokens
    from models.sampler import prefill_and_compress
    t = parse_method("auto:budget=0.125,keys=channel")
    group = np.gcd(32, long_tiny.config.head_dim)
    rng = np.random.default_rng(5)
    for lengths in ((1,), (40,), (1100,), (1100, 333)):
        prompts = [rng.integers(3, 256, n).tolist() for n in lengths]
        pre = prefill_and_compress(long_tiny, prompts, transform=t, chunk=256)
        budget = bf16_budget(long_tiny, len(lengths), max(lengths), 0.125)
        assert held_bytes(pre.cache) <= budget, (lengths, held_bytes(pre.cache), budget)
        for layer in pre.cache:
            assert isinstance(layer, ResidualCache)
            assert isinstance(layer.body.k, PackedChannels)
            assert isinstance(layer.body.v, PackedTokens)
            kept = np.asarray(layer.pos != kvjax.EMPTY).sum(-1)  # [B, KVH]
            assert (kept == kept[:, :1]).all()  # the same count per head
            if max(lengths) >= 1100:
                coded = np.asarray(layer.body.pos != kvjax.EMPTY).sum(-1)[0, 0]
                assert coded > 0 and coded % group == 0, coded
                assert 0 <= kept[0, 0] - coded < group
                assert layer.body.k.group == group
        if len(lengths) == 2:  # the short row keeps at most its own tokens and fits
            assert (kept[1] <= kept[0]).all()


def test_channel_keep_adds_exact_tokens_to_a_coded_body():
    """A layer coded before (a re-plan): its coded tokens all stay; of its exact tokens the
    best stay while the bytes last (`ratio` of a coded slot each)."""
    group, d = 16, 16
    layer = kvjax.init_cache(1, 1, 64, d)
    x = jax.random.normal(jax.random.key(0), (1, 1, 40, d))
    layer = kvjax.write(layer, x, x, jnp.arange(40)[None])
    coded = planner._encode(layer, 4, "channel")  # 32 coded, 8 exact
    assert int(coded.body.length) == 32 and int(coded.recent.length) == 8
    seen = kvjax.view(coded)
    valid = seen.pos != kvjax.EMPTY
    scores = jnp.where(valid, seen.pos.astype(jnp.float32), 0.0)  # later scores higher
    in_body = valid & (jnp.arange(valid.shape[-1]) < coded.body.capacity)
    keep = planner.channel_keep(scores, valid, jnp.int32(36), 0.5, group, in_body)
    body = np.asarray(keep[0, 0, :coded.body.capacity])
    recent = np.asarray(keep[0, 0, coded.body.capacity:])
    assert body.sum() == 32  # every coded token stays
    assert recent.sum() == 2  # (36 - 32) x 0.5 exact
    kept_pos = np.asarray(seen.pos[0, 0, coded.body.capacity:])[recent]
    assert sorted(kept_pos.tolist()) == [38, 39]  # the best of the exact ones


def test_score_choice_and_its_statistics():
    assert planner.auto(budget=0.25, score="attention").stats == StatsSpec(window=32)
    default = planner.auto(budget=0.25)
    assert default.update.score == "mixed" and default.stats.query_moments
    assert planner.auto(budget=0.25, score="expected_attention").stats == default.stats
    with pytest.raises(ValueError, match="score='h2o'"):
        planner.auto(budget=0.25, score="h2o")


def test_mixed_scores_are_the_mean_of_expected_and_window_attention(tiny_model):
    """`score="mixed"` ranks a head's tokens by the mean of its expected-attention and its
    window-attention distributions, each normalised to sum to 1 over the head's tokens."""
    from kvjax.core.cache import view
    from models.sampler import prefill_batch
    ids = np.random.default_rng(7).integers(3, 256, 96).tolist()
    stats_spec = planner.auto(budget=0.25).stats
    pre = prefill_batch(tiny_model, [ids], stats=stats_spec)
    layer, stats = view(pre.cache[1]), pre.stats[1]
    signal = {s: planner.head_signals(layer, stats, 32, s)[0] for s in planner.SCORES}
    valid = np.asarray(layer.pos != kvjax.EMPTY)
    for p in signal.values():  # [B, KVH, C]: a distribution per head over its written slots
        np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-5)
        assert not np.asarray(p)[~valid].any()
    expected = 0.5 * (np.asarray(signal["expected_attention"]) + np.asarray(signal["attention"]))
    np.testing.assert_allclose(signal["mixed"], expected, rtol=1e-6, atol=1e-9)
    assert not np.allclose(signal["expected_attention"], signal["attention"], atol=1e-3)


def test_repeated_updates_track_a_growing_context():
    """Pure kvjax: write, re-plan, write more, re-plan: each time `nbytes` <= the budget of
    all tokens seen, and the kept tokens grow with the context."""
    layers, kvh, d, heads = 3, 2, 16, 4
    spec = kvjax.CacheSpec(layers, kvh, d)
    cache = kvjax.init_model_cache(spec, batch=1, capacity=512)
    t = planner.auto(budget=0.2, window=8, score="attention")
    state = t.init(cache)
    key = jax.random.key(0)
    seen, kept_before = 0, 0
    for chunk in (100, 60, 60, 100):
        key, k1, k2 = jax.random.split(key, 3)
        k, v = jax.random.normal(k1, (2, 1, kvh, chunk, d))
        pos = jnp.arange(seen, seen + chunk)[None]
        cache = tuple(kvjax.write(layer, k, v, pos) for layer in cache)
        seen += chunk
        stats = tuple(_stats(jax.random.fold_in(k2, i), heads, d, seen, 8) for i in range(layers))
        cache, state = jax.jit(t.update)(cache, state, stats)
        held = held_bytes(cache)
        assert held <= 0.2 * planner.bf16_full_bytes(layers, 1, kvh, d, seen)
        kept = int(np.asarray(state.head_kept).sum())
        assert kept > kept_before
        kept_before = kept


def window_stats(queries, query_pos) -> LayerStats:
    """One layer's statistics holding only the observed queries [B, W, H, D] (built by
    `init_stats`, so fields added to `LayerStats` later stay empty)."""
    b, w, h, d = queries.shape
    layer = kvjax.init_cache(b, 1, 1, d)
    empty = init_stats(StatsSpec(window=w), (layer,), h, np.ones(d // 2, np.float32))[0]
    return empty._replace(queries=jnp.asarray(queries), query_pos=jnp.asarray(query_pos))


def _stats(key, heads, d, seen, window) -> LayerStats:
    q = jax.random.normal(key, (1, window, heads, d))
    return window_stats(q, jnp.arange(seen - window, seen)[None])


# ----------------------------------------------------------------------------- decisions


def test_a_concentrated_head_keeps_fewer_tokens_than_a_diffuse_one():
    """Head 0's window queries point at 3 keys; head 1's keys are all alike (diffuse
    attention). The planner gives head 0 fewer of the layer's slots and a lower entropy."""
    c, d, w = 64, 16, 8
    rng = np.random.default_rng(0)
    keys = np.zeros((2, c, d), np.float32)  # [KVH, C, D]
    keys[0] = rng.normal(size=(c, d)) * 0.1
    q = np.zeros((1, w, 2, d), np.float32)  # one query head per KV head
    for hot in (5, 17, 40):
        keys[0, hot] = 0
        keys[0, hot, 0] = 4.0
    q[0, :, 0, 0] = 4.0  # head 0 attends to its 3 hot keys
    keys[1] = 0.01 * rng.normal(size=(c, d))  # head 1: nearly equal logits
    q[0, :, 1] = 1.0
    layer = kvjax.init_cache(1, 2, c, d)
    layer = kvjax.write(layer, jnp.asarray(keys)[None], jnp.asarray(keys)[None],
                        jnp.arange(c)[None])
    stats = (window_stats(q, jnp.arange(c - w, c)[None]),)
    t = planner.auto(budget=0.3, window=w, sinks=0, recent=0, alpha=0.0, keys="token",
                     score="attention")
    cache, state = t.update((layer,), t.init((layer,)), stats)
    kept = np.asarray(state.head_kept)[0, 0]
    entropy = np.asarray(state.head_entropy)[0, 0]
    assert kept[0] < kept[1], kept
    assert kept[0] >= 3  # the hot keys stay
    hot_kept = set(np.asarray(kvjax.view(cache[0]).pos)[0, 0].tolist())
    assert {5, 17, 40} <= hot_kept
    assert entropy[0] < entropy[1]
    # the same update with the heads' signals swapped swaps the split
    swapped = (jax.tree.map(lambda x: x, layer).replace(
        k=layer.k[::-1], v=layer.v[::-1]),)
    stats_swapped = (stats[0]._replace(queries=stats[0].queries[:, :, ::-1]),)
    _, state2 = t.update(swapped, t.init(swapped), stats_swapped)
    assert np.asarray(state2.head_kept)[0, 0].tolist() == kept[::-1].tolist()


def test_knapsack_gives_a_sensitive_layer_more_bytes_and_beats_uniform():
    """Against brute force on a small instance: the plan fits, is never worse than the best
    config used in every layer, and the layer with the larger damage gets more bytes."""
    cost = np.array([1.0, 2.0, 3.0, 5.0])
    damage = np.array([[4.0, 2.0, 1.0, 0.5],   # a sensitive layer
                       [1.0, 0.5, 0.3, 0.2],
                       [1.0, 0.5, 0.3, 0.2]])
    for capacity in (3.0, 5.0, 7.0, 9.0, 15.0):
        pick = planner.knapsack(damage, cost, capacity)
        total = sum(cost[p] for p in pick)
        assert total <= capacity
        got = sum(damage[i, p] for i, p in enumerate(pick))
        uniform = [damage[:, j].sum() for j in range(4) if 3 * cost[j] <= capacity]
        assert got <= min(uniform) + 1e-9
        best = min(sum(damage[i, p] for i, p in enumerate(ps))
                   for ps in itertools.product(range(4), repeat=3)
                   if sum(cost[p] for p in ps) <= capacity)
        assert got <= best + 1.0  # within one hull step of the optimum
        if capacity < 15:
            assert cost[pick[0]] >= cost[pick[1]]


def test_static_plan_spends_more_bits_or_tokens_with_more_budget():
    small = planner.static_plan(0.0625, 30, 3, 64, "prior")
    large = planner.static_plan(0.5, 30, 3, 64, "prior")
    slot = lambda c: planner.layer_bytes(1, 3, 64, "float32", c.bits, c.keys)[1]
    spend = lambda plan: sum(c.keep * slot(c) for c in plan)
    assert spend(large) > 2 * spend(small)
    for plan, f in ((small, 0.0625), (large, 0.5)):
        assert spend(plan) <= f * 30 * 260 + 1e-6


def test_one_compiled_update_per_budget_and_shape(tiny_model):
    """The same spec parsed twice is one transform; two budgets are two updates."""
    a, b = parse_method("auto:budget=0.25"), parse_method("auto:budget=0.25")
    assert a is b
    assert parse_method("auto:budget=0.125").update != a.update
    assert planner.auto(budget=0.25).update == a.update


def prefix_and_probe(model, seed: int, room: int = 0):
    """(layer 1 of a 160-token prefill cut to its first 144 positions, statistics of 32
    queries for the selection, the 16 queries after them [B, 16, H, D] and their positions):
    what the calibration measures with, on a random prompt."""
    from models.sampler import prefill_batch
    ids = np.random.default_rng(seed).integers(3, 256, 160).tolist()
    pre = prefill_batch(model, [ids], stats=StatsSpec(window=48), room=room)
    layer, stats = pre.cache[1], pre.stats[1]
    prefix = layer.replace(pos=jnp.where(layer.pos >= 144, kvjax.EMPTY, layer.pos))
    select = stats._replace(queries=stats.queries[:, :32], query_pos=stats.query_pos[:, :32])
    return prefix, select, stats.queries[:, 32:], stats.query_pos[:, 32:]


def test_config_damage_ranks_codecs_and_keep_shares(tiny_model):
    """The calibration's measure on the tiny model: fewer bits or fewer tokens never do
    better than more (for the same queries), and keeping all at 8 bits is almost exact."""
    prefix, select, q, q_pos = prefix_and_probe(tiny_model, seed=4)
    err = {(k, b): float(planner.config_damage(prefix, select, q, q_pos, k, b, window=32))
           for k, b in [(1.0, 8), (1.0, 4), (1.0, 2), (0.5, 8), (0.125, 8)]}
    assert err[(1.0, 8)] < 1e-3
    assert err[(1.0, 8)] < err[(1.0, 4)] < err[(1.0, 2)]
    assert err[(1.0, 8)] < err[(0.5, 8)] < err[(0.125, 8)]


@pytest.mark.parametrize("keys", planner.KEYS)
def test_stored_in_place_attends_like_the_stored_layer(tiny_model, keys):
    """The dense stand-in the KL calibration runs: same shapes and cursor as the prefix, the
    stored layer's tokens at their own slots, and queries attend over it as over the layer
    `auto` stores (pooled for per-token keys, KIVI's coding for per-channel)."""
    from kvjax.core.attention import attend_reference
    prefix, select, q, q_pos = prefix_and_probe(tiny_model, seed=5, room=16)
    choice = planner.LayerChoice(0.5, 4, keys)
    stored = planner._stored(prefix, select, choice, 32, "attention")
    dense = planner.stored_in_place(prefix, select, 0.5, 4, keys, 32, "attention")
    assert jax.tree.map(jnp.shape, dense) == jax.tree.map(jnp.shape, prefix)
    assert int(dense.length) == int(prefix.length)
    kept = dense.pos != kvjax.EMPTY
    assert int(kept.sum()) == int((kvjax.view(stored).pos != kvjax.EMPTY).sum())
    slots = jnp.broadcast_to(jnp.arange(prefix.capacity), kept.shape)
    assert bool(jnp.all(jnp.where(kept, dense.pos == slots, True)))  # each at its own slot
    assert 0.4 < float(kept.mean()) * prefix.capacity / 144 < 0.6
    want = attend_reference(q, q_pos, stored)
    got = attend_reference(q, q_pos, dense)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(attend_reference(q, q_pos, prefix) - want))) > 1e-3


# ----------------------------------------------------------------------------- explanations


def test_plan_summary_and_picture_on_the_tiny_model(tiny_model, tmp_path):
    from experiments.eval.planner_view import draw_plan, kept_per_head, plan_summary
    from models.sampler import prefill_and_compress
    summary = plan_summary("auto:budget=0.25,table=prior", tiny_model)
    assert summary["source"].startswith("prior")
    assert len(summary["bits"]) == tiny_model.config.num_layers
    assert plan_summary("snapkv:ratio=0.5", tiny_model) is None
    ids = list(range(3, 203))
    pre = prefill_and_compress(tiny_model, [ids], transform=parse_method(
        "auto:budget=0.25,table=prior"))
    kept = kept_per_head(pre.cache)
    assert kept.shape == (tiny_model.config.num_layers, tiny_model.config.num_kv_heads)
    assert 0 < kept.sum() < len(ids) * kept.size
    draw_plan(summary, kept, len(ids), "test", tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_inspect_and_eval_rows_carry_the_plan_on_smollm2(smollm2, tmp_path, capsys):
    """The real model: `kvjax inspect --method auto:...` draws the plan and prints it; a ppl
    cell of `kvjax eval` records it with the row (from the shipped calibration)."""
    import json

    from experiments.cli.main import main
    from experiments.eval import cells
    from experiments.eval.grid import Cell
    out = tmp_path / "x.png"
    code = main(["inspect", "--context-file", "experiments/data/kjv_genesis_1-3.txt",
                 "--prompt", "Who made light?", "--max-tokens", "200",
                 "--method", "auto:budget=0.125", "--out", str(out), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plan = printed["plan"]
    assert len(plan["bits"]) == 30 and set(plan["bits"]) <= {2, 4, 8}
    assert np.asarray(plan["kept"]).shape == (30, 3)
    assert out.with_suffix(".plan.png").is_file()
    row = cells.run_ppl_cell(Cell("ppl", 64, "auto:budget=0.25", trials=2, batch=2))
    assert row["plan"]["source"] == planner.plan_source(30)
    assert len(row["plan"]["keep"]) == 30


def test_pareto_rows_count_dense_eviction_as_bf16_storage(tiny_model):
    """An eviction row's `bf16_bytes` (`Perplexity.cache_bf16_bytes`) equals `nbytes` of the
    same kept tokens in a bfloat16 cache, per-head or pooled head-wise alike; a codec row has
    none (its bytes are what it stores)."""
    from experiments.eval.planner_pareto import eviction_only, fraction
    from experiments.eval.ppl import full_bf16_bytes, perplexity
    c = tiny_model.config
    ids = np.arange(3, 3 + 48) % c.vocab_size
    for spec in ("knorm:ratio=0.5", "snapkv:ratio=0.5,headwise=true"):
        r = perplexity(tiny_model, ids, context=48, prefix=32, transform=parse_method(spec))
        assert eviction_only(spec), spec  # k, v halve; int32 positions and cursors do not
        assert r.cache_bytes / 2 < r.cache_bf16_bytes < r.cache_bytes, spec
        if spec.startswith("knorm"):  # per head: 16 of 32 tokens, exactly a bf16 cache's
            assert r.cache_bf16_bytes == full_bf16_bytes(tiny_model, 16)
        row = {"bf16_bytes": r.cache_bf16_bytes, "cache_bytes": r.cache_bytes,
               "full_bf16_bytes": r.full_bf16_bytes}
        assert fraction(row) == r.cache_bf16_bytes / full_bf16_bytes(tiny_model, 32)
    assert not eviction_only("knorm:ratio=0.5+kivi:bits=4")


def test_results_planner_table_is_the_report_of_its_rows():
    """docs/RESULTS.md's `auto` tables are `planner_pareto.summary`, `press_table` and
    `per_text_tables` of the committed rows, so a changed row, an edited cell or a bold `auto`
    that is not below its rival fails; every `auto` row stays within its budget; kvpress's
    rows equal kvjax's."""
    from pathlib import Path

    from experiments.eval.planner_pareto import (_rows, fraction, per_text_tables, press_table,
                                                 summary)
    root = Path(__file__).parents[1]
    rows = _rows(root / "docs/results/planner/rows.jsonl")
    theirs = _rows(root / "docs/results/planner/kvpress_rows.jsonl")
    results = (root / "docs/RESULTS.md").read_text()
    assert summary(rows) in results
    assert press_table(rows, theirs) in results
    assert per_text_tables(rows) in results
    cells = summary(rows).splitlines()[2:]  # the reading counts the bold `auto` cells
    wins = sum("| **" in line for line in cells)
    assert f"`auto` is below the best fixed method or chain with no more bytes in {wins} of " \
        f"{len(cells)} cells" in " ".join(results.split())
    ours = {(r["method"], r["text"]): r["ppl"] for r in rows}
    for r in theirs:  # kvpress's press on the same windows as kvjax's row: within 0.1%
        assert abs(ours[r["method"], r["text"]] / r["ppl"] - 1) < 1e-3, r
    for r in rows:
        if r["method"].startswith("auto:budget="):
            budget = float(r["method"].split(",")[0].split("=")[1])
            assert r["cache_bytes"] <= budget * r["full_bf16_bytes"], r["method"]
    assert fraction({"bf16_bytes": None, "cache_bytes": 1.0, "full_bf16_bytes": 4.0}) == 0.25
