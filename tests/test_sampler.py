import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import CacheTransform, parse_method
from models.llama import Llama, LlamaConfig, new_cache
from models.sampler import (Sampling, compress, decode, generate, pad_prompts, prefill_batch,
                            sample_tokens)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15]]


def naive_greedy(model, prompt, n):
    """Greedy decoding by re-running the whole sequence each step (no cache reuse)."""
    seq = list(prompt)
    for _ in range(n):
        t = len(seq)
        logits, _ = model(jnp.array([seq]), jnp.arange(t)[None], new_cache(model.config, 1, t))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


def test_greedy_generation_equals_uncached_greedy(tiny_model):
    out = generate(tiny_model, [PROMPTS[0]], max_new_tokens=6, eos_ids=())
    assert out.tokens[0].tolist() == naive_greedy(tiny_model, PROMPTS[0], 6)


@pytest.mark.parametrize("chunk", [2, 4, 256])
def test_batch_of_ragged_prompts_equals_each_alone(tiny_model, chunk):
    batch = generate(tiny_model, PROMPTS, max_new_tokens=8, chunk=chunk, eos_ids=())
    for i, p in enumerate(PROMPTS):
        alone = generate(tiny_model, [p], max_new_tokens=8, chunk=chunk, eos_ids=())
        assert batch.tokens[i].tolist() == alone.tokens[0].tolist()


def test_stops_at_eos_and_pads_after(tiny_model):
    free = generate(tiny_model, PROMPTS, max_new_tokens=8, eos_ids=())
    eos = int(free.tokens[1, 2])  # make the third token of sequence 1 an end token
    out = generate(tiny_model, PROMPTS, max_new_tokens=8, eos_ids=(eos,), pad_id=0)
    for i in range(3):
        n = out.num_tokens[i]
        row = free.tokens[i].tolist()
        want_n = row.index(eos) + 1 if eos in row else 8
        assert n == want_n
        assert out.tokens[i, :n].tolist() == row[:n]
        assert np.all(out.tokens[i, n:] == 0)


def test_compiles_once_across_calls_with_same_shapes(tiny_model, count_traces):
    kwargs = dict(max_new_tokens=5, chunk=4, eos_ids=())
    generate(tiny_model, [[1, 2, 3, 4, 5], [6, 7]], **kwargs)
    with count_traces() as traces:
        generate(tiny_model, [[9, 9, 9], [8, 8, 8, 8, 8, 8]], **kwargs)  # same padded shapes
        generate(tiny_model, [[1, 1, 1, 1, 1, 1, 1], [2]], seed=3, **kwargs)
    assert traces.count == 0


def test_each_call_reads_the_models_current_weights_without_walking_its_graph(count_traces,
                                                                             monkeypatch):
    """The jitted steps take the model itself as a pytree of its weights: weights changed in
    place between calls are what the next call uses, with no retrace, and a warm call never
    walks the module graph (`nnx.split`: ~20 ms of every call at SmolLM2's size)."""
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    other = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(1))
    kwargs = dict(max_new_tokens=6, chunk=4, eos_ids=())
    before = generate(model, [PROMPTS[0]], **kwargs).tokens
    expected = generate(other, [PROMPTS[0]], **kwargs).tokens
    assert before.tolist() != expected.tolist()  # the two weight sets decode differently
    nnx.update(model, nnx.state(other))
    real_split, splits = nnx.split, []
    monkeypatch.setattr(nnx, "split", lambda *a, **k: splits.append(a) or real_split(*a, **k))
    with count_traces() as traces:
        after = generate(model, [PROMPTS[0]], **kwargs).tokens
    assert after.tolist() == expected.tolist()
    assert traces.count == 0 and splits == []

@pytest.mark.parametrize("method", ["snapkv:ratio=0.5,window=2+quantize:bits=8,group=8",
                                    "streaming_llm:ratio=0.5"])
