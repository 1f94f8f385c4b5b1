"""`[mesh]` in an eval config: checked when the config loads, and the real model's cells on
a data=2 x model=4 mesh of 8 fake CPU devices give the rows of one device."""

from __future__ import annotations

import textwrap

import pytest

from experiments.eval import harness
from experiments.eval.grid import read_config
from tests.test_sharding import run_on_8_devices

GRID = """
trials = 2
batch = 2
max_new_tokens = 6

[[grid]]
tasks = ["ppl"]
lengths = [64]
methods = ["full", "snapkv:ratio=0.5+kivi:bits=4,group=16,residual=16"]

[[grid]]
tasks = ["passkey"]
lengths = [256]
methods = ["snapkv:ratio=0.5"]
"""


def _config(tmp_path, mesh: str, grid: str = GRID):
    path = tmp_path / "grid.toml"
    path.write_text(grid + mesh, encoding="utf-8")
    return path


def test_mesh_table_sets_every_cell_mesh(tmp_path):
    grid = read_config(_config(tmp_path, "[mesh]\ndata = 2\nmodel = 4\n"))
    assert len(grid.cells) == 3 and {c.mesh for c in grid.cells} == {"data=2,model=4"}
    assert {c.mesh for c in read_config(_config(tmp_path, "[mesh]\nmodel = 8\n")).cells} \
        == {"data=1,model=8"}
    assert {c.mesh for c in read_config(_config(tmp_path, "")).cells} == {""}


@pytest.mark.parametrize("mesh, message", [
    ("[mesh]\ndata = 2\nmodle = 4\n", "unknown [mesh] key 'modle' (did you mean 'model'?)"),
    ("[mesh]\ndata = 0\n", "[mesh] data = 0: must be an integer >= 1"),
    ("[mesh]\nmodel = 2.0\n", "[mesh] model = 2.0: must be an integer >= 1"),
    ("[mesh]\nmodel = true\n", "[mesh] model = True: must be an integer >= 1"),
    ("mesh = \"data=2\"\n", "mesh = 'data=2': must be a [mesh] table"),
    ("[mesh]\n", "mesh = {}: must be a [mesh] table"),
])
def test_bad_mesh_table_is_refused_naming_key_and_value(tmp_path, mesh, message):
    if not mesh.startswith("["):  # a top-level key must come before the [[grid]] tables
        path = tmp_path / "grid.toml"
        path.write_text(mesh + GRID, encoding="utf-8")
    else:
        path = _config(tmp_path, mesh)
    with pytest.raises(ValueError) as e:
        read_config(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_mesh_must_use_every_device_and_kvjax_cells_only(tmp_path):
    import jax
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"\[mesh\] data=1,model={n + 1} needs {n + 1} "
                                         rf"devices, {n} available"):
        harness.load_config(_config(tmp_path, f"[mesh]\nmodel = {n + 1}\n"))
    assert harness.load_config(_config(tmp_path, f"[mesh]\nmodel = {n}\n")).cells[0].mesh
    kvpress = GRID + 'engines = ["kvjax", "kvpress"]\n'
    with pytest.raises(ValueError, match=r"\[mesh\] runs kvjax cells only"):
        read_config(_config(tmp_path, "[mesh]\nmodel = 1\n", kvpress))


SWEEP = textwrap.dedent("""
    import dataclasses, json, sys
    from pathlib import Path
    from flax import nnx
    import models.loading
    from experiments.eval import cells
    from experiments.eval import harness
    from models.llama import Llama, LlamaConfig
    from models.tokenizer import load_tokenizer
    from tests.conftest import smollm2_path

    # a tiny random decoder with 4 KV heads behind the real tokenizer (so the cells' prompts
    # are the real ones): on data=2 x model=4 its attention, MLP and vocabulary split over
    # `model` and batch-2 caches put one sequence per data shard, one KV head per device
    tokenizer = load_tokenizer(models.loading.converted_dir(smollm2_path()))
    cfg = LlamaConfig.tiny(vocab_size=49152, num_kv_heads=4, num_heads=8, max_position=2048)
    models.loading.load_model = lambda name, *a, **k: (Llama(cfg, rngs=nnx.Rngs(0)), tokenizer)

    grid = harness.load_config(Path(sys.argv[1]))  # checks data x model = 8 devices
    rows = []
    for cell in grid.cells:
        sharded = cells.run_kvjax_cell(cell)
        one = cells.run_kvjax_cell(dataclasses.replace(cell, mesh=""))
        rows.append({"sharded": sharded, "one": one})
    print(json.dumps(rows))
""")

TIMES = ("seconds", "seconds_per_trial", "mesh")  # what may differ between the two rows


def test_eval_rows_on_a_mesh_equal_one_device_rows(tmp_path):
    """The harness's own cells (`run_kvjax_cell`) on data=2 x model=4 vs one device: ppl with
    `full` and a SnapKV+KIVI chain and a SnapKV passkey cell, a tiny random 4-KV-head decoder
    behind the real tokenizer: every row field equals the one-device row's (passkey outputs
    exactly), the perplexities within float32 summation-order rounding."""
    path = _config(tmp_path, "[mesh]\ndata = 2\nmodel = 4\n")
    rows = run_on_8_devices(SWEEP.replace("sys.argv[1]", repr(str(path))), timeout=900)
    assert len(rows) == 3
    for pair in rows:
        sharded, one = pair["sharded"], pair["one"]
        assert sharded["mesh"] == "data=2,model=4" and one["mesh"] == ""
        assert set(sharded) == set(one)
        for key in set(sharded) - set(TIMES) - {"score", "nll"}:
            assert sharded[key] == one[key], (sharded["method"], key)
        # the o_proj / down_proj partial sums are added in another order on the mesh
        assert sharded["score"] == pytest.approx(one["score"], rel=1e-5), sharded["method"]
    assert rows[-1]["one"]["outputs"] and rows[-1]["one"]["task"] == "passkey"
