"""mkdocs hooks: README.md is the site's home page (no copy under docs/), and links to the
notebooks (`docs/notebooks` is a link to `experiments/notebooks`) point to their pages."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def _home_page(readme: str) -> str:
    """README's links are relative to the repository; the home page's to docs/."""
    def relink(match: re.Match) -> str:
        target = match.group(1)
        if target.startswith(("http", "#")):
            return match.group(0)
        if target.startswith("docs/"):
            return f"]({target[len('docs/'):]})"
        if target.startswith("experiments/notebooks/"):
            return f"](notebooks/{target.rsplit('/', 1)[1]})"
        return match.group(0)  # a repository file: left as written (not a page)
    return re.sub(r"\]\(([^)]+)\)", relink, readme)


def on_files(files, config):
    files.append(File.generated(config, "index.md",
                                content=_home_page((ROOT / "README.md").read_text())))
    return files


def on_page_markdown(markdown, page, config, files):
    """A guide's links to the notebooks (valid on GitHub) point to their rendered pages."""
    return markdown.replace("](../../experiments/notebooks/", "](../notebooks/")
