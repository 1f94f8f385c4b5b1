"""Parity with kvpress 0.5.5 on SmolLM2: EntropyGatedChunkKVPress (`entropy_chunkkv`).

The golden (`experiments/golden/make_kvpress_zoo_third.py`, made by running
kvpress, never kvjax) holds, per inner press (SnapKV, Knorm: non-negative and
negative scores), text (640 and 300 tokens of The Devil's Dictionary) and
ratio (0.5, 0.75), the positions kvpress kept in every layer and KV head. kvjax
prefills the same ids once and applies the method from its spec string to a
copy of that cache. QFilterPress runs with the golden's own filters in place of the hub's
(`qfilter` with the same filters), LUKVPress with the golden's budget curve (`lukv` with the
same curve), KVComposePress after its own second pass (`kvcompose`), ExpectedAttentionStatsPress with
seeded query statistics (`expected_attention_stats` with the same), KVzapPress (linear and
MLP) with seeded surrogate weights (`kvzap` with the same, saved by orbax), FastKVzipPress with
seeded gates (`fastkvzip` with the same, saved by orbax); ChunkPress around key-only scorers
and around SnapKV and TOVA (each chunk's own last queries, `chunk_window`). RestoreKVPress has
no golden: it needs hub adapters kvpress cannot load here (docs/DECISIONS.md).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from tests.near_ties import knorm_scores_by_position, near_tie_swaps, scores_by_position
from tests.test_kvpress_parity import (compress_context, keep_by_position, prefill_contexts,
                                      reconstructed_contexts)
from tests.test_kvpress_zoo_parity import unpack

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "kvpress_zoo_third.npz")
STATS = kvjax.StatsSpec(window=1024)  # every query of both texts (SnapKV's last 64)

# golden press name -> kvjax spec at kvpress's defaults ({r}: the compression ratio)
SPECS = {
    "entropy_chunkkv_snapkv": "entropy_chunkkv:inner=snapkv,ratio={r}",
    "entropy_chunkkv_knorm": "entropy_chunkkv:inner=knorm,ratio={r}",
}
CHUNK = 10  # kvpress's default chunk_length


def _cases() -> list[str]:
    g = np.load(GOLDEN)
    return sorted(k[:-len("_keep")] for k in g.files
                  if k.endswith("_keep") and k.split("_", 1)[1].rsplit("_r", 1)[0] in SPECS)


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.fixture(scope="module")
def prefilled(smollm2, golden):
    """ctx -> (full cache, statistics, tokens) after prefilling the golden ids once."""
    return prefill_contexts(smollm2[0], golden, STATS)


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases())
def test_kept_positions_match_kvpress(prefilled, golden, case):
    """Exactly kvpress's kept positions in every layer and KV head (no ties to name), and
    the entropy gate really acts: some chunk is kept in part (ChunkKV keeps whole chunks)."""
    ctx, rest = case.split("_", 1)
    name, ratio = rest.rsplit("_r", 1)
    out, n = compress_context(prefilled, ctx, SPECS[name].format(r=float(ratio)))
    ours, theirs = keep_by_position(out, n), unpack(golden, f"{case}_keep", n)
    assert ours.sum(-1).tolist() == theirs.sum(-1).tolist()
    assert (ours.sum(-1) == max(1, int(n * (1 - float(ratio))))).all()
    np.testing.assert_array_equal(ours, theirs, err_msg=case)
    width = -(-n // CHUNK) * CHUNK
    per_chunk = np.pad(theirs, ((0, 0), (0, 0), (0, width - n))).reshape(
        theirs.shape[:2] + (-1, CHUNK)).sum(-1)
    assert ((per_chunk > 0) & (per_chunk < CHUNK)).any(), case


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.50", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
def test_qfilter_keeps_kvpress_positions_given_the_same_filters(prefilled, golden, ctx, ratio,
                                                                tmp_path):
    """QFilterPress with the golden's filters (kvpress's hub filters are out of reach) and
    `qfilter:filters=PATH` with the same filters keep the same positions in every layer and
    KV head (no ties to name)."""
    path = str(tmp_path / "filters.npz")
    np.savez(path, q_filters=golden["qfilter_filters"])
    out, n = compress_context(prefilled, ctx, f"qfilter:ratio={float(ratio)},filters={path}")
    ours, theirs = keep_by_position(out, n), unpack(golden, f"{ctx}_qfilter_r{ratio}_keep", n)
    assert (ours.sum(-1) == int(n * (1 - float(ratio)))).all()
    np.testing.assert_array_equal(ours, theirs)


@pytest.fixture(scope="module")
def lukv_curve(golden, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lukv") / "curve.npy")
    np.save(path, golden["lukv_curve"])
    return path


@pytest.fixture(scope="module")
def prefilled_lukv(smollm2, golden, lukv_curve):
    """As `prefilled`, collecting what LU-KV's inner ExpectedAttention needs."""
    return prefill_contexts(smollm2[0], golden,
                            kvjax.parse_method(f"lukv:ratio=0.5,curve={lukv_curve}").stats)


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.50", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
def test_lukv_keeps_kvpress_positions_given_the_same_curve(prefilled_lukv, golden, lukv_curve,
                                                           ctx, ratio):
    """LUKVPress (ExpectedAttention with epsilon 0.02, sink 4, window 1) with the golden's
    random budget curve and `lukv:curve=PATH` with the same curve: the same per-head counts
    (kvpress's rounding) and the same kept positions in every layer and KV head, but for swaps
    at near-ties (`tests/near_ties.py`: kvjax's scores of the swapped positions within 1e-4)."""
    from kvjax.core.layout import pool_heads
    from kvjax.policies.eviction_lukv import protected_scores
    spec = f"lukv:ratio={float(ratio)},curve={lukv_curve}"
    out, n = compress_context(prefilled_lukv, ctx, spec)
    ours, theirs = keep_by_position(out, n), unpack(golden, f"{ctx}_lukv_r{ratio}_keep", n)
    assert ours.sum(-1).tolist() == theirs.sum(-1).tolist()
    assert len(set(theirs.sum(-1).ravel().tolist())) > 10  # the counts differ by head
    cache, stats, _ = prefilled_lukv[ctx]
    update = kvjax.parse_method(spec).update
    scores = np.full(ours.shape, np.nan, np.float32)
    for layer in {int(i) for i in np.argwhere(ours != theirs)[:, 0]}:  # only where they differ
        seen = kvjax.view(pool_heads(cache[layer]))
        slot = protected_scores(update.scorer, seen, stats[layer], jnp.array([n]),
                                jax.random.key(0), update.sink, update.window)
        scores[layer] = scores_by_position(seen, slot, n)
    near_tie_swaps(ours, theirs, scores)


