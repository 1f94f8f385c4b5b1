"""What a wheel install carries: the built wheel holds every package with its data (the CPU
kernel's C++ source, the texts, the shipped configs, the notebooks, the trained artifacts:
the planner's controller and the KVzap surrogate), and `--config NAME`
finds a shipped grid without the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_code_and_data(tmp_path):
    import importlib.metadata
    # the installed setuptools when it is new enough (pyproject: >= 77), else pip's own build env
    isolated = int(importlib.metadata.version("setuptools").split(".")[0]) < 77
    source = tmp_path / "source"  # a copy: setuptools writes build/ and *.egg-info in place
    for name in ("kvjax", "models", "kernels_pallas", "experiments"):
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(tmp_path), str(source)] + ([] if isolated else
                                                        ["--no-build-isolation"]),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("kvjax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"experiments/configs/{p.name}" for p in (ROOT / "experiments/configs").glob("*.toml")}
    want |= {f"experiments/notebooks/{p.name}"
             for p in (ROOT / "experiments/notebooks").glob("*.ipynb")}
    want |= {f"experiments/data/{p.name}" for p in (ROOT / "experiments/data").glob("*.txt")}
    for folder in ("experiments/data/kvzap", "experiments/data/duo",  # orbax; DuoAttention's
                   "kvjax/policies/planner_controller"):  # trained patterns (.npz)
        want |= {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*") if p.is_file()}
    want |= {"kvjax/core/cpu_kernels/decode_attention.cc", "kvjax/py.typed",
             "experiments/cli/main.py", "experiments/eval/harness.py", "models/sampler.py",
             "kernels_pallas/paged_attention.py", "kvjax/memory/paging.py"}
    assert not want - names, sorted(want - names)
    assert not any(n.startswith(("tests/", "docs/")) for n in names)


def test_a_shipped_config_is_named_without_a_path(tmp_path, monkeypatch):
    from experiments.cli.main import CONFIGS, build_parser, config_path
    monkeypatch.chdir(tmp_path)  # no experiments/configs/ here
    args = build_parser().parse_args(["eval", "--config", "ruler_smoke", "--out", "o"])
    assert args.config == CONFIGS / "ruler_smoke.toml" and args.config.is_file()
    assert config_path("my_grid.toml") == Path("my_grid.toml")  # a file name stays a file
    (tmp_path / "ruler_smoke").write_text("")  # a file of that name wins over the shipped one
    assert config_path("ruler_smoke") == Path("ruler_smoke")


def test_an_unknown_config_names_the_shipped_ones(tmp_path, capsys, monkeypatch):
    from experiments.cli.main import main
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--config", "no_such_grid", "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert "no_such_grid" in err and "ruler_long" in err and "smoke" in err
