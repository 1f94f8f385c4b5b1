"""Batch isolation, for every registered method: a row's tokens do not depend on the other rows.

For each method in `kvjax.METHODS` (new ones are picked up automatically) and one chain of a
zoo method, re-rotation and KIVI (`CHAINS`), random prompts of
random lengths are generated as one batch; then the rows are permuted and every other row's
content replaced by fresh random tokens of the same length (the batch's shapes, hence its
compiled programs, stay the same). The kept row must generate exactly the same tokens, and
so must every row in its new place. A policy that ranked across the batch, leaked padding,
or drew randomness per batch position instead of per sequence would break it.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from flax import nnx

import kvjax
from models.llama import Llama, LlamaConfig
from models.sampler import generate
from tests.test_every_method_every_prompt import random_basis

CONFIG = LlamaConfig.tiny(head_dim=32, max_position=512, num_layers=1)
MAX_NEW = 4
SPECIAL = {
    "full": "full",
    "sliding_window": "sliding_window:window=24",
    "quantize": "quantize",
    "kivi": "kivi:bits=2,residual=32",
    "fp8": "fp8",
    "low_rank": "low_rank:rank=16,basis={basis}",
    "linear_state": "linear_state",
    "fold": "snapkv:ratio=0.5+fold",
    "rerotate": "knorm:ratio=0.5+rerotate",
    "simlayerkv": "simlayerkv:lazy_threshold=0.3,n_recent=16",  # 1.0 (the default) never trims
    "finch": "finch:ratio=0.5,window=4",  # window: the question's tokens (no default)
    "kvzip": "kvzip:ratio=0.5,prompt=bare",  # a tiny model has no tokenizer for kvpress's prompt
    "kvgrad": "kvgrad:ratio=0.5,prompt=bare",
    "duo_attention": "duo_attention:head_ratio=0.5,scores={basis},sink=4,recent=8",  # scores: a file
    "qfilter": "qfilter:ratio=0.5,filters={basis}",  # filters: a file
    "lukv": "lukv:ratio=0.5,curve={basis}",  # a budget curve: a file
    "expected_attention_stats": "expected_attention_stats:ratio=0.5,stats={basis}",
    "kvzap": "kvzap:ratio=0.5,weights={basis}.kvzap",  # a random surrogate (orbax)
    "fastkvzip": "fastkvzip:ratio=0.5,gates={basis}.fastkvzip",  # random gates (orbax)
    "restorekv": "restorekv:ratio=0.5,adapter={basis}.restorekv,prompt=bare",  # random (orbax)
    "dms": "dms:inner=knorm,threshold=-4,window=16",  # no ratio: a threshold
    "auto": "auto:budget=0.25",
}
"""Specs for methods that take no `ratio`; every other method runs as `NAME:ratio=0.5`."""
CHAINS = {  # a zoo method, re-rotation and a codec whose groups fill on these prompts
    "lagkv+rerotate+kivi": "lagkv:ratio=0.5,lag=16+rerotate+kivi:bits=4,group=16,residual=16",
}


def spec_for(name: str, basis: str) -> str:
    return {**SPECIAL, **CHAINS}.get(name, f"{name}:ratio=0.5").format(basis=basis)


@pytest.fixture(scope="module")
def model():
    return Llama(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def basis_file(tmp_path_factory):
    return random_basis(tmp_path_factory.mktemp("basis") / "basis.npz", CONFIG.num_layers,
                        CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.num_heads,
                        CONFIG.hidden_size)


def test_every_registered_method_has_a_spec(basis_file):
    for name in kvjax.METHODS:
        kvjax.parse_method(spec_for(name, basis_file))  # a new method needing more: SPECIAL


@pytest.mark.parametrize("name", sorted(kvjax.METHODS) + list(CHAINS))
def test_a_rows_tokens_do_not_depend_on_the_other_rows(model, basis_file, name):
    spec = spec_for(name, basis_file)
    transform = kvjax.parse_method(spec)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    lengths = rng.integers(5, 90, 3).tolist()
    tokens = lambda n: rng.integers(3, CONFIG.vocab_size, n).tolist()
    prompts = [tokens(n) for n in lengths]
    first = generate(model, prompts, max_new_tokens=MAX_NEW, transform=transform)
    want = [first.tokens[i, :first.num_tokens[i]].tolist() for i in range(3)]

    order = rng.permutation(3).tolist()  # row order[j] goes to place j
    kept = int(rng.integers(3))  # this row keeps its content; the others get new tokens
    again_prompts = [prompts[i] if i == kept else tokens(lengths[i]) for i in order]
    again = generate(model, again_prompts, max_new_tokens=MAX_NEW, transform=transform)
    place = order.index(kept)
    got = again.tokens[place, :again.num_tokens[place]].tolist()
    assert got == want[kept], (spec, lengths, order, kept)

    # the permuted batch of the original prompts: every row as before
    permuted = generate(model, [prompts[i] for i in order], max_new_tokens=MAX_NEW,
                        transform=transform)
    for j, i in enumerate(order):
        assert permuted.tokens[j, :permuted.num_tokens[j]].tolist() == want[i], (spec, i, j)
