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


def run_on_8_devices(script: str, timeout: int = 600) -> dict:
    """Run `script` in a process with 8 fake CPU devices; the JSON of its last stdout line."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_generation_sharded_over_batch_and_kv_heads_matches_one_device():
    result = run_on_8_devices(SCRIPT)
    assert result["sharded"] == result["single"]
    assert result["devices"] == 8
    assert result["k_spec"][0] == str(("batch", "kv")) and result["pos_spec"][:2] == ["batch", "kv"]
    assert result["k_shard_shape"][0] == 1  # each device holds one sequence's one KV head
    assert result["kivi_sharded"] == result["kivi_single"]  # a KIVI cache shards the same way
    assert result["words_spec"][0] == str(("batch", "kv"))


IDENTITY = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import kvjax
    from flax import nnx
    from models import sampler
    from models.llama import Llama, LlamaConfig
    from models.sharding import cache_placer, collectives, make_mesh, on_mesh, shard_model

    assert jax.device_count() == 8, jax.devices()
    cfg = LlamaConfig.tiny(num_kv_heads=4, num_heads=8, head_dim=64, hidden_size=80,
                           intermediate_size=120)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh("data=2,model=4")
    sharded = shard_model(model, mesh)
    rng = np.random.default_rng(0)
    rows = {}
    for method, batch in METHODS:
        prompts = [rng.integers(3, 250, 150 - 7 * i).tolist() for i in range(batch)]
        transform = kvjax.parse_method(method)
        kw = dict(max_new_tokens=6, chunk=8, eos_ids=())
        one = sampler.generate(model, prompts, transform=transform, **kw)
        placed = on_mesh(transform, mesh)
        many = sampler.generate(sharded, prompts, transform=placed,
                                place_cache=cache_placer(mesh), **kw)
        # the compiled compression and decode steps of the sharded run, for their collectives
        pre = sampler.prefill_batch(sharded, prompts, stats=placed.stats, room=6, chunk=8,
                                    place_cache=cache_placer(mesh))
        tstate = placed.init(pre.cache)
        hlo_compress = sampler._compress_stacked.lower(placed.update, pre.cache, tstate,
                                               pre.stats).compile().as_text()
        post = sampler.compress(pre, placed, room=6)
        start = sampler.DecodeStart(post.logits, post.transform_state, None,
                                    jnp.asarray(post.next_pos), jax.random.key(0))
        hlo_decode = sampler._decode.lower(sharded, post.cache, start,
                                           sampler.DecodeConfig(6)).compile().as_text()
        leaves = lambda c: [x for x in jax.tree_util.tree_leaves(c) if x.ndim]
        rows[method] = {
            "one": one.tokens.tolist(), "many": many.tokens.tolist(),
            "weight_spec": str(sharded.layers[0].attn.q_proj.kernel.get_value().sharding.spec),
            "cache_specs": sorted({str(x.sharding.spec) for x in leaves(many.cache)}),
            "cache_devices": min(len(x.sharding.device_set) for x in leaves(many.cache)),
            "capacities": sorted({p.shape[-1] for c in (pre.cache, post.cache, many.cache)
                                  for p in jax.tree_util.tree_leaves(
                                      [getattr(l, "recent", l).pos for l in c]
                                      + [l.body.pos for l in c if hasattr(l, "body")])}),
            "compress": collectives(hlo_compress), "decode": collectives(hlo_decode)}
    print(json.dumps(rows))
""")

SHARDED_METHODS = [("full", 2), ("snapkv:ratio=0.5+kivi:bits=4,residual=32", 2),
                   ("snapkv:ratio=0.5,headwise=true", 8)]


def _shape_dims(text: str) -> list[int]:
    """Dimensions of an HLO result shape such as 'f32[2,96,32]{2,1,0}' (tuples flattened)."""
    import re
    return [int(d) for dims in re.findall(r"\[([\d,]*)\]", text) for d in dims.split(",") if d]


