"""Orbax checkpoints: kvjax caches and transform states round-trip exactly, a compressed prompt
saved by one process continues token-identically in another (with the weights restored onto a
mesh of 8 fake devices), an interrupted save leaves the previous checkpoint readable, and a
mismatched model, method or checkpoint kind is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.tools import checkpoint
from models.checkpoints import (fingerprint, load_prompt, load_weights, save_prompt,
                                save_weights)
from models.llama import Llama, LlamaConfig
from models.sampler import decode, prefill_and_compress

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4, 5, 6, 7, 8]]
METHODS = ["full", "snapkv:ratio=0.5+kivi:bits=4,group=4,residual=4",
           "kivi:bits=2,group=4,residual=4+snapkv:ratio=0.5", "fp8",
           "snapkv:ratio=0.5,headwise=true"]
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _bits(x):
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x)


def assert_same_tree(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(_bits(x), _bits(y))  # bit-exact


@pytest.mark.parametrize("method", METHODS)
def test_compressed_prompt_round_trips_exactly(tiny_model, tmp_path, method):
    pre = prefill_and_compress(tiny_model, PROMPTS, transform=kvjax.parse_method(method), room=8)
    save_prompt(tmp_path, pre, tiny_model, method)
    again = load_prompt(tmp_path, tiny_model, method)
    assert isinstance(again.next_pos, np.ndarray)
    assert_same_tree(pre._replace(next_pos=None), again._replace(next_pos=None))
    np.testing.assert_array_equal(again.next_pos, pre.next_pos)
    assert kvjax.nbytes(again.cache) == kvjax.nbytes(pre.cache)
    transform = kvjax.parse_method(method)
    want = decode(tiny_model, pre, max_new_tokens=6, transform=transform, eos_ids=())
    got = decode(tiny_model, again, max_new_tokens=6, transform=transform, eos_ids=())
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_mismatched_method_model_or_kind_is_a_clear_error(tiny_model, tmp_path):
    method = "snapkv:ratio=0.5"
    pre = prefill_and_compress(tiny_model, PROMPTS, transform=kvjax.parse_method(method), room=8)
    save_prompt(tmp_path / "p", pre, tiny_model, method)
    with pytest.raises(ValueError, match=r"method: saved 'snapkv:ratio=0.5', expected 'full'"):
        load_prompt(tmp_path / "p", tiny_model, "full")
    other = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(1))  # same shapes, other weights
    with pytest.raises(ValueError, match="model: saved"):
        load_prompt(tmp_path / "p", other, method)
    save_weights(tmp_path / "w", tiny_model)
    with pytest.raises(ValueError, match="kind: saved 'weights', expected 'prompt'"):
        load_prompt(tmp_path / "w", tiny_model, method)
    with pytest.raises(ValueError, match="holds a 'prompt' checkpoint, not weights"):
        load_weights(tmp_path / "p")
    with pytest.raises(ValueError, match="config: saved"):
        load_weights(tmp_path / "w", config=LlamaConfig.tiny(num_layers=3))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt(tmp_path / "missing", tiny_model, method)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        checkpoint.restore(tmp_path / "empty")


def test_only_kvjax_and_models_types_are_loaded(tmp_path):
    cache = kvjax.init_model_cache(kvjax.CacheSpec(1, 1, 4), batch=1, capacity=4)
    checkpoint.save(tmp_path, cache)
    manifest = checkpoint.read_manifest(tmp_path)
    with pytest.raises(ValueError, match="only types from kvjax, models are loaded"):
        checkpoint._abstract_tree(manifest["structure"], ["os.path.join"])


def test_weights_round_trip_and_fingerprint(tiny_model, tmp_path):
    save_weights(tmp_path, tiny_model)
    again = load_weights(tmp_path, config=tiny_model.config)
    assert again.config == tiny_model.config
    assert_same_tree(nnx.state(again), nnx.state(tiny_model))
    assert fingerprint(again) == fingerprint(tiny_model)
    assert fingerprint(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(1))) != fingerprint(tiny_model)
    cfg = LlamaConfig.smollm2_135m()
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


CONTINUE = textwrap.dedent("""
    import json, sys
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import kvjax
    from models.checkpoints import load_prompt, load_weights
    from models.sampler import decode

    assert jax.device_count() == 8, jax.devices()
    weights_dir, prompt_dir, full_dir, method = sys.argv[1:5]
    model = load_weights(weights_dir)
    pre = load_prompt(prompt_dir, model, method)
    out = decode(model, pre, max_new_tokens=10, transform=kvjax.parse_method(method), eos_ids=())

    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    def shard(aval):  # the last axis over 8 devices where it divides, else replicated
        last = aval.shape[-1] if aval.shape else 0
        spec = P(*([None] * (len(aval.shape) - 1)), "model") if last and last % 8 == 0 else P()
        return NamedSharding(mesh, spec)
    on_mesh = load_weights(weights_dir, sharding=shard)
    kernel = on_mesh.layers[0].mlp.up_proj.kernel.get_value()
    pre_full = load_prompt(full_dir, on_mesh, "full", sharding=NamedSharding(mesh, P()))
    out_full = decode(on_mesh, pre_full, max_new_tokens=10, eos_ids=())
    print(json.dumps({"tokens": out.tokens.tolist(), "full_on_mesh": out_full.tokens.tolist(),
                      "devices": len(kernel.sharding.device_set),
                      "shard": list(kernel.addressable_shards[0].data.shape)}))
