"""A study's report, from what its stages ran: every reported number (``runs``), each (stage,
point) fitted once (``stats.fit``), the declared primary family under Holm, every other
contrast secondary, and the report's two files: ``verdicts.json`` and ``report.md``.

Rules, each applied from the data and stated in the report:

- **seeds**: only the stage's declared seeds are read; a model missing one is named, and a
  seed on disk that the spec does not declare is left out (and counted);
- **did not learn**: a cell none of whose seeds beats chance (recall: accuracy above
  1/values + the stage's margin; language: bits per byte below the bytes' unigram entropy)
  is reported as such, left out of its point's fit and out of the primary family;
- **rates**: each model's trials and the seeds they ran on; a choice made on one seed and
  under 1M selection bytes, or at the edge of what was tried, is named beside the model;
- **parameters**: every model's count against the reference's, the difference stated where
  it exceeds 2%;
- **no extrapolation**: only measured points are reported.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ecp_lm.studies import stats
from ecp_lm.studies.rates import choice
from ecp_lm.studies.runner import read_json
from ecp_lm.studies.spec import Contrast, CostClaim, Language, Stage, Study, cell, model_config

PARAMETER_TOLERANCE = 0.02
MIN_SELECTION_BYTES = 1_000_000


@dataclass
class StageData:
    """What one stage's folder holds for its spec."""

    stage: Stage
    values: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)
    """{point: {cell: {seed: metric}}}"""
    per_item: dict[tuple[str, str, int], tuple[list[float], list[float]]] = field(
        default_factory=dict)
    """{(point, cell, seed): (each item's numerator, its denominator)} at the last point (and
    on recall at each distance): queries' correctness over 1, or documents' loss in bits over
    their bytes (``stats.bootstrap``)."""
    context: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    undeclared: int = 0
    trials: dict[str, dict[float, dict[int, float]]] = field(default_factory=dict)
    selection_bytes: int | None = None
    chance: float = 0.0
    learned: dict[str, bool] = field(default_factory=dict)
    compressors: dict[str, float] = field(default_factory=dict)
    """Language: bits per byte of general-purpose compressors on the reported test bytes."""
    run_rates: dict[str, float] = field(default_factory=dict)
    curves: dict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    """Recall: {cell: {seed: its held-out curve}} where the results keep it."""
    timed: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    """{model: {seed: {"steps", "train_s"}}} of the equal-time runs."""

    @property
    def metric(self) -> str:
        return self.stage.task.metric

    @property
    def final(self) -> str:
        """The last budget point (not the equal-time one)."""
        return [p for p in self.stage.points() if p.isdigit()][-1]


def load_stage(stage: Stage, folder: Path) -> StageData:
    """The stage's runs, trials and chance level found in ``folder``."""
    data = StageData(stage)
    language = isinstance(stage.task, Language)
    for m in stage.models:
        for d in [None] if language else stage.depths(m):
            base = folder / "runs" / m / ("" if d is None else f"L{d}")
            found = {int(p.parent.name[4:]): p for p in base.glob("seed*/result.json")}
            timed = {int(p.parent.name[9:]): p for p in base.glob("time-seed*/result.json")}
            data.undeclared += len(set(found) - set(stage.seeds))
            for s in stage.seeds:
                if s not in found:
                    data.missing.append(f"{cell(m, d)} seed {s}")
                    continue
                add_result(data, read_json(found[s]), cell(m, d), s, language)
                if s in timed:
                    add_timed(data, read_json(timed[s]), m, s)
    for path in sorted(folder.glob("select/*/lr*/**/result.json")):
        r = read_json(path)
        data.trials.setdefault(r["model"], {}).setdefault(r["lr"], {})[
            r.get("seed", 0)] = r[data.metric]
        data.selection_bytes = r.get("bytes_scored", data.selection_bytes)
    if language:
        from ecp_lm.studies.language import chance_level, compressors

        data.chance = chance_level(stage.task)
        if data.metric == "bits_per_byte":
            data.compressors = compressors(stage.task.source, stage.task.report_tokens)
    else:
        from ecp_lm.studies.recall import chance

        data.chance = chance(stage) + stage.task.chance_margin
    low = stage.task.lower_is_better
    # a cell is analysed once every seed of the stage has run (a stage under way has some)
    data.learned = {c: any((v < data.chance) == low for v in seeds.values())
                    for c, seeds in data.values.get(data.final, {}).items()
                    if set(stage.seeds) <= set(seeds)}
    return data