@pytest.fixture(scope="module")
def prefilled_kvcompose(smollm2, golden):
    """ctx -> (full cache, statistics with KVCompose's pass scores, tokens)."""
    return reconstructed_contexts(smollm2, golden, "kvcompose:ratio=0.5")


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.50", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
def test_kvcompose_keeps_kvpress_positions(prefilled_kvcompose, golden, ctx, ratio):
    """KVComposePress (structured): the same per-layer counts (every head of a layer alike)
    and the same kept positions in every layer and KV head."""
    out, n = compress_context(prefilled_kvcompose, ctx, f"kvcompose:ratio={float(ratio)}")
    ours, theirs = keep_by_position(out, n), unpack(golden, f"{ctx}_kvcompose_r{ratio}_keep", n)
    assert ours.sum(-1).tolist() == theirs.sum(-1).tolist()
    assert (theirs.sum(-1) == theirs.sum(-1)[:, :1]).all()  # structured: one count a layer
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.50", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
def test_expected_attention_stats_keeps_kvpress_positions_given_the_same_statistics(
        smollm2, golden, prefilled, ctx, ratio, tmp_path):
    """ExpectedAttentionStatsPress with the golden's query statistics (made again from their
    seed) and `expected_attention_stats:stats=PATH` with the same: the same kept positions in
    every layer and KV head."""
    from experiments.golden.make_kvpress_zoo_third import query_stats
    cfg = smollm2[0].config
    mean, cov = query_stats(cfg.num_layers, cfg.num_heads, cfg.head_dim)
    path = str(tmp_path / "stats.npz")
    np.savez(path, query_mean=mean, query_cov=cov)
    out, n = compress_context(prefilled, ctx,
                              f"expected_attention_stats:ratio={float(ratio)},stats={path}")
    ours = keep_by_position(out, n)
    theirs = unpack(golden, f"{ctx}_expected_attention_stats_r{ratio}_keep", n)
    np.testing.assert_array_equal(ours, theirs)


