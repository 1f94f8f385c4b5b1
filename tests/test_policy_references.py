"""H2O, sliding window and random eviction against references written from their definitions.

kvpress has no H2O to compare with under sdpa (its ObservedAttentionPress needs eager
attention, `docs/DECISIONS.md`), so H2O is checked against a plain-numpy implementation of
the rule of the H2O paper (Zhang et al. 2023, "Heavy-Hitter Oracle"), written from the paper
and kvjax's documentation, not from kvjax's code:

* every cached token accumulates the attention it receives, summed over the queries that saw
  it (prefill and every decode step) and, with GQA, over the query heads of its KV head
  (`docs/DECISIONS.md`, "GQA aggregation");
* a KV head keeps its `recent` latest tokens plus its `heavy = budget - recent` tokens of
  largest accumulated attention among the rest; ties go to the earlier token (kvjax's
  documented `keep_top_k` rule; compaction keeps slot order, so earlier slot = earlier
  position);
* with a ratio, `budget = max(1, floor(n * (1 - ratio)))` of the `n` prompt tokens and
  `recent = floor(budget * recent_fraction)`; the budget is fixed at the first eviction and
  every later eviction (one per decode step, as in the paper) brings the cache back to it.

The numpy model is a float64 re-implementation of the tiny Llama (RMSNorm, rotate-half RoPE,
GQA causal softmax attention, SwiGLU) that evicts as it goes, so later tokens see only the
kept cache, as in kvjax. Its logits are first checked against kvjax's on the uncompressed
model. Kept positions must then be equal per layer, KV head and sequence, exactly. Float32
(kvjax) against float64 (numpy) could only swap two tokens whose accumulated attention ties
within float32 rounding; each comparison asserts that no such near-tie sits at the boundary,
so the exact equality is meaningful and not luck.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import EMPTY
from models.export import params_dict
from models.llama import LlamaConfig
from models.sampler import compress, extend, prefill_and_compress, prefill_batch

# Relative gap below which two accumulated masses count as tied at float32 accuracy: the mass
# is a sum of <= T * G softmax probabilities, each with relative error ~1e-6 (float32 matmuls
# and exp at the model's "highest" precision), so 1e-4 of the boundary value is far above it.
NEAR_TIE = 1e-4


# ----------------------------------------------------------------------------- numpy reference


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """x [T, N, D] rotated by positions pos [T]: pairs (i, i + D/2), angle pos * theta^(-2i/D)."""
    d = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, d, 2) / d)  # [T, D/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class NumpyH2O:
    """One sequence through a float64 numpy Llama whose cache follows the H2O rule.

    Per layer and KV head the cache is a list of tokens (key, value, position, accumulated
    attention). `feed` runs tokens through the model (attending to the kept cache),
    `evict(budget, recent)` applies the paper's rule.
    """

    def __init__(self, cfg: LlamaConfig, params: dict):
        self.cfg, self.p = cfg, {k: np.asarray(v, np.float64) for k, v in params.items()}
        kvh, d = cfg.num_kv_heads, cfg.head_dim
        self.k = [[np.zeros((0, d)) for _ in range(kvh)] for _ in range(cfg.num_layers)]
        self.v = [[np.zeros((0, d)) for _ in range(kvh)] for _ in range(cfg.num_layers)]
        self.pos = [[np.zeros(0, np.int64) for _ in range(kvh)] for _ in range(cfg.num_layers)]
        self.mass = [[np.zeros(0) for _ in range(kvh)] for _ in range(cfg.num_layers)]
        self.margins: list[float] = []  # relative boundary gaps of every heavy-hitter choice

    def feed(self, tokens: list[int], start: int) -> np.ndarray:
        """Tokens at positions start, start+1, ... -> logits [T, V]."""
        cfg, p = self.cfg, self.p
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = h // kvh
        t = len(tokens)
        pos = np.arange(start, start + t)
        x = p["embed"][np.asarray(tokens)]  # [T, hidden]
        for i in range(cfg.num_layers):
            w = lambda name: p[f"layers/{i}/{name}"]
            a = rms_norm(x, w("input_norm/weight"), cfg.rms_norm_eps)
            q = rope((a @ w("attn/q_proj/kernel")).reshape(t, h, d), pos, cfg.rope_theta)
            k = rope((a @ w("attn/k_proj/kernel")).reshape(t, kvh, d), pos, cfg.rope_theta)
            v = (a @ w("attn/v_proj/kernel")).reshape(t, kvh, d)
            out = np.zeros((t, h, d))
            for j in range(kvh):
                self.k[i][j] = np.concatenate([self.k[i][j], k[:, j]])
                self.v[i][j] = np.concatenate([self.v[i][j], v[:, j]])
                self.pos[i][j] = np.concatenate([self.pos[i][j], pos])
                self.mass[i][j] = np.concatenate([self.mass[i][j], np.zeros(t)])
                visible = self.pos[i][j][None, :] <= pos[:, None]  # [T, N] causal
                for head in range(j * g, (j + 1) * g):  # the query heads of KV head j
                    s = q[:, head] @ self.k[i][j].T / math.sqrt(d)
                    s = np.where(visible, s, -np.inf)
                    prob = np.exp(s - s.max(-1, keepdims=True))
                    prob /= prob.sum(-1, keepdims=True)  # [T, N]
                    out[:, head] = prob @ self.v[i][j]
                    self.mass[i][j] += prob.sum(0)  # attention received, summed over queries
            x = x + out.reshape(t, h * d) @ w("attn/o_proj/kernel")
            m = rms_norm(x, w("post_attn_norm/weight"), cfg.rms_norm_eps)
            gate = m @ w("mlp/gate_proj/kernel")
            x = x + (gate / (1 + np.exp(-gate)) * (m @ w("mlp/up_proj/kernel"))) @ w(
                "mlp/down_proj/kernel")
        return rms_norm(x, p["norm/weight"], cfg.rms_norm_eps) @ p["embed"].T

    def evict(self, budget: int, recent: int) -> None:
        """Keep, per layer and KV head, the `recent` latest tokens and the `budget - recent`
        others with the largest accumulated attention (ties: the earlier token)."""
        for i in range(self.cfg.num_layers):
            for j in range(self.cfg.num_kv_heads):
                pos, mass = self.pos[i][j], self.mass[i][j]
                n = len(pos)
                if n <= budget:
                    continue
                by_age = np.argsort(-pos, kind="stable")  # latest first
                keep = set(by_age[:recent].tolist())
                rest = [s for s in range(n) if s not in keep]
                rest.sort(key=lambda s: (-mass[s], pos[s]))  # heaviest first, ties: earlier
                heavy = budget - recent
                keep |= set(rest[:heavy])
                if 0 < heavy < len(rest):
                    top = mass[rest[heavy - 1]]
                    self.margins.append((top - mass[rest[heavy]]) / max(abs(top), 1e-30))
                idx = np.sort(np.fromiter(keep, int))  # slot order = position order
                self.k[i][j], self.v[i][j] = self.k[i][j][idx], self.v[i][j][idx]
                self.pos[i][j], self.mass[i][j] = pos[idx], mass[idx]

    def kept(self) -> list[list[list[int]]]:
        """[layer][KV head] sorted kept positions."""
        return [[sorted(p.tolist()) for p in layer] for layer in self.pos]


def kept_positions(cache, b: int) -> list[list[list[int]]]:
    """[layer][KV head] sorted kept positions of sequence `b` of a kvjax cache."""
    return [[sorted(int(x) for x in row if x != EMPTY) for row in np.asarray(layer.pos)[b]]
            for layer in cache]


def h2o_budget(n: int, ratio: float, recent_fraction: float = 0.5) -> tuple[int, int]:
    """(budget, recent) of `h2o(ratio=...)` for an n-token prompt, from the documented rule."""
    budget = max(1, math.floor(n * (1 - ratio) + 1e-9))
    return budget, math.floor(budget * recent_fraction)


# ----------------------------------------------------------------------------- H2O


def test_numpy_reference_model_matches_kvjax_logits(tiny_model):
    """The reference's forward is the same model: logits agree to float32 accuracy."""
    cfg = tiny_model.config
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 24).tolist()
    ref = NumpyH2O(cfg, params_dict(tiny_model)).feed(ids, 0)
    pre = prefill_batch(tiny_model, [ids], chunk=8)
    got = np.asarray(pre.logits)[0]
    # float32 through 2 layers of a 64-wide model: ~1e-6 relative per op, logits ~O(1)
    np.testing.assert_allclose(got, ref[-1], rtol=1e-4, atol=1e-4 * np.abs(ref[-1]).max())


