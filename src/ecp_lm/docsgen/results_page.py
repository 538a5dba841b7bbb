"""``docs/results.md``: the results page, its prose from ``evidence4/results.md.in`` and its
numbers from the committed report of Evidence IV (``evidence4/report/small``).

The prose holds placeholders that the report fills: ``{VERDICTS}`` the verdict table
(``report.verdict_lines``), ``{PRIMARY}`` the primary family's table, ``{STAGES}`` and
``{SECONDARY}`` those sections of ``report.md`` verbatim, and ``{seed:STAGE:POINT:A:B}`` the
seed sentence of that comparison (``report.seed_sentence``; capitalised where it starts a
sentence). So no number on the page is typed by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

TEMPLATE = "evidence4/results.md.in"
REPORT = "evidence4/report/small"
PAGE = "docs/results.md"


def section(report: str, title: str) -> str:
    """The text under ``## title`` in ``report`` (up to the next ``## ``)."""
    found = re.search(rf"^## {re.escape(title)}[^\n]*\n(.*?)(?=^## |\Z)", report, re.S | re.M)
    if found is None:
        raise ValueError(f"{REPORT}/report.md has no section {title!r}")
    return found.group(1).strip()


def render(root: Path) -> str | None:
    """The page, or None where the repository at ``root`` has no template."""
    from ecp_lm.studies.report import seed_sentence, verdict_lines

    template = root / TEMPLATE
    if not template.is_file():
        return None
    verdicts = json.loads((root / REPORT / "verdicts.json").read_text())
    report = (root / REPORT / "report.md").read_text()
    primary = section(report, "Primary family")

    def seed(match: re.Match) -> str:
        stage, point, a, b = match.group(1).split(":")
        [row] = [r for r in verdicts["comparisons"]
                 if (r["stage"], r["point"], r["a"], r["b"]) == (stage, point, a, b)]
        text = seed_sentence(row)
        before = match.string[:match.start()].rstrip(" ")
        starts = not before or before.endswith((".", "\n"))
        return text[0].upper() + text[1:] if starts else text

    text = template.read_text()
    text = text.replace("{VERDICTS}", "\n".join(verdict_lines(verdicts)))
    text = text.replace("{PRIMARY}", "\n".join(line for line in primary.splitlines()
                                               if line.startswith("|")))
    text = text.replace("{STAGES}", section(report, "Stages"))
    text = text.replace("{SECONDARY}", section(report, "Secondary comparisons"))
    return re.sub(r"\{seed:([^}]*)\}", seed, text)
