"""The mask pictures show exactly what each architecture's mask predicate allows.

Each ``docs/img/masks/NAME.svg`` is read back: per panel, the query rows and key columns it holds
(those not shaded absent), the cells drawn as attended, and the layers and heads it stands for.
The attended cells must be exactly the pairs ``arch.layer(i).mask`` allows over those positions,
for every layer and head the panel names; the panels must cover every layer and head once; and
the rows each layer holds must be the ones SPEC §3 describes (written out here, not taken from
the code). That the files equal a fresh rendering is test_reference's check.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ecp_lm.config import ARCHS
from ecp_lm.docsgen import masks
from ecp_lm.model.kernels.masks import materialize

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


@dataclass
class ReadPanel:
    layers: list[int]
    heads: list[int]
    queries: list[int]
    keys: list[int]
    attended: set[tuple[int, int]]


def read_picture(name: str) -> list[ReadPanel]:
    root = ET.parse(ROOT / f"docs/img/masks/{name}.svg").getroot()
    panels = []
    for group in root.iter(f"{SVG}g"):
        grid = group.find(f"{SVG}rect[@class='grid']")
        cell = int(grid.get("width")) // masks.SEQ_LEN
        n = int(grid.get("width")) // cell
        absent_rows, absent_cols, attended = set(), set(), set()
        for rect in group.iter(f"{SVG}rect"):
            x, y, w, h = (int(rect.get(a)) for a in ("x", "y", "width", "height"))
            kind = rect.get("class")
            if kind == "absent" and w == n * cell:
                absent_rows.add(y // cell)
            elif kind == "absent":
                absent_cols.add(x // cell)
            elif kind == "on":
                assert h == cell and w % cell == 0
                attended |= {(y // cell, x // cell + j) for j in range(w // cell)}
        panels.append(ReadPanel(
            [int(v) for v in group.get("data-layers").split()],
            [int(v) for v in group.get("data-heads").split()],
            [q for q in range(n) if q not in absent_rows],
            [k for k in range(n) if k not in absent_cols], attended))
    return panels


def test_every_architecture_has_a_picture() -> None:
    assert set(ARCHS) <= set(masks.PICTURES)
    for name in masks.PICTURES:
        assert (ROOT / f"docs/img/masks/{name}.svg").is_file(), name


@pytest.mark.parametrize("name", list(masks.PICTURES))
def test_picture_is_the_predicate(name: str) -> None:
    arch = masks.build_architecture(name)
    n_layers, n_heads = arch.cfg.n_layers, arch.cfg.n_heads
    covered = []
    for panel in read_picture(name):
        assert {q for q, _ in panel.attended} <= set(panel.queries)
        assert {k for _, k in panel.attended} <= set(panel.keys)
        queries, keys = torch.tensor(panel.queries), torch.tensor(panel.keys)
        for layer in panel.layers:
            grid = materialize(arch.layer(layer).mask, queries, keys, n_heads)
            grid = grid.expand(n_heads, len(queries), len(keys))  # (H, Rq, Rk)
            for head in panel.heads:
                allowed = {(panel.queries[i], panel.keys[j])
                           for i, j in grid[head].nonzero().tolist()}
                assert panel.attended == allowed, f"{name}: layer {layer}, head {head}"
                covered.append((layer, head))
    assert sorted(covered) == [(i, h) for i in range(n_layers) for h in range(n_heads)]


# The rows (queries, keys) each layer holds at N = 32, l = 16, p = 8 (SPEC §3): the perceiver
# family's layer 0 queries only the latents 16..31 (double: every row but in its last layer);
# compressed_double's later layers hold the p compressed rows at positions 8..15.
ALL, LATENTS, COMPRESSED = list(range(32)), list(range(16, 32)), list(range(8, 32))
ROWS = {
    "ecp": {0: (ALL, ALL), 1: (ALL, ALL), 2: (ALL, ALL)},
    "perceiver_ar": {0: (LATENTS, ALL), 1: (LATENTS, LATENTS), 2: (LATENTS, LATENTS)},
    "double": {0: (ALL, ALL), 1: (ALL, ALL), 2: (LATENTS, ALL)},
    "compressed_double": {0: (ALL, ALL), 1: (COMPRESSED, COMPRESSED), 2: (LATENTS, COMPRESSED)},
}


@pytest.mark.parametrize("name", list(ROWS))
def test_panels_hold_the_layers_rows(name: str) -> None:
    for panel in read_picture(name):
        for layer in panel.layers:
            assert (panel.queries, panel.keys) == ROWS[name][layer], f"{name} layer {layer}"


def test_ecp_picture_matches_the_spec() -> None:
    # SPEC §3: a query sees its own segment causally and the whole previous one (m = 8).
    [panel] = read_picture("ecp")
    assert panel.attended == {(q, k) for q in range(32) for k in range(32)
                              if k <= q and q // 8 - k // 8 <= 1}
