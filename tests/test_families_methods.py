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

import numpy as np
import pytest

import kvjax
from models.loading import build_model, load_hf_dir
from models.sampler import generate, windowed_layers
from tests.test_every_method_every_prompt import (
    BASIS, PROMPT_ONLY, SPECS, check_stores, is_codec, random_basis,
    step_equals_decoded_step)

GOLDEN = Path(__file__).parent / "golden" / "families"
FAMILIES = ("llama3", "qwen2", "qwen3", "mistral_sw", "gemma3", "phi3")
LENGTHS = (7, 33, 129)
MAX_NEW = 5



@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, model, basis path): the family's model and a random orthonormal basis for its
    full-attention layers (the layers low_rank sees)."""
    cfg, params = load_hf_dir(GOLDEN / request.param)
    model = build_model(cfg, params)
    full_layers = cfg.num_layers - len(windowed_layers(model))
    path = random_basis(tmp_path_factory.mktemp("basis") / f"{request.param}_basis.npz",
                        max(full_layers, 1), cfg.num_kv_heads, cfg.head_dim, cfg.num_heads,
                        cfg.hidden_size, cfg.num_layers)
    return request.param, model, path


def prompts(vocab: int) -> list[list[int]]:
    return [np.random.default_rng(n).integers(3, vocab, n).tolist() for n in LENGTHS]



@pytest.mark.parametrize("spec", SPECS)
def test_method_generates_on_every_family(family, spec):
    name, model, basis = family
    batch = prompts(model.config.vocab_size)
    every = 0 if spec in PROMPT_ONLY else 2  # kvzip: the prompt only (the sweep checks it refuses)
    out = generate(model, batch, max_new_tokens=MAX_NEW, compress_every=every, eos_ids=(),
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
        step_equals_decoded_step(model, out.cache, out.tokens[:, -1], next_pos,
                                 windowed=windowed_layers(model))