def run_h2o(model, prompts, transform, decode_tokens, chunk=8):
    """kvjax: prefill + compress, then one token at a time, compressing after each."""
    pre = prefill_and_compress(model, prompts, transform=transform, chunk=chunk,
                               room=len(decode_tokens[0]), max_write=1)
    history = [[kept_positions(pre.cache, b) for b in range(len(prompts))]]
    for step in range(len(decode_tokens[0])):
        pre = extend(model, pre, [[toks[step]] for toks in decode_tokens], transform=transform)
        cache, state = transform.update(pre.cache, pre.transform_state, pre.stats)
        pre = pre._replace(cache=cache, transform_state=state)
        history.append([kept_positions(cache, b) for b in range(len(prompts))])
    return history


def run_reference(model, prompt, decode_tokens, budget, recent):
    ref = NumpyH2O(model.config, params_dict(model))
    ref.feed(prompt, 0)
    ref.evict(budget, recent)
    history = [ref.kept()]
    for step, tok in enumerate(decode_tokens):
        ref.feed([tok], len(prompt) + step)
        ref.evict(budget, recent)
        history.append(ref.kept())
    return history, ref.margins


@pytest.mark.parametrize("heavy,recent", [(6, 4), (9, 0), (0, 7), (3, 1)])
def test_h2o_keeps_the_papers_heavy_hitters_and_recent_tokens(tiny_model, heavy, recent):
    """Token budgets: exactly the reference's positions after prefill and after each of 6
    decode steps (one eviction per step), per layer, KV head and sequence of a padded batch."""
    rng = np.random.default_rng(10 + heavy + 3 * recent)
    cfg = tiny_model.config
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (29, 21)]
    decode = [rng.integers(3, cfg.vocab_size, 6).tolist() for _ in prompts]
    got = run_h2o(tiny_model, prompts, kvjax.h2o(heavy=heavy, recent=recent), decode)
    for b, prompt in enumerate(prompts):
        want, margins = run_reference(tiny_model, prompt, decode[b], heavy + recent, recent)
        assert min(margins, default=1.0) > NEAR_TIE, "a near-tie at the boundary: pick a seed"
        for step, kept in enumerate(want):
            assert got[step][b] == kept, (b, step)
            assert all(len(h) == heavy + recent for layer in kept for h in layer)


