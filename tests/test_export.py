"""`jax.export` of the decode step: serialized, deserialized, executed, compared with the model.

Every test runs the *deserialized* exported function on CPU and compares its logits and the
whole cache it returns (every layer, every field: keys, values or their codes and scales,
positions, cursors) with the live model's step on the same inputs.

Tolerances: the exported step and the live step (the model called under `jax.jit`) are
compiled separately, so XLA may fuse and reorder float32 sums differently; logits and dense
keys/values agree to float32 rounding through a 2-layer, 64-wide model (rtol 1e-5). Integer leaves (positions, cursors, packed
codes) are compared exactly, and so are KIVI's stored scales for keys the live and exported
steps computed bit-identically (the codes of every flushed group match).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from models.export import export_decode_step, params_dict
from models.llama import Llama, LlamaConfig, new_cache
from models.sampler import prefill_and_compress

RTOL = 1e-5  # float32 rounding, jitted against op-by-op (see the module docstring)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def assert_caches_match(got, want):
    """Element-wise: integer leaves (positions, cursors, codes) exactly, floats to RTOL."""
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def, (got_def, want_def)
    for a, b in zip(got_leaves, want_leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        if np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
            np.testing.assert_array_equal(a, b)
        else:
            scale = max(float(np.abs(b.astype(np.float32)).max()), 1e-30)
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=RTOL,
                                       atol=RTOL * scale)


def live_step(model):
    """The live model's decode step, jitted (eager op-by-op dispatch is ~100x slower)."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, tok, pos, cache: nnx.merge(graphdef, state)(tok, pos, cache))
    return lambda tok, pos, cache: run(state, tok, pos, cache)


def run_both(model, step, cache, tokens, start):
    """Feed `tokens` [B, T] one at a time from positions `start` [B] through the live model
    and the exported `step`; compare logits and caches after every step."""
    params, live_model = params_dict(model), live_step(model)
    live, exported = cache, jax.tree_util.tree_map(jnp.copy, cache)  # the step donates
    for t in range(tokens.shape[1]):
        tok, pos = tokens[:, t:t + 1], (start + t)[:, None].astype(jnp.int32)
        want, live = live_model(tok, pos, live)
        got, exported = step.call(params, tok, pos, exported)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, -1]), rtol=RTOL,
                                   atol=RTOL * float(jnp.abs(want).max()))
        assert_caches_match(exported, live)
    return live, exported


def test_exported_decode_step_round_trips_with_identical_logits(model):
    cfg = model.config
    exported = export_decode_step(model, batch=2, capacity=8)
    step = jax.export.deserialize(exported.serialize())
    assert "layers/0/attn/q_proj/kernel" in params_dict(model)
    tokens = jnp.array([[5, 6, 7], [8, 9, 10]])
    live, restored = run_both(model, step, new_cache(cfg, 2, 8), tokens, jnp.zeros(2, jnp.int32))
    assert isinstance(restored[0], kvjax.TokenCache) and int(restored[0].length) == 3
    # the module before and after serialization computes bit-identical results
    before, _ = exported.call(params_dict(model), tokens[:, :1], jnp.zeros((2, 1), jnp.int32),
                              new_cache(cfg, 2, 8))
    after, _ = step.call(params_dict(model), tokens[:, :1], jnp.zeros((2, 1), jnp.int32),
                         new_cache(cfg, 2, 8))
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_export_for_accelerators_runs_and_matches_on_cpu(model):
    """One module lowered for CPU, TPU and CUDA: deserialized, it runs on CPU (the same
    StableHLO the accelerators would get, selected by platform) and matches the model."""
    exported = export_decode_step(model, batch=1, capacity=8, platforms=["cpu", "tpu", "cuda"])
    step = jax.export.deserialize(exported.serialize())
    assert set(step.platforms) == {"cpu", "tpu", "cuda"}
    run_both(model, step, new_cache(model.config, 1, 8), jnp.array([[3, 4, 5, 6]]),
             jnp.zeros(1, jnp.int32))


def test_exported_decode_step_writes_into_a_kivi_cache(model):
    """The exported step takes the codec's layout and encodes what it writes (KIVI-4): 11
    tokens, past residual + group, so one group moves into the quantized body."""
    cfg = model.config
    kivi = kvjax.kivi(bits=4, group=4, residual=4)
    step = jax.export.deserialize(
        export_decode_step(model, batch=2, capacity=16, transform=kivi).serialize())
    empty = kivi.update(new_cache(cfg, 2, 16), kivi.init(new_cache(cfg, 2, 16)), None)[0]
    tokens = 5 + jnp.tile(jnp.arange(11)[None], (2, 1))
    _, restored = run_both(model, step, empty, tokens, jnp.zeros(2, jnp.int32))
    assert isinstance(restored[0], kvjax.ResidualCache)
    assert int(restored[0].body.length) == 4  # 11 tokens: flushed before the 9th write


