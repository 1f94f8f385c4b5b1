"""RestoreKV's model half: the restore pass, and training its embeddings and adapter.

`kvjax.policies.eviction_restorekv` declares the method; here the model runs it. After
prefill and KVzip's reconstruction pass, `restore_pass` feeds the `n` restore embeddings at
the positions after each prompt, through a copy of the model with the LoRA adapter merged
(`models.lora.merged`), on top of the full cache: their keys and values are written behind
the prompt. `models.sampler.prefill_and_compress` calls it, moves the next positions past
them (kvpress: the question starts at the cache's length), then evicts.

kvpress downloads the paper's adapters for two 8B models only; `train_restorekv` trains
them for any model kvjax runs, by self-distillation as the paper does: the teacher is the
model on the full cache, the student the same model on the cache KVzip compressed at a
ratio with the restore tokens written before the eviction; the loss is the KL divergence
between their next-token distributions over the continuation after each context, and only
the embeddings and the adapter learn (Adam, optax). `kvjax calibrate --restorekv --out DIR`
runs it on windows of a text and saves `RestoreTokens` with orbax.

The student's pass is a dense, differentiable forward (`Llama.forward` with
`impl="reference"` and the CPU kernels off: the blockwise attention and the FFI kernels have
no derivative), its evicted slots masked out by position, as kvpress masks them.

Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> import kvjax
    >>> from kvjax.policies.eviction_restorekv import restorekv
    >>> from models.llama import Llama, LlamaConfig
    >>> from models.sampler import prefill_and_compress
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> tokens = initial_tokens(model, n=4, rank=2, targets=("v_proj",))
    >>> out = prefill_and_compress(model, [list(range(3, 35))], room=4,
    ...                            transform=restorekv(0.5, tokens, prompt="bare"))
    >>> int(out.next_pos[0])                  # 32 prompt tokens, then 4 restore tokens
    36
    >>> sum(int(kvjax.num_valid(layer).sum()) for layer in out.cache)  # as kvzip: 128 / 2
    64
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.core import cpu_kernel
from kvjax.core.cache import EMPTY
from kvjax.core.stats import StatsSpec
from kvjax.policies.eviction import check_int, check_real
from kvjax.policies.eviction_kvzip import (Reconstruction, ReconstructionPrompt, kvzip_keep,
                                           stacked_slot_scores)
from kvjax.policies.eviction_restorekv import RestoreTokens
from models.llama import Llama, new_cache, windowed_layers
from models.lora import LoRA, merged

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the adapter's default targets


def lora_of(tokens: RestoreTokens, model: Llama) -> LoRA:
    """The adapter of `tokens` as a `models.lora.LoRA`, checked against `model`."""
    cfg = model.config
    tokens.check_model(cfg.num_layers, cfg.hidden_size)
    lora = LoRA(tokens.lora_a, tokens.lora_b, tokens.alpha)
    lora.check_model(model)
    return lora


def initial_tokens(model: Llama, n: int = 8, rank: int = 8, alpha: float = 16.0,
                   targets: Sequence[str] = ATTENTION, seed: int = 0) -> RestoreTokens:
    """Untrained `RestoreTokens`: `n` embeddings drawn from the model's token embeddings
    (distinct random rows), a fresh adapter (PEFT's start: B = 0, so it changes nothing)."""
    check_int("restorekv", "n", n)
    rng = np.random.default_rng(seed)
    table = np.asarray(model.embed[...], np.float32)
    rows = rng.choice(table.shape[0], n, replace=False)
    lora = LoRA.initial(model, rank, alpha, tuple(targets), seed)
    return RestoreTokens(table[rows], lora.a, lora.b, lora.alpha)


@functools.partial(jax.jit, static_argnames=("alpha", "impl"))
def _write_restore(model, params, embeddings, positions, cache, alpha: float, impl: str):
    """The cache with the restore embeddings [n, hidden] written at `positions` [B, n] by the
    adapted model (one pass, every row the same embeddings)."""
    b, n = positions.shape
    x = model.scale_embedded(jnp.tile(embeddings, (b, 1)))  # [B*n, hidden]
    return merged(model, params, alpha).forward_embedded(x, positions, cache, impl=impl)[1]


def restore_pass(model: Llama, cache, next_pos: np.ndarray, tokens: RestoreTokens,
                 impl: str = "xla"):
    """`cache` with the restore tokens written after every prompt, at positions `next_pos`
    [B] (each prompt's next) onward; the caller moves its next positions `tokens.n` on. Every
    layer needs `tokens.n` free slots (`prefill_and_compress` leaves them)."""
    lora = lora_of(tokens, model)
    n = tokens.n
    if next_pos.max() + n > model.config.max_position:
        raise ValueError(f"restorekv: {n} restore tokens after {next_pos.max()} reach past "
                         f"the model's {model.config.max_position} positions")
    windowed = windowed_layers(model)
    for i, layer in enumerate(cache):
        free = layer.capacity - int(layer.length)
        if i not in windowed and free < n:
            raise ValueError(f"restorekv: layer {i} has {free} free slots, the restore pass "
                             f"writes {n}; prefill with room for them")
    positions = (next_pos[:, None] + np.arange(n)).astype(np.int32)
    return _write_restore(model, lora.params(), jnp.asarray(tokens.embeddings),
                          jnp.asarray(positions), cache, lora.alpha, impl)


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class RestoreKVTraining:
    """Trained `RestoreTokens`, each step's loss, and the held-out KL divergences (nats per
    token) of KVzip alone, of the untrained and of the trained restore tokens per ratio."""

    tokens: RestoreTokens
    history: np.ndarray  # [steps] the training loss
    held_out: dict  # ratio -> {"kvzip", "untrained", "trained"}
    config: dict


@dataclasses.dataclass(frozen=True)
class _Sample:
    """One window prepared for training: the prefilled full cache, the continuation, the
    teacher's log-probabilities and, per ratio, the student's keep mask."""

    cache: tuple
    start: int  # the first restore position (the context's length)
    continuation: jax.Array  # [1, T] int32
    teacher: jax.Array  # [1, T, V] float32 log-probabilities on the full cache
    keep: dict  # ratio -> per layer [1, KVH, C] bool (restore slots kept)
    kvzip_keep: dict  # ratio -> the same for KVzip alone (no restore slots)


@jax.jit
def _teacher(model, tokens, positions, cache):
    """Log-probabilities [1, T, V] of `tokens` on the full `cache`, in the student's numerics
    (a student that evicts nothing and writes no restore tokens has KL 0)."""
    with cpu_kernel.disabled():
        h, _, _ = model.forward(tokens, positions, cache, impl="reference")
    return jax.nn.log_softmax(model.logits(h), axis=-1)


def _student(model, params, embeddings, alpha, cache, keep, tokens, start: int):
    """Log-probabilities [1, T, V] of `tokens` [1, T] after the restore pass on the full
    `cache` and the eviction `keep` (per layer [1, KVH, C] bool), differentiable in `params`
    and `embeddings`; `embeddings` None: no restore tokens (KVzip alone)."""
    with cpu_kernel.disabled():  # XLA's ops throughout: the CPU kernels have no derivative
        n = 0 if embeddings is None else embeddings.shape[0]
        if n:
            positions = jnp.arange(start, start + n, dtype=jnp.int32)[None]
            x = model.scale_embedded(embeddings)
            _, cache, _ = merged(model, params, alpha).forward_embedded(
                x, positions, cache, impl="reference")
        cache = tuple(layer.replace(pos=jnp.where(k, layer.pos, EMPTY))
                      for layer, k in zip(cache, keep))
        t = tokens.shape[1]
        positions = jnp.arange(start + n, start + n + t, dtype=jnp.int32)[None]
        h, _, _ = model.forward(tokens, positions, cache, impl="reference")
    return jax.nn.log_softmax(model.logits(h), axis=-1)


def kl_per_token(teacher: jax.Array, student: jax.Array) -> jax.Array:
    """Mean over tokens of KL(teacher || student), both [.., T, V] log-probabilities."""
    return jnp.mean(jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1))