def test_h2o_breaks_exact_ties_towards_the_earlier_token():
    """Masses that tie exactly (here: in groups of three) keep the earliest tokens of a tie,
    as the reference rule (`NumpyH2O.evict`) and kvjax's `keep_top_k` document."""
    n, heavy, recent = 12, 4, 2
    spec = kvjax.CacheSpec(1, 1, 4)
    cache = kvjax.init_model_cache(spec, 1, n, track_mass=True)
    kv = jnp.ones((1, 1, n, 4))
    layer = kvjax.write(cache[0], kv, kv, jnp.arange(n)[None])
    mass = np.array([1, 5, 5, 5, 2, 3, 3, 3, 0, 1, 9, 9], np.float32)  # recent: 10, 11
    layer = layer.replace(mass=jnp.asarray(mass)[None, None])
    t = kvjax.h2o(heavy=heavy, recent=recent)
    out, _ = t.update((layer,), t.init((layer,)), None)
    # heavy: the three 5s (1, 2, 3), then the first of the three 3s (5, not 6 or 7)
    assert kept_positions(out, 0) == [[[1, 2, 3, 5, 10, 11]]]
    ref = NumpyH2O.__new__(NumpyH2O)  # the reference's eviction alone, on the same masses
    ref.cfg = LlamaConfig.tiny(num_layers=1, num_kv_heads=1, num_heads=1)
    ref.pos, ref.mass, ref.margins = [[np.arange(n)]], [[mass.astype(np.float64)]], []
    ref.k = ref.v = [[np.zeros((n, 4))]]
    ref.evict(heavy + recent, recent)
    assert ref.kept() == [[[1, 2, 3, 5, 10, 11]]]