def add_result(data: StageData, r: dict[str, Any], name: str, seed: int,
               language: bool) -> None:
    data.run_rates[r["model"]] = r["lr"]
    if language:
        for p in r["points"]:
            data.values.setdefault(str(p["steps"]), {}).setdefault(name, {})[seed] = \
                p[data.metric]
            if str(p["steps"]) == data.final and "documents" in p:
                docs = p["documents"]
                data.per_item[data.final, name, seed] = (
                    [v / math.log(2) for v in docs["nll"]], [float(b) for b in docs["bytes"]])
            elif str(p["steps"]) == data.final and "correct" in p:
                data.per_item[data.final, name, seed] = (p["correct"], [1.0] * len(p["correct"]))
            if "context_gain_bits" in p:
                data.context.setdefault(str(p["steps"]), {}).setdefault(name, {})[seed] = \
                    p["context_gain_bits"]
        return
    data.values.setdefault(str(r["steps"]), {}).setdefault(name, {})[seed] = r["accuracy"]
    if "curve" in r:
        data.curves.setdefault(name, {})[seed] = r["curve"]
    for d, accuracy in r.get("accuracy_by_distance", {}).items():
        data.values.setdefault(f"d{d}", {}).setdefault(name, {})[seed] = accuracy
    if "per_query" in r:
        from ecp_lm.training.mqar import unpack_queries

        correct = [float(c) for c in unpack_queries(r["per_query"])[0]]
        data.per_item[data.final, name, seed] = (correct, [1.0] * len(correct))
        distance = r["per_query"].get("distance", "").split()
        for d in sorted(set(distance)):
            items = [c for c, x in zip(correct, distance, strict=True) if x == d]
            data.per_item[f"d{d}", name, seed] = (items, [1.0] * len(items))


def add_timed(data: StageData, r: dict[str, Any], model: str, seed: int) -> None:
    """An equal-time run: at point ``time<last>``, beside the reference's last point."""
    last = str(max(data.stage.task.points))
    [p] = r["points"]
    point = data.values.setdefault(f"time{last}", {})
    point.setdefault(model, {})[seed] = p[data.metric]
    data.timed.setdefault(model, {})[seed] = {"steps": p["steps"], "train_s": r["train_s"]}
    ref = data.stage.reference
    point.setdefault(ref, {})[seed] = data.values[last][ref][seed]


def runs_of(data: Mapping[str, StageData]) -> list[dict[str, Any]]:
    """Every reported number before any analysis, as ``verdicts.json`` holds them."""
    return [{"stage": name, "point": point, "model": c, "seed": s, "metric": metric,
             "value": v}
            for name, d in data.items()
            for metric, values in ((d.metric, d.values), ("context_gain_bits", d.context))
            for point, cells in values.items()
            for c, seeds in cells.items() for s, v in sorted(seeds.items())]


def resolve(c: Contrast, data: StageData) -> Contrast:
    return Contrast(c.stage, data.final if c.point == "final" else c.point, c.weights, c.name)


def secondary(data: StageData, primary: list[Contrast]) -> list[Contrast]:
    """The reference against every other cell at every point (and, on recall, at each depth
    and for each depth step's interaction), less the primary ones."""
    stage, ref, out = data.stage, data.stage.reference, []
    others = [m for m in stage.models if m != ref]
    for point in (p for p in stage.points() if p in data.values):
        if isinstance(stage.task, Language):
            out += [Contrast.pair(stage.name, ref, m, point) for m in others
                    if m in data.values[point]]
            continue
        depths, ran = [f"L{d}" for d in stage.task.depths], set(stage.cells())
        out += [Contrast.pair(stage.name, f"{ref}@{d}", f"{m}@{d}", point)
                for d in depths for m in others if f"{m}@{d}" in ran]
        out += [Contrast.interaction(stage.name, ref, m, lo, hi, point)
                for lo, hi in itertools.pairwise(depths) for m in others
                if {f"{m}@{lo}", f"{m}@{hi}"} <= ran]
    declared = {(c.stage, c.point, c.weights) for c in primary}
    return [c for c in out if (c.stage, c.point, c.weights) not in declared]


