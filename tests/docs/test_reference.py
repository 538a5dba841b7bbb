"""The generated reference pages and pictures are current and complete.

Each file ``python -m ecp_lm.docsgen`` writes (``docs/reference/{cli,config,api}.md``,
``docs/img/masks/*.svg``) equals a fresh rendering byte for byte; every option of every ``ecp``
parser and every config key and preset is in the committed reference.
"""

from __future__ import annotations

import argparse
import html
import os
import re
from dataclasses import fields
from pathlib import Path

import pytest

from ecp_lm.docsgen import REGENERATE, render_all
from ecp_lm.docsgen.cli_page import documented, fixed_width, top_parser, walk
from ecp_lm.docsgen.markdown import anchor

ROOT = Path(__file__).resolve().parents[2]
RENDERED = render_all(ROOT)


@pytest.mark.parametrize("path", sorted(RENDERED))
def test_generated_file_is_current(path: str) -> None:
    committed = ROOT / path
    assert committed.is_file(), f"{path} is missing: run `{REGENERATE}` (make docs-gen)"
    assert committed.read_text() == RENDERED[path], (
        f"{path} differs from what the code renders now: run `{REGENERATE}` (make docs-gen) "
        f"and commit the result")


def test_rendering_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from ecp_lm.docsgen import cli_page

    monkeypatch.setenv("COLUMNS", "47")
    assert cli_page.render() == RENDERED["docs/reference/cli.md"]
    assert os.environ["COLUMNS"] == "47"  # put back after rendering


def section(page: str, key: str) -> str:
    """The text under the heading whose anchor is ``key``, up to the next heading."""
    match = re.search(rf"^#+ .*\{{#{re.escape(key)}\}}\n(.*?)(?=^#+ |\Z)", page, re.M | re.S)
    assert match, f"no heading with anchor #{key}"
    return match.group(1)


def option_names(action: argparse.Action) -> list[str]:
    if action.option_strings:
        return list(action.option_strings)
    return [action.metavar if isinstance(action.metavar, str) else action.dest]


def test_every_cli_option_is_in_the_reference() -> None:
    page = (ROOT / "docs/reference/cli.md").read_text()
    missing = []
    with fixed_width():
        parser = top_parser()
    for path, sub in walk(parser):
        text = section(page, anchor(*path))
        missing += [f"{' '.join(path)} {name}" for action in documented(sub)
                    for name in option_names(action)
                    if not re.search(rf"(?:`|, ){re.escape(name)}[ `,]", text)]
    assert not missing, f"not in docs/reference/cli.md: {missing}; run `{REGENERATE}`"


def test_every_config_key_and_preset_is_in_the_reference() -> None:
    from ecp_lm.config import PRESETS
    from ecp_lm.run.config import RUN_PRESETS, SECTION_TYPES
    from ecp_lm.run.describe import field_docs

    page = (ROOT / "docs/reference/config.md").read_text()
    for name, cls in SECTION_TYPES.items():
        docs = field_docs(cls)
        for f in fields(cls):
            text = section(page, anchor(name, f.name))
            assert f"`{f.type}`" in text, f"{name}.{f.name}: its type is not shown"
            words = re.sub(r"[`*_\\]", "", docs.get(f.name, ""))[:40]
            shown = html.unescape(re.sub(r"[`*_\\]", "", text))
            assert words in shown, f"{name}.{f.name}: its doc is not shown"
    for key, presets in (("run-presets", RUN_PRESETS), ("model-presets", PRESETS)):
        for name in presets:
            assert "```yaml" in section(page, anchor(key, name))


def test_api_page_names_the_public_api() -> None:
    import ecp_lm

    page = (ROOT / "docs/reference/api.md").read_text()
    for name in ecp_lm.__all__:
        value = getattr(ecp_lm, name)
        if callable(value):
            module = value.__module__
            target = module if module == "ecp_lm.api" else f"{module}.{name}"
            assert f"\n::: {target}\n" in page, f"{name}: no `::: {target}` in api.md"


def test_the_results_page_is_rendered_from_the_report() -> None:
    """Every table of docs/results.md is the committed report's, and its seed sentences are
    report.seed_sentence's: the template holds placeholders, not numbers."""
    from ecp_lm.docsgen import results_page

    template = (ROOT / results_page.template_of(results_page.lead(ROOT))).read_text()
    assert "{VERDICTS}" in template and "{PRIMARY}" in template and "{seed:" in template
    assert not any(line.startswith("|") for line in template.splitlines())
    assert "docs/results.md" in RENDERED
