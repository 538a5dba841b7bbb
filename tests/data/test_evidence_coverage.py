"""The share of sympy-code's splits that Study II's slices cover, as the evidence page
(docs/evidence.md) and the archive (docs/archive.md) quote it: counted from the corpus's own
document index (marked ``integration``: the corpus is fetched through the package registry)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_integration import fetched

from ecp_lm.experiments.evidence.models import coverage

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_quoted_coverage():
    from ecp_lm.data.sources import open_source

    source = fetched(lambda: open_source("sympy-code"))

    def quoted(split: str) -> str:
        c = coverage([size for _, size in source.documents(split)], 256 * 1024)
        return f"{c['documents']} of its {c['of']} documents, {c['share']:.0%} of"

    results = (ROOT / "docs" / "archive.md").read_text()
    evidence = (ROOT / "docs" / "evidence.md").read_text()
    assert f"(first 256 KiB: {quoted('valid')}\nits bytes)" in results
    assert f"first 256 KiB of the test split\n({quoted('test')} its bytes)" in results
    assert f"first 256 KiB of the test split ({quoted('test')} its bytes)" in evidence