def test_entropy_chunk_rule_matches_kvpress_on_random_scores():
    """The rule alone (no model): kvpress's EntropyGatedChunkKVPress.compress around a press
    whose score is given, against `entropy_chunk_keep` jitted, on 60 random cases: partial
    last chunks, rows shorter than a chunk, signed and spiky scores, budgets below a chunk."""
    torch = pytest.importorskip("torch", reason="[optional] torch is in the `compare` extra, "
                                                "not installed")
    kvpress = pytest.importorskip("kvpress", reason="[optional] kvpress is in the `compare` "
                                                    "extra, not installed")
    import jax
    import jax.numpy as jnp
    from kvjax.policies.eviction_entropy_chunk import entropy_chunk_keep

    rule = jax.jit(entropy_chunk_keep, static_argnums=(3, 4))
    rng = np.random.default_rng(0)

    class Module:
        head_dim = 1

    for trial in range(60):
        t, heads = int(rng.integers(1, 90)), 3
        ratio = float(rng.choice([0.1, 0.25, 0.5, 0.75, 0.9]))
        chunk = int(rng.choice([2, 5, 10, 13]))
        low = int(rng.choice([1, chunk - 1]))  # few (chunk, low) pairs: few compiles
        s = rng.standard_normal((1, heads, t)).astype(np.float32)
        s = (s, np.abs(s) ** 3, np.exp(3 * s))[trial % 3]
        inner = kvpress.KnormPress(compression_ratio=ratio)
        inner.score = lambda *args, s=s, **kwargs: torch.from_numpy(s)
        press = kvpress.EntropyGatedChunkKVPress(press=inner, chunk_length=chunk,
                                                 low_entropy_chunk_length=low)
        keys = torch.arange(t, dtype=torch.float32).view(1, 1, t, 1).expand(1, heads, t, 1)
        kept, _ = press.compress(Module(), None, keys, keys, None, {})
        theirs = np.zeros(t, bool)
        theirs[kept[0, 0, :, 0].numpy().astype(int)] = True
        scores = np.zeros((1, 96), np.float32)  # empty slots past the row's tokens
        scores[0, :t] = s.sum(1)[0]
        budget = jnp.array([max(1, int(t * (1 - ratio)))])
        ours = np.asarray(rule(jnp.asarray(scores), jnp.array([t]), budget, chunk, low))[0]
        assert not ours[t:].any()
        np.testing.assert_array_equal(ours[:t], theirs, err_msg=f"trial {trial}")


@pytest.fixture(scope="module")
def kvzap_dirs(smollm2, tmp_path_factory):
    """kind -> the orbax directory of the golden's surrogate (made again from its seed)."""
    from experiments.golden.make_kvpress_zoo_third import kvzap_weights
    from kvjax.policies.eviction_kvzap import KVzapModel
    cfg = smollm2[0].config
    out = {}
    for kind in ("linear", "mlp"):
        path = tmp_path_factory.mktemp("kvzap") / kind
        KVzapModel(**kvzap_weights(kind, cfg.num_layers, cfg.hidden_size,
                                   cfg.num_kv_heads)).save(path)
        out[kind] = str(path)
    return out


