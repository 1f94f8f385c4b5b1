"""KVzip's (and KVgrad's) context-reconstruction pass: the model half of
`kvjax.policies.eviction_kvzip`.

A transform whose `StatsSpec` asks for a `reconstruction` gets it here, after
prefill: every sequence's context is fed again, chunk by chunk, behind the
reconstruction prompt, on top of a copy of the prefilled cache (each chunk
starts from the prefilled cache again), and each layer's slots are scored by
`eviction_kvzip.chunk_scores` from the pass's queries (KVgrad: also from the
gradient of the pass's objective, `attention_output_gradients`; KVzip+: also from each
query's attention input norm and each value's `||v W_o||`). The scores reach the
transform's update as `LayerStats.position_scores`. `models.sampler.prefill_and_compress`
calls `reconstruct` for such a transform; nothing else changes.

The prompt is token ids: `chat_prompt(tokenizer)` makes kvpress's ("Repeat the
previous context exactly.", the chat template's closing after it, its opening
as the prefix not reconstructed), `with_tokenizer` binds it to a transform.

Example:
    >>> from flax import nnx
    >>> import kvjax
    >>> from models.llama import Llama, LlamaConfig
    >>> from models.sampler import prefill_and_compress
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> t = kvjax.parse_method("kvzip:ratio=0.5,prompt=bare")   # no tokenizer: chunks alone
    >>> out = prefill_and_compress(model, [list(range(3, 35))], transform=t, room=4)
    >>> sum(int(kvjax.num_valid(layer).sum()) for layer in out.cache)  # 32 x 2 KV heads x 2 / 2
    64
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core import cpu_kernel
from kvjax.core.cache import EMPTY
from kvjax.core.layout import resize
from kvjax.core.stats import StatsSpec, init_stats
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction_kvzip import (Reconstruction, ReconstructionPrompt, chunk_scores,
                                           reconstruction_inputs, value_output_norms)
from models.llama import Llama, fixed_rope_frequencies, windowed_layers

FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with"


def chat_prompt(tokenizer) -> ReconstructionPrompt:
    """kvpress KVzipPress's prompt ids for `tokenizer` (a `models.tokenizer.Tokenizer`): the
    instruction, the chat template's closing of a user turn as the suffix and its opening's
    token count as the prefix (no template: no prefix, "\\n" as the suffix)."""
    if not tokenizer.chat_template:
        prefix, suffix = [], tokenizer.encode("\n")
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}])
        opening, closing = text.split(separator)
        prefix = tokenizer.encode(opening.split(dummy)[0], allow_special=True)
        suffix = tokenizer.encode(closing, allow_special=True)
    return ReconstructionPrompt(first=tuple(tokenizer.encode(FIRST)),
                                next=tuple(tokenizer.encode(NEXT)), suffix=tuple(suffix),
                                prefix=len(prefix))


def with_tokenizer(transform: CacheTransform, tokenizer) -> CacheTransform:
    """`transform` with its reconstruction prompt bound to `tokenizer`'s ids (`chat_prompt`)
    when it asks for one and has none yet; any other transform unchanged."""
    rec = transform.stats.reconstruction
    if rec is None or rec.prompt is not None:
        return transform
    bound = dataclasses.replace(rec, prompt=chat_prompt(tokenizer))
    return transform._replace(stats=dataclasses.replace(transform.stats, reconstruction=bound))


@functools.partial(jax.jit, static_argnames=("capacities", "impl", "group_mean"))
def _pass_scores(model, tokens, positions, cache, start, end, sinks, context,
                 capacities: tuple[int, ...], impl, group_mean: bool = False):
    """Per layer [B, KVH, C_l]: one reconstruction pass's scores of the prefilled slots (a
    sliding-window layer's are computed alike, and unused: methods leave those layers be)."""
    spec = StatsSpec(window=tokens.shape[1])
    stats = model.init_stats(spec, cache)
    _, cache, stats = model.forward(tokens, positions, cache, stats, spec, impl=impl)
    return tuple(chunk_scores(layer, s.queries, s.query_pos, start, end, sinks, context,
                              group_mean=group_mean)[..., :c]
                 for layer, s, c in zip(cache, stats, capacities))


