"""The share of sympy-code's splits that Study II's slices cover, as the evidence page
(docs/evidence.md) and the archive (docs/archive.md) quote it: counted from the corpus's own
document index (marked ``integration``: the corpus is fetched through the package registry).
The pages are archived (frozen at the commits docs/archive/README.md names); the corpus is not,
so the quote is still checked against it."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_integration import fetched

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def quoted(sizes: list[int], scored_bytes: int) -> str:
    """What the pages say the first ``scored_bytes`` bytes of a split (documents of byte
    ``sizes``, in stream order) cover: the documents with at least one byte inside, and the
    share of the split's bytes."""
    total = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    documents = sum(start < min(scored_bytes, total) for start in starts)
    share = min(scored_bytes, total) / total
    return f"{documents} of its {len(sizes)} documents, {share:.0%} of"


def test_quoted_coverage():
    from ecp_lm.data.sources import open_source

    source = fetched(lambda: open_source("sympy-code"))
    valid, test = ([size for _, size in source.documents(split)] for split in ("valid", "test"))
    archive = (ROOT / "docs" / "archive.md").read_text()
    evidence = (ROOT / "docs" / "evidence.md").read_text()
    assert f"(first 256 KiB: {quoted(valid, 256 * 1024)}\nits bytes)" in archive
    assert f"first 256 KiB of the test split\n({quoted(test, 256 * 1024)} its bytes)" in archive
    assert f"first 256 KiB of the test split ({quoted(test, 256 * 1024)} its bytes)" in evidence