@pytest.fixture(scope="module")
def prefilled_kvzap(smollm2, golden, kvzap_dirs):
    """kind -> ctx -> (full cache, statistics with the surrogate's scores, tokens)."""
    return {kind: prefill_contexts(smollm2[0], golden, kvjax.parse_method(
        f"kvzap:ratio=0.5,weights={path}").stats) for kind, path in kvzap_dirs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.50", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_kvzap_keeps_kvpress_positions_given_the_same_weights(prefilled_kvzap, golden,
                                                              kvzap_dirs, kind, ctx, ratio):
    """KVzapPress(model_type=kind) with the golden's surrogate (NVIDIA's are published for a
    few large models only) and `kvzap:weights=DIR` with the same weights saved by orbax: the
    same per-head counts (ScorerPress's `int(n (1 - r))`) and kept positions in every layer
    and KV head, but among exact ties at the budget's edge. Those exist in layer 0 only: its
    attention input is the normed embedding of the token alone, so a repeated token scores
    the same wherever it stands, and torch's `topk` keeps a different one of them than kvjax
    (the earlier slot); there the kept count among the tied positions must agree."""
    out, n = compress_context(prefilled_kvzap[kind], ctx,
                              f"kvzap:ratio={float(ratio)},weights={kvzap_dirs[kind]}")
    ours = keep_by_position(out, n)
    theirs = unpack(golden, f"{ctx}_kvzap_{kind}_r{ratio}_keep", n)
    assert (theirs.sum(-1) == int(n * (1 - float(ratio)))).all()
    _, stats, _ = prefilled_kvzap[kind][ctx]
    for layer, s in enumerate(stats):
        scores = np.asarray(s.position_scores)[0, :, :n]  # [KVH, n]: kvjax's own scores
        for h in range(scores.shape[0]):
            differ = ours[layer, h] != theirs[layer, h]
            if not differ.any():
                continue
            edge = scores[h][ours[layer, h]].min()  # the lowest kept score
            tied = scores[h] == edge
            assert layer == 0 and tied[differ].all(), (layer, h, np.flatnonzero(differ))
            assert ours[layer, h][tied].sum() == theirs[layer, h][tied].sum()