def test_compressed_generation_compiles_once_for_equal_shapes(tiny_model, count_traces, method):
    """Prefill, compression, shrink and the decode loop of a compressed cache: a second call
    with other tokens of the same lengths (and another seed) traces nothing."""
    from kvjax import parse_method
    kwargs = dict(max_new_tokens=6, chunk=4, eos_ids=(), transform=parse_method(method))
    generate(tiny_model, [list(range(3, 15)), list(range(20, 29))], **kwargs)
    with count_traces() as traces:
        generate(tiny_model, [list(range(40, 52)), list(range(60, 69))], seed=1, **kwargs)
    assert traces.count == 0


def test_transform_runs_after_prefill_and_every_n_decode_steps(tiny_model):
    calls = CacheTransform(
        init=lambda cache: jnp.zeros((2,), jnp.int32),  # [calls, last cache length seen]
        update=lambda cache, state, stats=None: (
            cache, jnp.stack([state[0] + 1, cache[0].length])))
    out = generate(tiny_model, PROMPTS, max_new_tokens=10, chunk=4, transform=calls,
                   compress_every=3, eos_ids=())
    # once after prefill, then after decode steps 3, 6 and 9 (each step appends one token)
    assert out.transform_state.tolist() == [4, 8 + 9]
    plain = generate(tiny_model, PROMPTS, max_new_tokens=10, chunk=4, eos_ids=())
    np.testing.assert_array_equal(out.tokens, plain.tokens)  # an identity changes nothing


def test_sampling_is_seeded_and_respects_top_k(tiny_model):
    s = Sampling(temperature=1.0, top_k=3)
    a = generate(tiny_model, PROMPTS, max_new_tokens=6, sampling=s, seed=1, eos_ids=())
    b = generate(tiny_model, PROMPTS, max_new_tokens=6, sampling=s, seed=1, eos_ids=())
    c = generate(tiny_model, PROMPTS, max_new_tokens=6, sampling=s, seed=2, eos_ids=())
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_sample_tokens_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)
    draw = lambda s: np.array([int(sample_tokens(logits, k, s)[0]) for k in keys[:400]])
    assert set(draw(Sampling(1.0, top_k=2))) <= {0, 1}
    assert set(draw(Sampling(1.0, top_p=0.7))) <= {0, 1}       # 0.5 < 0.7 <= 0.8
    assert set(draw(Sampling(1.0, top_p=0.5))) == {0}
    assert int(sample_tokens(logits, keys[0], Sampling())[0]) == 0  # greedy
    counts = np.bincount(draw(Sampling(1.0)), minlength=4) / 400
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.08)


def test_pad_prompts_left_pads_to_chunk_multiple():
    p = pad_prompts([[1, 2, 3], [4]], multiple=4, pad_id=0)
    np.testing.assert_array_equal(p.tokens, [[0, 1, 2, 3], [0, 0, 0, 4]])
    np.testing.assert_array_equal(p.positions, [[-1, 0, 1, 2], [-1, -1, -1, 0]])


def test_bad_requests_raise(tiny_model):
    with pytest.raises(ValueError, match="capacity"):
        generate(tiny_model, PROMPTS, max_new_tokens=8, capacity=10)
    with pytest.raises(ValueError, match="context"):
        generate(tiny_model, [[1] * 500], max_new_tokens=20)  # tiny max_position is 512
    with pytest.raises(ValueError, match="at least one token"):
        generate(tiny_model, [[1], []])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_model, PROMPTS, max_new_tokens=0)
    with pytest.raises(ValueError, match="sampling"):
        Sampling(temperature=-1.0)


