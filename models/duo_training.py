"""DuoAttention's retrieval-head patterns, trained on the model itself (Xiao et al. 2024, §3.2).

kvpress's DuoAttentionPress downloads these patterns for six 7-8B checkpoints; for any other
model (SmolLM2 among them) it has only its on-the-fly approximation. kvjax trains them as the
paper does: one gate per (layer, KV head), starting at 1; every layer attends with
`kvjax.policies.eviction_duo.gated_attention` (`gate * full + (1 - gate) * streaming`, the
streaming part seeing only the first `sink` and last `recent` keys); the loss is the mean
squared distance between the final (normed) hidden states of the model with full attention and
with the gated mix, over the answer tokens of synthetic multi-passkey retrieval samples
(`passkey_sample`), plus `reg` times the gates' mean; Adam (the paper's AdamW without weight
decay) on the paper's trapezoid learning-rate schedule, the gates clipped to [0, 1] after
every step. A head whose gate stays high is a retrieval head. `save_patterns` writes the
`.npz` that `duo_attention:scores=PATH` reads (`head_scores` = the gates).

Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> rng = np.random.default_rng(0)
    >>> samples = [(rng.integers(3, 200, 48), np.arange(48) >= 40)]  # ids, supervised tokens
    >>> out = train_duo_gates(model, samples, steps=4, sink=4, recent=8, progress=False)
    >>> out.gates.shape, bool((out.gates <= 1).all() and (out.gates >= 0).all())
    ((2, 2), True)
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.core import cpu_kernel
from kvjax.policies.eviction import check_int, check_real
from kvjax.policies.eviction_duo import RECENT, SINK, gated_attention
from models.llama import Llama, new_cache, windowed_layers

LR, REG = 0.02, 0.05  # the paper's published patterns: lr=0.02, reg=0.05
PASSKEYS, WORDS = 5, 16  # per sample (the paper: 10 passkeys of 32 words in 1k-128k tokens)
PASSKEY_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
                 "india", "juliett", "kilo", "lima", "mike", "november", "oscar", "papa",
                 "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray",
                 "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
            "ninth", "tenth")
OPENING = "This is a very long story book: <book> "
CLOSING = " </book>.\n\n"
NEEDLE = "Remember this sequence of words, it's the {} passkey to the vault: "
QUESTION = "Based on the content of the book, what is the {} passkey to the vault?\nPasskey: "
SEPARATOR = "\n\n"


def passkey_sample(tokenizer, haystack: Sequence[int], length: int, passkeys: int, words: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One multi-passkey retrieval sample of exactly `length` tokens, as the paper's training
    data: `passkeys` needles ("Remember this sequence of words, it's the first passkey to the
    vault: " + `words` random NATO-alphabet words) put into the haystack's first tokens at
    sorted random depths in [5%, 95%], the book closed, then every question and its passkey.

    Returns (ids [length] int32, answer [length] bool: the question-and-answer tokens, whose
    hidden states the loss compares)."""
    check_int("passkey_sample", "length", length)
    check_int("passkey_sample", "passkeys", passkeys)
    if passkeys > len(ORDINALS):
        raise ValueError(f"passkey_sample: need passkeys <= {len(ORDINALS)}, got {passkeys}")
    check_int("passkey_sample", "words", words, 1)
    enc = tokenizer.encode
    keys = [enc(" ".join(rng.choice(PASSKEY_WORDS, words))) for _ in range(passkeys)]
    needles = [enc(SEPARATOR + NEEDLE.format(ORDINALS[i])) + keys[i] + enc(SEPARATOR)
               for i in range(passkeys)]
    qa = sum((enc(QUESTION.format(ORDINALS[i])) + keys[i] + enc(SEPARATOR)
              for i in range(passkeys)), [])
    opening, closing = enc(OPENING), enc(CLOSING)
    fill = length - len(opening) - len(closing) - len(qa) - sum(map(len, needles))
    if fill < passkeys:
        raise ValueError(f"passkey_sample: length={length} is too short for {passkeys} passkeys "
                         f"of {words} words: must be >= {length - fill + passkeys}")
    if len(haystack) < fill:
        raise ValueError(f"passkey_sample: the haystack has {len(haystack)} tokens, "
                         f"length={length} needs {fill}")
    cuts = np.sort(rng.choice(np.arange(int(0.05 * fill), int(0.95 * fill) + 1), passkeys,
                              replace=False))
    context, last = list(opening), 0
    for cut, needle in zip(cuts, needles):
        context += list(haystack[last:cut]) + needle
        last = cut
    context += list(haystack[last:fill]) + closing
    ids = np.asarray(context + qa, np.int32)
    return ids, np.arange(length) >= len(context)


def passkey_samples(tokenizer, text_ids: Sequence[int], count: int, length: int,
                    passkeys: int = PASSKEYS, words: int = WORDS, seed: int = 0):
    """`count` `passkey_sample`s of `length` tokens, each on a haystack cut from `text_ids` at
    a random offset."""
    check_int("passkey_samples", "count", count)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        start = int(rng.integers(0, max(len(text_ids) - length, 0) + 1))
        out.append(passkey_sample(tokenizer, text_ids[start:start + length], length, passkeys,
                                  words, rng))
    return out