def sides(c: Contrast) -> tuple[str, str]:
    """The verdict file's ``a`` and ``b``: the two models, or an interaction's two gains."""
    if len(c.weights) == 2:
        return c.weights[0][0], c.weights[1][0]
    (a_hi, _), (a_lo, _), (b_hi, _), (b_lo, _) = c.weights
    return f"{a_hi} − {a_lo}", f"{b_hi} − {b_lo}"


def per_seed(c: Contrast, values: dict[str, dict[int, float]]) -> dict[int, float]:
    """The contrast computed within each seed that every cell of it ran."""
    seeds = set.intersection(*(set(values.get(m, {})) for m, _ in c.weights))
    return {s: sum(w * values[m][s] for m, w in c.weights) for s in sorted(seeds)}


EXCLUSIONS = (("did_not_learn", "did not learn"), ("not_run", "not run yet"),
              ("not_in_budget", "not in this budget"))
"""Why a declared comparison is not in the family: the verdict file's key, and its words."""


def analyse(study: Study, data: Mapping[str, StageData], alpha: float = stats.ALPHA,
            budget: str | None = None) -> dict[str, Any]:
    """The verdict file: ``runs``, ``comparisons`` (the keys of ``stats.COMPARISON_KEYS``
    and, beside them, the contrast's name, its per-seed values, the seeds agreeing with its
    sign and the bootstrap interval where per-item data exist), and what was left out."""
    stages = study.stages(budget) if budget else {n: d.stage for n, d in data.items()}
    excluded, contrasts, primary = [], [], []
    for c in study.primary:
        if c.stage not in stages:
            continue
        cells, d, have = [m for m, _ in c.weights], data.get(c.stage), set(stages[c.stage].cells())
        absent = [m for m in cells if m not in have]
        if not absent and d is not None:
            c = resolve(c, d)
            primary.append(c)
        why = ({"not_in_budget": absent} if absent else {"not_run": cells} if d is None else
               {"not_run": [m for m in cells if m not in d.learned],
                "did_not_learn": [m for m in cells if d.learned.get(m) is False]})
        if any(why.values()):
            excluded.append({"contrast": c.name, "stage": c.stage, "point": c.point,
                             "did_not_learn": why.pop("did_not_learn", []),
                             **{k: v for k, v in why.items() if v}})
        else:
            contrasts.append((c, True))
    for d in data.values():
        for c in secondary(d, primary):
            if all(d.learned.get(m, False) for m, _ in c.weights):
                contrasts.append((c, False))
    groups: dict[tuple[str, str], dict[tuple[str, int], float]] = {}
    for name, d in data.items():
        for point, cells in d.values.items():
            for c_name, seeds in cells.items():
                if d.learned.get(c_name):
                    for s, v in seeds.items():
                        groups.setdefault((name, point), {})[c_name, s] = v
    fits = {key: stats.fit(v) for key, v in groups.items() if len(by_cell(v)) > 1}
    declared = [stats.Comparison(c.stage, c.point, *sides(c), data[c.stage].metric, primary,
                                 c.weights) for c, primary in contrasts]
    rows = stats.compare(fits, declared, alpha)
    for row, (c, _) in zip(rows, contrasts, strict=True):
        d = data[c.stage]
        seeds = per_seed(c, d.values[c.point])
        sign = -1 if d.stage.task.lower_is_better else 1
        row.update(contrast=c.name, per_seed=seeds, seeds=len(seeds),
                   favour_a=sum(sign * v > 0 for v in seeds.values()),
                   favour_b=sum(sign * v < 0 for v in seeds.values()),
                   bootstrap=item_bootstrap(c, d, row["level"]))
    return {"study": study.name, "alpha": alpha, "runs": runs_of(data),
            "comparisons": [{k: r[k] for k in (*stats.COMPARISON_KEYS, "level", "contrast",
                                                 "per_seed", "seeds", "favour_a", "favour_b",
                                                 "bootstrap", "pooled")} for r in rows],
            "excluded": excluded, "chance": {n: d.chance for n, d in data.items()},
            "lower_is_better": {n: d.stage.task.lower_is_better for n, d in data.items()},
            "seeds": {n: list(d.stage.seeds) for n, d in data.items()},
            "parameters": {n: {m: parameter_count(d.stage, m) for m in d.stage.models}
                           for n, d in data.items()},
            **({"cost_claims": [cost_claim(c) for c in study.cost_claims]}
               if study.cost_claims else {}),
            "fits": {f"{s}/{p}": {"residual_sd": f.residual_variance ** 0.5, "df": f.df,
                                  "cells": list(f.models), "seeds": list(f.seeds),
                                  "bartlett_p": stats.bartlett(by_cell(groups[s, p])),
                                  "pooled": f.pooled}
                     for (s, p), f in fits.items()}}


