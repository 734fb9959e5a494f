"""The README and the pages under docs/: links resolve inside the repository, the README stays short.

Every relative link (inline, reference-style or HTML ``src``/``href``) in ``README.md`` and
``docs/*.md`` must name a file or folder of this repository; a ``#fragment`` on a Markdown target must
name one of its headings, slugged as GitHub does. Links outside the repository (the design notes once
linked at ``../shared/design/``) are refused: what readers need lives in ``docs/``. Web links are not
fetched.

Every table of every Markdown file in the repository (the README, ``docs/`` and the GPU run records under
``bench/results/``, which the docs cite) is rendered by a Markdown parser with GitHub's table extension
(markdown-it-py), and a page fails on what would show as raw text on GitHub: a line that starts with ``|`` but is
not rendered into a table (above all a table split by a blank line), or a row with more or fewer cells than its
header (the parser pads or drops cells without a word).
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# The pages whose tables are checked: the docs and the GPU run records (bench/results/<date>-<gpu>/), which the
# docs cite as evidence; a record's split table hides its rows as raw text as surely as a page's does.
RECORDS = sorted((ROOT / "bench" / "results").glob("**/*.md"))
TABLE_PAGES = [*PAGES, *RECORDS]

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


# Tables: rendered by markdown-it-py (CommonMark plus GitHub's table extension, as GitHub renders them).
_MARKDOWN = MarkdownIt("commonmark").enable("table")
_CELL_SEPARATOR = re.compile(r"(?<!\\)\|")  # an unescaped pipe, as the table extension splits rows
# Pages with a known table fault that someone else's change fixes: a strict xfail, so the fix must remove the entry.
_KNOWN_TABLE_FAULTS: dict[str, str] = {}  # page -> why its tables are known not to render (a strict xfail)


def _cell_count(line: str) -> int:
    """The cells a table row holds as written: split on unescaped pipes, without the outer pipes' empty ends."""
    cells = _CELL_SEPARATOR.split(line.strip())
    if cells and not cells[0].strip():
        cells.pop(0)
    if cells and not cells[-1].strip():
        cells.pop()
    return len(cells)


def table_faults(text: str) -> list[str]:
    """What in ``text`` would not render as the table it means to be, one line each (1-based line numbers): a line
    starting with ``|`` outside any rendered table, code block or HTML block (a table split by a blank line when only
    blank lines separate it from a table above), and a row with more or fewer cells than its table's header."""
    lines = text.splitlines()
    tables, in_table, in_code = [], set(), set()
    for token in _MARKDOWN.parse(text):
        if token.type == "table_open":
            tables.append(token.map)
            in_table.update(range(*token.map))
        elif token.type in ("fence", "code_block", "html_block"):
            in_code.update(range(*token.map))
    rows = [number not in in_code and line.lstrip().startswith("|") for number, line in enumerate(lines)]
    faults = []
    for number in range(len(lines)):
        if not rows[number] or number in in_table or (number > 0 and rows[number - 1]):
            continue  # not a row, a rendered one, or one more line of a block of rows reported at its first
        above = number - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        if above >= 0 and rows[above]:
            faults.append(
                f"line {number + 1}: a blank line at line {above + 2} splits a table; the rows below render as text"
            )
        else:
            faults.append(f"line {number + 1}: a table row outside any table")
    for start, end in tables:
        header = _cell_count(lines[start])
        for number in range(start + 2, end):
            cells = _cell_count(lines[number])
            if cells != header:
                faults.append(f"line {number + 1}: {cells} cells in a table whose header has {header}")
    return faults


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_TABLE_FAULTS[_name(page)]))
        if _name(page) in _KNOWN_TABLE_FAULTS
        else page
        for page in TABLE_PAGES
    ],
    ids=_name,
)
def test_tables_render(page):
    faults = table_faults(page.read_text(encoding="utf-8"))
    assert not faults, f"{_name(page)} has tables that render as raw text on GitHub:\n" + "\n".join(faults)


def test_every_markdown_file_has_its_tables_checked():
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    unchecked = sorted(set(filter(None, listed.split("\0"))) - {_name(page) for page in TABLE_PAGES})
    assert not unchecked, f"tests/test_docs.py does not check the tables of {unchecked}: add them to TABLE_PAGES"
    assert set(_KNOWN_TABLE_FAULTS) <= {_name(page) for page in TABLE_PAGES}


def test_table_faults_are_found():
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert table_faults(table) == []
    assert table_faults(table + "| `x \\| y` | 3 |\n") == []  # an escaped pipe is no separator
    assert table_faults("```\n| not | a table |\n```\n\n    | code | block |\n") == []
    split = "line {}: a blank line at line {} splits a table; the rows below render as text"
    assert table_faults(table + "\n| 3 | 4 |\n| 5 | 6 |\n\n| 7 | 8 |\n") == [split.format(5, 4), split.format(8, 7)]
    assert table_faults("Text.\n\n| a | b |\n| 1 | 2 |\n") == ["line 3: a table row outside any table"]
    assert table_faults("| a | b |\n|---|\n| 1 | 2 |\n") == ["line 1: a table row outside any table"]
    assert table_faults(table + "| 3 |\n| 4 | 5 | 6 |\n") == [
        "line 4: 1 cells in a table whose header has 2",
        "line 5: 3 cells in a table whose header has 2",
    ]
    assert table_faults("- item\n\n  | a | b |\n  |---|---|\n  | 1 | 2 |\n") == []  # a table in a list item
