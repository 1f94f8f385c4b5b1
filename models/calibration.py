"""Calibration runs on real text: per-head low-rank bases for `kvjax.policies.low_rank`.

Example:
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))   # random weights, vocab 256
    >>> ids = list(range(3, 67))       # real use: tokenizer.encode(text)[-16384:]
    >>> basis = calibrate_low_rank(model, ids, window=32, batch=2, progress=False)
    >>> basis.keys.shape, basis.tokens   # [L, KVH, D, D], tokens per sequence and head
    ((2, 2, 16, 16), 64)
    >>> import os, tempfile
    >>> basis.save(os.path.join(tempfile.mkdtemp(), "basis.npz"))
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from kvjax.policies.low_rank import LowRankBasis, accumulate_moments, basis_from_moments
from models.llama import Llama


def calibrate_low_rank(model: Llama, ids: Sequence[int], window: int = 1024, batch: int = 4,
                       progress: bool = True) -> LowRankBasis:
    """Bases from the cached keys and values of `ids`, prefilled in windows of `window` tokens.

    The text is cut into consecutive windows (a shorter tail is dropped),
    prefilled `batch` windows at a time, and each cache's second moments
    are summed; the bases are their eigenvectors.
    """
    from models.sampler import prefill_batch

    windows = [list(ids[i:i + window]) for i in range(0, len(ids) - window + 1, window)]
    if not windows:
        raise ValueError(f"calibration needs at least one window of {window} tokens, "
                         f"got {len(ids)} tokens")
    moments = None
    for start in tqdm(range(0, len(windows), batch), desc="calibrating low-rank bases",
                      unit="batch", disable=not progress):
        pre = prefill_batch(model, windows[start:start + batch])
        moments = accumulate_moments(moments, pre.cache)
    return basis_from_moments(moments)


def calibrate_duo_attention(model: Llama, texts: Sequence[Sequence[int]], q_len: int = 500,
                            batch: int = 10, progress: bool = True):
    """[L, KVH] float32 DuoAttention head scores of `texts` (token-id lists), kvpress's
    on-the-fly rule (`kvjax.policies.eviction_duo.duo_head_scores`): per text, each head's mean
    pre-RoPE query (the prefill's query moments) and key (the cached keys, RoPE undone), then
    the score of those means, averaged over the texts (prefilled `batch` at a time). Save as
    `np.savez(path, head_scores=...)` for `duo_attention:scores=PATH`.

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> calibrate_duo_attention(model, [list(range(3, 40)), list(range(5, 30))],
        ...                         progress=False).shape     # [L, KVH]
        (2, 2)
    """
    import jax.numpy as jnp
    import numpy as np

    from kvjax.core.cache import EMPTY
    from kvjax.core.stats import StatsSpec
    from kvjax.policies.eviction_duo import duo_head_scores
    from kvjax.policies.eviction_sequence import unrope
    from models.llama import rope_frequencies
    from models.sampler import prefill_batch

    if not texts:
        raise ValueError("calibrate_duo_attention needs at least one text")
    inv = jnp.asarray(rope_frequencies(model.config))
    total = None
    for start in tqdm(range(0, len(texts), batch), desc="DuoAttention head scores",
                      unit="batch", disable=not progress):
        group = [list(ids) for ids in texts[start:start + batch]]
        pre = prefill_batch(model, group, stats=StatsSpec(query_moments=True))
        q_mean = jnp.stack([s.q_sum / s.q_count[:, None, None] for s in pre.stats], 1)
        k_mean = []
        for layer in pre.cache:  # [B, KVH, C, D] keys at `pos`, left padding EMPTY
            valid = (layer.pos != EMPTY)[..., None]
            k = unrope(layer.logical_k.astype(jnp.float32), layer.pos, inv)
            k_mean.append(jnp.sum(k * valid, axis=2) / jnp.sum(valid, axis=2))  # [B, KVH, D]
        k_mean = jnp.stack(k_mean, 1)  # [B, L, KVH, D]
        for row in range(len(group)):  # q_mean [B, L, H, D]
            score = np.asarray(duo_head_scores(q_mean[row], k_mean[row], inv, q_len))
            total = score / len(texts) if total is None else total + score / len(texts)
    return total.astype(np.float32)


def _check_windows(name: str, windows: Sequence[Sequence[int]]) -> None:
    """ValueError unless `windows` are one or more non-empty token windows of one length."""
    if not windows or len({len(w) for w in windows}) != 1 or not len(windows[0]):
        raise ValueError(f"{name} needs one or more token windows of one length, got lengths "
                         f"{sorted({len(w) for w in windows})}")


def calibrate_qfilters(model: Llama, windows: Sequence[Sequence[int]], samples: int = 3000,
                       seed: int = 0, batch: int = 2, progress: bool = True):
    """[L, KVH, D] float32 Q-Filters (Godey et al. 2025) of `windows` (token-id lists of equal
    length), the paper's rule: per layer, the post-RoPE queries of `samples` tokens drawn at
    random (the same tokens for every head; all of them when there are fewer); per query head,
    the first right singular vector `v` of those queries, signed so that most queries project
    positively on it; the filter is `-v` (kvpress scores `-(filter . k)`), averaged over the
    query heads of each KV head. Save as `np.savez(path, q_filters=...)` for
    `qfilter:filters=PATH`.

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> calibrate_qfilters(model, [list(range(3, 40)), list(range(5, 42))],
        ...                    progress=False).shape     # [L, KVH, D]
        (2, 2, 16)
    """
    import numpy as np

    from kvjax.core.stats import StatsSpec
    from models.sampler import prefill_batch

    _check_windows("calibrate_qfilters", windows)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"calibrate_qfilters: samples must be an int >= 1, got {samples!r}")
    cfg, width = model.config, len(windows[0])
    total = len(windows) * width
    drawn = np.sort(np.random.default_rng(seed).permutation(total)[:samples])  # flat token ids
    queries = [[] for _ in range(cfg.num_layers)]  # per layer: [n, H, D] chunks
    for start in tqdm(range(0, len(windows), batch), desc="Q-Filters queries", unit="batch",
                      disable=not progress):
        group = [list(w) for w in windows[start:start + batch]]
        here = drawn[(drawn >= start * width) & (drawn < (start + len(group)) * width)]
        row, token = np.divmod(here - start * width, width)
        pre = prefill_batch(model, group, stats=StatsSpec(window=width))
        for layer, stats in enumerate(pre.stats):  # queries [B, width, H, D] post-RoPE
            queries[layer].append(np.asarray(stats.queries)[row, token])
    filters = []
    for chunks in queries:
        q = np.concatenate(chunks).transpose(1, 0, 2).astype(np.float64)  # [H, n, D]
        u, _, vh = np.linalg.svd(q, full_matrices=False)
        sign = np.where((u[..., 0] > 0).mean(-1) > 0.5, 1.0, -1.0)  # [H]
        per_head = -sign[:, None] * vh[:, 0]  # [H, D]
        filters.append(per_head.reshape(cfg.num_kv_heads, -1, per_head.shape[-1]).mean(1))
    return np.stack(filters).astype(np.float32)


def calibrate_lukv(model: Llama, windows: Sequence[Sequence[int]], inner=None,
                   prefix: float = 0.75, sink: int = 4, window: int = 1, batch: int = 2,
                   progress: bool = True):
    """[99, L, KVH] float32 LU-KV budget curve of `windows` (token-id lists of equal length;
    `lukv:curve=PATH` reads it saved as `np.savez(path, budget_curve=...)`).

    Per window, the first `prefix` of its tokens are prefilled and scored by the inner policy
    (`inner`: a scored-policy factory; None: ExpectedAttention with epsilon 0.02, LUKVPress's
    default), the first `sink` and last `window` tokens first; the whole window is prefilled
    and the attention its remaining tokens' queries pay each prefix token, summed over a KV
    head's query heads, is that token's future utility. A head's utility curve is the share of
    it its top-k tokens hold (`eviction_lukv.utility_curves`), averaged over the windows; the
    curve's rows allocate `1 - r` of all tokens over every layer and head by the hulls of those
    curves (`eviction_lukv.budget_curve`).

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> curve = calibrate_lukv(model, [list(range(3, 43)), list(range(5, 45))],
        ...                        progress=False)
        >>> curve.shape, bool(((curve >= 0) & (curve <= 1)).all())     # [99, L, KVH]
        ((99, 2, 2), True)
    """
    import numpy as np

    from kvjax.core.stats import StatsSpec
    from kvjax.policies.eviction_lukv import KVPRESS_INNER, budget_curve, utility_curves
    from kvjax.policies.eviction_wrappers import inner_scorer
    from models.sampler import prefill_batch

    _check_windows("calibrate_lukv", windows)
    if not 0 < prefix < 1:
        raise ValueError(f"calibrate_lukv: prefix must be in (0, 1), got {prefix!r}")
    width = len(windows[0])
    p = int(width * prefix)
    if p < 1 or p >= width:
        raise ValueError(f"calibrate_lukv: windows of {width} tokens leave no prefix or no "
                         f"future at prefix={prefix}")
    scorer, spec = inner_scorer(KVPRESS_INNER if inner is None else inner, "lukv", 0.5)
    total = None
    for start in tqdm(range(0, len(windows), batch), desc="LU-KV utility curves",
                      unit="batch", disable=not progress):
        group = [list(w) for w in windows[start:start + batch]]
        pre = prefill_batch(model, [w[:p] for w in group], stats=spec)
        full = prefill_batch(model, group, stats=StatsSpec(window=width - p))
        stats = pre.stats if pre.stats is not None else (None,) * len(pre.cache)
        scores, importance = [], []
        for cp, sp, cf, sf in zip(pre.cache, stats, full.cache, full.stats):
            s, a = _lukv_scores(scorer, sink, window, p, cp, sp, cf, sf)
            scores.append(np.asarray(s))
            importance.append(np.asarray(a))
        curves = utility_curves(np.stack(scores, 1), np.stack(importance, 1))  # [B, L, KVH, P+1]
        total = curves.sum(0) if total is None else total + curves.sum(0)
    return budget_curve(total / len(windows))


@functools.partial(jax.jit, static_argnames=("scorer", "sink", "window", "p"))
def _lukv_scores(scorer, sink: int, window: int, p: int, prefix_cache, prefix_stats,
                 full_cache, full_stats):
    """([B, KVH, p] the inner scores of the prefix tokens by position, protected ones +inf;
    [B, KVH, p] the attention the window's later queries pay each of them)."""
    from kvjax.core.attention import attention_weights
    from kvjax.core.cache import view
    from kvjax.policies.eviction_lukv import protected_scores
    from models.reconstruction import by_position

    seen = view(prefix_cache)
    scores = protected_scores(scorer, seen, prefix_stats,
                              jnp.full((seen.batch,), p // 2, jnp.int32), jax.random.key(0),
                              sink, window)
    weights = attention_weights(full_stats.queries, full_stats.query_pos, full_cache)
    return (by_position(scores, seen.pos)[..., :p],
            by_position(weights.sum((2, 3)), full_cache.pos)[..., :p])


def calibrate_query_stats(model: Llama, windows: Sequence[Sequence[int]], sinks: int = 4,
                          batch: int = 2, progress: bool = True):
    """(mean [L, H, D], covariance [L, H, D, D]) float32 of the pre-RoPE queries of `windows`
    (token-id lists), each window's first `sinks` positions left out, the covariance with
    `N - 1` (kvpress's `collect_queries`, which ExpectedAttentionStatsPress reads). Save as
    `np.savez(path, query_mean=..., query_cov=...)` for `expected_attention_stats:stats=PATH`.

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> mean, cov = calibrate_query_stats(model, [list(range(3, 40))], progress=False)
        >>> mean.shape, cov.shape        # [L, H, D], [L, H, D, D]
        ((2, 4, 16), (2, 4, 16, 16))
    """
    import numpy as np

    from kvjax.core.stats import StatsSpec
    from models.sampler import prefill_batch

    if not windows or any(len(w) <= sinks for w in windows):
        raise ValueError(f"calibrate_query_stats needs windows of more than sinks={sinks} "
                         f"tokens, got lengths {sorted({len(w) for w in windows})}")
    spec = StatsSpec(query_moments=True, moments_skip=sinks)
    total = None
    for start in tqdm(range(0, len(windows), batch), desc="query statistics", unit="batch",
                      disable=not progress):
        pre = prefill_batch(model, [list(w) for w in windows[start:start + batch]], stats=spec)
        sums = [(np.asarray(s.q_sum, np.float64).sum(0), np.asarray(s.q_outer, np.float64).sum(0),
                 float(np.asarray(s.q_count).sum())) for s in pre.stats]
        total = sums if total is None else [tuple(a + b for a, b in zip(x, y))
                                            for x, y in zip(total, sums)]
    mean = np.stack([q / n for q, _, n in total])  # [L, H, D]
    cov = np.stack([(outer - n * np.einsum("hi,hj->hij", q / n, q / n)) / (n - 1)
                    for q, outer, n in total])
    return mean.astype(np.float32), cov.astype(np.float32)


def kvzap_training_data(model: Llama, windows: Sequence[Sequence[int]], prompt,
                        samples: int = 256, seed: int = 0, batch: int = 2,
                        progress: bool = True):
    """(inputs [N, L, hidden], targets [N, L, KVH]) float32 for KVzap (kvpress's
    `KVzapDataCollector`): `kvzip_training_data` with KVzip+'s scores, and their log.

    Example:
        >>> from flax import nnx
        >>> from kvjax.policies.eviction_kvzip import ReconstructionPrompt
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> x, y = kvzap_training_data(model, [list(range(3, 35))], ReconstructionPrompt(),
        ...                            samples=8, progress=False)
        >>> x.shape, y.shape       # [N, L, hidden], [N, L, KVH]
        ((8, 2, 64), (8, 2, 2))
    """
    import numpy as np

    x, y = kvzip_training_data(model, windows, prompt, samples, seed, batch, progress,
                               plus=True, who="kvzap_training_data")
    return x, np.log(np.maximum(y, np.finfo(np.float32).tiny)).astype(np.float32)


def kvzip_training_data(model: Llama, windows: Sequence[Sequence[int]], prompt,
                        samples: int = 256, seed: int = 0, batch: int = 2,
                        progress: bool = True, plus: bool = False,
                        who: str = "kvzip_training_data"):
    """(inputs [N, L, hidden], targets [N, L, KVH]) float32: each layer's attention input of
    `samples` tokens drawn at random from every window (token-id lists of one length; all
    tokens when fewer), and their KVzip scores (`plus`: KVzip+'s), from the reconstruction
    pass behind `prompt`, a `ReconstructionPrompt` (`models.reconstruction.chat_prompt(
    tokenizer)` for kvpress's; its `prefix` leading tokens are not reconstructed, so not
    drawn). Fast KVzip's gates learn the scores, KVzap's surrogates their log.

    Example:
        >>> from flax import nnx
        >>> from kvjax.policies.eviction_kvzip import ReconstructionPrompt
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> x, y = kvzip_training_data(model, [list(range(3, 35))], ReconstructionPrompt(),
        ...                            samples=8, progress=False)
        >>> x.shape, y.shape, bool(((y >= 0) & (y <= 1)).all())   # attention: in [0, 1]
        ((8, 2, 64), (8, 2, 2), True)
    """
    import numpy as np

    import kvjax
    from kvjax.policies.eviction_kvzip import Reconstruction
    from models.reconstruction import reconstruct

    _check_windows(who, windows)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{who}: samples must be an int >= 1, got {samples!r}")
    width = len(windows[0])
    if prompt.prefix >= width:
        raise ValueError(f"{who}: windows of {width} tokens leave nothing after "
                         f"the prompt's {prompt.prefix}-token prefix")
    rec = Reconstruction(chunk_size=width, prompt=prompt, plus=plus)
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for start in tqdm(range(0, len(windows), batch), desc="KVzip+ scores" if plus else
                      "KVzip scores", unit="batch", disable=not progress):
        group = [list(w) for w in windows[start:start + batch]]
        tokens = jnp.asarray(group, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
        cache = kvjax.init_model_cache(model.config.cache_spec, len(group), width)
        cache, inputs = _attention_inputs(model, tokens, positions, cache)
        stats = reconstruct(model, cache, None, np.full(len(group), width), group, rec)
        scores = np.stack([np.asarray(s.position_scores) for s in stats], 1)  # [B, L, KVH, T]
        inputs = np.stack([np.asarray(h) for h in inputs], 2)  # [B, T, L, hidden]
        for b in range(len(group)):
            take = np.sort(rng.permutation(np.arange(prompt.prefix, width))[:samples])
            xs.append(inputs[b, take])
            ys.append(scores[b, :, :, take])
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.float32)


@functools.partial(jax.jit, donate_argnums=(3,))
def _attention_inputs(model, tokens, positions, cache):
    """The prefilled cache and each layer's attention inputs [B, T, hidden] of `tokens`."""
    from kvjax.core.stats import NO_STATS
    from models.reconstruction import probe_forward
    _, cache, _, inputs = probe_forward(model, tokens, positions, cache, None, NO_STATS)
    return cache, inputs
