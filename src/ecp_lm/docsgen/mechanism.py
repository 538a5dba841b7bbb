"""``docs/img/evidence5-mechanism.svg``: Evidence V's recall accuracy against the key-to-query
distance, one panel per depth, from the committed verdict file's runs (points ``d<distance>``).

Each model is a line through its mean over seeds at each distance, its seeds as dots. A model
whose definition bounds what a query sees (``specs.evidence5.reach``) has the furthest any query
sees drawn as a dashed vertical line of its colour: past it no query sees its key, so it should
fall to chance there. Chance (1 / the values) is the dotted line. Coordinates are rounded to
one decimal, so the bytes are the same wherever the picture is drawn.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from xml.sax.saxutils import escape

PICTURE = "docs/img/evidence5-mechanism.svg"
VERDICTS = "evidence5/report/small/verdicts.json"
COLOURS = ("#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
           "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1")
WIDTH, HEIGHT, LEFT, TOP, GAP, LEGEND = 260, 200, 56, 36, 40, 250


def render(root: Path) -> str | None:
    """The picture, where ``root`` holds the verdict file; None otherwise."""
    path = root / VERDICTS
    if not path.is_file():
        return None
    return draw(json.loads(path.read_text()))


def mechanism_runs(verdicts: dict) -> dict[tuple[str, int], dict[int, list[float]]]:
    """{(model, depth): {distance: [value per seed]}} of the mechanism stage's runs."""
    out: dict[tuple[str, int], dict[int, list[float]]] = {}
    for r in verdicts["runs"]:
        if r["stage"] == "mechanism" and r["point"].startswith("d"):
            model, depth = r["model"].split("@L")
            out.setdefault((model, int(depth)), {}).setdefault(int(r["point"][1:]), []).append(
                r["value"])
    return out


def reaches(models: list[str], depth: int) -> dict[str, int]:
    """The furthest any query of the small budget's task sees at ``depth``, for each model
    whose definition bounds it."""
    from ecp_lm.studies.specs.evidence5 import STUDY, reach

    stage = STUDY.stages("small")["mechanism"]
    out = {m: reach(stage, m, depth) for m in models}
    return {m: r[1] for m, r in out.items() if r is not None}


def draw(verdicts: dict) -> str:
    runs = mechanism_runs(verdicts)
    models = list(dict.fromkeys(m for m, _ in runs))
    depths = sorted({d for _, d in runs})
    distances = sorted({x for cells in runs.values() for x in cells})
    colour = {m: COLOURS[i % len(COLOURS)] for i, m in enumerate(models)}
    lo, hi = math.log2(distances[0]) - 0.3, math.log2(2 * distances[-1]) + 0.3
    from ecp_lm.studies.specs.evidence5 import DISTANCE_TASK

    chance = 1.0 / DISTANCE_TASK["num_values"]

    def x(d: float) -> float:
        return round(WIDTH * (math.log2(d) - lo) / (hi - lo), 1)

    def y(a: float) -> float:
        return round(HEIGHT * (1 - a), 1)

    total = LEFT + len(depths) * (WIDTH + GAP) + LEGEND
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total}" '
           f'height="{TOP + HEIGHT + 44}" font-family="sans-serif" font-size="11">']
    for i, depth in enumerate(depths):
        ox = LEFT + i * (WIDTH + GAP)
        out += [f'<g transform="translate({ox},{TOP})" data-depth="{depth}">',
                f'<text x="{WIDTH / 2}" y="-14" text-anchor="middle" font-size="13">'
                f'L = {depth}</text>',
                f'<rect width="{WIDTH}" height="{HEIGHT}" fill="none" stroke="#444"/>']
        for d in sorted({*distances, 2 * distances[-1]}):
            out.append(f'<text x="{x(d)}" y="{HEIGHT + 14}" text-anchor="middle">{d}</text>')
        for a in (0, 0.5, 1):
            out.append(f'<text x="-6" y="{y(a) + 4}" text-anchor="end">{a:g}</text>')
        out.append(f'<line x1="0" x2="{WIDTH}" y1="{y(chance)}" y2="{y(chance)}" '
                   f'stroke="#888" stroke-dasharray="1,3"/>')
        for m, r in reaches(models, depth).items():
            out.append(f'<line class="reach" data-model="{escape(m)}" x1="{x(r)}" '
                       f'x2="{x(r)}" y1="0" y2="{HEIGHT}" stroke="{colour[m]}" '
                       f'stroke-dasharray="4,3"/>')
        for m in models:
            cells = runs.get((m, depth))
            if not cells:  # a model that does not run at this depth
                continue
            points = " ".join(f"{x(d)},{y(statistics.fmean(v))}" for d, v in sorted(
                cells.items()))
            out.append(f'<polyline class="mean" data-model="{escape(m)}" points="{points}" '
                       f'fill="none" stroke="{colour[m]}" stroke-width="1.5"/>')
            out += [f'<circle cx="{x(d)}" cy="{y(a)}" r="1.5" fill="{colour[m]}"/>'
                    for d, values in sorted(cells.items()) for a in values]
        out.append("</g>")
    out.append(f'<text x="{LEFT + len(depths) * (WIDTH + GAP) / 2}" y="{TOP + HEIGHT + 36}" '
               f'text-anchor="middle">distance from key to query (positions)</text>')
    out.append(f'<text transform="translate(16,{TOP + HEIGHT / 2}) rotate(-90)" '
               f'text-anchor="middle">accuracy (report sequences)</text>')
    lx = LEFT + len(depths) * (WIDTH + GAP)
    n = len(models)
    out += [f'<text x="{lx}" y="{TOP + 14 * n + 12}">dashed: furthest reach by definition</text>',
            f'<text x="{lx}" y="{TOP + 14 * n + 26}">dotted: chance</text>']
    for i, m in enumerate(models):
        out += [f'<line x1="{lx}" x2="{lx + 18}" y1="{TOP + 14 * i}" y2="{TOP + 14 * i}" '
                f'stroke="{colour[m]}" stroke-width="2"/>',
                f'<text x="{lx + 24}" y="{TOP + 14 * i + 4}">{escape(m)}</text>']
    return "\n".join([*out, "</svg>"]) + "\n"
