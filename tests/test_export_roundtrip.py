"""Export round trips of random small configs: the artifact generates the live model's tokens.

Each case draws a tiny Llama config (layers, heads, KV heads, head size, tied or untied
embeddings), a method (full, an eviction policy, a codec, a chain), a chunk and buckets from
a seeded generator, exports it, reloads the artifact through `kvjax.tools.exported` (no Flax, no
model code) and compares a random batch's greedy tokens with the live sampler's. Also: the
artifact's manifest passes its own schema check and every file matches its recorded hash.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.tools import exported
from models.export import export_artifact
from models.llama import Llama, LlamaConfig
from models.sampler import generate

METHODS = ["full", "snapkv:ratio=0.5,window=8", "streaming_llm:ratio=0.5", "sliding_window:window=24",
           "kivi:bits=4,group=8,residual=8", "quantize:bits=8,group=8",
           "h2o:ratio=0.5+quantize:bits=4,group=8"]


def draw(seed: int):
    rng = np.random.default_rng(seed)
    kv_heads = int(rng.choice([1, 2]))
    config = LlamaConfig.tiny(num_layers=int(rng.integers(1, 3)), num_kv_heads=kv_heads,
                              num_heads=kv_heads * int(rng.choice([1, 2])),
                              head_dim=int(rng.choice([16, 32])),
                              tie_embeddings=bool(rng.integers(2)), max_position=256)
    chunk = int(rng.choice([8, 16]))
    return rng, config, METHODS[seed % len(METHODS)], chunk


@pytest.mark.parametrize("seed", range(len(METHODS)))
def test_random_config_round_trips(seed, tmp_path):
    rng, config, method, chunk = draw(seed)
    model = Llama(config, rngs=nnx.Rngs(seed))
    path = export_artifact(model, None, tmp_path / "a", method=method, chunk=chunk,
                           max_len=128, buckets=(64, 128))
    manifest = exported._read_manifest(path)
    exported.check_files(path, manifest)  # the writer's records match what it wrote
    decoder = exported.load(path)
    batch = int(rng.integers(1, 4))
    prompts = [rng.integers(3, config.vocab_size, int(n)).tolist()
               for n in rng.integers(3, 60, batch)]
    got = decoder.generate(prompts, max_new_tokens=5)
    live = generate(model, prompts, max_new_tokens=5, chunk=chunk,
                    transform=kvjax.parse_method(method))
    np.testing.assert_array_equal(got.tokens, live.tokens, err_msg=f"{config} {method}")
    np.testing.assert_array_equal(got.num_tokens, live.num_tokens)
