"""`perplexity` (`kvjax ppl --json`) reports the compressed prefix's bytes and the same
prefix's bytes as an uncompressed bfloat16 cache, so any method's budget can be checked."""

import numpy as np

import kvjax
from experiments.eval.ppl import full_bf16_bytes, perplexity


def _layer_bytes(batch, kvh, slots, d, itemsize):
    """Independent count: keys + values + an int32 position per slot and head + a cursor."""
    return batch * kvh * slots * (2 * d * itemsize + 4) + 4


def test_full_method_reports_float32_prefix_and_bf16_reference(tiny_model):
    c = tiny_model.config
    ids = np.arange(3, 3 + 48) % c.vocab_size  # one window
    out = perplexity(tiny_model, ids, context=48, prefix=32, transform=kvjax.full())
    want_f32 = c.num_layers * _layer_bytes(1, c.num_kv_heads, 32, c.head_dim, 4)
    want_bf16 = c.num_layers * _layer_bytes(1, c.num_kv_heads, 32, c.head_dim, 2)
    assert out.cache_bytes == want_f32
    assert out.full_bf16_bytes == want_bf16 == full_bf16_bytes(tiny_model, 32)


def test_eviction_halves_the_prefix_bytes(tiny_model):
    c = tiny_model.config
    ids = np.arange(3, 3 + 96) % c.vocab_size
    out = perplexity(tiny_model, ids, context=48, prefix=32, batch_size=2,
                     transform=kvjax.knorm(ratio=0.5))
    # 2 windows of 48 (the second is 47 long): each keeps 16 of its 32 prefix tokens;
    # a batch of 2 shares one cursor per layer, so per window it is half of it
    want = c.num_layers * (_layer_bytes(2, c.num_kv_heads, 16, c.head_dim, 4) / 2)
    assert out.cache_bytes == want
    assert out.full_bf16_bytes == full_bf16_bytes(tiny_model, 32)
    assert np.isfinite(out.ppl)


def test_plain_perplexity_reports_the_window_cache(tiny_model):
    c = tiny_model.config
    ids = np.arange(3, 3 + 64) % c.vocab_size
    out = perplexity(tiny_model, ids, context=32)  # windows 0-32, 32-64 (ends at the text)
    assert out.cache_bytes == c.num_layers * _layer_bytes(1, c.num_kv_heads, 32, c.head_dim, 4)
    assert out.full_bf16_bytes == full_bf16_bytes(tiny_model, 32)
