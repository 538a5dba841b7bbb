"""The documentation site builds strictly: ``mkdocs build --strict`` exits 0 and logs no
warning (a broken link or anchor, a page missing from the nav, a docstring mkdocstrings cannot
read). ``make test`` runs this, so the site is built wherever the tests run; ``make docs``
builds it into site/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]')")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"}
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert done.returncode == 0 and not warnings, (
        f"mkdocs build --strict exited with {done.returncode}; its warnings:\n"
        + "\n".join(warnings or output.splitlines()[-20:]))
    assert (tmp_path / "site" / "index.html").is_file()


def test_links_to_repository_files_outside_the_site(tmp_path: Path) -> None:
    from ecp_lm.docsgen.site_hooks import repository_target

    docs, site = tmp_path / "docs", {"index.md", "reports/r.md"}
    (docs / "reports").mkdir(parents=True)
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence" / "a.md").write_text("a report\n")

    def target(link: str, page: str = "index.md") -> str | None:
        return repository_target(link, page, docs, tmp_path, site)

    assert target("../evidence/a.md") == "evidence/a.md"  # outside docs/
    assert target("../../evidence/a.md#top", "reports/r.md") == "evidence/a.md"
    assert target("reports/") == "docs/reports"  # a folder, not a page
    assert target("reports/r.md") is None  # a page of the site
    assert target("missing.md") is None  # nowhere: left for MkDocs to report
    assert target("../../../outside.md") is None  # outside the repository
    assert target("https://example.org/x.md") is None
    assert target("#anchor") is None
