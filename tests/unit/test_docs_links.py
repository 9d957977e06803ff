"""Every relative link in README.md and docs/*.md points at a file that exists."""

import re

import pytest

# [text](target) and ![alt](target); the target ends at whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _pages(root):
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _relative_targets(text: str) -> list[str]:
    """Link targets outside code blocks that name a path here (no scheme, no bare anchor)."""
    targets = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_link_scanner_finds_relative_links_only():
    text = "[a](docs/x.md) ![b](y.png) [c](https://e.org) [d](#top) [e](z.md#part)\n```\n[f](no.md)\n```"
    assert _relative_targets(text) == ["docs/x.md", "y.png", "z.md"]


def test_every_page_is_checked(repo_root):
    names = {p.name for p in _pages(repo_root)}
    assert {"README.md", "config.md", "metrics.md", "layout.md"} <= names


@pytest.mark.parametrize("name", ["README.md", "docs"])
def test_relative_links_point_at_files(repo_root, name):
    pages = [p for p in _pages(repo_root) if (p.name == "README.md") == (name == "README.md")]
    broken = [
        f"{page.relative_to(repo_root)}: {target}"
        for page in pages
        for target in _relative_targets(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not broken, "links to missing files:\n" + "\n".join(broken)
