"""The documentation site (mkdocs.yml) builds with warnings as errors: the guides, README as
the home page, the four notebooks and the API reference generated from every docstring of
`kvjax`, `models` and `kernels_pallas`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strict_with_every_page(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    home = (site / "index.html").read_text()
    assert "pip install -e" in home and 'href="guide/command-line/"' in home
    for notebook in ("quickstart", "your_own_policy", "your_own_model", "kernels"):
        assert (site / "notebooks" / notebook / "index.html").exists(), notebook
    api = (site / "api" / "core" / "index.html").read_text()
    assert "kvjax.core.cache.TokenCache" in api or "TokenCache" in api
    for page in (ROOT / "docs" / "guide").glob("*.md"):
        assert (site / "guide" / page.stem / "index.html").exists(), page.name


def test_every_guide_page_is_in_the_navigation():
    text = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in (ROOT / "docs" / "guide").glob("*.md")
               if f"guide/{p.name}" not in text]
    assert not missing, missing
