"""Bring your own model: a decoder written here, not in `models/`, runs every kvjax transform.

The contract `models.sampler` (generate, prefill, decode, compression) asks of a model:

* an `nnx.Module` (jitted functions take it as a pytree of weights) with a frozen, hashable
  `config` holding `cache_spec` (`kvjax.CacheSpec`), `num_layers`, `vocab_size`,
  `max_position` and `eos_ids`;
* `forward(tokens [B, T], positions [B, T], cache, stats, spec, *, impl) -> (hidden
  [B, T, D], cache, stats)`, where each attention layer writes its keys and values with
  `kvjax.write`, attends with `kvjax.attend(q, positions, layer_cache, impl=impl)`, folds
  attention mass in with `kvjax.core.stats.accumulate_mass` (H2O and other accumulated-attention
  policies) and, when `stats` is not None, its queries with `kvjax.core.stats.observe` (SnapKV's
  window, ExpectedAttention's moments);
* `logits(hidden) -> [..., vocab]` and `init_stats(spec, cache)` (None when the spec needs
  nothing: `kvjax.init_stats` otherwise, given each layer's output projection W_o
  [H*D, hidden] when `spec.output_projection` is set: CriticalKV's scorers read it).

The decoder below is deliberately not `models.llama`: no RoPE (positions enter as a learned
table), one head per KV head, a GELU MLP. Greedy tokens with the full cache equal a plain
forward over the growing sequence; every method of the sweep's table generates on it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.core.stats import NO_STATS, accumulate_mass, observe
from models.sampler import generate
from tests.test_every_method_every_prompt import (
    BASIS, PROMPT_ONLY, SPECS, check_stores, random_basis)


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 64
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 2  # = KV heads here
    head_dim: int = 32
    max_position: int = 512
    eos_ids: tuple[int, ...] = ()

    @property
    def cache_spec(self) -> kvjax.CacheSpec:
        return kvjax.CacheSpec(self.num_layers, self.num_heads, self.head_dim)


class TinyAttention(nnx.Module):
    def __init__(self, cfg: TinyConfig, rngs: nnx.Rngs):
        init = lambda n: nnx.Param(jax.random.normal(rngs.params(), (cfg.hidden, n)) * 0.15)
        self.qkv = init(3 * cfg.num_heads * cfg.head_dim)
        self.out = nnx.Param(jax.random.normal(rngs.params(), (cfg.num_heads * cfg.head_dim,
                                                                cfg.hidden)) * 0.15)
        self.shape = (cfg.num_heads, cfg.head_dim)

    def __call__(self, x, positions, cache, stats, spec, impl):  # x [B, T, D]
        b, t, _ = x.shape
        h, d = self.shape
        q, k, v = jnp.split(x @ self.qkv[...], 3, axis=-1)
        q, k, v = (y.reshape(b, t, h, d) for y in (q, k, v))  # [B, T, H, D]
        cache = kvjax.write(cache, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions)
        out = kvjax.attend(q, positions, cache, impl=impl)  # [B, T, H, D]
        cache = accumulate_mass(cache, q, positions)
        if stats is not None:
            stats = observe(spec, stats, q, q, positions)  # no RoPE: pre- and post- are equal
        return out.reshape(b, t, h * d) @ self.out[...], cache, stats


class TinyDecoder(nnx.Module):
    def __init__(self, cfg: TinyConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden)))
        self.where = nnx.Param(jax.random.normal(rngs.params(), (cfg.max_position, cfg.hidden))
                               * 0.3)
        self.layers = nnx.List([TinyAttention(cfg, rngs) for _ in range(cfg.num_layers)])
        self.mlp = nnx.Linear(cfg.hidden, cfg.hidden, rngs=rngs)

    def forward(self, tokens, positions, cache, stats=None, spec=NO_STATS, *, impl="xla"):
        x = self.embed[...][tokens] + self.where[...][jnp.maximum(positions, 0)]  # [B, T, D]
        new_cache, new_stats = [], []
        for i, layer in enumerate(self.layers):
            a, c, s = layer(x, positions, cache[i], None if stats is None else stats[i], spec,
                            impl)
            x = x + a
            x = x + jax.nn.gelu(self.mlp(x))
            new_cache.append(c)
            new_stats.append(s)
        return x, tuple(new_cache), None if stats is None else tuple(new_stats)

    def logits(self, h):
        return h @ self.embed[...].T

    def init_stats(self, spec, cache):
        if not (spec.window or spec.query_moments or spec.output_projection):
            return None
        freqs = np.zeros(self.config.head_dim // 2, np.float32)  # no RoPE: nothing rotates
        out_proj = ([layer.out[...] for layer in self.layers]  # W_o [H*D, hidden] per layer
                    if spec.output_projection else None)
        return kvjax.init_stats(spec, cache, self.config.num_heads, freqs, out_proj)



@pytest.fixture(scope="module")
def model():
    return TinyDecoder(TinyConfig(), nnx.Rngs(0))


def plain_greedy(model, prompt, n):
    """Greedy tokens from a full forward over the growing sequence (no cache reuse)."""
    ids = list(prompt)
    for _ in range(n):
        t = len(ids)
        cache = kvjax.init_model_cache(model.config.cache_spec, 1, t)
        h, _, _ = model.forward(jnp.asarray([ids]), jnp.arange(t)[None], cache)
        ids.append(int(jnp.argmax(model.logits(h[0, -1]))))
    return ids[len(prompt):]


def test_own_decoder_with_a_full_cache_equals_its_plain_forward(model):
    prompt = np.random.default_rng(0).integers(3, 64, 50).tolist()
    out = generate(model, [prompt], max_new_tokens=8, chunk=16)
    assert out.tokens[0].tolist() == plain_greedy(model, prompt, 8)


@pytest.mark.parametrize("spec", [s for s in SPECS if "low_rank" not in s])
def test_every_method_runs_on_an_own_decoder(model, spec, tmp_path):
    """(low_rank needs a calibrated basis of the model's keys: the sweep's covers it;
    duo_attention gets random head scores for this model's layers and heads.) kvzip and
    kvgrad replay the context through kvjax's own decoder, so they refuse another one by
    name; kvzap and fastkvzip read the attention inputs kvjax's decoder passes to `observe`, and
    refuse a decoder whose statistics have none, by name."""
    cfg = model.config
    scores = random_basis(tmp_path / "scores.npz", cfg.num_layers, cfg.num_heads, cfg.head_dim,
                          hidden=cfg.hidden)
    prompts = [np.random.default_rng(n).integers(3, 64, n).tolist() for n in (7, 129)]
    run = lambda: generate(model, prompts, max_new_tokens=5, compress_every=2, eos_ids=(),
                           chunk=64, transform=kvjax.parse_method(spec.replace(BASIS, scores)))
    if spec.startswith(("kvzap", "fastkvzip")):  # scores from the attention inputs kvjax's
        with pytest.raises(ValueError, match="scores tokens as the model runs them"):  # decoder
            run()  # hands to `observe`; this decoder collects no such statistics
        return
    if spec in PROMPT_ONLY:
        with pytest.raises(ValueError, match="reconstruction pass runs kvjax's own decoder"):
            run()
        return
    out = run()
    assert out.tokens.shape == (2, 5)
    check_stores(out.cache)
