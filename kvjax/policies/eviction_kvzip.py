"""KVzip and KVgrad (kvpress KVzipPress, KVgradPress): keep what the model needs to repeat
its context.

KVzip (Kim et al. 2025) scores a prefilled context query-agnostically by
*context reconstruction*: the model is fed "Repeat the previous context
exactly." (its chat template's closing after it) followed by the context
again, on top of the prefilled cache, and each cached token scores the most
attention any reconstruction query pays it. Exactly kvpress's rule:

1. The context after the template's opening (`prefix` tokens, which are not
   reconstructed and score 0) is cut into chunks of `chunk_size` tokens. The
   first chunk is fed behind `first + suffix`, each later one behind
   `next + (the previous chunk's last 8 ids) + suffix`, at positions after the
   whole context (the cache goes back to the context before every chunk).
2. In every layer, the queries of that pass attend (softmax) over the
   `min(n_sink, chunk start)` first tokens, the chunk's own tokens and,
   causally, the pass's tokens, and nothing else; a chunk token's score is
   the maximum of that attention over the pass's queries and the query heads
   of its KV head.
3. The first `n_sink` tokens score above everything (kvpress: the maximum +
   1). The `floor(L * KVH * T * ratio)` lowest scores of all layers and KV
   heads together are evicted (`layerwise`: `floor(KVH * T * ratio)` per
   layer), so budgets differ by layer and head (the pooled layout, as Ada-KV).

Steps 1-2 need the model: this module only declares the pass
(`StatsSpec(reconstruction=Reconstruction(...))`) and scores it
(`chunk_scores`); `models.reconstruction` runs it after prefill (the sampler
does so for any transform that asks) and hands each layer's scores to the
update as `LayerStats.position_scores` (by token position, so an eviction before `kvzip`
in a chain moves nothing out of place). Step 3 is this transform's update.

KVgrad (`kvgrad`, kvpress KVgradPress, chunks of 512) scores the same pass
differently: each attention weight times `||v W_o||_2` (the value through the
query head's rows of the output projection) and times `||d Phi / d a_p||_2`,
the gradient of `Phi = sum_p ||h_p||^2` (the last layer's output over the
pass, before the final norm) with respect to probe token p's attention output,
before the same maximum; `models.reconstruction` takes it with `jax.grad`.

The prompt is token ids of the model's tokenizer: `prompt="chat"` (kvpress's)
wants them bound by `models.reconstruction.with_tokenizer(transform, tok)`,
which the CLI does; `prompt="bare"` feeds the chunks alone (no instruction, no
template), for a model without a tokenizer.

Example:
    >>> t = kvzip(ratio=0.5)                          # KVzipPress(0.5)
    >>> t.stats.reconstruction.chunk_size, t.stats.reconstruction.prompt is None
    (2048, True)
    >>> kvzip(ratio=0.5, prompt="bare").stats.reconstruction.prompt
    ReconstructionPrompt(first=(), next=(), suffix=(), prefix=0)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from kvjax.core.attention import attention_weights
from kvjax.core.cache import EMPTY, Cache, TokenCache
from kvjax.core.layer import is_plain
from kvjax.core.layout import compact, map_layers, pool_heads
from kvjax.core.selection import init_budget, rank
from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import _check_bool, check_int, check_real

PROMPTS = ("chat", "bare")
QUERY_BLOCK = 128  # reconstruction queries scored at a time (`chunk_scores`)


@dataclasses.dataclass(frozen=True)
class ReconstructionPrompt:
    """The token ids around each reconstructed chunk (kvpress's `prepare`)."""

    first: tuple[int, ...] = ()  # before the first chunk: "Repeat the previous context exactly."
    next: tuple[int, ...] = ()  # before a later chunk: "...exactly, starting with" (+ 8 ids)
    suffix: tuple[int, ...] = ()  # after the instruction: the chat template's closing
    prefix: int = 0  # leading context tokens not reconstructed: the template's opening


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """What the model runs after prefill for KVzip (hashable: part of the `StatsSpec`)."""

    chunk_size: int = 2048
    n_sink: int = 4
    overlap: int = 8  # ids of the previous chunk repeated before a later chunk (kvpress's 8)
    prompt: ReconstructionPrompt | None = None  # None: bind a tokenizer's first
    gradient: bool = False  # KVgrad: weigh by ||v W_o|| and the objective's gradient
    plus: bool = False  # KVzip+: weigh by ||v W_o|| / ||h|| (h: the query's attention input)
    group_mean: bool = False  # KVCompose: a query head's max over the pass, mean over its group
    restore: object = None  # RestoreKV: its `RestoreTokens`, written after the pass, or None


def reconstruction_inputs(context: Sequence[int], rec: Reconstruction
                          ) -> list[tuple[int, int, list[int]]]:
    """kvpress's `prepare` for one sequence: per chunk, (start, end, ids fed), where the chunk
    is the context's tokens `[start, end)` and the ids are prompt + suffix + the chunk.

    Example:
        >>> p = ReconstructionPrompt(first=(7,), next=(8,), suffix=(9,), prefix=1)
        >>> rec = Reconstruction(chunk_size=3, overlap=1, prompt=p)
        >>> reconstruction_inputs([1, 2, 3, 4, 5], rec)
        [(1, 4, [7, 9, 2, 3, 4]), (4, 5, [8, 4, 9, 5])]
    """
    p = rec.prompt
    if p is None:
        raise ValueError("kvzip: the reconstruction prompt's token ids are not bound: "
                         "models.reconstruction.with_tokenizer(transform, tokenizer) binds "
                         "the tokenizer's (the CLI does), or use prompt=bare")
    ctx = list(context)[p.prefix:]
    chunks = [ctx[i:i + rec.chunk_size] for i in range(0, len(ctx), rec.chunk_size)] or [[]]
    out, start = [], p.prefix
    for i, chunk in enumerate(chunks):
        head = list(p.first) if i == 0 else \
            list(p.next) + chunks[i - 1][-rec.overlap:] if rec.overlap else list(p.next)
        out.append((start, start + len(chunk), head + list(p.suffix) + chunk))
        start += len(chunk)
    return out


def chunk_scores(layer: TokenCache, queries: jax.Array, query_pos: jax.Array, start: jax.Array,
                 end: jax.Array, sinks: jax.Array, context: jax.Array,
                 value_norms: jax.Array | None = None,
                 query_weights: jax.Array | None = None,
                 group_mean: bool = False, query_block: int = QUERY_BLOCK) -> jax.Array:
    """[B, KVH, C] float32: per slot of the chunk `[start, end)`, the most attention a
    reconstruction query pays it (0 outside the chunk); `group_mean`: each query head's most,
    averaged over the KV head's query heads (KVCompose).

    The queries' softmax runs over the first `sinks` tokens, the chunk and the pass's own
    tokens (positions >= `context`, causally): kvpress's `_compute_cross_attention`. The
    queries go `query_block` at a time (a running maximum), so memory is
    `B * H * query_block * C` floats, not `B * H * W * C`: a batch of 8 contexts of 1,024
    tokens otherwise needs 18 GiB of temporaries in SmolLM2's pass.

    Args:
      layer: the layer's cache after the pass (the context, then the pass's tokens).
      queries: [B, W, H, D] the pass's post-RoPE queries; query_pos [B, W] (EMPTY: padding).
      start, end, sinks, context: [B] int32 (a row with start == end scores nothing).
      value_norms: [B, KVH, G, C] KVgrad's `||v W_o||_2` per query head, or None.
      query_weights: [B, W] KVgrad's gradient norm per query, or None.

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> layer = kvjax.init_cache(batch=1, kv_heads=1, capacity=4, head_dim=2)
        >>> layer = kvjax.write(layer, jnp.zeros((1, 1, 4, 2)), jnp.zeros((1, 1, 4, 2)),
        ...                     jnp.arange(4)[None])       # context 0..2, one pass token at 3
        >>> s = chunk_scores(layer, jnp.zeros((1, 1, 1, 2)), jnp.array([[3]]), jnp.array([1]),
        ...                  jnp.array([3]), jnp.array([0]), jnp.array([3]))
        >>> [round(x, 4) for x in s[0, 0].tolist()]   # slots 1, 2 and the pass token share 1
        [0.0, 0.3333, 0.3333, 0.0]
    """
    row = lambda x: x.reshape(-1, 1, 1)
    pos = layer.pos  # [B, KVH, C]
    in_chunk = (pos >= row(start)) & (pos < row(end))
    seen = in_chunk | (pos < row(sinks)) | (pos >= row(context))
    sub = layer.replace(pos=jnp.where(seen & (pos != EMPTY), pos, EMPTY))
    b, w, h, _ = queries.shape
    n = -(-w // query_block)  # padding queries (EMPTY) attend nothing: their rows are zeros
    pad = lambda x, fill: jnp.pad(x, [(0, 0), (0, n * query_block - w)] + [(0, 0)] * (x.ndim - 2),
                                  constant_values=fill)
    blocks = lambda x: jnp.moveaxis(x.reshape(b, n, query_block, *x.shape[2:]), 1, 0)

    def most(best, block):  # best [B, KVH, G, C]: the running maximum over queries
        q, q_pos, q_weight = block  # q_weight None: KVzip's plain maximum
        weights = attention_weights(q, q_pos, sub)  # [B, KVH, G, query_block, C]
        if value_norms is not None:
            weights = weights * value_norms[:, :, :, None, :]
        if q_weight is not None:
            weights = weights * q_weight[:, None, None, :, None]
        return jnp.maximum(best, weights.max(axis=3)), None

    best0 = jnp.zeros((b, sub.kv_heads, h // sub.kv_heads, sub.capacity), jnp.float32)
    weight_blocks = None if query_weights is None else \
        blocks(pad(query_weights.astype(jnp.float32), 0))
    best, _ = jax.lax.scan(most, best0, (blocks(pad(queries.astype(jnp.float32), 0)),
                                         blocks(pad(query_pos, EMPTY)), weight_blocks))
    best = best.mean(axis=2) if group_mean else best.max(axis=2)
    return jnp.where(in_chunk, best, 0.0)


def value_output_norms(values: jax.Array, out_proj: jax.Array) -> jax.Array:
    """[B, KVH, G, C] `||v W_o,h||_2`: each value through each of its KV head's query heads' rows
    of the output projection (kvpress `KVzipPress._compute_value_output_norm`).

    Args:
      values: [B, KVH, C, D]; out_proj: [H*D, hidden] (rows head by head).

    Example:
        >>> import jax.numpy as jnp
        >>> w = jnp.array([[3., 4.], [0., 0.], [1., 0.], [0., 0.]])   # H = 2 heads of D = 2
        >>> value_output_norms(jnp.ones((1, 1, 1, 2)), w).tolist()      # |(3, 4)|, |(1, 0)|
        [[[[5.0], [1.0]]]]
    """
    b, kvh, c, d = values.shape
    w = out_proj.astype(jnp.float32).reshape(kvh, -1, d, out_proj.shape[-1])  # [KVH, G, D, hidden]
    return jnp.linalg.norm(jnp.einsum("bhcd,hgdj->bhgcj", values.astype(jnp.float32), w), axis=-1)


def kvzip_keep(scores: jax.Array, pos: jax.Array, ratio: jax.Array, n_sink: int,
               layerwise: bool, restored: int = 0) -> jax.Array:
    """[L, B, KVH, C] bool: what KVzip keeps of `scores` [L, B, KVH, C] (slots at `pos`).

    The first `n_sink` positions always; then per row the lowest `floor(N * ratio)` scores
    go, N every layer's and KV head's tokens (or, `layerwise`, one layer's). Ties go to
    the earlier layer, head and slot.

    `restored` (RestoreKV): each row's newest `restored` positions are restore tokens, kept
    and not ranked, and as many more context tokens go as they fill (`N` counts the context
    only): `floor(N * ratio) + R`, R the restore slots, at most N. kvpress evicts
    `int(N * min(1, ratio + restored / T))` (T: the context's length), the same count in
    exact arithmetic; its double product can land one below (DECISIONS "RestoreKVPress").

    Example:
        >>> import jax.numpy as jnp
        >>> s = jnp.array([[[[0.9, 0.1, 0.3, 0.2]]], [[[0.5, 0.6, 0.05, 0.7]]]])  # L=2, C=4
        >>> pos = jnp.broadcast_to(jnp.arange(4), s.shape)
        >>> kvzip_keep(s, pos, jnp.float32(0.5), 1, False)[:, 0, 0].astype(int).tolist()
        [[1, 0, 0, 0], [1, 1, 0, 1]]
    """
    valid = pos != EMPTY
    newest = jnp.max(pos, axis=(0, 2, 3))[None, :, None, None]  # [1, B, 1, 1]
    reserved = valid & (pos > newest - restored)
    context = valid & ~reserved
    scores = jnp.where(pos < n_sink, jnp.inf, scores.astype(jnp.float32))
    count = lambda mask: jnp.sum(mask, axis=(2, 3)) if layerwise else jnp.sum(mask, (0, 2, 3))
    held = count(context)  # [L, B] or [B]: the context's tokens, every head's
    n = jnp.floor(held.astype(jnp.float32) * ratio).astype(jnp.int32) + count(reserved)
    return drop_lowest(scores, context, jnp.minimum(n, held)) | reserved


def drop_lowest(scores: jax.Array, valid: jax.Array, n: jax.Array) -> jax.Array:
    """[L, B, KVH, C] bool: the `valid` slots left when the `n` lowest `scores` go, `n` [B]
    per row over every layer and KV head together, or `n` [L, B] per layer and row. Ties go
    to the earlier layer, head and slot.

    Example:
        >>> import jax.numpy as jnp
        >>> s = jnp.array([[[[0.9, 0.1, 0.3]]], [[[0.5, 0.6, 0.05]]]])  # L=2, B=1, KVH=1, C=3
        >>> drop_lowest(s, s > 0, jnp.array([2]))[:, 0, 0].astype(int).tolist()
        [[1, 0, 1], [1, 1, 0]]
    """
    num_layers, b, kvh, c = scores.shape
    if n.ndim == 2:  # [L, B, KVH*C]: each layer alone
        flat = lambda x: x.reshape(num_layers, b, kvh * c)
        lowest = rank(-flat(scores), flat(valid)) < n[:, :, None]
    else:  # [B, L*KVH*C]: every layer together
        flat = lambda x: x.transpose(1, 0, 2, 3).reshape(b, num_layers * kvh * c)
        lowest = rank(-flat(scores), flat(valid)) < n[:, None]
        lowest = lowest.reshape(b, num_layers, kvh, c).transpose(1, 0, 2, 3)
    return valid & ~lowest.reshape(scores.shape)


def slot_scores(position_scores: jax.Array, pos: jax.Array) -> jax.Array:
    """[B, KVH, C] each slot's score from the scores by position [B, KVH, P] (0 for an empty
    slot or a position past P, which a prefilled cache never holds).

    Example:
        >>> import jax.numpy as jnp
        >>> slot_scores(jnp.array([[[0.1, 0.2, 0.3]]]), jnp.array([[[2, -1, 0, 5]]])).tolist()
        [[[0.30000001192092896, 0.0, 0.10000000149011612, 0.0]]]
    """
    size = position_scores.shape[-1]
    got = jnp.take_along_axis(position_scores, jnp.clip(pos, 0, size - 1), axis=-1)
    return jnp.where((pos >= 0) & (pos < size), got, 0.0)


def pooled_mask(keep: jax.Array) -> jax.Array:
    """[B, KVH, C] per-head mask -> [B, KVH, KVH*C], the pooled layout's (`pool_heads`:
    head h owns slots [h*C, (h+1)*C))."""
    b, kvh, c = keep.shape
    own = jnp.eye(kvh, dtype=bool)[None, :, :, None]
    return (own & keep[:, :, None, :]).reshape(b, kvh, kvh * c)


def _evict(layer: TokenCache, keep: jax.Array) -> TokenCache:
    return compact(pool_heads(layer), pooled_mask(keep))


def pass_scores(name: str, cache: Cache, stats) -> tuple[jax.Array, jax.Array]:
    """(positions, scores) [L, B, KVH, C] of every slot from the reconstruction pass's
    `position_scores`; a ValueError naming `name` without them (no pass ran: a decode-time
    update) or on a layer that is not a plain per-head token cache."""
    if stats is None or any(s is None or s.position_scores is None for s in stats):
        raise ValueError(f"{name} scores slots by a pass the model runs after prefill "
                         "(models.reconstruction; the sampler runs it): it has no scores "
                         "here. It compresses the prompt only, not during decoding "
                         "(compress_every)")
    for i, (layer, s) in enumerate(zip(cache, stats)):
        if not is_plain(layer) or layer.pooled or \
                s.position_scores.shape[:2] != layer.pos.shape[:2]:
            raise ValueError(f"{name}: layer {i} is not a plain per-head token cache (a "
                             f"codec's or a head-wise policy's before it in the chain); "
                             f"{name} ranks the tokens of a plain cache after prefill")
    return stacked_slot_scores(cache, stats)


def stacked_slot_scores(cache: Cache, stats) -> tuple[jax.Array, jax.Array]:
    """(positions, scores) [L, B, KVH, C] of every slot from each layer's `position_scores`,
    C the widest layer's slots (the others padded with EMPTY slots scored 0)."""
    width = max(layer.pos.shape[-1] for layer in cache)  # layers may differ after a shrink
    pad = lambda x, fill: jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[-1])),
                                  constant_values=fill)
    pos = jnp.stack([pad(layer.pos, EMPTY) for layer in cache])
    return pos, jnp.stack([pad(slot_scores(s.position_scores, layer.pos), 0.0)
                           for s, layer in zip(stats, cache)])


@dataclasses.dataclass(frozen=True)
class KVzipUpdate:
    """`kvzip`'s update: every layer's reconstruction scores ranked together (or by layer)."""

    n_sink: int = 4
    layerwise: bool = False
    restored: int = 0  # RestoreKV: each row's newest positions its restore pass wrote

    def __call__(self, cache: Cache, state, stats=None):
        pos, scores = pass_scores("kvzip", cache, stats)
        keep = kvzip_keep(scores, pos, state.ratio, self.n_sink, self.layerwise, self.restored)
        return map_layers(_evict, tuple(cache), tuple(keep)), state


def reconstruction_policy(name: str, ratio: float | None, n_sink: int, layerwise: bool,
                          chunk_size: int, prompt: str, gradient: bool,
                          plus: bool = False, restore=None) -> CacheTransform:
    """`kvzip` (gradient False; `plus`: KVzip+), `kvgrad` (True) or, with `restore` (its
    `RestoreTokens`), `restorekv`, its arguments checked under `name`."""
    check_real(name, "ratio", ratio, 0.0, 1.0, high_open=True)
    check_int(name, "n_sink", n_sink, 0)
    check_int(name, "chunk_size", chunk_size)
    _check_bool(name, "layerwise", layerwise)
    _check_bool(name, "plus", plus)
    if prompt not in PROMPTS:
        raise ValueError(f"{name}: prompt must be one of {', '.join(PROMPTS)}, got {prompt!r}")
    rec = Reconstruction(chunk_size, n_sink,
                         prompt=ReconstructionPrompt() if prompt == "bare" else None,
                         gradient=gradient, plus=plus, restore=restore)
    return CacheTransform(functools.partial(init_budget, ratio, None, 0),
                          KVzipUpdate(n_sink, layerwise, 0 if restore is None else restore.n),
                          StatsSpec(reconstruction=rec))


def kvzip(ratio: float | None = None, n_sink: int = 4, layerwise: bool = False,
          chunk_size: int = 2048, prompt: str = "chat", plus: bool = False) -> CacheTransform:
    """KVzip (Kim et al. 2025): evict what context reconstruction attends to least.

    As kvpress KVzipPress(compression_ratio=ratio, layerwise=layerwise, n_sink=n_sink,
    chunk_size=chunk_size, kvzip_plus_normalization=plus): see the module docstring.
    `prompt`: "chat" (kvpress's instruction and chat template, bound from the tokenizer by
    `models.reconstruction.with_tokenizer`) or "bare" (the chunks alone). `plus` (KVzip+):
    each attention weight divided by the norm of its query's attention input and times the
    key's `||v W_o||_2`, so a token counts by what it adds to the layer's output.
    """
    return reconstruction_policy("kvzip", ratio, n_sink, layerwise, chunk_size, prompt, False,
                                 plus)


def kvgrad(ratio: float | None = None, n_sink: int = 4, layerwise: bool = False,
           chunk_size: int = 512, prompt: str = "chat") -> CacheTransform:
    """KVgrad: KVzip's reconstruction, each attention weight times `||v W_o||_2` and times
    `||d Phi / d a_p||_2`, the gradient of `Phi = sum_p ||h_p||^2` (the last layer's output
    over the pass, before the final norm) with respect to probe token p's attention output.

    As kvpress KVgradPress(compression_ratio=ratio, layerwise=layerwise, n_sink=n_sink,
    chunk_size=chunk_size); `models.reconstruction` takes the gradient with `jax.grad`.
    """
    return reconstruction_policy("kvgrad", ratio, n_sink, layerwise, chunk_size, prompt, True)