def probe_forward(model: Llama, tokens, positions, cache, offsets, spec: StatsSpec, impl="xla"):
    """`model.forward` with `offsets[l]` [B*T, hidden] added to layer l's attention output
    (None: no offsets): (the last layer's output [B, T, hidden] before the final norm, cache,
    stats, per layer each token's attention input `h` [B, T, hidden] float32: KVzip+ divides
    by its norm, KVzap learns from it). With zero offsets, `model.norm` of it is
    `model.forward`'s output (tested): the same layers, the same order, the same embedding."""
    b, t = tokens.shape
    x = model.embed_tokens(tokens)
    stats = model.init_stats(spec, cache) or (None,) * len(model.layers)
    offsets = (0.0,) * len(model.layers) if offsets is None else offsets
    new_cache, new_stats, inputs = [], [], []
    for layer, layer_cache, layer_stats, offset in zip(model.layers, cache, stats, offsets):
        x, h, layer_cache, layer_stats = _probe_layer(layer, x, positions, layer_cache,
                                                      layer_stats, offset, spec, impl)
        inputs.append(h.astype(jnp.float32).reshape(b, t, -1))
        new_cache.append(layer_cache)
        new_stats.append(layer_stats)
    return x.reshape(b, t, -1), tuple(new_cache), tuple(new_stats), tuple(inputs)


def _probe_layer(layer, x, positions, layer_cache, layer_stats, offset, spec, impl):
    """One decoder block as `Block.__call__`, with `offset` added to its attention output:
    (x after it [B*T, hidden], its attention input h, the layer's cache, its stats)."""
    h = layer.input_norm(x)  # [B*T, hidden]
    a, layer_cache, layer_stats = layer.attn(h, positions, layer_cache, impl, layer_stats, spec)
    return layer.after_attention(x, a + offset), h, layer_cache, layer_stats


def attention_output_gradients(model: Llama, tokens, positions, cache, spec: StatsSpec):
    """KVgrad's backward pass: (per layer `d Phi / d a` [B*T, hidden] at its attention output
    `a`, the pass's cache, its stats), Phi = sum over real tokens of `||h||^2` (the last
    layer's output, before the final norm); `jax.grad` of `probe_forward` by its offsets.

    The backward runs layer by layer: each layer's forward is recomputed from its saved input
    once the gradient above it is ready (`_after`), so memory holds one layer's
    attention probabilities, not all of them (`jax.grad` of the whole pass needed 36 GiB of
    temporaries for 8 contexts of 1,024 tokens in SmolLM2). Attention by its plain definition
    (`impl="reference"`): the blockwise loop has no VJP.
    """
    with cpu_kernel.disabled():  # the CPU kernels (FFI calls) have no derivative: XLA's ops
        return _attention_output_gradients(model, tokens, positions, cache, spec)


def _attention_output_gradients(model: Llama, tokens, positions, cache, spec: StatsSpec):
    b, t = tokens.shape
    real = (positions != EMPTY).astype(jnp.float32).reshape(b * t, 1)
    x = model.embed_tokens(tokens)
    stats = model.init_stats(spec, cache)
    inputs, new_cache, new_stats = [], [], []
    for layer, layer_cache, layer_stats in zip(model.layers, cache, stats):
        inputs.append(x)
        x, _, layer_cache, layer_stats = _probe_layer(layer, x, positions, layer_cache,
                                                      layer_stats, 0.0, spec, "reference")
        new_cache.append(layer_cache)
        new_stats.append(layer_stats)
    grad_x = 2.0 * x * real  # d Phi / d x, the last layer's output
    grads = [None] * len(model.layers)
    for i in reversed(range(len(model.layers))):
        x_i = _after(inputs[i], grad_x)

        def block(x, offset, i=i):
            return _probe_layer(model.layers[i], x, positions, cache[i], stats[i], offset, spec,
                                "reference")[0]

        _, vjp = jax.vjp(block, x_i, jnp.zeros_like(x_i))
        grad_x, grads[i] = vjp(grad_x)
    return tuple(grads), tuple(new_cache), tuple(new_stats)


def _after(x: jax.Array, y: jax.Array) -> jax.Array:
    """`x` unchanged, but computed from only once `y` is: a data dependency (`x + 0 * y[0, 0]`,
    exact for a finite `y`). XLA:CPU drops `optimization_barrier`, and without an order it
    recomputes every layer's forward before the first backward step, holding them all."""
    return x + 0.0 * y[0, 0]


