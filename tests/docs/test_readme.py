"""The README is a landing page whose every number comes from a source in the repository.

Each number is rendered here from its source (a report JSON, the Makefile, pyproject.toml, or
``ecp_lm`` code such as the cost model) and must appear in the README as written. A number in
the README's prose or tables that no check renders fails ``test_every_number_is_checked``, so a
new number needs a check before it can be quoted. The site's home page, docs/index.md, is the
README with links relative to docs/: the same checks hold for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.config import ARCHS, PRESETS, ModelConfig
from ecp_lm.model.archs import architecture

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LANDING = {"README.md": README, "docs/index.md": ROOT / "docs" / "index.md"}
MAX_LINES = 250


def text(page: str = "README.md") -> str:
    return LANDING[page].read_text(encoding="utf-8")


def report(path: str) -> dict | list:
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, the body with its final newline."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", markdown, flags=re.S | re.M)


def prose(markdown: str) -> str:
    """The README without fenced blocks, inline code, link targets and HTML comments: the text
    whose numbers are quotes."""
    out = re.sub(r"^```.*?^```$", "", markdown, flags=re.S | re.M)
    out = re.sub(r"<!--.*?-->", "", out, flags=re.S)
    out = re.sub(r"`[^`]*`", "", out)
    return re.sub(r"\]\([^)]*\)", "]", out)


def paper(arch: str) -> ModelConfig:
    return ModelConfig.from_preset("paper", arch=arch)


# --- the rendered quotes --------------------------------------------------------------------


def arch_rows() -> dict[str, tuple[str, str, str]]:
    """Each architecture's entries and tiles relative to full attention and its decode cache
    per layer at the ``paper`` preset."""
    rows = {}
    for arch in ARCHS:
        cfg = paper(arch)
        cost = attention_cost(cfg)
        kind = architecture(arch)(cfg)
        slots = kind.cache_capacity
        decode = "state" if kind.recurrent else "none" if slots is None else str(slots)
        rows[arch] = (f"{cost.ratio_to_full:.3f}", f"{cost.tile_ratio_to_full:.3f}", decode)
    return rows


def paper_sizes() -> list[str]:
    p = PRESETS["paper"]
    m = p["seq_len"] // p["num_segments"]
    window = paper("sliding_window").resolved().window
    return [f"N = {p['seq_len']}, S = {p['num_segments']} (m = {m}), L = {p['n_layers']}",
            f"w = {window}, ECP's entries"]


def verdict_quotes() -> list[str]:
    """The verdict table of the committed report of the study that leads the results page,
    and the budget and width it ran at (test_results_page checks that report against its run
    files)."""
    from ecp_lm.docsgen.results_page import lead
    from ecp_lm.studies.report import verdict_lines
    from ecp_lm.studies.specs import load

    study = lead(ROOT)
    root = ROOT / study
    budget = "full" if (root / "report" / "full" / "verdicts.json").exists() else "small"
    verdicts = report(f"{study}/report/{budget}/verdicts.json")
    width = load(study).stages(budget)["language"].task.size["d_model"]
    return [*verdict_lines(verdicts), f"budget `{budget}` (d_model {width} on language"]


def setup_quotes() -> list[str]:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    pin = re.search(r"^TORCH_PIN \?= (\S+)$", makefile, flags=re.M).group(1)
    extras = re.search(r"pip install --quiet -e ('[^']+')", makefile).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    python = re.search(r'^requires-python = "([^"]+)"$', pyproject, flags=re.M).group(1)
    return [f"It installs `{pin}`, the CPU build, before the package.",
            f"Then it runs `pip install -e {extras}`.",
            f"Python ≥ {python.removeprefix('>=')}"]


def stack_quotes() -> list[str]:
    """xLSTM's stack as its paper names it, xLSTM[mLSTM layers:sLSTM layers], from the
    pattern ``config.STACKS`` gives it."""
    from ecp_lm.config import STACKS

    kinds = [kind for part in STACKS["xlstm"].split(",")
             for kind in [part.partition("*")[0]] * int(part.partition("*")[2] or 1)]
    return [f"(xLSTM[{kinds.count('mlstm')}:{kinds.count('slstm')}])"]


SOURCES = {"paper preset": paper_sizes, "verdicts": verdict_quotes, "setup": setup_quotes,
           "stacks": stack_quotes}


def quotes() -> list[str]:
    return [q for source in SOURCES.values() for q in source()]


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("page", LANDING)
def test_landing_page_is_short(page):
    lines = text(page).splitlines()
    assert len(lines) <= MAX_LINES, f"{page} has {len(lines)} lines, at most {MAX_LINES}"


@pytest.mark.parametrize("page", LANDING)
@pytest.mark.parametrize("name, language", [("quickstart.py", "python"),
                                            ("quickstart.sh", "bash")])
def test_landing_page_quotes_the_examples_verbatim(page, name, language):
    example = ROOT / "docs" / "examples" / name
    assert example.is_file(), f"docs/examples/{name} does not exist"
    body = example.read_text(encoding="utf-8")
    assert (language, body) in fenced_blocks(text(page)), (
        f"{page} has no ```{language} block equal to docs/examples/{name}")


def test_the_quickstart_examples_are_short():
    examples = ROOT / "docs" / "examples"
    code = [line for line in (examples / "quickstart.py").read_text().splitlines() if line.strip()]
    assert len(code) <= 10
    commands = [line for line in (examples / "quickstart.sh").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) <= 5


def test_the_two_commands_are_make_targets_ci_runs():
    readme = text()
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):
        assert re.search(rf"^make {target} +#", readme, flags=re.M)
        assert re.search(rf"^{target}:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", LANDING)
@pytest.mark.parametrize("source", SOURCES)
def test_quotes_match_their_source(source, page):
    landing = text(page)
    for quote in SOURCES[source]():
        assert quote in landing, f"{page} does not say {quote!r}"


@pytest.mark.parametrize("page", LANDING)
def test_architecture_table_is_the_cost_model(page):
    """Every row of the architectures table: entries and tiles relative to full attention at
    the paper preset, and the decode cache in slots (none for the perceiver family, a state
    for the recurrent mixers)."""
    expected = arch_rows()
    found = {}
    for line in text(page).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].strip("`") in ARCHS:
            found[cells[0].strip("`")] = (cells[2], cells[3], cells[4].split()[0].strip(","))
    assert found == expected


def test_hybrid_pattern_is_valid():
    pattern = re.search(r"model\.layer_pattern='([^']+)'", text()).group(1)  # the first
    cfg = ModelConfig.from_preset("tiny", arch="hybrid", layer_pattern=pattern, n_layers=4)
    assert "transformer" in cfg.layer_archs and "ecp" in cfg.layer_archs


def test_citation_names_the_paper():
    readme = text()
    [arxiv] = set(re.findall(r"arXiv (\d{4}\.\d{5})", readme))
    [bibtex] = [body for lang, body in fenced_blocks(readme) if lang == "bibtex"]
    assert f"eprint        = {{{arxiv}}}" in bibtex


def rendered_numbers() -> set[str]:
    numbers = {n for q in quotes() for n in re.findall(r"\d(?:[\d,]*\d)?(?:\.\d+)?", q)}
    for row in arch_rows().values():
        numbers.update(row)
    return numbers


@pytest.mark.parametrize("page", LANDING)
def test_every_number_is_checked(page):
    """A number in the page's prose and tables (not in code, nor a symbol's coefficient as
    in N/2 or 2m, nor a model's name as Mamba-2) is one a check above renders, or the paper's
    arXiv id."""
    allowed = rendered_numbers() | set(re.findall(r"arXiv (\d{4}\.\d{5})", text(page)))
    for line in prose(text(page)).splitlines():
        for number in re.findall(r"(?<![\w./-])\d(?:[\d,]*\d)?(?:\.\d+)?(?![\w/])", line):
            assert number in allowed, f"{number!r} in {page} line {line!r} is not checked"


@pytest.mark.parametrize("page", LANDING)
def test_links_resolve(page):
    """Relative links and images name files of the repository; an anchor names a heading."""
    base = LANDING[page].parent
    for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = base / path
        assert file.exists(), f"{page} links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                     for h in headings}
            assert anchor in slugs, f"{path} has no heading #{anchor}"


def test_the_reproducing_page_writes_the_recipe_as_it_is():
    """The reproducing tutorial writes configs/wikitext103-ecp.yaml into its folder from a
    ``file:`` block (a page runs in a folder of its own): that block is the recipe verbatim."""
    page = (ROOT / "docs" / "tutorials" / "reproducing.md").read_text(encoding="utf-8")
    name = "configs/wikitext103-ecp.yaml"
    block = re.search(rf"<!-- file: {re.escape(name)} -->\n```yaml\n(.*?)^```$", page,
                      flags=re.S | re.M)
    assert block, f"docs/tutorials/reproducing.md has no file block for {name}"
    assert block.group(1) == (ROOT / name).read_text(encoding="utf-8")


def test_getting_started_quotes_the_recorded_demo():
    """The demo's table and timings on the getting-started page are docs/demo_results.json's."""
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    summary = report("docs/demo_results.json")
    for r in summary["rows"]:
        row = (f"{r['arch']:<12} {r['params']:>11,} {r['train_tokens_per_s']:>12,.0f} "
               f"{r['loss']:>10.4f} {r['bits_per_byte']:>15.4f} {r['tokens_scored']:>14,}")
        assert row in page, f"getting-started.md does not show {row!r}"
    rows = {r["arch"]: r for r in summary["rows"]}
    minutes = [summary["seconds"] / 60, rows["ecp"]["train_seconds"] / 60,
               rows["perceiver_ar"]["train_seconds"] / 60]
    said = ("the demo took {:.1f} minutes.\nECP trained for {:.1f} minutes and PerceiverAR for "
            "{:.1f} minutes").format(*minutes)
    assert said in page
    gap = rows["perceiver_ar"]["bits_per_byte"] - rows["ecp"]["bits_per_byte"]
    assert f"ECP reaches {gap:.2f} bits per byte less than PerceiverAR" in page
    assert summary["sample"][:40] in page.replace("\n", " ")
