"""Methods defined outside kvjax: files or modules in $KVJAX_PLUGINS are imported the first time
`parse_method` meets an unknown name, so the CLI and eval workers find them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import kvjax
from kvjax.policies import methods

PLUGIN = textwrap.dedent('''
    import jax.numpy as jnp
    import kvjax

    def newest_first(layer, stats, budget, key):
        return layer.pos.astype(jnp.float32), jnp.zeros(layer.pos.shape, bool)

    def newest(ratio=None, budget=None, **options):
        return kvjax.scored_policy("{name}", newest_first, ratio=ratio, budget=budget, **options)

    kvjax.register_method("{name}", newest)
''')


@pytest.fixture
def plugin_file(tmp_path, monkeypatch):
    name = f"plugin_{os.getpid()}_{tmp_path.name}".replace("-", "_")
    path = tmp_path / f"{name}.py"
    path.write_text(PLUGIN.format(name=name))
    monkeypatch.setenv(methods.PLUGINS_ENV, str(path))
    yield name, path
    methods.METHODS.pop(name, None)
    methods._loaded_plugins.discard(str(path))


def test_unknown_name_loads_the_plugin_file(plugin_file):
    name, _ = plugin_file
    assert name not in methods.METHODS
    transform = kvjax.parse_method(f"{name}:ratio=0.5+kivi:bits=4")
    assert isinstance(transform, kvjax.CacheTransform) and name in methods.METHODS


def test_plugin_modules_and_bad_plugins(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "kvjax_plugin_mod.py").write_text(PLUGIN.format(name="by_module"))
    try:
        methods.load_plugins("kvjax_plugin_mod")
        assert "by_module" in methods.METHODS
    finally:
        methods.METHODS.pop("by_module", None)
    with pytest.raises(ValueError, match="plugin .*missing.py: no such file"):
        methods.load_plugins(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="plugin no_such_module_x: cannot import this module"):
        methods.load_plugins("no_such_module_x")
    monkeypatch.setenv(methods.PLUGINS_ENV, "")
    with pytest.raises(ValueError, match="unknown method 'still_unknown'"):
        kvjax.parse_method("still_unknown:ratio=0.5")


def test_a_fresh_process_finds_the_plugin_through_the_environment(plugin_file):
    name, path = plugin_file
    code = f"import kvjax; print(type(kvjax.parse_method('{name}:budget=4')).__name__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "CacheTransform"


def readme_policy() -> str:
    from pathlib import Path
    import re
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### Write your own policy", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_policy_is_the_notebooks_and_runs_through_the_sampler(tiny_model, tmp_path,
                                                                     monkeypatch):
    import nbformat
    import numpy as np
    from pathlib import Path

    from models.sampler import generate

    notebook = Path(__file__).parents[1] / "experiments" / "notebooks" / "your_own_policy.ipynb"
    cells = [c.source for c in nbformat.read(notebook, as_version=4).cells
             if c.cell_type == "code" and c.source.startswith("%%writefile")]
    assert readme_policy().strip() == cells[0].split("\n", 1)[1].strip()
    path = tmp_path / "readme_vnorm_policy.py"
    path.write_text(readme_policy())
    monkeypatch.setenv(methods.PLUGINS_ENV, str(path))
    try:
        transform = kvjax.parse_method("vnorm:ratio=0.5+kivi:bits=4,group=4,residual=4")
        prompts = [list(range(5, 40)), list(range(7, 20))]
        out = generate(tiny_model, prompts, max_new_tokens=4, transform=transform, eos_ids=())
        assert out.tokens.shape == (2, 4)
        for layer in out.cache:  # per KV head: half of the 35-token prompt, then 3 new tokens
            held = (np.asarray(layer.recent.pos[0]) >= 0).sum(-1) + (
                np.asarray(layer.body.pos[0]) >= 0).sum(-1)
            np.testing.assert_array_equal(held, [35 // 2 + 3] * layer.kv_heads)
    finally:
        methods.METHODS.pop("vnorm", None)
        methods._loaded_plugins.discard(str(path))
