"""The README and the pages under docs/: links resolve inside the repository, the README stays short.

Every relative link (inline, reference-style or HTML ``src``/``href``) in ``README.md`` and
``docs/*.md`` must name a file or folder of this repository; a ``#fragment`` on a Markdown target must
name one of its headings, slugged as GitHub does. Links outside the repository (the design notes once
linked at ``../shared/design/``) are refused: what readers need lives in ``docs/``. Web links are not
fetched.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

MAX_README_LINES = 220
TOP_LINES = 40
TOP_COMMANDS = (
    "python -m bench --pipeline z-image --weights random-full",
    "python -m pytest -q",
)

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HTML = re.compile(r"(?:src|href)\s*=\s*\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str, blank_code: bool = True) -> list[str]:
    """The lines of ``text`` outside fenced code blocks, with inline code spans blanked (``blank_code``)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(2)[0] * len(match.group(2))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
            continue
        lines.append(_INLINE_CODE.sub("", line) if blank_code else line)
    return lines


def links(page: Path) -> list[str]:
    """Every link target in ``page``, as written (fragments included), code excluded."""
    found = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        found += _INLINE_LINK.findall(line)
        found += _HTML.findall(line)
        reference = _REFERENCE.match(line)
        if reference:
            found.append(reference.group(1))
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = (ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN")
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (repeats numbered ``-1``, ``-2``... as on GitHub)."""
    seen: dict[str, int] = {}
    result = set()
    for line in _prose_lines(page.read_text(encoding="utf-8"), blank_code=False):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def _relative_links(page: Path) -> list[tuple[str, Path, str]]:
    """``(as written, resolved path, fragment)`` for every link of ``page`` that is not a web address."""
    result = []
    for target in links(page):
        if not target or _SCHEME.match(target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        result.append((target, resolved, fragment))
    return result


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_docs_exist():
    assert README.is_file()
    assert (DOCS / "index.md").is_file(), "docs/index.md lists the pages"
    assert len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve_inside_the_repository(page):
    outside, missing = [], []
    for target, resolved, _ in _relative_links(page):
        if not resolved.is_relative_to(ROOT):
            outside.append(target)
        elif not resolved.exists():
            missing.append(target)
    assert not outside, f"{_name(page)} links outside the repository (put what readers need in docs/): {outside}"
    assert not missing, f"{_name(page)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_fragments_name_headings(page):
    broken = [
        target
        for target, resolved, fragment in _relative_links(page)
        if fragment
        and resolved.suffix == ".md"
        and resolved.is_file()
        and resolved.is_relative_to(ROOT)
        and fragment not in anchors(resolved)
    ]
    assert not broken, f"{_name(page)} links to headings that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_reference_to_notes_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text, f"{_name(page)} points at ../shared: the design belongs in docs/"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_starts_with_the_two_commands():
    top = "\n".join(README.read_text(encoding="utf-8").splitlines()[:TOP_LINES])
    for command in TOP_COMMANDS:
        assert command in top, f"README.md's first {TOP_LINES} lines lack `{command}`"


def test_every_page_is_reachable_from_the_index():
    index = DOCS / "index.md"
    linked = {resolved for _, resolved, _ in _relative_links(index)}
    unlisted = [_name(page) for page in PAGES if page not in (README, index) and page not in linked]
    assert not unlisted, f"docs/index.md does not list {unlisted}"
    assert index in {resolved for _, resolved, _ in _relative_links(README)}, "README.md does not link docs/index.md"


def test_link_extraction_skips_code_and_web_addresses(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A `code` heading: yes, twice\n"
        "# A `code` heading: yes, twice\n"
        "[a](one.md#part) and ![b](img/two.png) and `[c](not-a-link.md)` and [d](https://example.com)\n"
        "```bash\n[e](inside-a-fence.md)\n```\n"
        '[ref]: three.md\n<img src="four.png">\n',
        encoding="utf-8",
    )
    assert links(page) == ["one.md#part", "img/two.png", "https://example.com", "three.md", "four.png"]
    assert anchors(page) == {"a-code-heading-yes-twice", "a-code-heading-yes-twice-1"}
    assert _slug('Beside torch.compile(mode="reduce-overhead")') == "beside-torchcompilemodereduce-overhead"
    assert _slug("Z-Image 1024², 8 steps") == "z-image-1024²-8-steps"