@functools.partial(jax.jit, static_argnames=("alpha", "start"))
def _kl(model, params, embeddings, alpha, cache, keep, tokens, teacher, start):
    return kl_per_token(teacher, _student(model, params, embeddings, alpha, cache, keep,
                                          tokens, start))


@jax.jit
def _prefill(model, tokens, cache):
    """`cache` after `tokens` [1, T] at positions 0..T-1."""
    return model.forward(tokens, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], cache)[1]


def _prepare(model: Llama, window: Sequence[int], prefix: int, n: int,
             ratios: Sequence[float], rec: Reconstruction) -> _Sample:
    from models.reconstruction import reconstruct

    context, continuation = list(window[:prefix]), list(window[prefix:])
    cache = _prefill(model, jnp.asarray([context], jnp.int32),
                     new_cache(model.config, 1, len(window) + n))
    next_pos = np.array([prefix])
    stats = reconstruct(model, cache, None, next_pos, [context], rec)
    cont = jnp.asarray([continuation], jnp.int32)
    teacher = _teacher(model, cont, jnp.arange(prefix, len(window))[None], cache)
    # where the restore pass writes: the slots after the prompt, at positions prefix.. (the
    # adapter does not move them: any one gives the positions)
    written = restore_pass(model, cache, next_pos, initial_tokens(model, n, 1, targets=("v_proj",)))
    pos, scores = stacked_slot_scores(written, stats)
    plain_pos, plain_scores = stacked_slot_scores(cache, stats)
    keep, alone = {}, {}
    for r in ratios:
        k = kvzip_keep(scores, pos, jnp.float32(r), rec.n_sink, False, restored=n)
        keep[r] = tuple(k[i, ..., :layer.capacity] for i, layer in enumerate(written))
        k = kvzip_keep(plain_scores, plain_pos, jnp.float32(r), rec.n_sink, False)
        alone[r] = tuple(k[i, ..., :layer.capacity] for i, layer in enumerate(cache))
    return _Sample(cache, prefix, cont, teacher, keep, alone)