""")


def test_another_process_continues_token_identically(tiny_model, tmp_path):
    """A KIVI-chain prompt continues identically in a fresh process; the weights also restore
    straight onto an 8-device mesh, and a full-cache prompt continues identically there."""
    method = "snapkv:ratio=0.5+kivi:bits=4,group=4,residual=4"
    transform = kvjax.parse_method(method)
    pre = prefill_and_compress(tiny_model, PROMPTS, transform=transform, room=16)
    pre_full = prefill_and_compress(tiny_model, PROMPTS, room=16)
    save_weights(tmp_path / "weights", tiny_model)
    save_prompt(tmp_path / "prompt", pre, tiny_model, method)
    save_prompt(tmp_path / "full", pre_full, tiny_model, "full")
    want = decode(tiny_model, pre, max_new_tokens=10, transform=transform, eos_ids=()).tokens
    want_full = decode(tiny_model, pre_full, max_new_tokens=10, eos_ids=()).tokens
    env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", CONTINUE, str(tmp_path / "weights"),
                           str(tmp_path / "prompt"), str(tmp_path / "full"), method], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == want.tolist()
    assert result["full_on_mesh"] == want_full.tolist()
    up = tiny_model.layers[0].mlp.up_proj.kernel.get_value().shape  # [64, 128]
    assert result["devices"] == 8 and result["shard"] == [up[0], up[1] // 8]


INTERRUPTED = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from kvjax.tools import checkpoint

    checkpoint.save(sys.argv[1], {"x": jnp.arange(10.0)})
    def hang(self, directory):  # the arrays are written; the step is not yet committed
        print("writing", flush=True)
        time.sleep(600)
    ocp.CompositeCheckpointHandler.finalize = hang
    checkpoint.save(sys.argv[1], {"x": -jnp.arange(10.0)})
""")


def test_a_save_killed_midway_leaves_the_previous_checkpoint_readable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(tmp_path)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.kill()  # SIGKILL in the middle of the second save
    finally:
        proc.wait(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("2")) == [
        "2.orbax-checkpoint-tmp"]  # the second save really was cut short
    tree, _ = checkpoint.restore(tmp_path)
    np.testing.assert_array_equal(tree["x"], np.arange(10.0))
    checkpoint.save(tmp_path, {"x": 2 * np.arange(10.0, dtype=np.float32)})  # saving goes on
    tree, _ = checkpoint.restore(tmp_path)
    np.testing.assert_array_equal(tree["x"], 2 * np.arange(10.0))
