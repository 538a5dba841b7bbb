"""A study's cost claim, checked at the paper's sizes: ECP's fraction of full attention in score
entries and in tiles, against ECP's definition counted here (a query of segment k sees segment
k − 1 whole and its own causally)."""

from __future__ import annotations

import pytest

from ecp_lm.studies.report import cost_claim, cost_claim_lines
from ecp_lm.studies.spec import CostClaim


def ecp_fractions(n: int, s: int) -> tuple[float, float]:
    """(entries, tiles) over N²: S causal segments and S − 1 whole previous ones; a tile kernel
    scores 2S − 1 whole m × m tiles."""
    m = n // s
    entries = s * m * (m + 1) // 2 + (s - 1) * m * m
    return entries / n ** 2, (2 * s - 1) * m * m / n ** 2


def test_twelve_percent_at_the_papers_sizes():
    row = cost_claim(CostClaim("ECP needs 12% of full attention's compute", "ecp", 0.12))
    entries, tiles = ecp_fractions(2048, 8)
    assert (row["seq_len"], row["num_segments"], row["n_layers"]) == (2048, 8, 12)
    assert row["entries"] == pytest.approx(entries) and row["tiles"] == pytest.approx(tiles)
    assert not row["holds_entries"] and not row["holds_tiles"]  # 17.2% and 23.4%
    least = {name: min(s for s in (2, 4, 8, 16, 32, 64) if ecp_fractions(2048, s)[i] <= 0.125)
             for i, name in enumerate(("entries", "tiles"))}
    assert (row["least_s_entries"], row["least_s_tiles"]) == (least["entries"], least["tiles"])
    text = "\n".join(cost_claim_lines([row]))
    assert "| 17.2% | 23.4% | no, no |" in text


def test_a_claim_that_holds_is_called_so():
    row = cost_claim(CostClaim("ECP needs a quarter of full attention's compute", "ecp", 0.25))
    assert row["holds_entries"] and row["holds_tiles"]