CLAIM_SLACK = 0.005
"""A cost claim holds in a convention where the fraction is at most the claimed one plus half a
percentage point (a claim of 12% holds for 12.4%, not for 12.6%)."""


def cost_claim(c: CostClaim) -> dict[str, Any]:
    """A cost claim checked at its preset's sizes: the fraction of full attention in score
    entries and in tiles, whether each holds, and the smallest S (a divisor of N) at which
    each would."""
    from ecp_lm.bench.complexity import attention_cost
    from ecp_lm.config import PRESETS, ModelConfig

    size = {**PRESETS[c.preset], "arch": c.arch}
    cost = attention_cost(ModelConfig(**size))
    n = size["seq_len"]
    at_s = {s: attention_cost(ModelConfig(**{**size, "num_segments": s}))
            for s in range(2, n // 2 + 1) if n % s == 0}
    row = {"claim": c.claim, "arch": c.arch, "preset": c.preset, "seq_len": n,
           "num_segments": size["num_segments"], "n_layers": size["n_layers"],
           "fraction": c.fraction, "entries": cost.ratio_to_full,
           "tiles": cost.tile_ratio_to_full, "causal": cost.ratio_to_causal}
    for name, ratio in (("entries", "ratio_to_full"), ("tiles", "tile_ratio_to_full")):
        row[f"holds_{name}"] = getattr(cost, ratio) <= c.fraction + CLAIM_SLACK
        row[f"least_s_{name}"] = min((s for s, a in at_s.items()
                                      if getattr(a, ratio) <= c.fraction + CLAIM_SLACK),
                                     default=None)
    return row


def cost_claim_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["## Cost claims", "",
             "Fractions of full attention (L·N² score entries) by `ecp complexity`: the entries "
             "the mask allows, and the whole tiles a block kernel scores. A claim holds within "
             f"{CLAIM_SLACK * 100:g} of a percentage point.", "",
             "| claim | sizes | entries | tiles | holds (entries, tiles) | holds from S = |",
             "|---|---|---:|---:|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['claim']} | {r['preset']}: N {r['seq_len']}, S {r['num_segments']}, "
            f"L {r['n_layers']} | {r['entries']:.1%} | {r['tiles']:.1%} | "
            f"{'yes' if r['holds_entries'] else 'no'}, {'yes' if r['holds_tiles'] else 'no'} | "
            f"{r['least_s_entries'] or 'never'} (entries), {r['least_s_tiles'] or 'never'} "
            f"(tiles) |")
    return [*lines, ""]


def by_cell(values: Mapping[tuple[str, int], float]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for (c, _), v in values.items():
        out.setdefault(c, []).append(v)
    return out


def item_bootstrap(c: Contrast, d: StageData, level: float) -> list[float] | None:
    """The bootstrap over items (queries or documents) and seeds of a contrast, where every
    seed of each of its cells stored them at its point; None otherwise."""
    cells = [m for m, _ in c.weights]
    if any((c.point, m, s) not in d.per_item for m in cells for s in d.stage.seeds):
        return None
    items = {(m, s): d.per_item[c.point, m, s] for m in cells for s in d.stage.seeds}
    return list(stats.bootstrap(items, c.weights, level=level))


# The markdown -----------------------------------------------------------------------------

UNITS = {"bits_per_byte": "bits/byte", "accuracy": "accuracy"}


def seed_sentence(row: dict[str, Any]) -> str:
    """What the seeds of a comparison say, one by one, as a sentence of the results page."""
    a, b = row["a"], row["b"]
    if " − " in a:  # an interaction: (a@hi − a@lo) − (b@hi − b@lo)
        hi, lo = (c.split("@")[1] for c in a.split(" − "))
        a, b = f"{a.split('@')[0]}'s gain from {lo} to {hi}", f"{b.split('@')[0]}'s"
    n, fa, fb = row["seeds"], row["favour_a"], row["favour_b"]
    where = f"on {row['stage']} at {row['point']}"
    if fa == n:
        return f"{where}, {a} is ahead of {b} in each of the {n} seeds"
    if fb == n:
        return f"{where}, {b} is ahead of {a} in each of the {n} seeds"
    tied = n - fa - fb
    return (f"{where}, {a} is ahead of {b} in {fa} of the {n} seeds and behind in {fb}"
            + (f", tied in {tied}" if tied else ""))


def size_note(analysis: dict[str, Any], row: dict[str, Any]) -> str:
    """Where the other model's parameter count is more than 2% from ECP's: by how much."""
    counts = analysis["parameters"][row["stage"]]
    other = row["b"].split("@")[0].split(" ")[0]
    ratio = counts[other] / counts[row["a"].split("@")[0].split(" ")[0]] - 1
    return f" ({other}: {ratio:+.0%} parameters)" if abs(ratio) > PARAMETER_TOLERANCE else ""


def verdict_lines(analysis: dict[str, Any]) -> list[str]:
    """The verdict table (README, results page): one row per primary comparison, then one per
    declared comparison left out because a model did not learn."""
    out = ["| comparison | stage, point | ECP − other | interval at Holm's level | "
           "seeds with ECP ahead | verdict |", "|---|---|---:|---|---|---|"]
    for r in (r for r in analysis["comparisons"] if r["family"] == "primary"):
        lower = analysis["lower_is_better"][r["stage"]]
        ahead = (r["estimate"] < 0) == lower
        verdict = ("ECP ahead" if ahead else "ECP behind") if r["called"] else "not called"
        out.append(f"| {r['contrast']}{size_note(analysis, r)} | {r['stage']}, {r['point']} | "
                   f"{r['estimate']:+.4f} "
                   f"{UNITS[r['metric']]} | [{r['low']:+.4f}, {r['high']:+.4f}] "
                   f"({r['level']:.2%}) | {r['favour_a']} of {r['seeds']} | {verdict} |")
    for e in analysis["excluded"]:
        out.append(f"| {e['contrast']} | {e['stage']}, {e['point']} | — | — | — | "
                   f"{exclusion_text(e, ': ')} |")
    return out


def exclusion_text(e: dict[str, Any], joint: str = " ") -> str:
    """Why a declared comparison is left out: "did not learn: mamba2@L4" (``joint`` ": ") or
    "mamba2@L4 did not learn"."""
    parts = [(text, ", ".join(e[key])) for key, text in EXCLUSIONS if e.get(key)]
    return "; ".join(f"{text}{joint}{cells}" if joint != " " else f"{cells} {text}"
                     for text, cells in parts)


def call_text(row: dict[str, Any], lower_is_better: bool) -> str:
    if row["family"] == "secondary":
        return "secondary"
    if not row["called"]:
        return "not called"
    ahead = (row["estimate"] < 0) == lower_is_better
    return f"called: {row['a'].split(' ')[0]} ahead" if ahead else \
        f"called: {row['b'].split(' ')[0]} ahead"


def p_text(p: float) -> str:
    return "< 1e-12" if p < 1e-12 else f"{p:.2g}"


def seeds_text(row: dict[str, Any]) -> str:
    return f"{row['favour_a']} of {row['seeds']} for {row['a'].split('@')[0].split(' ')[0]}"


def comparison_table(rows: list[dict[str, Any]], lower: dict[str, bool]) -> list[str]:
    out = ["| contrast | stage, point | estimate | interval | level | df | p | per seed "
           "| bootstrap | call |", "|---|---|---:|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        boot = "not stored" if r["bootstrap"] is None else \
            f"[{r['bootstrap'][0]:+.4f}, {r['bootstrap'][1]:+.4f}]"
        out.append(f"| {r['contrast']} | {r['stage']}, {r['point']} | {r['estimate']:+.4f} | "
                   f"[{r['low']:+.4f}, {r['high']:+.4f}] | {r['level']:.4f} | {r['df']} | "
                   f"{p_text(r['p'])} | {seeds_text(r)} | {boot} | "
                   f"{call_text(r, lower[r['stage']])} |")
    return out


def stage_table(d: StageData, point: str, params: dict[str, int]
                ) -> list[str]:
    ref = params[d.stage.reference]
    metric = "bits per byte (test split)" if d.metric == "bits_per_byte" else \
        f"accuracy ({'test split' if isinstance(d.stage.task, Language) else 'report sequences'})"
    at = f"{point} steps" if point.isdigit() else \
        f"{d.final} steps, the queries at distance {point[1:]}" if point.startswith("d") else \
        f"equal training time: {d.stage.reference} at {point[4:]} steps, " + ", ".join(
            f"{m} at {runs[min(runs)]['steps']} steps" for m, runs in d.timed.items())
    out = [f"### {d.stage.name} at {at}: {metric}", "",
           "| model | parameters | rate | mean | SD | per seed |", "|---|---|---|---:|---:|---|"]
    for c_name, seeds in d.values.get(point, {}).items():
        model, _, depth = c_name.partition("@L")
        count, base = (params[model], ref) if not depth else (
            parameter_count(d.stage, model, int(depth)),
            parameter_count(d.stage, d.stage.reference, int(depth)))
        ratio = count / base - 1
        size = f"{count:,}" + (f" ({ratio:+.1%} vs {d.stage.reference})"
                               if abs(ratio) > PARAMETER_TOLERANCE else "")
        values = list(seeds.values())
        sd = statistics.stdev(values) if len(values) > 1 else float("nan")
        out.append(f"| {cell_label(d, c_name, seeds)} | {size} | {rate_text(d, model)} | "
                   f"{statistics.fmean(values):.4f} | {sd:.4f} | "
                   f"{', '.join(f'{v:.4f}' for _, v in sorted(seeds.items()))} |")
    if d.metric == "bits_per_byte":
        for name, bits in d.compressors.items():
            out.append(f"| {name} (reference) | — | — | {bits:.4f} | — | — |")
        out.append(f"| unigram entropy (chance) | — | — | {d.chance:.4f} | — | — |")
    else:
        out.append(f"| chance + margin | — | — | {d.chance:.4f} | — | — |")
    return [*out, ""]


def cell_label(d: StageData, name: str, seeds: dict[int, float]) -> str:
    """A cell as tables name it: marked where it did not learn or has not run every seed."""
    return name + ("" if d.learned.get(name) else " (did not learn)" if name in d.learned
                   else f" ({len(seeds)} of {len(d.stage.seeds)} seeds)")


def distance_lines(d: StageData) -> list[str]:
    """Recall with distances: every cell's accuracy at every distance in one table, the mean
    over its seeds and their range (the stage tables hold each seed)."""
    task = d.stage.task
    distances = () if isinstance(task, Language) else task.task.get("distances", ())
    if not distances:
        return []
    out = [f"## Accuracy by distance: {d.stage.name}", "",
           f"Accuracy on the report sequences' queries at each distance after {d.final} steps: "
           f"the mean over the seeds [lowest, highest]. Chance + margin: {d.chance:.4f}.", "",
           "| model | " + " | ".join(f"d = {x}" for x in distances) + " |",
           "|---|" + "---:|" * len(distances)]
    for name in d.stage.cells():
        cells = [d.values.get(f"d{x}", {}).get(name) for x in distances]
        if any(cells):
            out.append(f"| {cell_label(d, name, cells[0] or {})} | " + " | ".join(
                "—" if not v else f"{statistics.fmean(v.values()):.3f} "
                f"[{min(v.values()):.3f}, {max(v.values()):.3f}]" for v in cells) + " |")
    return [*out, ""]


def timed_lines(d: StageData, folder: Path) -> str:
    """How equal the equal-time runs' times are: the step times measured side by side times
    the steps, and each run's own training seconds."""
    times, ref = read_json(folder / "step_s.json"), d.stage.reference
    last = max(d.stage.task.points)
    parts = [f"{ref}: {last} × {times[ref]:.3f} s = {last * times[ref]:.0f} s"]
    for m, runs in d.timed.items():
        steps = runs[min(runs)]["steps"]
        own = ", ".join(f"{r['train_s']:.0f}" for _, r in sorted(runs.items()))
        parts.append(f"{m}: {steps} × {times[m]:.3f} s = {steps * times[m]:.0f} s "
                     f"({steps * times[m] / (last * times[ref]) - 1:+.1%}; its runs trained "
                     f"{own} s)")
    return "Equal time, by the step times measured side by side: " + "; ".join(parts) + "."


SENSITIVE_BITS = 0.02
"""A context gain the control (full attention) must clear in every seed before another
model's gain says anything about its use of long context."""


def context_lines(d: StageData) -> list[str]:
    """Each measured model's context gain (bits per byte on windows of 2m minus on windows of
    N, the same targets) by seed, and whether the control clears ``SENSITIVE_BITS`` in every
    seed at that point."""
    if not d.context:
        return []
    out = ["### Context gain (secondary)", "",
           "Bits per byte with windows of 2m minus with windows of N, on the same test "
           "targets: what context beyond two segments is worth.", "",
           "| point | model | mean | per seed |", "|---|---|---:|---|"]
    for point, models in d.context.items():
        for m, seeds in models.items():
            out.append(f"| {point} | {m} | {statistics.fmean(seeds.values()):+.4f} | "
                       f"{', '.join(f'{v:+.4f}' for _, v in sorted(seeds.items()))} |")
    control = "transformer"
    for point, models in d.context.items():
        if control in models:
            gains = models[control].values()
            above = sum(g > SENSITIVE_BITS for g in gains)
            out.append(f"\nAt {point} steps the {control}'s gain exceeds {SENSITIVE_BITS} "
                       f"bits/byte in {above} of {len(gains)} seeds"
                       + ("." if above == len(gains) else ": the task cannot show a use of "
                          "long context at this point, ECP's or any model's."))
    return [*out, ""]


def plateau_lines(d: StageData) -> list[str]:
    """Recall with distances: how much the reference's held-out accuracy at d ≤ 2m rose over
    the last fifth of its training, per depth and seed (whether it had stopped improving)."""
    task = d.stage.task
    distances = task.task.get("distances", ()) if not isinstance(task, Language) else ()
    m = task.task["seq_len"] // task.num_segments if distances else 0
    near = [str(x) for x in distances if x <= 2 * m]
    if not near:
        return []
    out = ["### Training length", "", f"{d.stage.reference}'s held-out accuracy at distances "
           f"{', '.join(near)} (≤ 2m) at the last evaluation minus at the first at or past 80% "
           f"of the {task.steps} steps, by seed:", ""]
    for depth in task.depths:
        rises = []
        for _, curve in sorted(d.curves.get(cell(d.stage.reference, depth), {}).items()):
            late = [p for p in curve if p["step"] >= 0.8 * task.steps]
            first, last = (statistics.fmean(p["accuracy_by_distance"][x] for x in near)
                           for p in (late[0], late[-1]))
            rises.append(f"{last - first:+.3f}")
        out.append(f"- L = {depth}: {', '.join(rises) or 'no curve stored'}")
    return [*out, ""]


def rate_text(d: StageData, model: str) -> str:
    trials = d.trials.get(model)
    if not trials:
        return "—"
    scores = {lr: statistics.fmean(s.values()) for lr, s in trials.items()}
    chosen = choice(scores, d.stage.task.lower_is_better)
    seeds = sorted({s for t in trials.values() for s in t})
    notes = [] if chosen["inside"] else ["at the edge"]
    if len(seeds) < 2 and (d.selection_bytes or 0) < MIN_SELECTION_BYTES:
        notes.append(f"seed {seeds[0]} only")
    ran = d.run_rates.get(model, chosen["lr"])
    if ran != chosen["lr"]:
        notes.append(f"its runs used {ran:g}")
    return f"{chosen['lr']:g}" + (f" ({', '.join(notes)})" if notes else "")


def report_markdown(study: Study, budget: str, analysis: dict[str, Any],
                    data: Mapping[str, StageData], root: Path) -> str:
    lower = {n: d.stage.task.lower_is_better for n, d in data.items()}
    rows = analysis["comparisons"]
    primary = [r for r in rows if r["family"] == "primary"]
    lines = [f"# {study.name}, budget {budget}", "", study.question, "",
             f"## Primary family: {len(primary)} comparison{'s' * (len(primary) != 1)}, "
             f"Holm at α = "
             f"{analysis['alpha']}", "",
             "Estimate: mean(a) − mean(b) over the seeds; the interval is the pooled "
             "additive model's at the level Holm's step gives it (where the models' variances "
             "differ, a paired t on the comparison's own per-seed values: see the fits).", "",
             *comparison_table(primary, lower), ""]
    for e in analysis["excluded"]:
        lines.append(f"- Not in the family: {e['contrast']} ({e['stage']}, {e['point']}): "
                     f"{exclusion_text(e)}.")
    lines.append("")
    for d in data.values():
        lines += distance_lines(d)
    lines += ["## Stages", ""]
    for name, d in data.items():
        params = analysis["parameters"][name]
        for point in (p for p in d.stage.points() if p in d.values):
            lines += stage_table(d, point, params)
        if d.timed:
            lines += timed_lines(d, root / name / budget), ""
        fit_lines = [f"{key}: residual SD {f['residual_sd']:.4f} on {f['df']} df, "
                     + (f"Bartlett p = {f['bartlett_p']:.2g}" if f["bartlett_p"] is not None
                        else "Bartlett not testable (a cell has no spread over its seeds)")
                     + ("" if f["pooled"] else "; not pooled: each contrast is a paired t "
                        "on its own per-seed values")
                     for key, f in analysis["fits"].items() if key.startswith(f"{name}/")]
        lines += [f"Fits: {'; '.join(fit_lines)}." if fit_lines else
                  "No fit: no model learned.", ""]
        if d.missing:
            lines += [f"Missing: {', '.join(d.missing)}.", ""]
        if d.undeclared:
            lines += [f"{d.undeclared} run(s) at seeds the spec does not declare are left "
                      f"out.", ""]
    for d in data.values():
        lines += context_lines(d) + plateau_lines(d)
    lines += cost_claim_lines(analysis.get("cost_claims", []))
    secondary = [r for r in rows if r["family"] == "secondary"]
    lines += ["## Secondary comparisons", "",
              "Unadjusted 95% intervals, never called.", "",
              *comparison_table(secondary, lower), ""]
    return "\n".join(lines)


def parameter_count(stage: Stage, model: str, depth: int | None = None) -> int:
    """``model``'s parameters in ``stage``: on recall at ``depth`` layers (None: the selection
    depth)."""
    from ecp_lm.model.matching import parameter_count as count

    if isinstance(stage.task, Language):
        return count(model_config(stage, model))
    return count(model_config(stage, model, depth or stage.task.select_depth))


def load(study: Study, budget: str, root: Path) -> dict[str, StageData]:
    found = {}
    for name, stage in study.stages(budget).items():
        folder = root / name / budget
        if (folder / "runs").is_dir():
            found[name] = load_stage(stage, folder)
    return found
