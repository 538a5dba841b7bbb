"""Evidence V's accuracy-against-distance picture (``docsgen.mechanism``) read back: each
model's line passes through its mean over seeds at every distance, a bounded model's reach is
drawn at the furthest its definition lets a query see (ECP L·m + m − 1, a window L·(w − 1)),
and an unbounded model has none."""

from __future__ import annotations

import math
import statistics
import xml.etree.ElementTree as ET

from ecp_lm.docsgen.mechanism import HEIGHT, WIDTH, draw

NS = "{http://www.w3.org/2000/svg}"
DISTANCES = (2, 4, 8, 16, 32)


def verdicts():
    runs = []
    for i, model in enumerate(("ecp", "sliding_window_tiles", "transformer")):
        for depth in (2, 4):
            for seed in (0, 1):
                for j, d in enumerate(DISTANCES):
                    runs.append({"stage": "mechanism", "point": f"d{d}",
                                 "model": f"{model}@L{depth}", "seed": seed,
                                 "metric": "accuracy",
                                 "value": 0.9 - 0.15 * j - 0.05 * i + 0.02 * seed + 0.01 * depth})
    runs.append({"stage": "mechanism", "point": "3000", "model": "ecp@L2", "seed": 0,
                 "metric": "accuracy", "value": 0.5})
    return {"runs": runs}


def test_a_model_is_drawn_only_at_the_depths_it_ran():
    v = verdicts()
    v["runs"] += [{"stage": "mechanism", "point": f"d{d}", "model": "rwkv7@L2", "seed": 0,
                   "metric": "accuracy", "value": 0.5} for d in DISTANCES]
    svg = ET.fromstring(draw(v))
    drawn = {int(g.get("data-depth")): {p.get("data-model") for p in g.iter(f"{NS}polyline")}
             for g in svg.iter(f"{NS}g")}
    assert "rwkv7" in drawn[2] and "rwkv7" not in drawn[4]


def axis_x(d: float) -> float:
    """Where the picture's log-2 axis puts distance d (2 … 64, a margin of 0.3 on each side)."""
    lo, hi = math.log2(2) - 0.3, math.log2(64) + 0.3
    return WIDTH * (math.log2(d) - lo) / (hi - lo)


def test_each_line_is_the_mean_over_seeds_and_the_reach_is_the_definitions():
    v = verdicts()
    svg = ET.fromstring(draw(v))
    panels = {int(g.get("data-depth")): g for g in svg.iter(f"{NS}g")}
    assert sorted(panels) == [2, 4]
    for depth, g in panels.items():
        lines = {p.get("data-model"): p.get("points") for p in g.iter(f"{NS}polyline")}
        assert set(lines) == {"ecp", "sliding_window_tiles", "transformer"}
        for model, points in lines.items():
            drawn = [tuple(map(float, xy.split(","))) for xy in points.split()]
            want = [statistics.fmean(r["value"] for r in v["runs"]
                                     if r["model"] == f"{model}@L{depth}"
                                     and r["point"] == f"d{d}") for d in DISTANCES]
            assert [round(1 - y / HEIGHT, 3) for _, y in drawn] == [round(w, 3) for w in want]
            assert [round(x) for x, _ in drawn] == [round(axis_x(d)) for d in DISTANCES]
        reach = {ln.get("data-model"): float(ln.get("x1"))
                 for ln in g.iter(f"{NS}line") if ln.get("class") == "reach"}
        m, w = 4, 4  # the small task: N = 64 in 16 segments; the tile window w = m
        assert set(reach) == {"ecp", "sliding_window_tiles"}
        # a segment's last query sees its own m - 1 and L segments before them
        assert round(reach["ecp"]) == round(axis_x(depth * m + m - 1))
        assert round(reach["sliding_window_tiles"]) == round(axis_x(depth * (w - 1)))
