"""Two processes x 4 fake CPU devices on loopback (`kvjax launch`) give one process's tokens.

The launched script joins the others through `models.sharding.init_distributed`
(`jax.distributed.initialize` from the `KVJAX_*` variables launch sets), generates once
on its own first device and once with weights and caches sharded over the 8-device
data=2 x model=4 mesh spanning both processes (gloo collectives), and prints both.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json
    from models.sharding import init_distributed
    assert init_distributed()
    import jax, numpy as np
    import kvjax
    from flax import nnx
    from models import sampler
    from models.llama import Llama, LlamaConfig
    from models.sharding import cache_placer, make_mesh, on_mesh, shard_model

    cfg = LlamaConfig.tiny(num_kv_heads=4, num_heads=8, head_dim=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))  # the same seed in every process
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, 100 - 7 * i).tolist() for i in range(2)]
    t = kvjax.parse_method("snapkv:ratio=0.5+kivi:bits=4,residual=32")
    kw = dict(max_new_tokens=6, chunk=8, eos_ids=())
    one = sampler.generate(model, prompts, transform=t, **kw)  # this process's first device
    mesh = make_mesh("data=2,model=4")
    many = sampler.generate(shard_model(model, mesh), prompts, transform=on_mesh(t, mesh),
                            place_cache=cache_placer(mesh), **kw)
    k = many.cache[0].recent.k
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": jax.device_count(), "local": jax.local_device_count(),
                      "one": one.tokens.tolist(), "many": many.tokens.tolist(),
                      "k_devices": len(k.sharding.device_set),
                      "k_local_shards": len(k.addressable_shards)}))
""")


def test_two_processes_of_four_devices_give_one_process_tokens(tmp_path: Path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "experiments.cli.main", "launch", "-n", "2",
                           "--local-devices", "4", "--timeout", "840", "--", sys.executable,
                           str(script)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (row["process"], row["processes"], row["devices"], row["local"]) == (0, 2, 8, 4)
    assert row["k_devices"] == 8 and row["k_local_shards"] == 4  # the cache spans both
    assert row["many"] == row["one"]


def test_launch_without_a_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "experiments.cli.main", "launch", "-n", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs a command" in proc.stderr
