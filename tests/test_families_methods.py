"""Every method of the sweep (`kvjax.METHODS`, the extra specs and three chains) generates on
each family's tiny random checkpoint (tests/golden/families).

One batch of prompts of 7, 33 and 129 tokens (the longest crosses every window: 40, 48, 64),
five new tokens, compressed after prefill and every two decode steps (the sweep runs prompt
compression alone too; here both paths run in one generation, a fifth of the sweep's cost). Methods compress the
full-attention layers (`models.sampler.for_full_layers`): a sliding-window layer's cache is
its window by construction and stays as it is, so on Mistral and Phi-3 with a sliding window
(every layer windowed) every method leaves the cache as `full` does, and the tokens equal
the full cache's. Nothing may raise, every logit must be finite, and a codec's cache gives
the logits attention over its decoded values gives (as the sweep checks).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.low_rank import LowRankBasis
from models.loading import build_model, load_hf_dir
from models.sampler import generate, windowed_layers
from tests.test_every_method_every_prompt import (BASIS, SPECS, check_stores, is_codec,
                                                  one_step)

GOLDEN = Path(__file__).parent / "golden" / "families"
FAMILIES = ("llama3", "qwen2", "qwen3", "mistral_sw", "gemma3", "phi3")
LENGTHS = (7, 33, 129)
MAX_NEW = 5


@pytest.fixture(scope="module", autouse=True)
def _quick_compiles():
    """XLA with most optimizations off (the sweep's setting: ~40 small programs a family)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, model, basis path): the family's model and a random orthonormal basis for its
    full-attention layers (the layers low_rank sees)."""
    cfg, params = load_hf_dir(GOLDEN / request.param)
    model = build_model(cfg, params)
    full_layers = cfg.num_layers - len(windowed_layers(model))
    rng = np.random.default_rng(0)
    shape = (max(full_layers, 1), cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    keys, values = (np.linalg.qr(rng.standard_normal(shape))[0].astype(np.float32)
                    for _ in range(2))
    energy = np.tile(np.arange(cfg.head_dim, 0, -1, dtype=np.float32), shape[:2] + (1,))
    path = tmp_path_factory.mktemp("basis") / f"{request.param}_basis.npz"
    LowRankBasis(keys, values, energy, energy, 1).save(path)
    return request.param, model, str(path)


def prompts(vocab: int) -> list[list[int]]:
    return [np.random.default_rng(n).integers(3, vocab, n).tolist() for n in LENGTHS]


def step_equals_decoded_step(model, cache, tokens, next_pos) -> None:
    """One more step over `cache` gives the logits attention over its decoded values gives
    (windowed layers have no free slot by design: they make room by dropping the oldest)."""
    windowed = windowed_layers(model)
    for i, layer in enumerate(cache):
        assert i in windowed or kvjax.free_tokens(layer) >= 1, f"layer {i} is full"
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(tokens, jnp.int32)[:, None]
    pos = jnp.asarray(next_pos, jnp.int32)[:, None]
    encoded, decoded = (np.asarray(one_step(graphdef, state, tokens, pos, cache, decoded=d))
                        for d in (False, True))
    assert np.isfinite(encoded).all()
    np.testing.assert_allclose(encoded, decoded, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", SPECS)
def test_method_generates_on_every_family(family, spec):
    name, model, basis = family
    batch = prompts(model.config.vocab_size)
    out = generate(model, batch, max_new_tokens=MAX_NEW, compress_every=2, eos_ids=(),
                   transform=kvjax.parse_method(spec.replace(BASIS, basis)), chunk=64)
    assert out.tokens.shape == (len(LENGTHS), MAX_NEW)
    assert ((0 <= out.tokens) & (out.tokens < model.config.vocab_size)).all()
    check_stores(out.cache)
    windows = model.config.layer_windows
    for layer, window in zip(out.cache, windows):
        if window is not None:  # untouched by the method: a plain window-sized cache
            assert isinstance(layer, kvjax.TokenCache) and layer.capacity == window
    if all(w is not None for w in windows):  # nothing a method may compress
        full = generate(model, batch, max_new_tokens=MAX_NEW, eos_ids=(), chunk=64)
        np.testing.assert_array_equal(out.tokens, full.tokens)
    if is_codec(out.cache):
        next_pos = [n + MAX_NEW - 1 for n in LENGTHS]  # the last drawn token is unwritten
        step_equals_decoded_step(model, out.cache, out.tokens[:, -1], next_pos)
