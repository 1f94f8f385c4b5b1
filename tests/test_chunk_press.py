"""ChunkPress (`chunk`, kvpress ChunkPress): each chunk of positions compressed on its own,
against numpy and batch by batch on a tiny model (the kvpress parity on SmolLM2 is in
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


@pytest.mark.parametrize("inner", ["snapkv", "tova"])
def test_window_scorers_see_each_chunks_own_window_in_a_padded_batch(tiny_model, inner):
    """`chunk:inner=snapkv|tova,chunk_length=80`: a left-padded batch of 150 and 230 tokens
    (chunks of 80, 70 and 80, 80, 70 positions) keeps, per row, exactly what the row keeps
    alone (each chunk's window queries turned by the row's own length: the kvpress parity at
    batch 1 is in tests/test_kvpress_zoo_third.py), and each chunk keeps its own share."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (150, 230)]
    t = kvjax.parse_method(f"chunk:inner={inner},ratio=0.3,chunk_length=80")
    assert t.stats.chunk_length == 80

    def kept(batch):
        pre = prefill_batch(tiny_model, batch, stats=t.stats)
        out, _ = t.update(pre.cache, t.init(pre.cache), pre.stats)
        return [[[set(np.asarray(layer.pos[b, h])[np.asarray(layer.pos[b, h]) != EMPTY]
                      .tolist()) for h in range(layer.kv_heads)] for layer in out]
                for b in range(len(batch))]

    together = kept(prompts)
    for b, ids in enumerate(prompts):
        assert together[b] == kept([ids])[0], b
        for heads in together[b]:
            for got in heads:
                for lo in range(0, len(ids), 80):
                    size = min(80, len(ids) - lo)
                    assert len([p for p in got if lo <= p < lo + 80]) == int(size * 0.7)


@pytest.mark.parametrize("spec, words", [
    ("chunk:inner=expected_attention,ratio=0.5", ["inner=expected_attention", "moments"]),
    ("chunk:inner=h2o,ratio=0.5", ["inner=h2o", "attention mass"]),
    ("chunk:inner=snapkv,ratio=0.5,chunk_length=64", ["inner=snapkv", "64", "chunk_length"]),
    ("chunk:inner=knorm,ratio=1.0", ["ratio", "1.0"]),
    ("chunk:inner=knorm", ["ratio", "None"]),
    ("chunk:inner=knorm,ratio=0.5,chunk_length=0", ["chunk_length", "0"]),
    ("chunk:inner=nope,ratio=0.5", ["nope"]),
])
def test_bad_arguments_raise_naming_them(spec, words):
    with pytest.raises(ValueError) as e:
        kvjax.parse_method(spec)
    assert all(w in str(e.value) for w in words), str(e.value)