def test_exported_decode_step_continues_a_compressed_chain_cache(model):
    """A prompt compressed by SnapKV (r=0.5) then KIVI-4 and shrunk to its budget plus room:
    the step exported for that layout continues it like the live model, batch of two
    prompts of different lengths (left-padded), across a KIVI flush."""
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (24, 17)]
    chain = kvjax.parse_method("snapkv:ratio=0.5,window=4+kivi:bits=4,group=4,residual=4")
    room = 9
    pre = prefill_and_compress(model, prompts, transform=chain, room=room, chunk=8,
                               max_write=1)
    assert isinstance(pre.cache[0], kvjax.ResidualCache)
    kept = [int(np.sum(np.asarray(layer.pos)[0, 0] != kvjax.EMPTY)) for layer in pre.cache]
    assert kept == [12] * cfg.num_layers  # the budget of the 24-token prompt
    step = jax.export.deserialize(export_decode_step(model, cache=pre.cache).serialize())
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, room)))
    body_before = int(pre.cache[0].body.length)
    _, restored = run_both(model, step, pre.cache, tokens, jnp.asarray(pre.next_pos))
    assert int(restored[0].body.length) > body_before  # decode flushed a group into the body


def test_export_rejects_a_missing_or_double_layout(model):
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        export_decode_step(model, batch=1)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        export_decode_step(model, batch=0, capacity=8)
    with pytest.raises(ValueError, match="not both"):
        export_decode_step(model, batch=1, capacity=8, cache=new_cache(model.config, 1, 8))
    with pytest.raises(ValueError, match="layers"):
        export_decode_step(model, cache=new_cache(model.config, 1, 8)[:1])


# ----------------------------------------------------------------------------- artifacts
# `export_artifact` + `kvjax.tools.exported`: prefill chunk, compression and decode step with a
# symbolic batch, in capacity buckets, generating like the live sampler (the real model, in
# a process without Flax: tests/test_run_exported.py).

import json  # noqa: E402
import shutil  # noqa: E402

from kvjax.tools import exported  # noqa: E402
from models.export import export_artifact  # noqa: E402
from models.sampler import generate  # noqa: E402

SPEC = "snapkv:ratio=0.5,window=8+kivi:bits=4,group=8,residual=8"  # flushes on short prompts


@pytest.fixture(scope="module")
def artifacts(model, tmp_path_factory):
    return {m: export_artifact(model, None, tmp_path_factory.mktemp("artifact"), method=m,
                               chunk=16, max_len=128, buckets=(64, 128))
            for m in ("full", SPEC)}


def kept_positions(cache) -> list[np.ndarray]:
    """Per layer, each [batch, head] row's valid positions, sorted ([B, KVH, n] ragged -> list)."""
    out = []
    for layer in cache:
        pos = np.asarray(layer.pos)
        out.append([sorted(row[row != kvjax.EMPTY].tolist()) for row in pos.reshape(-1, pos.shape[-1])])
    return out


@pytest.mark.parametrize("method", ["full", SPEC])
def test_artifact_generates_the_live_models_tokens(model, artifacts, method):
    """Batches 1 and 3 from one artifact: the live sampler's tokens, the same kept tokens."""
    decoder = exported.load(artifacts[method])
    rng = np.random.default_rng(1)
    for batch in (1, 3):
        prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(40, 90, batch)]
        got = decoder.generate(prompts, max_new_tokens=6)
        live = generate(model, prompts, max_new_tokens=6, chunk=16,
                        transform=kvjax.parse_method(method))
        np.testing.assert_array_equal(got.tokens, live.tokens)
        np.testing.assert_array_equal(got.num_tokens, live.num_tokens)
        assert kept_positions(got.cache) == kept_positions(live.cache)
        assert got.prefill_bucket == 128
        if method == SPEC:  # compressed to ~half, decoded in the smaller bucket, quantized body
            assert got.decode_bucket == 64
            assert all(int(layer.body.length) > 0 for layer in got.cache)


def assert_same_slots(a, b):
    """Every row of dense layers `a` and `b` holds the same (position, key, value) set."""
    pa, pb = (np.asarray(x.pos).reshape(-1, x.pos.shape[-1]) for x in (a, b))
    for r in range(pa.shape[0]):
        ia = np.flatnonzero(pa[r] != kvjax.EMPTY)[np.argsort(pa[r][pa[r] != kvjax.EMPTY])]
        ib = np.flatnonzero(pb[r] != kvjax.EMPTY)[np.argsort(pb[r][pb[r] != kvjax.EMPTY])]
        np.testing.assert_array_equal(pa[r][ia], pb[r][ib])
        for name in ("k", "v"):  # decoded bit for bit: codes, groups and scales moved intact
            np.testing.assert_array_equal(np.asarray(getattr(a, name))[r][ia],
                                          np.asarray(getattr(b, name))[r][ib])