def train_restorekv(model: Llama, windows: Sequence[Sequence[int]],
                    prompt: ReconstructionPrompt, prefix: int,
                    ratios: Sequence[float] = (0.5, 0.75), held_out: int = 1, n: int = 8,
                    rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = ATTENTION,
                    steps: int = 200, lr: float = 1e-3, chunk_size: int = 2048,
                    seed: int = 0, progress: bool = True) -> RestoreKVTraining:
    """Restore embeddings and adapter trained on `windows` (token ids, all one length): each
    window's first `prefix` tokens are the context, the rest the continuation the student
    is scored on; each step takes the next (window, ratio) pair of the training windows
    (all but the last `held_out`), cycling. KVzip scores the contexts behind `prompt`
    (`models.reconstruction.chat_prompt`) in chunks of `chunk_size`."""
    check_int("train_restorekv", "steps", steps)
    check_int("train_restorekv", "held_out", held_out, 1)
    check_real("train_restorekv", "lr", lr, 1e-12)
    lengths = sorted({len(w) for w in windows})
    if len(lengths) != 1 or len(windows) <= held_out:
        raise ValueError(f"train_restorekv: needs more than held_out={held_out} windows of one "
                         f"length, got {len(windows)} of lengths {lengths}")
    if not 0 < prefix < lengths[0]:
        raise ValueError(f"train_restorekv: prefix must be in [1, {lengths[0] - 1}] (the "
                         f"windows' length {lengths[0]} less one), got {prefix!r}")
    if not ratios:
        raise ValueError("train_restorekv: needs at least one ratio")
    for r in ratios:
        check_real("train_restorekv", "ratio", r, 0.0, 1.0, high_open=True)
    if windowed_layers(model):
        raise ValueError("train_restorekv: sliding-window layers are not trained for (their "
                         "cache is the window; KVzip leaves them be)")
    import optax

    rec = Reconstruction(chunk_size, prompt=prompt)
    samples = [_prepare(model, w, prefix, n, ratios, rec) for w in
               tqdm(windows, desc="RestoreKV: teachers and KVzip", disable=not progress)]
    train, held = samples[:-held_out], samples[-held_out:]
    start = initial_tokens(model, n, rank, alpha, targets, seed)
    params = (lora_of(start, model).params(), jnp.asarray(start.embeddings))
    optimizer = optax.adam(lr)
    state = optimizer.init(params)

    @functools.partial(jax.jit, static_argnames=("start",))
    def step(model, params, state, cache, keep, tokens, teacher, start):
        loss, grads = jax.value_and_grad(lambda p: _kl(model, p[0], p[1], alpha, cache, keep,
                                                       tokens, teacher, start))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def held_kl(params, ratio, restore=True):
        return float(np.mean([_kl(model, params[0], params[1] if restore else None, alpha,
                                  s.cache, s.keep[ratio] if restore else s.kvzip_keep[ratio],
                                  s.continuation, s.teacher, s.start) for s in held]))

    before = {r: (held_kl(params, r, False), held_kl(params, r)) for r in ratios}
    pairs = [(s, r) for s in train for r in ratios]
    history = []
    for i in tqdm(range(steps), desc="RestoreKV", unit="step", disable=not progress):
        s, r = pairs[i % len(pairs)]
        params, state, loss = step(model, params, state, s.cache, s.keep[r], s.continuation,
                                   s.teacher, s.start)
        history.append(float(loss))
    scores = {r: {"kvzip": before[r][0], "untrained": before[r][1],
                  "trained": held_kl(params, r)} for r in ratios}
    trained = LoRA.from_params(params[0], alpha)
    tokens = RestoreTokens(np.asarray(params[1], np.float32), trained.a, trained.b, alpha)
    config = {"windows": len(windows), "held_out": held_out, "window": lengths[0],
              "prefix": prefix, "ratios": list(ratios), "n": n, "rank": rank, "alpha": alpha,
              "targets": list(targets), "steps": steps, "lr": lr, "seed": seed}
    return RestoreKVTraining(tokens, np.asarray(history, np.float32), scores, config)