def duo_hidden(model: Llama, tokens: jax.Array, gates: jax.Array, sink: int,
               recent: int) -> jax.Array:
    """Final-norm hidden states [B, T, hidden] float32 of `tokens` [B, T] (positions 0..T-1)
    with every layer's attention gated by `gates` [L, KVH] (`gated_attention`): all ones is
    the model itself (`teacher_hidden`)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    softcap = model.config.attn_softcap
    with cpu_kernel.disabled():  # XLA's ops throughout: the CPU kernels have no derivative
        x = model.embed_tokens(tokens)
        for i, layer in enumerate(model.layers):
            _, q, k, v = layer.attn.project(layer.input_norm(x), positions)
            out = gated_attention(q, k, v, gates[i], sink, recent, softcap)
            x = layer.after_attention(x, layer.attn.o_proj(out.reshape(b * t, -1)))
        return model.norm(x).reshape(b, t, -1)


def distill_loss(full: jax.Array, mixed: jax.Array, answer: jax.Array) -> jax.Array:
    """Mean over the `answer` [B, T] tokens of the mean over hidden units of the squared
    difference between `full` and `mixed` [B, T, hidden]."""
    per_token = jnp.mean(jnp.square(full - mixed), axis=-1)
    return jnp.sum(per_token * answer) / jnp.maximum(jnp.sum(answer), 1)


def schedule(lr: float, steps: int):
    """The paper's trapezoid: linear warm-up over the first fifth of `steps`, flat, linear
    decay over the last fifth, never below a tenth of `lr`."""
    fifth = max(steps // 5, 1)

    def rate(step):
        up = jnp.maximum((step + 1) / fifth, 0.1)
        down = jnp.maximum((steps - step) / fifth, 0.1)
        return lr * jnp.minimum(1.0, jnp.minimum(up, down))
    return rate


@dataclasses.dataclass(frozen=True)
class DuoTraining:
    """Trained gates [L, KVH] in [0, 1] (1: a retrieval head), the streaming window they were
    trained for, and each step's (distillation loss, mean gate)."""

    gates: np.ndarray
    sink: int
    recent: int
    history: np.ndarray  # [steps, 2]
    config: dict

    def save(self, path) -> None:
        """An `.npz` for `duo_attention:scores=PATH` (`head_scores` = the gates)."""
        np.savez(path, head_scores=self.gates.astype(np.float32), sink=self.sink,
                 recent=self.recent, history=self.history, config=json.dumps(self.config))


def check_trainable(model: Llama) -> None:
    """ValueError unless every layer attends to the whole context (sliding-window layers have
    no full-attention branch to gate)."""
    windowed = windowed_layers(model)
    if windowed:
        raise ValueError(f"train_duo_gates: layers {list(windowed)} attend through a sliding "
                         "window; DuoAttention's gates need full-attention layers")


def train_duo_gates(model: Llama, samples: Sequence[tuple[np.ndarray, np.ndarray]],
                    steps: int = 200, lr: float = LR, reg: float = REG, sink: int = SINK,
                    recent: int = RECENT, progress: bool = True) -> DuoTraining:
    """Gates trained over `samples` ((ids [T], answer [T] bool) pairs, e.g. `passkey_sample`),
    one sample per step, in order, cycling. Each distinct length compiles once."""
    check_trainable(model)
    check_int("train_duo_gates", "steps", steps, 1)
    check_int("train_duo_gates", "sink", sink, 0)
    check_int("train_duo_gates", "recent", recent, 1)
    check_real("train_duo_gates", "lr", lr, 1e-12)
    check_real("train_duo_gates", "reg", reg, 0.0)
    if not samples:
        raise ValueError("train_duo_gates: needs at least one sample")
    for ids, answer in samples:
        if np.shape(ids) != np.shape(answer) or np.ndim(ids) != 1 or not np.any(answer):
            raise ValueError("train_duo_gates: each sample is (ids [T], answer [T] bool) with "
                             f"at least one answer token; got shapes {np.shape(ids)}, "
                             f"{np.shape(answer)}")
    cfg = model.config
    gates = jnp.ones((cfg.num_layers, cfg.num_kv_heads), jnp.float32)
    state = _optimizer(lr, steps).init(gates)
    history, teachers = [], {}
    for i in tqdm(range(steps), desc="DuoAttention gates", unit="step", disable=not progress):
        ids, answer = samples[i % len(samples)]
        tokens = jnp.asarray(ids, jnp.int32)[None]
        if i % len(samples) not in teachers:
            teachers[i % len(samples)] = teacher_hidden(model, tokens)
        gates, state, distill = _step(model, gates, state, tokens, jnp.asarray(answer)[None],
                                      teachers[i % len(samples)], lr, reg, steps, sink, recent)
        history.append((float(distill), float(gates.mean())))
    config = {"steps": steps, "lr": lr, "reg": reg, "sink": sink, "recent": recent,
              "samples": len(samples), "lengths": sorted({len(s[0]) for s in samples})}
    return DuoTraining(np.asarray(gates), sink, recent, np.asarray(history, np.float32), config)


def _optimizer(lr, steps: int):
    """Adam (the paper's AdamW, weight decay 0) on `schedule(lr, steps)`."""
    import optax
    return optax.adam(schedule(lr, steps))


@jax.jit
def teacher_hidden(model: Llama, tokens: jax.Array) -> jax.Array:
    """The model's own final-norm hidden states [B, T, hidden] of `tokens` [B, T] (positions
    0..T-1), full attention: what the gated model is trained to reproduce."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return model.hidden(tokens, positions, new_cache(model.config, b, t))[0]


@functools.partial(jax.jit, static_argnames=("steps", "sink", "recent"))
def _step(model, gates, state, tokens, answer, full, lr, reg, steps, sink, recent):
    """One Adam step on the gates: (gates clipped to [0, 1], optimizer state, distillation)."""
    import optax

    def loss(g):
        distill = distill_loss(full, duo_hidden(model, tokens, g, sink, recent), answer)
        return distill + reg * jnp.mean(jnp.abs(g)), distill

    (_, distill), grads = jax.value_and_grad(loss, has_aux=True)(gates)
    updates, state = _optimizer(lr, steps).update(grads, state, gates)
    return jnp.clip(optax.apply_updates(gates, updates), 0.0, 1.0), state, distill
