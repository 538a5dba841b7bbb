"""``docs/results.md``: the results page, its prose from the leading study's template
(``STUDY/results.md.in``) and its numbers from that study's committed report
(``STUDY/report/small``). The newest study of ``STUDIES`` whose template and report are both
committed leads. The landing pages' results block (README.md, docs/index.md, between
``LANDING_MARKS``) comes from its ``STUDY/landing.md.in`` the same way.

The prose holds placeholders that the report fills: ``{VERDICTS}`` the verdict table
(``report.verdict_lines``), ``{PRIMARY}`` the primary family's table, ``{STAGES}``,
``{SECONDARY}`` and ``{COSTS}`` those sections of ``report.md`` verbatim, ``{COMPRESSORS}`` the
compressors' rows of the stage tables, ``{SECTION:TITLE}`` the report's section of that title
verbatim, ``{IF:STAGE}`` … ``{/IF:STAGE}`` text kept only once that stage has runs (a study
that runs in parts), and ``{seed:STAGE:POINT:A:B}`` the seed sentence of that
comparison (``report.seed_sentence``; capitalised where it starts a sentence). So no number on
the page is typed by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

STUDIES = ("evidence5", "evidence4")
"""The studies that can lead the page, newest first."""
PAGE = "docs/results.md"
LANDINGS = {"README.md": "docs/", "docs/index.md": ""}
"""The landing pages whose results block is rendered, each with its path to ``docs/``."""
LANDING_MARKS = ("<!-- results: rendered from the leading study's landing.md.in -->",
                 "<!-- /results -->")
SECTIONS = {"STAGES": "Stages", "SECONDARY": "Secondary comparisons", "COSTS": "Cost claims"}
"""The placeholders that stand for a report section verbatim, by the section's title."""


def template_of(study: str) -> str:
    return f"{study}/results.md.in"


def landing_of(study: str) -> str:
    return f"{study}/landing.md.in"


def report_of(study: str) -> str:
    return f"{study}/report/small"


def lead(root: Path) -> str | None:
    """The newest study whose template and report are committed under ``root``."""
    return next((s for s in STUDIES if (root / template_of(s)).is_file()
                 and (root / report_of(s) / "verdicts.json").is_file()), None)


def section(report: str, title: str) -> str:
    """The text under the ``##`` or ``###`` heading that starts with ``title`` in ``report``,
    up to the next heading of its level or above."""
    found = re.search(rf"^(##|###) {re.escape(title)}[^\n]*\n", report, re.M)
    if found is None:
        raise ValueError(f"the report has no section {title!r}")
    level = len(found.group(1))
    rest = report[found.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[:end.start() if end else len(rest)].strip()


def compressor_rows(report: str) -> str:
    """The compressors' rows of the report's stage tables, one table: stage, compressor, bits
    per byte on the bytes the models are scored on."""
    rows, stage = [], None
    for line in report.splitlines():
        heading = re.match(r"^### (\S+) at (\d+) steps: bits per byte", line)
        if heading:
            stage = heading.group(1)
        found = re.match(r"^\| (.+) \(reference\) \| — \| — \| ([\d.]+) \|", line)
        if found and stage and (stage, found.group(1)) not in {(r[0], r[1]) for r in rows}:
            rows.append((stage, found.group(1), found.group(2)))
    if not rows:
        return "No language stage has run yet, so no compressor is scored beside the models."
    return "\n".join(["| stage | compressor | bits per byte |", "|---|---|---:|",
                      *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def render(root: Path) -> str | None:
    """The page, or None where the repository at ``root`` has no study to lead it."""
    study = lead(root)
    return None if study is None else fill(root, study, template_of(study))


def landing(root: Path, page: str) -> str | None:
    """``page`` (a landing page of ``LANDINGS``) with its block between ``LANDING_MARKS``
    rendered from the leading study's ``landing.md.in`` (``{DOCS}`` the path from the page to
    ``docs/``); None where there is no study to lead or no such page or block."""
    study, path = lead(root), root / page
    if study is None or not path.is_file() or not (root / landing_of(study)).is_file():
        return None
    text = path.read_text()
    begin, end = LANDING_MARKS
    if begin not in text or end not in text:
        return None
    block = fill(root, study, landing_of(study)).replace("{DOCS}", LANDINGS[page])
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{block}{end}{rest.split(end, 1)[1]}"


def fill(root: Path, study: str, template: str) -> str:
    """``template`` (a path under ``root``) with its placeholders filled from ``study``'s
    committed report."""
    from ecp_lm.studies.report import seed_sentence, verdict_lines

    verdicts = json.loads((root / report_of(study) / "verdicts.json").read_text())
    report = (root / report_of(study) / "report.md").read_text()

    def seed(match: re.Match) -> str:
        stage, point, a, b = match.group(1).split(":")
        rows = [r for r in verdicts["comparisons"]
                if (r["stage"], r["point"], r["a"], r["b"]) == (stage, point, a, b)]
        if len(rows) != 1:
            raise ValueError(f"{template}: {match.group(0)} names no comparison of the report")
        [row] = rows
        text = seed_sentence(row)
        before = match.string[:match.start()].rstrip(" ")
        starts = not before or before.endswith((".", "\n"))
        return text[0].upper() + text[1:] if starts else text

    ran = {r["stage"] for r in verdicts.get("runs", [])}
    text = re.sub(r"\{IF:(\w+)\}\n?(.*?)\{/IF:\1\}\n?",
                  lambda m: m.group(2) if m.group(1) in ran else "",
                  (root / template).read_text(), flags=re.S)
    for name, title in SECTIONS.items():
        text = text.replace(f"{{{name}}}", f"{{SECTION:{title}}}")
    if "{COMPRESSORS}" in text:
        text = text.replace("{COMPRESSORS}", compressor_rows(report))
    if "{PRIMARY}" in text:
        text = text.replace("{PRIMARY}", "\n".join(
            line for line in section(report, "Primary family").splitlines()
            if line.startswith("|")))
    text = re.sub(r"\{SECTION:([^}]*)\}", lambda m: section(report, m.group(1)), text)
    text = text.replace("{VERDICTS}", "\n".join(verdict_lines(verdicts)))
    return re.sub(r"\{seed:([^}]*)\}", seed, text)