@pytest.mark.parametrize("ratio,fraction", [(0.5, 0.5), (0.75, 0.5), (0.3, 0.25)])
def test_h2o_ratio_splits_the_budget_as_documented(tiny_model, ratio, fraction):
    """`h2o(ratio=r, recent_fraction=f)`: budget max(1, floor(n(1-r))), floor(f*budget) recent."""
    rng = np.random.default_rng(int(100 * ratio + 10 * fraction))
    cfg = tiny_model.config
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (32, 26)]
    decode = [rng.integers(3, cfg.vocab_size, 4).tolist() for _ in prompts]
    got = run_h2o(tiny_model, prompts, kvjax.h2o(ratio=ratio, recent_fraction=fraction), decode)
    for b, prompt in enumerate(prompts):
        budget, recent = h2o_budget(len(prompt), ratio, fraction)
        want, margins = run_reference(tiny_model, prompt, decode[b], budget, recent)
        assert min(margins, default=1.0) > NEAR_TIE
        for step, kept in enumerate(want):
            assert got[step][b] == kept, (b, step, budget, recent)


def smollm2_h2o_differences(model, ratio: float = 0.5) -> list[tuple[int, int, int]]:
    """kvjax's H2O on SmolLM2 against numpy's rule: (layer, KV head, position) kept by one
    side only. Asserts the mass agrees and that every difference is a near-tie."""
    import os
    golden = np.load(os.path.join(os.path.dirname(__file__), "golden", "kvpress_golden.npz"))
    ids = golden["ctx2_ids"].tolist()
    n = len(ids)
    pre = prefill_batch(model, [ids], stats=kvjax.StatsSpec(window=n, attention_mass=True),
                        chunk=100)
    out = compress(pre, kvjax.h2o(ratio=ratio), shrink=False, keep_input=True)
    budget, recent = h2o_budget(n, ratio)
    cfg = model.config
    g = cfg.num_heads // cfg.num_kv_heads
    differ = []
    for i, layer in enumerate(pre.cache):
        q = np.asarray(pre.stats[i].queries, np.float64)[0]  # [T, H, D] post-RoPE
        assert (np.asarray(pre.stats[i].query_pos)[0] == np.arange(n)).all()
        pos = np.asarray(layer.pos)[0]  # [KVH, C]
        keys = np.asarray(layer.k, np.float64).reshape(cfg.num_kv_heads, -1, cfg.head_dim)
        for j in range(cfg.num_kv_heads):
            slot_of = np.argsort(pos[j][:n])  # position -> slot (prefill writes in order)
            k = keys[j][slot_of]  # [T, D] by position
            s = np.einsum("thd,sd->hts", q[:, j * g:(j + 1) * g], k) / math.sqrt(cfg.head_dim)
            s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
            prob = np.exp(s - s.max(-1, keepdims=True))
            mass = (prob / prob.sum(-1, keepdims=True)).sum((0, 1))  # [T] summed over G heads
            kv_mass = np.asarray(layer.mass)[0, j][slot_of]
            np.testing.assert_allclose(kv_mass, mass, rtol=1e-4, atol=1e-5 * mass.max())
            order = sorted(range(n - recent), key=lambda p: (-mass[p], p))
            want = set(range(n - recent, n)) | set(order[:budget - recent])
            got = {int(p) for p in np.asarray(out.cache[i].pos)[0, j] if p != EMPTY}
            assert len(got) == budget
            boundary = mass[order[budget - recent - 1]]
            for p in sorted(got ^ want):  # only near-ties at the boundary may differ
                assert abs(mass[p] - boundary) <= NEAR_TIE * boundary, (i, j, p)
                differ.append((i, j, p))
    return differ