def test_weights_and_caches_sharded_give_one_device_tokens_and_no_cache_all_gather():
    """data=2 x model=4 fake devices, a tiny config with 4 KV heads: every method's tokens
    equal one device's; the compiled compression and decode steps all-gather no cache tensor.

    Batch 2 puts one sequence on each data shard, so the KV heads split over `model`; the
    head-wise method runs at batch 8 (a sequence's heads share slots in its pooled layout, so
    its sequences, not its heads, are split over both axes)."""
    rows = run_on_8_devices(f"METHODS = {SHARDED_METHODS!r}\n" + IDENTITY, timeout=900)
    assert set(rows) == {method for method, _ in SHARDED_METHODS}
    _check_tokens_and_collectives(rows)
    specs = rows["full"]["cache_specs"]  # one sequence per data shard, 4 KV heads on model=4
    assert specs == ["P('data', 'model')", "P(('data', 'model'),)"]  # pos; rows of k, v


def _check_tokens_and_collectives(rows: dict) -> None:
    """Each method's sharded tokens equal one device's, its weights and caches are split,
    and its compiled compression and decode steps move no cache tensor."""
    for method, row in rows.items():
        assert row["many"] == row["one"], method
        assert row["weight_spec"] == "P(None, 'model')", method  # 4 KV heads: heads split
        assert row["cache_devices"] == 8, method  # every cache array lives on the whole mesh
        # a cache tensor is one with a slot axis: no collective moves a tensor with a
        # dimension equal to any cache capacity (none equals a model dimension, so a hit is
        # a cache tensor); what remains: o_proj/down_proj partial sums, the vocab-split
        # argmax, compaction's shared cursor, and (batch over model) the statistics
        capacities = set(row["capacities"])
        assert not capacities & {80, 120, 64, 256, 8 * 64, 4 * 64}, capacities
        for step in ("compress", "decode"):
            moved = [(op, s) for op, s in row[step] if set(_shape_dims(s)) & capacities]
            assert not moved, (method, step, moved)
        if method != "snapkv:ratio=0.5,headwise=true":  # heads split like the weights
            assert not [s for op, s in row["compress"] + row["decode"]
                        if op in ("all-to-all", "collective-permute")], method


BASIS = textwrap.dedent("""
    import numpy as np
    from kvjax.policies.low_rank import LowRankBasis
    rng = np.random.default_rng(0)  # random orthonormal per-head bases, [L, KVH, D, D]
    q = np.linalg.qr(rng.normal(size=(2, 4, 64, 64)))[0].astype(np.float32)
    energy = np.sort(rng.random((2, 4, 64)), -1)[..., ::-1].astype(np.float32)
    LowRankBasis(q, q, energy, energy, 1).save(BASIS_PATH)
""")


def test_h2o_expected_attention_and_low_rank_sharded_move_no_cache_tensor(tmp_path):
    """The same check for the transforms that read more than keys: H2O (the accumulated
    attention mass, a [B, KVH, C] cache tensor), expected attention (query moments from the
    prefill's statistics) and low-rank latents (a random orthonormal basis of rank 32):
    tokens equal one device's; no collective of the compression or decode step moves a
    tensor with a cache-capacity axis."""
    basis = tmp_path / "basis.npz"
    methods = [("h2o:ratio=0.5", 2), ("expected_attention:ratio=0.5", 2),
               (f"low_rank:rank=32,basis={basis}", 2)]
    script = (f"METHODS = {methods!r}\nBASIS_PATH = {str(basis)!r}\n" + BASIS + IDENTITY)
    rows = run_on_8_devices(script, timeout=900)
    assert set(rows) == {method for method, _ in methods}
    _check_tokens_and_collectives(rows)


PALLAS = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp
    import kvjax
    from models.sharding import attend_on_mesh, cache_placer, make_mesh

    from kvjax.policies.low_rank import accumulate_moments, basis_from_moments, low_rank

    mesh = make_mesh("data=2,model=4")
    rows = {}
    b, kvh, h, t, d = 2, 4, 8, 200, 64
    k, v = jax.random.normal(jax.random.key(0), (2, b, kvh, t, d))
    dense = (kvjax.write(kvjax.init_cache(b, kvh, 256, d), k, v,
                         jnp.arange(t)[None].repeat(b, 0)),)
    basis = basis_from_moments(accumulate_moments(None, dense))
    codecs = {"dense": None, "int4": kvjax.quantize(bits=4, group=32),
              "kivi": kvjax.kivi(bits=4, group=32, residual=32),
              "low_rank": low_rank(basis, rank=16, key_rank=32),
              "pooled": kvjax.parse_method("knorm:ratio=0.5,headwise=true")}
    for name, codec in codecs.items():
        cache = dense
        if codec is not None:
            cache, _ = codec.update(cache, codec.init(cache), None)
        q = jax.random.normal(jax.random.key(1), (b, 1, h, d))
        q_pos = jnp.full((b, 1), t - 1)
        ref = kvjax.attend(q, q_pos, cache[0], impl="reference")
        placed = cache_placer(mesh)(cache)[0]
        run = jax.jit(lambda q, p, l: attend_on_mesh(q, p, l, mesh, backend="tpu",
                                                     interpret=True))
        out = run(q, q_pos, placed)
        rows[name] = {"err": float(jnp.max(jnp.abs(out - ref))),
                      "spec": str(out.sharding.spec), "type": type(placed).__name__}
        if name == "low_rank":
            rows[name]["basis_spec"] = str(placed.k.basis.sharding.spec)
    print(json.dumps(rows))