# ----------------------------------------------------------------------------- kvpress


def save_peft(tokens: RestoreTokens, folder, base_model: str = "") -> None:
    """Write `tokens` as kvpress loads RestoreKV's hub artifacts: `restore_embeddings.safetensors`
    (key `restore_embeddings`, [n, hidden]) and a PEFT LoRA adapter (`adapter_config.json`,
    `adapter_model.safetensors`; torch's Linear weights are kvjax's kernels transposed, so
    `lora_A` = A_l^T [r, d_in] and `lora_B` = B_l^T [d_out, r])."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    from models.lora import TARGETS

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"restore_embeddings": np.ascontiguousarray(tokens.embeddings)},
              str(folder / "restore_embeddings.safetensors"))
    weights = {}
    for t in tokens.lora_a:
        group = {"attn": "self_attn", "mlp": "mlp"}[TARGETS[t][0]]
        for i in range(tokens.num_layers):
            base = f"base_model.model.model.layers.{i}.{group}.{t}"
            weights[f"{base}.lora_A.weight"] = np.ascontiguousarray(tokens.lora_a[t][i].T)
            weights[f"{base}.lora_B.weight"] = np.ascontiguousarray(tokens.lora_b[t][i].T)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    rank = next(iter(tokens.lora_a.values())).shape[-1]
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": tokens.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(tokens.lora_a), "fan_in_fan_out": False,
        "inference_mode": True}, indent=1))
