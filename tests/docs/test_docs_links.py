"""Relative links in docs/*.md and README.md reach an existing file, and a link with ``#anchor``
reaches a heading of that name.

The pages are rendered with Python-Markdown and the extensions of mkdocs.yml, so a heading's id is
the one the built site gives it (the ``toc`` extension's slug, ``_1`` for a repeat). README.md is
read on the forge, not in the site: its anchors, and those of the pages it links to, are the
forge's slugs (lowercase, punctuation dropped, each space a hyphen, ``-1`` for a repeat).
"""

from __future__ import annotations

import functools
import html
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from repo_paths import REPO

ROOT = REPO
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
HREF = re.compile(r'<a\b[^>]*?\bhref="([^"]*)"')
HEADING = re.compile(r"<h([1-6])\b([^>]*)>(.*?)</h\1>", re.DOTALL)


@functools.cache
def _markdown_extensions() -> tuple[list, dict]:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    names, configs = [], {}
    for entry in config.get("markdown_extensions", []):
        name, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        names.append(name)
        if options:
            configs[name] = options
    return names, configs


@functools.cache
def rendered(path: Path) -> str:
    markdown = pytest.importorskip("markdown")
    names, configs = _markdown_extensions()
    return markdown.markdown(path.read_text(encoding="utf-8"), extensions=names, extension_configs=configs)


def forge_slug(text: str) -> str:
    """A heading's anchor on the forge: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path, forge: bool) -> frozenset[str]:
    """The heading ids of a page, as the site (or, with ``forge``, the forge) names them."""
    page = rendered(path)
    if not forge:
        return frozenset(re.findall(r'<h[1-6]\b[^>]*\bid="([^"]+)"', page))
    seen: dict[str, int] = {}
    ids = set()
    for _, _, inner in HEADING.findall(page):
        text = html.unescape(re.sub(r"<[^>]+>", "", inner)).replace("¶", "")
        slug = forge_slug(text)
        ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(ids)


def broken_links(path: Path) -> list[str]:
    """``link: why`` for each relative link of a page that reaches no file or no heading."""
    forge = path.parent == ROOT  # README.md, read on the forge
    broken = []
    for href in (html.unescape(h) for h in HREF.findall(rendered(path))):
        parts = urlsplit(href)
        if parts.scheme or parts.netloc or href.startswith("/"):
            continue  # an absolute address or URL: not a file of this repository
        target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not target.exists():
            broken.append(f"{href}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif parts.fragment and target.suffix == ".md" and parts.fragment not in anchors(target, forge):
            broken.append(f"{href}: {target.name} has no heading #{parts.fragment}")
    return broken


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(path):
    assert not broken_links(path), "\n".join(broken_links(path))


def test_the_check_knows_the_slugs_and_catches_a_wrong_anchor(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Top\n\n## 2. Selections (SPEC §2, §3)\n\n## Twice\n\n## Twice\n\n```\n# not a heading\n```\n\n"
        "[ok](#2-selections-spec-2-3) [again](#twice_1) [code](#not-a-heading) [gone](b.md) "
        "[wrong](#2-selections-spec-2-spec-3)\n", encoding="utf-8")
    assert [link.split(":")[0] for link in broken_links(tmp_path / "a.md")] == [
        "#not-a-heading", "b.md", "#2-selections-spec-2-spec-3"]
    assert forge_slug("6. Bounds (SPEC §6) — `x`") == "6-bounds-spec-6--x"