""")


def test_pallas_kernel_under_shard_map_matches_the_reference_on_8_devices():
    """The TPU kernel (interpret mode) under `jax.shard_map` on data=2 x model=4, one sequence
    per data shard and one KV head (two query heads) per model shard, for a dense, an int4, a
    KIVI and a low-rank layer (keys of rank 32, values of 16; each shard holds its own head's
    bases, split over `model` like `pos`), and a pooled one (head-wise budgets: its sequences
    split over `data`, its heads never): equal to `attend(impl="reference")` on the whole
    layer within f32 rounding."""
    rows = run_on_8_devices(PALLAS)
    assert rows["kivi"]["type"] == "ResidualCache"
    assert rows["low_rank"]["basis_spec"] == "P('model', None, None)"
    for name, row in rows.items():
        assert row["err"] < 1e-5, name
        if name == "pooled":  # heads share a row: sequences split, heads never
            assert row["spec"] == "P('data',)", row
        else:
            assert row["spec"] == "P('data', None, 'model')", name  # query heads stay split


PPL = textwrap.dedent("""
    import argparse, json
    import jax, numpy as np
    import kvjax
    from flax import nnx
    import models.sharding as sharding
    from experiments.cli import main as cli
    from experiments.eval.ppl import perplexity
    from models.llama import Llama, LlamaConfig

    cfg = LlamaConfig.tiny(num_kv_heads=4, num_heads=8, head_dim=16, hidden_size=64,
                           intermediate_size=96)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    mesh = sharding.make_mesh("data=2,model=4")
    sharded = sharding.shard_model(model, mesh)
    ids = np.random.default_rng(0).integers(3, 250, 257).tolist()  # 4 windows of 64: 2 batches of 2
    placed = []  # the layouts of the caches `kvjax ppl --mesh` puts on the mesh
    real_placer = sharding.cache_placer
    def recording_placer(mesh):
        place = real_placer(mesh)
        def run(cache):
            out = place(cache)
            placed.append([str(x.sharding.spec) for x in jax.tree_util.tree_leaves(out[0])
                           if x.ndim])
            return out
        return run
    sharding.cache_placer = recording_placer

    class Tokens:  # `cmd_ppl` encodes the text file: a stand-in giving `ids`
        encode = staticmethod(lambda text: ids)
    rows = {}
    for method, prefix in (("full", 0), ("snapkv:ratio=0.5+kivi:bits=4,group=8,residual=8", 48)):
        one = perplexity(model, ids, 64, 64, batch_size=2, prefix=prefix,
                         transform=kvjax.parse_method(method))
        args = argparse.Namespace(text=TEXT, max_tokens=len(ids), context=64, stride=64,
                                  batch_size=2, prefix=prefix, method=method, mesh_obj=mesh)
        placed.clear()
        many = cli.cmd_ppl(args, sharded, Tokens())
        rows[method] = {"one": [one.ppl, one.tokens_scored],
                        "many": [many["ppl"], many["tokens_scored"]], "placed": placed[:]}
    print(json.dumps(rows))