@functools.partial(jax.jit, static_argnames=("capacities", "impl"))
def _gradient_pass_scores(model, tokens, positions, cache, start, end, sinks, context,
                          capacities: tuple[int, ...], impl=None):
    """KVgrad's scores of one pass: attention x ||v W_o||_2 x ||d Phi / d a_p||_2, per layer
    [B, KVH, C_l] (`attention_output_gradients`)."""
    b, t = tokens.shape
    grads, new_cache, stats = attention_output_gradients(model, tokens, positions, cache,
                                                         StatsSpec(window=t))
    out = []
    for layer, s, g, c, block in zip(new_cache, stats, grads, capacities, model.layers):
        norms = value_output_norms(layer.logical_v, block.attn.o_proj.kernel[...])
        weight = jnp.linalg.norm(g.reshape(b, t, -1), axis=-1)  # [B, T]
        out.append(chunk_scores(layer, s.queries, s.query_pos, start, end, sinks, context,
                                norms, weight)[..., :c])
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("capacities", "impl"))
def _plus_pass_scores(model, tokens, positions, cache, start, end, sinks, context,
                      capacities: tuple[int, ...], impl):
    """KVzip+'s scores of one pass: each attention weight divided by its query's attention
    input norm `||h||` and times the key's `||v W_o||_2`, per layer [B, KVH, C_l]."""
    spec = StatsSpec(window=tokens.shape[1])
    _, new_cache, stats, inputs = probe_forward(model, tokens, positions, cache, None, spec,
                                                impl)
    out = []
    for layer, s, h, c, block in zip(new_cache, stats, inputs, capacities, model.layers):
        h_norm = jnp.linalg.norm(h, axis=-1)  # [B, T]
        norms = value_output_norms(layer.logical_v, block.attn.o_proj.kernel[...])
        inverse = jnp.where(h_norm > 0, 1.0 / jnp.where(h_norm > 0, h_norm, 1.0), 0.0)
        out.append(chunk_scores(layer, s.queries, s.query_pos, start, end, sinks, context,
                                norms, inverse)[..., :c])
    return tuple(out)


def reconstruct(model: Llama, cache, stats, next_pos: np.ndarray,
                contexts: Sequence[Sequence[int]], rec: Reconstruction, impl="xla"):
    """`stats` (one `LayerStats` per layer, or None) with `position_scores` [B, KVH, C] from
    KVzip's reconstruction of `contexts` (the prefilled prompts, at positions 0..n-1 of
    `cache`, whose next positions are `next_pos` [B]).

    Every pass is padded to the longest one, so all compile to one program. The pass runs
    kvjax's own decoder (`models.llama.Llama`: its forward, RoPE and projections); another
    model is refused by name.
    """
    if not isinstance(model, Llama):
        raise ValueError(f"kvzip/kvgrad: the reconstruction pass runs kvjax's own decoder "
                         f"(models.llama.Llama, every family it loads), not a "
                         f"{type(model).__name__}; score such a model with another method")
    plans = [reconstruction_inputs(c, rec) for c in contexts]
    width = max(len(ids) for plan in plans for _, _, ids in plan)

    windowed = windowed_layers(model)  # their cache is the window: the model keeps it so
    capacities = tuple(layer.capacity for layer in cache)
    grown = tuple(layer if i in windowed else  # room for a pass behind the prefilled slots
                  resize(layer, max(layer.capacity, int(layer.length) + width))
                  for i, layer in enumerate(cache))
    total = None
    for i in range(max(len(plan) for plan in plans)):
        rows = [plan[i] if i < len(plan) else (0, 0, plan[-1][2]) for plan in plans]
        padded = np.full((len(rows), width), 0, np.int32)
        positions = np.full((len(rows), width), EMPTY, np.int32)
        for b, (_, _, ids) in enumerate(rows):
            padded[b, width - len(ids):] = ids
            positions[b, width - len(ids):] = next_pos[b] + np.arange(len(ids))
        start = np.array([r[0] for r in rows], np.int32)
        end = np.array([r[1] for r in rows], np.int32)
        sinks = np.minimum(rec.n_sink, start).astype(np.int32)
        args = (model, jnp.asarray(padded), jnp.asarray(positions), grown, jnp.asarray(start),
                jnp.asarray(end), jnp.asarray(sinks), jnp.asarray(next_pos, jnp.int32),
                capacities, impl)
        if rec.gradient:
            scores = _gradient_pass_scores(*args)
        elif rec.plus:
            scores = _plus_pass_scores(*args)
        else:
            scores = _pass_scores(*args, group_mean=rec.group_mean)
        total = scores if total is None else tuple(a + s for a, s in zip(total, scores))
    if stats is None:
        cfg = model.config
        stats = init_stats(StatsSpec(), cache, cfg.num_heads, fixed_rope_frequencies(cfg))
    return tuple(s._replace(position_scores=by_position(x, layer.pos))
                 for s, x, layer in zip(stats, total, cache))


@jax.jit
def by_position(scores: jax.Array, pos: jax.Array) -> jax.Array:
    """[B, KVH, C] slot scores -> [B, KVH, C] scores by token position (position p at index p;
    empty slots and positions past C, which a window layer may hold, dropped)."""
    b, kvh, c = pos.shape
    rows = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]
    return jnp.zeros((b, kvh, c), jnp.float32).at[(*rows, jnp.where(pos >= 0, pos, c))].set(
        scores, mode="drop")
