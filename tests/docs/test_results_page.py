"""The results page (docs/results.md) and the landing pages' verdict table: the committed
verdict file is the committed run files analysed again; the page holds the report's tables as
the engine renders them; the README's table is the verdict table; every number in the page's
prose is one the tables hold or a threshold of the protocol; and no sentence an earlier, weaker
analysis wrote (or a later measurement overturned) comes back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ecp_lm.docsgen import results_page
from ecp_lm.studies import report
from ecp_lm.studies.specs import load

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"
LEAD = results_page.lead(ROOT)
"""The study that leads the page (``results_page.lead``)."""
FOLDER = ROOT / LEAD
BUDGET = "full" if (FOLDER / "report" / "full" / "verdicts.json").exists() else "small"
"""The budget the report rests on: ``full`` once it has run, else ``small``."""
LANDING = {"README.md": ROOT / "README.md", "docs/index.md": ROOT / "docs" / "index.md"}
MAX_LINES = 400

OVERTURNED = {
    "The sliding window of ECP's cost beats it on that curve too":
        "Study II, one seed: Evidence III's three seeds did not separate them at 1,200 steps",
    "the sliding window is at least as good and mostly better":
        "Study II's summary: later runs put ECP ahead on some measures",
    "so at this budget the experiment can see long context":
        "the transformer's gain was an eighth of the project's own threshold",
    "at chance at every depth and every rate tried":
        "rates were tried at one depth, budget and seed; at chance is a collapsed rate",
    "An ordering is called only where the seeds' ranges do not overlap":
        "the rule is an unpaired test at p = 0.05 one-sided, uncorrected across ~100 calls",
    "in each of the five seeds at L = 2":
        "seed 1 of that comparison is an exact tie (115 of 2,048 queries for both)",
    "ECP did not learn the recall task at this budget":
        "ECP's seeds at L = 4 reach 0.270 and 0.122 against chance plus margin 0.0825",
    "no difference called on language 400 steps":
        "a design with 2 degrees of freedom at Holm over 32 comparisons; the pooled model "
        "calls the mixers and S² at every seed's agreement",
    "(equal time)": "the equal-time rows were the equal-step rows again, not measured",
    "the Results page extrapolates Evidence III's longer runs instead":
        "nothing past the measured range is reported",
}
"""Sentences of earlier reports that a stricter analysis or a later measurement overturned,
each with why; none may appear on the report or the landing pages."""


def verdicts() -> dict:
    return json.loads((FOLDER / "report" / BUDGET / "verdicts.json").read_text())


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def analysed():
    study = load(LEAD)
    data = report.load(study, BUDGET, FOLDER)
    return study, data, report.analyse(study, data, budget=BUDGET)


@pytest.mark.parametrize("page", [RESULTS, *LANDING.values()], ids=lambda p: p.name)
def test_no_page_repeats_an_overturned_claim(page):
    text = one_line(page.read_text())
    for claim, why in OVERTURNED.items():
        assert one_line(claim) not in text, f"{page.name} repeats {claim!r} ({why})"


def test_the_report_is_short():
    assert len(RESULTS.read_text().splitlines()) <= MAX_LINES


def test_the_committed_verdicts_are_the_run_files_analysed(analysed):
    _, data, analysis = analysed
    assert data, f"{LEAD}: no stage has run"
    assert json.loads(json.dumps(analysis)) == verdicts()


def test_every_model_has_the_same_seeds(analysed):
    study, data, _ = analysed
    for name, d in data.items():
        assert not d.missing, f"{name}: {d.missing}"
        for point, cells in d.values.items():
            for cell, seeds in cells.items():
                assert sorted(seeds) == list(study.stages(BUDGET)[name].seeds), (point, cell)


def test_the_page_holds_the_reports_tables(analysed):
    """The committed report.md is what the engine renders now; every row of its primary
    family is on the page, and every other table row is too, or the page names the report's
    file, where they all are."""
    study, data, analysis = analysed
    text = report.report_markdown(study, BUDGET, analysis, data, FOLDER)
    assert text == (FOLDER / "report" / BUDGET / "report.md").read_text()
    page = RESULTS.read_text()
    lines = set(page.splitlines())
    primary = results_page.section(text, "Primary family").splitlines()
    assert all(line in lines for line in primary if line.startswith("|"))
    missing = [line for line in text.splitlines() if line.startswith("|") and line not in lines]
    assert not missing or f"`{LEAD}/report/{BUDGET}/report.md`" in page, missing[:3]


@pytest.mark.parametrize("page", [*LANDING, "docs/results.md"])
def test_the_verdict_table_is_the_primary_family(page):
    """Every line of the verdict table, in order, and no other row after it."""
    path = LANDING.get(page, RESULTS)
    lines = path.read_text().splitlines()
    table = report.verdict_lines(verdicts())
    start = lines.index(table[0])
    assert lines[start:start + len(table)] == table
    assert not lines[start + len(table)].startswith("|")


def numbers_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w./-])[+−-]?\d(?:[\d,]*\d)?(?:\.\d+)?(?![\w/])", text))


def protocol_numbers(analysis, ran) -> set[str]:
    """What the page may write outside the tables: the numbers the spec's text states, the
    seeds, budgets, sizes, grids, fits and wall times of the stages that ran (``ran``), and the
    protocol's thresholds."""
    import importlib

    study = load(LEAD)
    out = {"2", "95", "10", str(analysis["alpha"]), "0.02", "1", "0"}
    # what the spec's own text states (the research's figures it quotes among them)
    out |= numbers_in(importlib.import_module(f"ecp_lm.studies.specs.{LEAD}").__doc__)
    for name, stage in study.stages(BUDGET).items():
        if name not in ran:
            continue
        out |= {str(len(stage.seeds)), str(stage.seeds[-1]), str(stage.grid.factor)}
        out |= {f"{r:g}" for r in stage.grid.rates} | set(stage.points())
        task = stage.task
        if isinstance(getattr(task, "task", None), dict):  # recall: N, m and the distances
            n = task.task["seq_len"]
            out |= {str(n), str(n // task.num_segments),
                    *map(str, task.task.get("distances", ()))}
        size = getattr(task, "size", {})
        if "num_segments" in size:  # language: m
            out.add(str(size["seq_len"] // size["num_segments"]))
        for v in [*size.values(), *getattr(task, "depths", ()),
                  getattr(task, "select_steps", 0), getattr(task, "select_tokens", 0) or 0]:
            out |= {str(v), f"{v:,}" if isinstance(v, int) else str(v)}
        seconds = sum(i["seconds"] for i in json.loads(
            (FOLDER / name / BUDGET / "invocations.json").read_text()))
        out.add(f"{seconds / 60:.0f}")
    for fit in analysis["fits"].values():
        out |= {str(fit["df"]), f"{fit['residual_sd']:.4f}", f"{fit['residual_sd']:.3f}"}
        if fit["bartlett_p"] is not None:
            out.add(f"{fit['bartlett_p']:.2g}")
    for r in analysis["comparisons"]:
        out |= {str(r["seeds"]), str(r["favour_a"]), str(r["favour_b"])}
    return out


def test_every_number_in_the_prose_is_checked(analysed):
    """A number outside the rendered tables, code and links is in the tables, the spec or the
    stages' records (seeds, budgets, sizes, grids, fits, minutes), or the paper's arXiv id."""
    study, data, analysis = analysed
    text = RESULTS.read_text()
    rendered = report.report_markdown(study, BUDGET, analysis, data, FOLDER).splitlines()
    rendered += report.verdict_lines(analysis)
    allowed = set().union(*(numbers_in(line) for line in rendered)) | protocol_numbers(
        analysis, data)
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


SEED_CLAIM = re.compile(r"\b(each|every|all|both|\d+|one|two|three|four|five) (of )?(the )?"
                        r"(\d+ |three |five |paired )?seeds?\b(?!')", re.I)


@pytest.mark.parametrize("page", [RESULTS, *LANDING.values()], ids=lambda p: p.name)
def test_every_sentence_about_seeds_is_generated_from_the_data(page):
    """A sentence that counts seeds ("in each of the 5 seeds", "3 of the 5 seeds") holds one
    of the sentences ``report.seed_sentence`` renders from the verdict file, verbatim but for
    its first letter; tables, code and the report's own lines are left out (rendered)."""
    from ecp_lm.studies.report import seed_sentence

    generated = {seed_sentence(r).lower() for r in verdicts()["comparisons"]}
    rendered = set((FOLDER / "report" / BUDGET / "report.md").read_text().splitlines())
    body = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.S | re.M)
    body = "\n".join(line for line in body.splitlines()
                     if not line.startswith("|") and line not in rendered)
    for sentence in re.split(r"(?<=[.!?])\s+", one_line(body)):
        counts = [m.group(0) for m in SEED_CLAIM.finditer(sentence)
                  if not m.group(0).lower().startswith(("seed ", "seeds "))]
        if counts and not re.search(r"(runs?|ran|gives?|has|have|trains?|with|declare|same|chosen)"
                                    r"[^.]*\bseeds?\b", sentence, re.I):
            assert any(g in sentence.lower() for g in generated), \
                f"{page.name}: {sentence!r} counts seeds but is not generated from the data"


def test_the_newest_study_with_a_template_and_a_report_leads(tmp_path):
    """Evidence IV leads until Evidence V has both its template and its report; then the
    page and the landing pages' results block are Evidence V's, its cost claims and compressor
    rows from its report, each block's links relative to its page."""
    import shutil

    evidence4 = ROOT / "evidence4"
    budget = "full" if (evidence4 / "report" / "full" / "verdicts.json").exists() else "small"
    shutil.copytree(evidence4 / "report", tmp_path / "evidence4" / "report")
    for template in ("results.md.in", "landing.md.in"):
        shutil.copy(evidence4 / template, tmp_path / "evidence4" / template)
    (tmp_path / "evidence5").mkdir()
    (tmp_path / "evidence5" / "results.md.in").write_text(
        "# Evidence V\n\n{VERDICTS}\n\n{COMPRESSORS}\n\n{COSTS}\n")
    (tmp_path / "evidence5" / "landing.md.in").write_text(
        "Evidence V.\n\n{VERDICTS}\n\n[Results]({DOCS}results.md).\n")
    begin, end = results_page.LANDING_MARKS
    for page in results_page.LANDINGS:
        (tmp_path / page).parent.mkdir(exist_ok=True)
        (tmp_path / page).write_text(f"# ecp-lm\n\n{begin}\nold\n{end}\n\n## More\n")
    assert results_page.lead(tmp_path) == "evidence4"
    assert results_page.landing(tmp_path, "README.md") == (
        "# ecp-lm\n\n" + begin + "\n" + (evidence4 / "landing.md.in").read_text().replace(
            "{DOCS}", "docs/").replace("{VERDICTS}", "\n".join(report.verdict_lines(
                json.loads((evidence4 / "report" / budget / "verdicts.json").read_text()))))
        + end + "\n\n## More\n")
    older = results_page.render(tmp_path)
    assert older.startswith((evidence4 / "results.md.in").read_text().split("\n\n")[0])
    if LEAD == "evidence4":
        assert older == RESULTS.read_text()

    report_dir = tmp_path / "evidence5" / "report" / "small"
    shutil.copytree(evidence4 / "report" / budget, report_dir)
    claim = report.cost_claim(load("evidence5").cost_claims[0])
    text = (report_dir / "report.md").read_text()
    text = text.replace("## Secondary comparisons",
                        "\n".join(report.cost_claim_lines([claim])) + "\n## Secondary comparisons")
    (report_dir / "report.md").write_text(text)
    assert results_page.lead(tmp_path) == "evidence5"
    page = results_page.render(tmp_path)
    assert page.startswith("# Evidence V\n")
    for page_name, docs in (("README.md", "docs/"), ("docs/index.md", "")):
        block = results_page.landing(tmp_path, page_name).split(begin)[1].split(end)[0]
        assert block.startswith("\nEvidence V.\n\n| comparison |")
        assert block.endswith(f"[Results]({docs}results.md).\n")
    assert "| 17.2% | 23.4% | no, no |" in page
    compressors = [line for line in text.splitlines() if "(reference)" in line]
    assert compressors
    for line in compressors:
        name, bits = line.split(" | ")[0][2:].removesuffix(" (reference)"), line.split(" | ")[3]
        assert f"| language | {name} | {bits} |" in page


def test_a_template_takes_any_report_section_and_says_when_no_compressor_ran(tmp_path):
    """``{SECTION:TITLE}`` is that section of the report verbatim (a ``###`` one up to the
    next heading of its level); ``{COMPRESSORS}`` on a report without a language stage says so
    instead of drawing an empty table."""
    folder = tmp_path / "evidence5"
    (folder / "report" / "small").mkdir(parents=True)
    (folder / "results.md.in").write_text(
        "{SECTION:Accuracy by distance}\n\n{SECTION:Context gain}\n\n{COMPRESSORS}\n")
    (folder / "report" / "small" / "verdicts.json").write_text(
        '{"comparisons": [], "excluded": []}')
    (folder / "report" / "small" / "report.md").write_text(
        "# r\n\n## Primary family: 0\n\n## Accuracy by distance: mechanism\n\n| a | b |\n\n"
        "## Stages\n\n### mechanism at 30 steps: accuracy\n\n| m |\n\n"
        "### Context gain (secondary)\n\n| g |\n\n## Secondary comparisons\n\n| s |\n")
    page = results_page.render(tmp_path)
    assert page == ("| a | b |\n\n| g |\n\nNo language stage has run yet, so no compressor is "
                    "scored beside the models.\n")


def test_a_part_of_the_template_shows_once_its_stage_has_run(tmp_path):
    """``{IF:STAGE}`` … ``{/IF:STAGE}``: kept where the verdict file has runs of that stage,
    dropped (with its line ends) where it has none."""
    folder = tmp_path / "evidence5"
    (folder / "report" / "small").mkdir(parents=True)
    (folder / "results.md.in").write_text(
        "# R\n{IF:mechanism}\nran: mechanism\n{/IF:mechanism}\n{IF:pixels}\nran: pixels\n"
        "{/IF:pixels}\nend\n")
    (folder / "report" / "small" / "verdicts.json").write_text(json.dumps(
        {"comparisons": [], "excluded": [], "runs": [
            {"stage": "mechanism", "point": "d2", "model": "ecp@L2", "seed": 0, "value": 1}]}))
    (folder / "report" / "small" / "report.md").write_text("# r\n")
    assert results_page.render(tmp_path) == "# R\nran: mechanism\nend\n"
