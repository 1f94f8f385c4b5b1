"""The research notebooks in experiments/notebooks/: each runs top to bottom (executed with
nbclient on a fresh kernel), none is committed with outputs, and README's quickstart is the
quickstart notebook's first code cell, verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "experiments" / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "your_own_policy", "your_own_model", "kernels"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: clear outputs before committing (a code cell has outputs)")


def test_readme_quickstart_is_the_notebooks_first_cell():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart (notebook)", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    nb = nbformat.read(ROOT / "experiments" / "notebooks" / "quickstart.ipynb", as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert block.strip() == first.source.strip()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, smollm2_file, tmp_path):
    """In a temporary folder (the policy notebook writes its plugin and results there)."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises on error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
