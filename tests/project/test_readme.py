"""The README stays short and the user docs hold together.

``README.md`` is at most ``README_MAX_LINES`` lines; the rest lives in the user pages under
``docs/`` (``USER_DOCS``). Every relative link in the README and in those pages names a file
that exists, and a ``#fragment`` on a link to a Markdown file names one of its headings, slugged
as GitHub slugs them. The README and those pages speak to users only: none of ``PROCESS_WORDS``
appears as a whole word outside fenced code blocks (a command or its output may legitimately
hold such a word, so fenced blocks are left out of that check, and of the link check).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
USER_DOCS = ("deploy.md", "telemetry.md", "diagnosis.md", "engine.md", "terms.md", "benchmarks.md")
PAGES = [ROOT / "README.md", *(ROOT / "docs" / name for name in USER_DOCS)]
PROCESS_WORDS = ("issue", "issues", "session", "sessions", "helper", "helpers", "closing note")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return FENCE.sub("", text)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character that is not
    a letter, digit, underscore, hyphen or space dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated slug gets -1, -2, … as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(_prose(path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", _prose(path.read_text()))
    return [
        target
        for target in LINK.findall(text)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:, …
    ]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_user_pages_exist():
    missing = [_rel(p) for p in PAGES if not p.is_file()]
    assert not missing, missing


def test_slug_follows_github():
    assert slug("Tensor and data parallelism") == "tensor-and-data-parallelism"
    assert slug("Prefill/decode disaggregation") == "prefilldecode-disaggregation"
    assert slug("How far to trust the diagnosis: the labelled corpus") == (
        "how-far-to-trust-the-diagnosis-the-labelled-corpus"
    )
    assert (
        slug("Fourth run: int4 on `x` — 2026-12-02, CPU") == "fourth-run-int4-on-x--2026-12-02-cpu"
    )


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    links = relative_links(page)
    assert links, f"{_rel(page)} links nowhere"
    for link in links:
        target, _, fragment = link.partition("#")
        dest = (page.parent / target).resolve() if target else page
        assert dest.exists(), f"{_rel(page)}: {link} names {target}, which does not exist"
        if fragment and dest.suffix == ".md":
            assert fragment in anchors(dest), (
                f"{_rel(page)}: {link}: no heading of {_rel(dest)} has the anchor #{fragment}"
            )


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_words_about_how_the_project_is_made(page):
    text = _prose(page.read_text())
    found = [word for word in PROCESS_WORDS if re.search(rf"\b{re.escape(word)}\b", text, re.I)]
    assert not found, f"{_rel(page)} speaks of {found}: user docs describe the product only"