def test_bucket_layout_keeps_every_slot_and_depends_on_capacity_only(model):
    t = kvjax.parse_method(SPEC)
    rng = np.random.default_rng(2)
    shapes = []
    for n in (70, 41):
        pre = prefill_and_compress(model, [rng.integers(3, 256, n).tolist()] * 2, transform=t,
                                   chunk=16, capacity=128, shrink=False)
        cut = exported.bucket_layout(pre.cache, 64)
        for before, after in zip(pre.cache, cut):
            assert_same_slots(kvjax.view(before), kvjax.view(after))
        shapes.append(jax.tree.map(lambda x: (x.shape, x.dtype), cut))
    assert shapes[0] == shapes[1]  # 70 and 41 tokens: one layout, one compiled decode step


def test_bucket_layout_gives_a_never_flushing_exact_part_the_bucket(model):
    """ThinK's exact part (later keys whole, never flushed: `KEEP_EXACT`) takes the bucket's
    capacity, as its body does."""
    pre = prefill_and_compress(model, [list(range(3, 60))] * 2, chunk=16, room=8,
                               transform=kvjax.parse_method("think:ratio=0.5"))
    cut = exported.bucket_layout(pre.cache, 64)
    for before, after in zip(pre.cache, cut):
        assert after.body.capacity == after.recent.capacity == 64
        assert_same_slots(kvjax.view(before), kvjax.view(after))


def test_bucket_layout_refuses_to_drop_written_slots(model):
    pre = prefill_and_compress(model, [list(range(3, 60))], chunk=16, capacity=96)
    with pytest.raises(ValueError, match="would drop written slots"):
        exported.bucket_layout(pre.cache, 32)


def test_generate_from_an_artifact_rejects_bad_input(artifacts):
    decoder = exported.load(artifacts["full"])
    with pytest.raises(ValueError, match="largest capacity bucket is 128"):
        decoder.generate([list(range(3, 120))], max_new_tokens=20)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        decoder.generate([[5]], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        decoder.generate([[5, 256]])
    with pytest.raises(ValueError, match="no tokenizer"):
        decoder.generate(["hello"])
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([[5], []])


def test_load_refuses_what_it_cannot_run(artifacts, tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        exported.load(tmp_path)
    manifest = json.loads((artifacts["full"] / "manifest.json").read_text())
    for change, message in (({"format": 99}, "format 99"),
                            ({"platforms": ["tpu"]}, r"exported for \['tpu'\]")):
        (tmp_path / "manifest.json").write_text(json.dumps({**manifest, **change}))
        with pytest.raises(ValueError, match=message):
            exported.load(tmp_path)


def test_export_artifact_rejects_bad_arguments(model, tmp_path):
    for kwargs, message in ((dict(chunk=0), "chunk must be an int >= 1"),
                            (dict(max_len=4096), "exceeds the model's 512 positions"),
                            (dict(max_len=24, chunk=16), "must be >= 2 x chunk"),
                            (dict(buckets=(16,), chunk=16, max_len=64), r"buckets \(16,\) must be ints"),
                            (dict(platforms=("gpu",)), "platforms"),
                            (dict(method="snapkv:ratio=2"), "ratio")):
        with pytest.raises(ValueError, match=message):
            export_artifact(model, None, tmp_path, **kwargs)


def test_artifact_tpu_entry_compiles_deviceless(model, tmp_path):
    """The TPU variant of every exported function goes through XLA:TPU (libtpu, no chip)."""
    from kernels_pallas.tpu_compile import libtpu_available
    if not libtpu_available():
        pytest.skip("[optional] libtpu (the tpu-compile extra) is not installed")
    path = export_artifact(model, None, tmp_path, method=SPEC, chunk=16, max_len=64,
                           buckets=(64,), platforms=("cpu", "tpu"))
    report = exported.compile_for_tpu(path, batch=3)
    fns = report["buckets"]["64"]
    assert set(fns) == {"prefill", "compress", "decode"}
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params_dict(model)))
    assert fns["prefill"]["argument_bytes"] > weights and fns["decode"]["argument_bytes"] > weights
    shutil.rmtree(path)


def test_export_commands_report_bad_input_in_one_line(tmp_path, capsys):
    """`kvjax run-exported` / `kvjax export`: exit status 2 and one `kvjax: error:` line, before
    any model is loaded."""
    from experiments.cli.main import main
    cases = ((["run-exported", str(tmp_path), "--prompt", "x"], "no manifest.json"),
             (["export", "--out", str(tmp_path / "a"), "--check-tpu"], "needs tpu in --platforms"),
             (["export", "--out", str(tmp_path / "a"), "--buckets", "128,x"],
              "--buckets '128,x': need comma-separated integers"))
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvjax: error:") and message in err and err.count("\n") == 1
