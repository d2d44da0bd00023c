"""The repository a newcomer reads: a short README whose links resolve, and nothing that points outside the
repository (notes that only the authors had, a sibling checkout). The docs site's own links are checked by
``mkdocs build --strict`` in ``scripts/test.sh``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300
# What once pointed outside the repository: the authors' design notes and reference notes, and a sibling checkout.
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|\breference/[a-z_]+\.md|\b[a-z_]+\.md §")


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".c", ".h", ".cfg"))]


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith(("http://", "https://", "#"))]
    assert targets, "the README links its docs pages"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_nothing_points_outside_the_repository():
    hits = []
    for path in _tracked_text_files():
        if not path.exists() or path == Path(__file__).resolve():
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "references outside the repository (cite the upstream URL instead):\n" + "\n".join(hits)


def test_license_and_changelog_exist():
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").startswith("# Changelog")
