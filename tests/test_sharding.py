"""Generation with the cache sharded over batch and KV heads on 8 fake CPU devices."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import functools, json
    import jax, numpy as np
    import kvjax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    from models.sampler import generate

    assert jax.device_count() == 8, jax.devices()
    model = Llama(LlamaConfig.tiny(num_kv_heads=2, num_heads=4), rngs=nnx.Rngs(0))
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4], [12, 13, 14], [1, 2, 3, 4, 5, 6, 7, 8]]
    single = generate(model, prompts, max_new_tokens=8, chunk=4, eos_ids=())
    mesh = jax.make_mesh((4, 2), ("batch", "kv"), axis_types=(AxisType.Auto, AxisType.Auto))
    sharded = generate(model, prompts, max_new_tokens=8, chunk=4, eos_ids=(),
                       place_cache=functools.partial(kvjax.shard_cache, mesh=mesh))
    k = sharded.cache[0].k
    kivi = kvjax.kivi(bits=4, group=2, residual=2)
    q_single = generate(model, prompts, max_new_tokens=8, chunk=4, eos_ids=(), transform=kivi)
    q_sharded = generate(model, prompts, max_new_tokens=8, chunk=4, eos_ids=(), transform=kivi,
                         place_cache=functools.partial(kvjax.shard_cache, mesh=mesh))
    words = kvjax.shard_cache(q_sharded.cache, mesh)[0].body.k.words
    print(json.dumps({
        "kivi_single": q_single.tokens.tolist(), "kivi_sharded": q_sharded.tokens.tolist(),
        "words_spec": [str(a) for a in words.sharding.spec],
        "single": single.tokens.tolist(), "sharded": sharded.tokens.tolist(),
        "k_spec": [str(a) for a in k.sharding.spec],
        "pos_spec": [str(a) for a in sharded.cache[0].pos.sharding.spec],
        "k_shard_shape": list(k.addressable_shards[0].data.shape),
        "devices": len(k.sharding.device_set)}))
""")


def test_generation_sharded_over_batch_and_kv_heads_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sharded"] == result["single"]
    assert result["devices"] == 8
    assert result["k_spec"][0] == str(("batch", "kv")) and result["pos_spec"][:2] == ["batch", "kv"]
    assert result["k_shard_shape"][0] == 1  # each device holds one sequence's one KV head
    assert result["kivi_sharded"] == result["kivi_single"]  # a KIVI cache shards the same way
    assert result["words_spec"][0] == str(("batch", "kv"))
