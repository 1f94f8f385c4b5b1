"""ChunkPress (`chunk`, kvpress ChunkPress): each chunk of positions compressed on its own,
against numpy on a tiny model (the kvpress parity on SmolLM2 is in
tests/test_kvpress_zoo_third.py)."""

import numpy as np
import pytest

import kvjax
from kvjax.core.cache import EMPTY
from models.sampler import prefill_batch


def key_norms(layer, b: int, n: int) -> np.ndarray:
    """[KVH, n] the key norm of each position of row b (float64 from the float32 keys)."""
    pos = np.asarray(layer.pos)[b]
    keys = np.asarray(kvjax.view(layer).k, np.float64)
    keys = keys.reshape(layer.batch, layer.kv_heads, layer.capacity, -1)[b]
    out = np.zeros((layer.kv_heads, n))
    for h in range(layer.kv_heads):
        ok = pos[h] != EMPTY
        out[h, pos[h][ok]] = np.linalg.norm(keys[h][ok], axis=-1)
    return out


@pytest.mark.parametrize("ratio, chunk_length", [(0.5, 8), (0.3, 16), (0.9, 7)])
def test_each_chunk_keeps_its_smallest_keys(tiny_model, ratio, chunk_length):
    """`chunk:inner=knorm`: a left-padded batch of 23 and 40 tokens; per row, layer, KV head
    and chunk of positions `[c L, (c + 1) L)`, the `max(1, floor(n_c (1 - ratio)))` positions
    with the smallest key norms (numpy, from the prefilled cache)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (23, 40)]
    t = kvjax.parse_method(f"chunk:inner=knorm,ratio={ratio},chunk_length={chunk_length}")
    pre = prefill_batch(tiny_model, prompts)
    out, _ = t.update(pre.cache, t.init(pre.cache), pre.stats)
    for b, ids in enumerate(prompts):
        n = len(ids)
        for layer, after in zip(pre.cache, out):
            norms = key_norms(layer, b, n)
            for h in range(layer.kv_heads):
                want = set()
                for lo in range(0, n, chunk_length):
                    span = np.arange(lo, min(lo + chunk_length, n))
                    kept = max(1, int(len(span) * (1 - ratio)))
                    want |= set(span[np.argsort(norms[h, span], kind="stable")[:kept]].tolist())
                got = np.asarray(after.pos[b, h])
                assert set(got[got != EMPTY].tolist()) == want, (b, h)


@pytest.mark.parametrize("spec, words", [
    ("chunk:inner=snapkv,ratio=0.5", ["inner=snapkv", "statistics", "knorm"]),
    ("chunk:inner=knorm,ratio=1.0", ["ratio", "1.0"]),
    ("chunk:inner=knorm", ["ratio", "None"]),
    ("chunk:inner=knorm,ratio=0.5,chunk_length=0", ["chunk_length", "0"]),
    ("chunk:inner=nope,ratio=0.5", ["nope"]),
])
def test_bad_arguments_raise_naming_them(spec, words):
    with pytest.raises(ValueError) as e:
        kvjax.parse_method(spec)
    assert all(w in str(e.value) for w in words), str(e.value)