@pytest.mark.parametrize("method", ["full", "snapkv:ratio=0.5", "kivi:bits=4,group=8"])
def test_compress_leaves_the_prefilled_cache_usable_for_another_policy(tiny_model, method):
    """One prefill serves two policies: compressing (with keep_input for `full`, whose cache is
    handed on and donated by decoding) leaves `pre.cache` intact, and no donation is refused
    (the compression's stacked outputs can take no layer's buffer, so it donates nothing)."""
    transform = parse_method(method)
    pre = prefill_batch(tiny_model, [list(range(3, 40))], stats=transform.stats, room=8)
    before = jax.tree_util.tree_map(np.asarray, pre.cache)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        out = compress(pre, transform, room=8, keep_input=True)
        decode(tiny_model, out, max_new_tokens=4)
    for a, b in zip(jax.tree_util.tree_leaves(pre.cache), jax.tree_util.tree_leaves(before)):
        assert not a.is_deleted()
        np.testing.assert_array_equal(np.asarray(a), b)


def test_no_sampler_function_takes_more_than_six_parameters():
    """Issue 47: the decode loop took 15 parameters (8 static) and generate 16; knobs now
    travel in named, frozen configs (DecodeConfig, PrefillConfig, RunOptions)."""
    import inspect

    import models.sampler as sampler

    functions = {name: f for name, f in vars(sampler).items()
                 if callable(f) and getattr(f, "__module__", None) == "models.sampler"
                 and not inspect.isclass(f)}
    counts = {name: len(inspect.signature(f).parameters) for name, f in functions.items()}
    assert {"_decode", "_prefill", "generate", "decode", "prefill_and_compress"} <= set(counts)
    assert counts["_decode"] == 4 and counts["generate"] == 6, counts
    assert max(counts.values()) <= 6, {k: n for k, n in counts.items() if n > 6}


def test_the_loop_state_is_a_named_type(tiny_model, monkeypatch):
    """The while_loop carry is a DecodeState (fields by name, not carry[6]) and the loop's
    static configuration is one frozen, hashable DecodeConfig."""
    import dataclasses

    import models.sampler as sampler

    carries = []
    real = jax.lax.while_loop
    monkeypatch.setattr(jax.lax, "while_loop",
                        lambda cond, body, init: carries.append(init) or real(cond, body, init))
    pre = prefill_batch(tiny_model, PROMPTS, room=5)
    config = sampler.DecodeConfig(5, eos_ids=(), pad_id=7)  # a config no other test compiles
    start = sampler.DecodeStart(pre.logits, None, None, jnp.asarray(pre.next_pos),
                                jax.random.key(0))
    sampler._decode.lower(tiny_model, pre.cache, start, config)
    (carry,) = carries
    assert type(carry) is sampler.DecodeState
    assert carry._fields == ("step", "token", "cache", "transform_state", "stats", "positions",
                             "done", "tokens", "key")
    assert carry.tokens.shape == (3, 5) and carry.done.dtype == jnp.bool_
    assert dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen
    assert hash(config) == hash(sampler.DecodeConfig(5, eos_ids=(), pad_id=7))


def test_equal_runs_compile_the_decode_loop_once(tiny_model):
    """DecodeConfig is the jit key: a second equal run (a rebuilt transform included) reuses
    the compiled loop, as the eight separate static arguments did."""
    from models.sampler import _decode

    from kvjax import on_layers

    run = lambda: generate(tiny_model, PROMPTS, max_new_tokens=4, eos_ids=(), chunk=4,
                           compress_every=2,  # a new on_layers wrapper each run
                           transform=on_layers(parse_method("h2o:ratio=0.5"), [0, 1]))
    first = run()
    size = _decode._cache_size()
    second = run()
    assert _decode._cache_size() == size
    assert first.tokens.tolist() == second.tokens.tolist()


def test_options_a_function_does_not_take_are_refused(tiny_model):
    pre = prefill_batch(tiny_model, PROMPTS, room=4)
    with pytest.raises(TypeError, match="decode.*'capacity'.*RunOptions"):
        decode(tiny_model, pre, max_new_tokens=2, capacity=64)
    with pytest.raises(TypeError, match="generate.*'temperature'"):
        generate(tiny_model, PROMPTS, temperature=0.5)
    with pytest.raises(ValueError, match="compress_every must be an int >= 0"):
        generate(tiny_model, PROMPTS, compress_every=-1)
