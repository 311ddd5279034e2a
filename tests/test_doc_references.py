"""Every reference to a section of the documentation names a page and a heading that exist.

Code, tests and docs point to the documentation as ``docs/<page>.md, "<heading>"``; more
headings of the same page follow as ``, "<heading>"`` (``docs/algorithms.md, "FIRM base
merge", "FIRM retention-constrained projection"``). A reference may wrap onto the next line of
a docstring or a comment. Headings are matched exactly (any level, outside code blocks), or by
their part before a colon (``"Threat model"`` for "Threat model: what the copies hide, and from
whom"), so a renamed or removed heading fails here until its references follow.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: where references live (the folders of the project's own files, and the top-level files)
FOLDERS = ("fedunlearn", "strategies", "clients", "wire", "simulations", "tests", "docs", "presets")
TOP_FILES = ("README.md", "pyproject.toml")
SUFFIXES = {".py", ".md", ".toml"}
#: ``docs/<page>.md, "<heading>"`` with more ``, "<heading>"`` of the same page
REFERENCE = re.compile(r'docs/([\w.-]+\.md), ("[^"]+"(?:, "[^"]+")*)')
#: a line break with the indentation and comment marker (``#``, ``#:``) of the next line
LINE_BREAK = re.compile(r"[ \t]*\n[ \t]*(?:#:?[ \t]*)?")
HEADING = re.compile(r"#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
#: the section sign: sections are named by their heading in docs/, never by the number of a
#: section of a document the repository does not hold
SECTION_SIGN = "\u00a7"


def project_files() -> list[Path]:
    """The project's own source, test and documentation files (this one, whose examples are
    not references, left out)."""
    files = [REPO / name for name in TOP_FILES if (REPO / name).is_file()]
    for folder in FOLDERS:
        files += sorted(p for p in (REPO / folder).rglob("*") if p.suffix in SUFFIXES)
    here = Path(__file__).resolve()
    return [p for p in files if "__pycache__" not in p.parts and p.resolve() != here]


def headings(page: Path) -> set[str]:
    """The text of every Markdown heading of ``page`` outside fenced code blocks, and of a
    heading with a colon also its part before the colon."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            text = " ".join(match.group(1).split())
            found |= {text, text.split(": ", 1)[0]}
    return found


def references(text: str) -> list[tuple[str, str]]:
    """``(page, heading)`` of every reference in ``text``, with wrapped lines joined."""
    joined = LINE_BREAK.sub(" ", text)
    return [
        (page, " ".join(heading.split()))
        for page, quoted in REFERENCE.findall(joined)
        for heading in re.findall(r'"([^"]+)"', quoted)
    ]


def test_references_are_read_across_wrapped_lines() -> None:
    text = 'x (docs/algorithms.md, "FIRM\n    # base merge", "MPU").\n'
    assert references(text) == [("algorithms.md", "FIRM base merge"), ("algorithms.md", "MPU")]
    assert references('see docs/mpu.md for more, and "this"') == []


def test_a_heading_is_named_in_full_or_by_its_part_before_a_colon(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Threat model: what it hides\n\n```\n# not a heading\n```\n")
    assert headings(page) == {"Title", "Threat model: what it hides", "Threat model"}


def test_every_referenced_page_and_heading_exists() -> None:
    pages = {p.name: headings(p) for p in (REPO / "docs").glob("*.md")}
    broken, count = [], 0
    for path in project_files():
        for page, heading in references(path.read_text(encoding="utf-8")):
            count += 1
            if page not in pages:
                broken.append(f"{path.relative_to(REPO)}: no page docs/{page}")
            elif heading not in pages[page]:
                broken.append(f'{path.relative_to(REPO)}: docs/{page} has no heading "{heading}"')
    assert count > 50, "the references were not found: has their form changed?"
    assert not broken, "\n".join(broken)


def test_no_numbered_sections_of_outside_documents() -> None:
    """No section sign, and no mention of a specification the repository does not hold."""
    outside = re.compile(SECTION_SIGN + r"|\b[S]PEC\b")  # [S]: this line is not a mention
    found = [
        path.relative_to(REPO).as_posix()
        for path in project_files()
        if outside.search(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"these files number sections instead of naming a docs/ heading: {found}"
