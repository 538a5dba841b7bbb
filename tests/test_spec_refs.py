"""Every spec citation in the code, tests, benchmarks, README and documentation pages names a
section of docs/spec.md.

A citation is ``SPEC §n`` (or ``docs/spec.md §n``), possibly followed by more sections:
``SPEC §2–§3``, ``SPEC §2, §5``, ``SPEC §3 and §3b``. A section is a heading ``## n. Title`` of
docs/spec.md, n a number with an optional letter (``3b``). Inside docs/spec.md itself every
``§n`` must name one of its sections too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC_FILE = ROOT / "docs" / "spec.md"
SCANNED_DIRS = ("src", "tests", "benchmarks")
SCANNED_FILES = ("README.md",)
SCANNED_PAGES = "docs"
"""The documentation's pages (``docs/**/*.md``), except docs/spec.md itself, whose own
references ``test_spec_cross_references_name_its_sections`` checks."""
TEXT_SUFFIXES = {".py", ".md", ".sh", ".cpp", ".h", ".txt", ".toml", ".yaml", ".yml"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}

HEADING = re.compile(r"^#{1,6}\s+(\d+[a-z]?)\.\s", re.MULTILINE)
SECTION = r"§\s*\d+[a-z]?\b"
CITATION = re.compile(rf"(?:\bSPEC|docs/spec\.md)\s+{SECTION}"
                      rf"(?:\s*(?:,|and|–|-|to)\s*{SECTION})*")
BARE_SECTION = re.compile(SECTION)
# "SPEC 6": a citation without the section sign (the one form is "SPEC §6").
MALFORMED = re.compile(r"\bSPEC\s+\d")


def headings(spec_text: str) -> set[str]:
    """The section numbers of the headings of a spec."""
    return set(HEADING.findall(spec_text))


def cited_sections(text: str) -> list[str]:
    """Every section number cited in ``text``, in order."""
    return [re.sub(r"[§\s]", "", ref) for match in CITATION.finditer(text)
            for ref in BARE_SECTION.findall(match.group(0))]


def problems(text: str, sections: set[str], where: str) -> list[str]:
    """One line per citation in ``text`` that names no section of ``sections``, or lacks §."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        found += [f"{where}:{lineno}: SPEC §{ref} is not a section of docs/spec.md"
                  for ref in cited_sections(line) if ref not in sections]
        found += [f"{where}:{lineno}: {m.group(0)!r}: cite as 'SPEC §n'"
                  for m in MALFORMED.finditer(line)]
    return found


def scanned_files() -> list[Path]:
    """README, the documentation's pages and the text files under src/, tests/ and benchmarks/,
    except this test (whose examples cite missing sections on purpose) and build output."""
    files = [ROOT / name for name in SCANNED_FILES]
    files += [path for path in sorted((ROOT / SCANNED_PAGES).rglob("*.md"))
              if path.resolve() != SPEC_FILE.resolve()]
    for folder in SCANNED_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if (path.is_file() and path.suffix in TEXT_SUFFIXES and not parts & SKIPPED_DIRS
                    and not any(p.endswith(".egg-info") for p in parts)
                    and path.resolve() != Path(__file__).resolve()):
                files.append(path)
    return files


def test_every_citation_names_a_section():
    sections = headings(SPEC_FILE.read_text(encoding="utf-8"))
    found, count = [], 0
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        count += len(cited_sections(text))
        found += problems(text, sections, str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)
    assert count >= 30  # the scan does see the code's citations


def test_the_documentation_pages_are_scanned():
    """The pages under docs/ are in the scan (spec.md aside), and they do cite the spec."""
    pages = [p for p in scanned_files() if p.is_relative_to(ROOT / SCANNED_PAGES)]
    assert ROOT / "docs" / "concepts" / "evaluation.md" in pages
    assert SPEC_FILE not in pages
    assert sum(len(cited_sections(p.read_text(encoding="utf-8"))) for p in pages) >= 3


def test_spec_cross_references_name_its_sections():
    text = SPEC_FILE.read_text(encoding="utf-8")
    sections = headings(text)
    assert {"1", "2", "2b", "3", "3b", "4", "4b", "5", "6", "7"} <= sections
    missing = [ref for ref in (re.sub(r"[§\s]", "", r) for r in BARE_SECTION.findall(text))
               if ref not in sections]
    assert not missing, missing


def test_a_citation_of_a_missing_section_is_reported():
    spec = "# title\n\n## 1. Names\n\n## 3. Archs\n\n## 3b. Baselines\n\n### Not numbered\n"
    sections = headings(spec)
    assert sections == {"1", "3", "3b"}
    code = ('"""Masks (SPEC §3, §3b)."""\n'
            "# SPEC §1–§3 and SPEC §9: the second is missing\n"
            "x = 1  # docs/spec.md §4b\n"
            "SPEC = MQARSpec(seq_len=64)  # a variable, not a citation\n"
            'help = "the SPEC 6 score"\n')
    assert cited_sections(code) == ["3", "3b", "1", "3", "9", "4b"]
    assert problems(code, sections, "example.py") == [
        "example.py:2: SPEC §9 is not a section of docs/spec.md",
        "example.py:3: SPEC §4b is not a section of docs/spec.md",
        "example.py:5: 'SPEC 6': cite as 'SPEC §n'",
    ]
    assert problems('"""SPEC §3b ``s2``; SPEC §3 and §3b."""', sections, "ok.py") == []
