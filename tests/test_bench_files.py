"""docs/bench/ keeps only what the docs cite: every committed file there is named by README.md,
docs/*.md or docs/guide/*.md (issue 47). A run's output that no page quotes is run history,
which git keeps; commit a file with the sentence that cites it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"


def expand(text: str) -> list[str]:
    """Shell-style braces: `kernel_ab_b{1,8}_v2.json` -> both names."""
    m = re.search(r"\{([^{}]*)\}", text)
    if not m:
        return [text]
    return [x for alt in m.group(1).split(",")
            for x in expand(text[:m.start()] + alt + text[m.end():])]


def cited(rel: str, docs: str, braced: set[str]) -> bool:
    """`rel` (a path under docs/bench) is cited by its path or file name, by a brace pattern
    that expands to it, or by its stem followed by `.*` / `.{` / a space, backtick, parenthesis
    or line end (an output prefix: `--out docs/bench/attention_layer_targets`)."""
    name, stem = Path(rel).name, Path(rel).stem
    if any(re.search(r"(?<![\w-])" + re.escape(n) + r"(?!\w)", docs) for n in (rel, name)):
        return True
    if any(t.endswith(name) for t in braced):
        return True
    return re.search(r"(?<![\w-])" + re.escape(stem) + r"(\.\*|\.\{|[ `)\n])", docs) is not None


def committed() -> list[str]:
    """The files under docs/bench that git tracks (every file there outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "docs/bench"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(BENCH)) for p in sorted(BENCH.rglob("*")) if p.is_file()]
    return [p.removeprefix("docs/bench/") for p in out]


def test_every_file_in_docs_bench_is_cited_by_the_docs():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    docs = "\n".join(p.read_text(encoding="utf-8") for p in pages) + "\n"
    braced = {x for m in re.finditer(r"[\w./-]*\{[\w,.-]+\}[\w./{},-]*", docs)
              for x in expand(m.group(0))}
    assert cited("kernel_ab_b8_4096_v2.json", "`docs/bench/kernel_ab_b{1,8}_4096_v2.json`\n",
                 {"docs/bench/kernel_ab_b1_4096_v2.json", "docs/bench/kernel_ab_b8_4096_v2.json"})
    assert not cited("e2e_v2.json", "old_e2e_v2.json e2e_v21.json", set())
    files = committed()
    assert files, "no files under docs/bench"
    uncited = [f for f in files if not cited(f, docs, braced)]
    assert not uncited, f"docs/bench files no page cites (cite them or git rm them): {uncited}"