""")


def test_ppl_on_a_mesh_places_its_caches_and_equals_one_device(tmp_path):
    """`kvjax ppl --mesh` (cmd_ppl with a mesh) puts every batch's cache on the data=2 x
    model=4 mesh through `cache_placer` (two windows a batch: one per data shard, 4 KV heads
    over model) for plain and compressed-prefix perplexity; the perplexity equals one
    device's within float32 summation-order rounding."""
    text = tmp_path / "t.txt"
    text.write_text("any text: the stand-in tokenizer ignores it", encoding="utf-8")
    rows = run_on_8_devices(f"TEXT = {str(text)!r}\n" + PPL)
    for method, row in rows.items():
        assert row["many"][1] == row["one"][1], method
        assert abs(row["many"][0] / row["one"][0] - 1) < 1e-5, (method, row)
        assert row["placed"], method  # every batch's cache went through the placer
        for specs in row["placed"]:
            assert "P('data', 'model', None)" in specs, (method, specs)  # pos [B, KVH, C]


PALLAS_MODEL = textwrap.dedent("""
    import json
    import jax, numpy as np
    import kvjax
    import kvjax.backends.dispatch
    from flax import nnx
    from models import sampler
    from models.llama import Llama, LlamaConfig
    from models.sharding import cache_placer, make_mesh, on_mesh, pallas_impl, shard_model

    calls = []  # layers that took the per-shard kernel (counted while tracing)
    real = kvjax.backends.dispatch.attend_on_mesh
    def counting(q, q_pos, layer, impl, **kw):
        calls.append(type(layer).__name__)
        return real(q, q_pos, layer, impl, **kw)
    kvjax.backends.dispatch.attend_on_mesh = counting

    cfg = LlamaConfig.tiny(num_kv_heads=4, num_heads=8, head_dim=64, hidden_size=80,
                           intermediate_size=120)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh("data=2,model=4")
    sharded = shard_model(model, mesh)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 250, n).tolist() for n in (150, 121)]
    impl = pallas_impl(mesh, backend="tpu", interpret=True)
    rows = {}
    for method in METHODS:
        transform = kvjax.parse_method(method)
        kw = dict(max_new_tokens=8, chunk=8, eos_ids=())
        one = sampler.generate(model, prompts, transform=transform, **kw)
        calls.clear()
        many = sampler.generate(sharded, prompts, transform=on_mesh(transform, mesh),
                                place_cache=cache_placer(mesh), impl=impl, **kw)
        rows[method] = {"one": one.tokens.tolist(), "many": many.tokens.tolist(),
                        "kernel_layers": sorted(set(calls)), "kernel_calls": len(calls)}
    print(json.dumps(rows))
""")


def test_pallas_impl_on_a_mesh_runs_the_kernel_per_shard_inside_the_model():
    """`generate(..., impl=pallas_impl(mesh))` on data=2 x model=4 (one sequence per data
    shard, one KV head per model shard): every layer's attention goes through the
    shard_map'd kernel (TPU kernel, interpret mode), and the greedy tokens equal one
    device's XLA run, for a dense and an int4 cache. (Evicted or KIVI caches shrink to
    capacities that are not a page multiple, which `supports_pallas` refuses on one device
    and on a mesh alike: they take the XLA path.)"""
    methods = ["full", "quantize:bits=4,group=16"]
    rows = run_on_8_devices(f"METHODS = {methods!r}\n" + PALLAS_MODEL)
    for method, row in rows.items():
        assert row["many"] == row["one"], method
        assert row["kernel_layers"] == ["TokenCache"], method
    # traced calls: prefill + decode for `full` (2 layers each); the int4 run reuses the
    # prefill (same dense shapes, jit cache) and traces its decode over int4 pages
    assert rows["full"]["kernel_calls"] >= 2 * 2
    assert rows["quantize:bits=4,group=16"]["kernel_calls"] >= 2


def test_generate_impl_pallas_with_a_mesh_is_the_per_shard_kernel():
    """`kvjax generate --mesh M --impl pallas` hands the sampler `pallas_impl(M)` (the kernel
    per shard, axes data/model); without a mesh, or with `--impl xla`, the flag as given."""
    import argparse

    import kvjax
    from experiments.cli.main import _impl
    from models.sharding import make_mesh

    mesh = make_mesh("data=1,model=1")
    impl = _impl(argparse.Namespace(impl="pallas", mesh_obj=mesh))
    assert impl == kvjax.PallasOnMesh(mesh, None, False, batch_axis="data", kv_axis="model")
    assert hash(impl) == hash(_impl(argparse.Namespace(impl="pallas", mesh_obj=mesh)))
    assert _impl(argparse.Namespace(impl="pallas")) == "pallas"
    assert _impl(argparse.Namespace(impl="xla", mesh_obj=mesh)) == "xla"