@pytest.mark.slow
def test_h2o_matches_the_reference_rule_on_smollm2_attention(smollm2):
    """On the real model (the 300-token golden passage, r=0.5: 75 recent + 75 heavy per head),
    kvjax's accumulated mass and H2O selection against numpy's rule applied to the attention
    recomputed in float64 from the same post-RoPE queries (a 300-query window) and cached
    keys, summed over the 3 query heads of each KV head. The mass agrees to 1e-4 relative;
    the kept positions are identical in all 30 layers x 3 KV heads (measured: no near-tie
    swap; the check allows only swaps within NEAR_TIE of the boundary)."""
    model, _ = smollm2
    assert smollm2_h2o_differences(model) == []


# ----------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_keeps_exactly_the_last_tokens(tiny_model, window):
    """`sliding_window(W)`: positions [max(0, n - W), n) of every sequence of n tokens so far,
    in every layer and KV head, after prefill and after each decode step (compress_every=1)."""
    rng = np.random.default_rng(window)
    cfg = tiny_model.config
    lengths = (33, 12, 20)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]
    decode = [rng.integers(3, cfg.vocab_size, 3).tolist() for _ in prompts]
    got = run_h2o(tiny_model, prompts, kvjax.sliding_window(window), decode)
    for step, per_seq in enumerate(got):
        for b, n in enumerate(lengths):
            end = n + step
            want = list(range(max(0, end - window), end))
            for layer in per_seq[b]:
                assert all(h == want for h in layer), (window, step, b, layer[0], want)


# ----------------------------------------------------------------------------- random


def random_keep(model, prompts, seed, ratio=0.5):
    pre = prefill_and_compress(model, prompts, transform=kvjax.random(ratio=ratio, seed=seed),
                               chunk=8, shrink=False)
    return [kept_positions(pre.cache, b) for b in range(len(prompts))]


def test_random_keeps_a_budget_of_valid_positions_fixed_by_the_seed(tiny_model):
    """Every row keeps exactly max(1, floor(n(1-r))) distinct positions of its own sequence
    (never padding); the same seed keeps the same set; different seeds differ."""
    rng = np.random.default_rng(7)
    lengths = (30, 17)
    prompts = [rng.integers(3, 256, n).tolist() for n in lengths]
    first = random_keep(tiny_model, prompts, seed=1)
    for b, n in enumerate(lengths):
        budget = max(1, math.floor(n * 0.5))
        for layer in first[b]:
            for head in layer:
                assert len(head) == budget and len(set(head)) == budget
                assert all(0 <= p < n for p in head)
    assert random_keep(tiny_model, prompts, seed=1) == first
    others = [random_keep(tiny_model, prompts, seed=s) for s in (2, 3)]
    for other in others:  # C(30, 15) > 1e8 sets per row: equal sets mean the seed is ignored
        for b in range(len(lengths)):
            assert all(x != y for x, y in zip(sum(other[b], []), sum(first[b], []))), b
    # heads and layers draw independently (per KV head), not one set for the whole layer
    assert first[0][0][0] != first[0][0][1]


def test_random_keeps_every_position_with_the_same_probability(tiny_model):
    """Over 300 seeds each position of a 24-token prompt is kept with frequency budget/n
    = 0.5, within 4.5 binomial standard deviations (sqrt(p(1-p)/N) = 0.029; with 24 positions
    x 4 rows the chance of a false alarm is < 1e-3)."""
    n, seeds, ratio = 24, 300, 0.5
    ids = np.random.default_rng(3).integers(3, 256, n).tolist()
    pre = prefill_batch(tiny_model, [ids], chunk=8)
    t = kvjax.random(ratio=ratio)
    update = jax.jit(t.update)
    counts = np.zeros((tiny_model.config.num_layers, tiny_model.config.num_kv_heads, n))
    for seed in range(seeds):
        state = t.init(pre.cache)._replace(key=jax.random.key(seed))
        cache, _ = update(jax.tree_util.tree_map(jnp.copy, pre.cache), state, None)
        for i, layer in enumerate(cache):
            pos = np.asarray(layer.pos)[0]
            for j in range(pos.shape[0]):
                counts[i, j, pos[j][pos[j] != EMPTY]] += 1
    p = max(1, math.floor(n * (1 - ratio))) / n
    freq = counts / seeds
    assert np.abs(freq - p).max() <= 4.5 * math.sqrt(p * (1 - p) / seeds), freq
