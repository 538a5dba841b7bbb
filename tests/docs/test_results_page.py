"""The one report (docs/results.md) and what the landing pages say of it: short; its verdict
and comparison tables the ones Evidence IV's report renders from the committed verdicts, which
are the committed stage summaries analysed again and whose every interval is recomputed here
from the seeds' run files; the README's summary exactly the verdict table; every number in its
prose one the tables or the stage summaries hold; and no sentence a later measurement
overturned, on the report or the landing pages."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ecp_lm.experiments.evidence4 import report
from evidence4_reference import check_report

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"
EVIDENCE4 = ROOT / "evidence4"
BUDGET = "full" if (EVIDENCE4 / "report" / "full" / "verdicts.json").exists() else "small"
"""The budget the report rests on: ``full`` once it has run, else ``small``."""
LANDING = {"README.md": ROOT / "README.md", "docs/index.md": ROOT / "docs" / "index.md"}
MAX_LINES = 400

OVERTURNED = {
    "The sliding window of ECP's cost beats it on that curve too":
        "Study II, one seed: Evidence III's three seeds did not separate them at 1,200 steps",
    "the sliding window is at least as good and mostly better":
        "Study II's summary: later runs put ECP ahead on some measures",
    "so at this budget the experiment can see long context":
        "the transformer's gain was an eighth of SENSITIVE_BITS, the project's own threshold",
    "at chance at every depth and every rate tried":
        "rates were tried at one depth, budget and seed; at chance is a collapsed rate",
    "at chance at every depth and at every rate tried": "as above",
    "hardly: at 1,200 steps the transformer gains from it in every seed":
        "not measurable at that budget: the control's gain is below the threshold",
    "on the language curve ahead at 600 steps":
        "one seed's rate choice at 300 steps may decide it; unpaired and uncorrected",
    "An ordering is called only where the seeds' ranges do not overlap":
        "the rule is an unpaired test at p = 0.05 one-sided, uncorrected across ~100 calls",
    "Implicit dropout | not supported":
        "contradicted at most epochs, not merely unsupported",
}
"""Sentences of earlier reports that later measurements or a stricter protocol overturned,
each with why; none may appear on the report or the landing pages."""


def verdicts() -> dict:
    return json.loads((EVIDENCE4 / "report" / BUDGET / "verdicts.json").read_text())


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("page", [RESULTS, *LANDING.values()], ids=lambda p: p.name)
def test_no_page_repeats_an_overturned_claim(page):
    text = one_line(page.read_text())
    for claim, why in OVERTURNED.items():
        assert one_line(claim) not in text, f"{page.name} repeats {claim!r} ({why})"


def test_the_report_is_short():
    assert len(RESULTS.read_text().splitlines()) <= MAX_LINES


def test_the_committed_verdicts_are_the_stage_summaries_analysed():
    stages = report.load(EVIDENCE4, BUDGET)
    assert set(stages) == {"language", "recall"}
    assert json.loads(json.dumps(report.analyse(stages))) == verdicts()


def test_every_interval_is_recomputed_from_the_committed_run_files():
    assert check_report(EVIDENCE4, BUDGET) == verdicts()["family"]


def test_the_report_holds_its_tables_as_rendered():
    text = RESULTS.read_text()
    stages = report.load(EVIDENCE4, BUDGET)
    for line in [*report.answer_lines(verdicts()), *report.comparison_lines(verdicts()),
                 *report.model_lines(stages), *report.chance_lines(verdicts(), stages),
                 earlier_context_line()]:
        assert line in text, line


@pytest.mark.parametrize("page", LANDING)
def test_the_landing_pages_summary_is_the_verdict_table(page):
    """Every line of the verdict table, in order, and no other question–answer row."""
    lines = LANDING[page].read_text().splitlines()
    table = report.answer_lines(verdicts())
    start = lines.index(table[0])
    assert lines[start:start + len(table)] == table
    assert lines[start + len(table)].strip() == ""


def dropout_gaps() -> dict:
    return report.dropout_gaps(ROOT / "evidence" / "dropout" / "full")


def test_the_dropout_table_is_evidence_iiis_runs_analysed():
    text = RESULTS.read_text()
    for line in report.dropout_lines(dropout_gaps()):
        assert line in text, line


def earlier_context_line() -> str:
    """Evidence III's transformer gains read for the budget the context question needs."""
    return report.earlier_context_line(report.earlier_context(ROOT / "evidence" / "curve" /
                                                              "full"))


def numbers_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w./-])[+−-]?\d(?:[\d,]*\d)?(?:\.\d+)?(?![\w/])", text))


def summary_numbers() -> set[str]:
    """What the stage summaries hold, as the page may write it: rates, parameter counts, step
    times, seeds, budgets, sizes and the stages' wall times."""
    out: set[str] = set()
    for stage, s in report.load(EVIDENCE4, BUDGET).items():
        for m in s["models"].values():
            out |= {f"{m['lr']:g}", f"{m['params']:,}",
                    *(f"{float(lr):g}" for lr in m["trials"])}
            if "step_s" in m:
                out.add(f"{m['step_s']:.3f}")
        out |= {str(v) for v in (s.get("points") or [])} | {str(d) for d in s.get("depths", [])}
        out |= {str(s["seeds"]), str(s["max_seeds"]), str(s.get("steps", "")),
                str(s.get("select_steps", ""))}
        out |= {f"{v:,}" if isinstance(v, int) else str(v) for v in s.get("size", {}).values()}
        seconds = sum(i["seconds"] for i in json.loads(
            (EVIDENCE4 / stage / BUDGET / "invocations.json").read_text()))
        out |= {f"{seconds / 60:.0f}"}
    return out


def test_every_number_in_the_prose_is_checked():
    """A number outside the rendered tables, code and links is in the tables or the stage
    summaries (rates, parameters, step times, budgets, minutes), a threshold of the protocol,
    or the paper's arXiv id."""
    from ecp_lm.experiments.evidence4.paired import ALPHA, FIVE_SEEDS
    from ecp_lm.experiments.long_context.measure import SENSITIVE_BITS

    text = RESULTS.read_text()
    rendered = [*report.answer_lines(verdicts()), *report.comparison_lines(verdicts()),
                *report.model_lines(report.load(EVIDENCE4, BUDGET)),
                *report.chance_lines(verdicts(), report.load(EVIDENCE4, BUDGET)),
                *report.dropout_lines(dropout_gaps()), earlier_context_line()]
    allowed = set().union(*(numbers_in(line) for line in rendered)) | summary_numbers()
    allowed |= {str(ALPHA), str(FIVE_SEEDS), str(SENSITIVE_BITS), "2", "95"}
    allowed |= set(re.findall(r"arXiv (\d{4}\.\d{5})", text))
    body = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    body = re.sub(r"`[^`]*`", "", body)
    body = re.sub(r"\]\([^)]*\)", "]", body)
    for line in body.splitlines():
        if line in rendered:
            continue
        for number in numbers_in(line):
            assert number.lstrip("+−-") in allowed or number in allowed, \
                f"{number!r} in results.md line {line!r} is not checked"