@pytest.mark.slow
@pytest.mark.parametrize("threshold", ["-0.5", "0.5"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_kvzap_threshold_keeps_what_dmspress_keeps(prefilled_kvzap, golden, kvzap_dirs, kind,
                                                   ctx, threshold):
    """DMSPress(KVzapPress(model_type=kind), threshold=t) (its 128-token window, prefill) and
    `kvzap:threshold=t,weights=DIR`: the same kept positions in every layer and KV head (the
    complement of what DMSPress masks), counts that differ by head."""
    out, n = compress_context(prefilled_kvzap[kind], ctx,
                              f"kvzap:threshold={float(threshold)},weights={kvzap_dirs[kind]}")
    ours = keep_by_position(out, n)
    theirs = unpack(golden, f"{ctx}_kvzap_dms_{kind}_r{threshold}_keep", n)
    assert len(set(theirs.sum(-1).ravel().tolist())) > 3  # the counts follow the scores
    np.testing.assert_array_equal(ours, theirs)


@pytest.fixture(scope="module")
def prefilled_snapkv(smollm2, golden):
    """As `prefilled`, with SnapKV's window of queries (its default 64)."""
    return prefill_contexts(smollm2[0], golden, kvjax.parse_method("snapkv:ratio=0.5").stats)


@pytest.mark.slow
@pytest.mark.parametrize("inner, threshold", [("knorm", "-17.8"), ("knorm", "-14.1"),
                                              ("snapkv", "3e-05"), ("snapkv", "0.0003")])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
def test_dms_keeps_what_dmspress_keeps(prefilled, prefilled_snapkv, golden, inner, threshold,
                                       ctx):
    """DMSPress(press=KnormPress() / SnapKVPress(), threshold=t) (its 128-token window,
    prefill) and `dms:inner=...,threshold=t`: the same kept positions in every layer and KV
    head -- the inner scores' raw values are kvpress's, not only their order."""
    out, n = compress_context(prefilled_snapkv if inner == "snapkv" else prefilled, ctx,
                              f"dms:inner={inner},threshold={float(threshold)}")
    ours = keep_by_position(out, n)
    theirs = unpack(golden, f"{ctx}_dms_{inner}_r{threshold}_keep", n)
    assert len(set(theirs.sum(-1).ravel().tolist())) > 3  # the counts follow the scores
    np.testing.assert_array_equal(ours, theirs)


@pytest.fixture(scope="module")
def fastkvzip_dir(smollm2, tmp_path_factory):
    """The orbax directory of the golden's gates (made again from its seed)."""
    from experiments.golden.make_kvpress_zoo_third import fastkvzip_gates
    cfg = smollm2[0].config
    path = tmp_path_factory.mktemp("fastkvzip") / "gates"
    fastkvzip_gates(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads,
                    cfg.num_heads // cfg.num_kv_heads).save(path)
    return str(path)


@pytest.fixture(scope="module")
def prefilled_fastkvzip(smollm2, golden, fastkvzip_dir):
    """ctx -> (full cache, statistics with the gates' scores, tokens)."""
    return prefill_contexts(smollm2[0], golden, kvjax.parse_method(
        f"fastkvzip:ratio=0.5,gates={fastkvzip_dir}").stats)


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.50", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
def test_fastkvzip_keeps_kvpress_positions_given_the_same_gates(prefilled_fastkvzip, golden,
                                                               fastkvzip_dir, ctx, ratio):
    """FastKVzipPress(compression_ratio=r) with the golden's gates (the paper's are published
    for a few large models only) and `fastkvzip:gates=DIR` with the same gates saved by orbax:
    the same `floor(L * KVH * T * r)` tokens evicted over all layers and KV heads, and the
    same kept positions in every layer and KV head (counts that differ by layer and head), but
    among exact ties at the budget's edge (layer 0's gates read the normed embedding alone,
    so a repeated token scores the same wherever it stands); there the kept count among the
    tied positions must agree."""
    from kvjax.policies.eviction_fastkvzip import protect_window
    out, n = compress_context(prefilled_fastkvzip, ctx,
                              f"fastkvzip:ratio={float(ratio)},gates={fastkvzip_dir}")
    ours = keep_by_position(out, n)
    theirs = unpack(golden, f"{ctx}_fastkvzip_r{ratio}_keep", n)
    layers, kvh = ours.shape[:2]
    evicted = int(layers * kvh * n * float(ratio))
    assert (~theirs).sum() == (~ours).sum() == evicted
    assert len(set(theirs.sum(-1).ravel().tolist())) > 10  # budgets differ by layer and head
    differ = ours != theirs
    if differ.any():
        _, stats, _ = prefilled_fastkvzip[ctx]
        pos = np.broadcast_to(np.arange(n), (layers, 1, kvh, n))
        scores = np.asarray(protect_window(
            np.stack([np.asarray(s.position_scores)[:, :, :n] for s in stats]), pos, 4096,
            0.02))[:, 0]  # [L, KVH, n], kvjax's own
        scores[:, :, :4] = np.inf  # the sinks
        edge = scores[ours].min()
        tied = scores == edge
        assert tied[differ].all(), np.argwhere(differ & ~tied)[:5]
        assert ours[tied].sum() == theirs[tied].sum()


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.30", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
@pytest.mark.parametrize("inner", ["knorm", "keydiff"])
def test_chunk_keeps_kvpress_positions(prefilled, golden, inner, ctx, ratio):
    """ChunkPress(press=Inner(r), chunk_length=128) and `chunk:inner=...,chunk_length=128`:
    the same kept positions in every layer and KV head, each chunk keeping its own
    `max(1, int(n_c (1 - r)))` (KeyDiff's anchor is the chunk's own mean key), but for Knorm's
    swaps at near-ties within a chunk (`tests/near_ties.py`: key norms within 1e-4; a repeated
    token's keys in layer 0 are its embedding alone, rotated, and equal to float32 rounding)."""
    chunk_length = 128
    out, n = compress_context(prefilled, ctx, f"chunk:inner={inner},ratio={float(ratio)},"
                                              f"chunk_length={chunk_length}")
    ours = keep_by_position(out, n)
    theirs = unpack(golden, f"{ctx}_chunk_{inner}_r{ratio}_keep", n)
    sizes = [min(chunk_length, n - s) for s in range(0, n, chunk_length)]
    per_chunk = [max(1, int(size * (1 - float(ratio)))) for size in sizes]
    assert (theirs.sum(-1) == sum(per_chunk)).all()
    for c, want in enumerate(per_chunk):  # every chunk keeps its own share
        assert (theirs[:, :, c * chunk_length:(c + 1) * chunk_length].sum(-1) == want).all()
    if inner == "keydiff":
        np.testing.assert_array_equal(ours, theirs)
        return
    scores = np.stack([knorm_scores_by_position(layer, n) for layer in prefilled[ctx][0]])
    near_tie_swaps(ours, theirs, scores, chunk=chunk_length)


@pytest.fixture(scope="module")
def prefilled_chunk_windows(smollm2, golden):
    """ctx -> the full cache and statistics with every 160-token chunk's last 64 queries."""
    return prefill_contexts(smollm2[0], golden, kvjax.StatsSpec(window=64, chunk_length=160))


@pytest.mark.slow
@pytest.mark.parametrize("ratio", ["0.30", "0.75"])
@pytest.mark.parametrize("ctx", ["ctx1", "ctx2"])
@pytest.mark.parametrize("inner", ["snapkv", "tova"])
def test_chunk_around_window_scorers_keeps_kvpress_positions(prefilled_chunk_windows, golden,
                                                             inner, ctx, ratio):
    """ChunkPress(press=SnapKV(r) | TOVA(r), chunk_length=160) and
    `chunk:inner=...,chunk_length=160`: each chunk scored by its own last queries (kvpress
    recomputes them from the chunk's hidden states and rotates them at the prompt's last
    positions; kvjax keeps every chunk's window as the model runs and turns it by as many
    positions): the same kept positions in every layer and KV head, on four whole chunks
    (640 tokens) and on a whole chunk plus a partial one (300). But for a tie: where a chunk
    keeps fewer than SnapKV's 64-query window (at r = 0.75, 40 of 160 and 35 of 140), every
    kept token is a window token, all scored alike (the window's protected maximum), and
    kvpress's `topk` picks among equal scores in an order of its own; there both engines keep
    that many of the chunk's last 64 positions and nothing else."""
    chunk_length, window = 160, 64 if inner == "snapkv" else 1
    out, n = compress_context(prefilled_chunk_windows, ctx,
                              f"chunk:inner={inner},ratio={float(ratio)},"
                              f"chunk_length={chunk_length}")
    ours = keep_by_position(out, n)
    theirs = unpack(golden, f"{ctx}_chunk_{inner}_r{ratio}_keep", n)
    tied = 0
    for lo in range(0, n, chunk_length):
        hi = min(lo + chunk_length, n)
        kept = max(1, int((hi - lo) * (1 - float(ratio))))
        if kept >= window:
            np.testing.assert_array_equal(ours[..., lo:hi], theirs[..., lo:hi], err_msg=f"{lo}")
            continue
        tied += 1
        for keep in (ours, theirs):
            assert (keep[..., lo:hi].sum(-1) == kept).all()
            assert not keep[..., lo:hi - window].any()
    assert tied == (len(range(0, n, chunk_length)) if inner == "snapkv" and ratio == "0.75"
                    else 0)
