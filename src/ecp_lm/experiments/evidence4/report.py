"""Evidence IV's one report: every comparison of the stages as one family, Holm-corrected, and
a verdict table with a one-line answer per question.

Each comparison pairs ECP's seeds with another model's (``paired.Paired``): the mean of the
per-seed differences (ECP − other) with a Student-t interval over the seeds, at the level Holm's
step-down gives it among all the comparisons in the report (``paired.holm``). An ordering is
called only where that interval excludes zero and, besides,

- both models' rates are inside their grids (``rates``: an edge rate is a choice the grid made);
- for an equal-time comparison, the side it can show (``only``) is the one ahead: the side that
  trained longer being ahead shows nothing about equal time.

The context question is asked only at budget points where the transformer's context gain
exceeds ``SENSITIVE_BITS`` in every seed; where it never does, the report says so and what the
measured gains extrapolate to.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ecp_lm.experiments.evidence4.paired import ALPHA, Paired, holm
from ecp_lm.experiments.evidence4.rates import rate_key

QUESTIONS = (
    ("window", "Is ECP better than a sliding window of the same cost (entries)?",
     ("sliding_window",)),
    ("tiles", "Is ECP better than a sliding window of its cost in the research's tiles?",
     ("sliding_window_tiles",)),
    ("s2", "Is ECP better than S² (about half its entries)?", ("s2",)),
    ("transformer", "Is ECP better than the full-attention transformer?", ("transformer",)),
    ("perceiver", "Is ECP better than PerceiverAR, the research's headline comparison?",
     ("perceiver_ar",)),
    ("mamba2", "Is ECP better than Mamba-2 of equal parameters?", ("mamba2",)),
    ("gated_deltanet", "Is ECP better than Gated DeltaNet of equal parameters?",
     ("gated_deltanet",)),
    ("rwkv7", "Is ECP better than RWKV-7 at attention's widths?", ("rwkv7",)),
)
"""The verdict table's questions: key, wording, and the models ECP is compared with."""
CONTEXT = ("context", "Does ECP use context beyond 2m (windows of N against 2m)?")


def load(out: Path, budget: str) -> dict[str, dict[str, Any]]:
    """The stages' summaries found under ``out`` at ``budget``, by stage."""
    found = {}
    for stage in ("language", "recall"):
        path = out / stage / budget / f"{stage}.json"
        if path.exists():
            found[stage] = json.loads(path.read_text())
    return found


def context_comparisons(language: dict[str, Any]) -> tuple[list[dict[str, Any]], dict]:
    """The context question's comparisons (ECP's gain against none, and against the
    transformer's), at the points where the transformer's gain clears the threshold in every
    seed; and what the report says about sensitivity."""
    from ecp_lm.experiments.long_context.measure import SENSITIVE_BITS

    models = language["models"]
    if not {"ecp", "transformer"} <= set(models):
        return [], {"measured": False}
    rows, points = [], {}
    for p in language["points"]:
        gains = models["transformer"]["points"][str(p)]["context_gain_bits"]
        ecp = models["ecp"]["points"][str(p)]["context_gain_bits"]
        sensitive = all(g > SENSITIVE_BITS for g in gains.values())
        points[str(p)] = {"transformer": gains, "ecp": ecp, "sensitive": sensitive}
        if sensitive:
            zeros = {s: 0.0 for s in ecp}
            rows += [{"name": f"context: ecp's gain vs none at {p} steps", "a": "ecp",
                      "b": "none", "held": "the same test targets", "measure": "gain",
                      "lower_is_better": False, "values": [ecp, zeros]},
                     {"name": f"context: ecp's gain vs the transformer's at {p} steps",
                      "a": "ecp", "b": "transformer", "held": "the same test targets",
                      "measure": "gain", "lower_is_better": False, "values": [ecp, gains]}]
    return rows, {"measured": True, "threshold_bits": SENSITIVE_BITS, "points": points,
                  "extrapolation": extrapolate(points, SENSITIVE_BITS),
                  "transformer_step_s": models["transformer"]["step_s"]}


def extrapolate(points: dict[str, dict[str, Any]], threshold: float) -> dict[str, Any] | None:
    """Where the transformer's mean gain, taken as linear in log(steps) through the first and
    last points, would pass ``threshold``: a named extrapolation, not a measurement. ``grows``
    is false where it did not grow, or is not yet positive at the last point; None for one
    point."""
    steps = sorted(map(int, points))
    if len(steps) < 2:
        return None
    first, last = (statistics.fmean(points[str(p)]["transformer"].values())
                   for p in (steps[0], steps[-1]))
    slope = (last - first) / (math.log(steps[-1]) - math.log(steps[0]))
    if slope <= 0 or last <= 0:  # no growth, or none yet of a gain: nothing to extend
        return {"grows": False, "first": first, "last": last}
    log_at = math.log(steps[-1]) + (threshold - last) / slope
    return {"grows": True, "first": first, "last": last,
            "steps": math.exp(log_at) if log_at < math.log(FAR) else None}


FAR = 1e9
"""Steps past which an extrapolation is not written as a number."""


def rate_problems(stages: dict[str, dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(stage, model) -> why no ordering involving the model is called there."""
    problems = {}
    for stage, summary in stages.items():
        for m, r in summary["models"].items():
            if not r["inside"]:
                problems[stage, m] = (f"{m}'s rate {r['lr']:g} is at the edge of the "
                                      f"{len(r['trials'])} it tried")
    return problems


def at_chance(stages: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """By stage, the models whose chosen rate's trial is at chance (recall: within the margin
    of 1 / the number of values; language: no lower than the bytes' unigram entropy): after
    the learners' rates were tried too, as ``rates.rescue_rates`` asks."""
    out = {}
    for stage, s in stages.items():
        scores = {name: m["trials"][rate_key(m["lr"])] for name, m in s["models"].items()}
        out[stage] = [name for name, score in scores.items()
                      if (score <= s["chance"] + s["chance_margin"] if stage == "recall"
                          else score >= s["chance_bits"])]
    return out


def analyse(stages: dict[str, dict[str, Any]], alpha: float = ALPHA) -> dict[str, Any]:
    """Every comparison of the stages, Holm-corrected as one family, with its call."""
    rows = [dict(c, stage=stage) for stage, s in stages.items() for c in s["comparisons"]]
    context = {"measured": False}
    if "language" in stages:
        extra, context = context_comparisons(stages["language"])
        rows += [dict(c, stage="language") for c in extra]
    rows = [r for r in rows if len(Paired.from_seeds(r["name"], *r["values"]).a) >= 2]
    tests = holm([Paired.from_seeds(r["name"], *r["values"]) for r in rows], alpha)
    problems = rate_problems(stages)
    out = []
    for row, test in zip(rows, tests, strict=True):
        sign = -1 if row["lower_is_better"] else 1
        ahead = None
        if test["called"]:
            ahead = "a" if sign * test["mean"] > 0 else "b"
        why = [problems[row["stage"], m] for m in (row["a"], row["b"])
               if (row["stage"], m) in problems]
        if ahead and row.get("only") and ahead != row["only"]:
            why.append("the model ahead trained longer")
        out.append({**{k: v for k, v in row.items() if k != "values"}, **test,
                    "values": row["values"], "ahead": None if why else ahead,
                    "not_called_because": why})
    return {"alpha": alpha, "family": len(out), "comparisons": out, "context": context,
            "at_chance": at_chance(stages)}


def effect(row: dict[str, Any]) -> str:
    """ECP's lead (+) or deficit (−) in the comparison's own units, with its interval."""
    sign = -1 if row["lower_is_better"] else 1
    lo, hi = sorted((sign * row["low"], sign * row["high"]))
    unit = "bits/byte" if row["measure"] == "bits_per_byte" else (
        "bits/byte of gain" if row["measure"] == "gain" else "accuracy")
    digits = 4 if row["measure"] != "accuracy" else 3
    return (f"{sign * row['mean']:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] {unit}")


def call_text(row: dict[str, Any]) -> str:
    if row["ahead"] == "a":
        return "ECP ahead"
    if row["ahead"] == "b":
        return f"{row['b']} ahead"
    if row["not_called_because"]:
        return "not called: " + "; ".join(row["not_called_because"])
    return "no difference called"


def where(row: dict[str, Any]) -> str:
    """Which measurement a comparison is: the language curve's point(s), recall's depth."""
    if row["stage"] == "recall":
        return f"recall L = {row['depth']}"
    points = row.get("points")
    if row["held"] == "equal training time":
        return f"language, equal time (ECP {points[0]} steps, {row['b']} {points[1]})"
    return f"language {row['name'].rsplit(' at ', 1)[-1]}"


def verdict_rows(analysis: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per question and measurement: the question's key, what is measured, the call,
    the effect with its corrected interval, the seeds and what is held equal."""
    rows = []
    for c in analysis["comparisons"]:
        context = c["name"].startswith("context")
        keys = [CONTEXT[0]] if context else [k for k, _, others in QUESTIONS
                                              if c["b"] in others and c["a"] == "ecp"]
        rows += [{"question": key, "versus": c["b"], "where": where(c), "stage": c["stage"],
                  "call": call_text(c), "effect": effect(c), "seeds": str(c["n"]),
                  "held": c["held"], "level": f"{1 - c['alpha']:.4g}",
                  "ahead_in": ahead_in(c)} for key in keys]
    return rows


def ahead_in(row: dict[str, Any]) -> str:
    """In how many of the paired seeds ECP's own value is ahead of the other's: a count, not a
    test (the call is the interval's)."""
    a, b = row["values"]
    seeds = [s for s in a if s in b]
    sign = -1 if row["lower_is_better"] else 1
    return f"{sum(sign * (a[s] - b[s]) > 0 for s in seeds)} of {len(seeds)}"


def answer(key: str, rows: list[dict[str, Any]]) -> str:
    """The question's one-line answer from its rows: yes (ECP ahead wherever a difference is
    called), no (behind wherever one is), mixed, or not shown (none called), and where."""
    mine = [r for r in rows if r["question"] == key]
    if not mine:
        return "not measured at this budget"
    groups = {"ahead on": [], "behind on": [], "no difference called on": [],
              "not called (a rate at its grid's edge) on": [],
              "not called (the model ahead trained longer) on": []}
    for r in mine:
        if r["call"] == "ECP ahead":
            groups["ahead on"].append(r["where"])
        elif r["call"].endswith(" ahead"):
            groups["behind on"].append(r["where"])
        elif "edge" in r["call"]:
            groups["not called (a rate at its grid's edge) on"].append(r["where"])
        elif "trained longer" in r["call"]:
            groups["not called (the model ahead trained longer) on"].append(r["where"])
        else:
            groups["no difference called on"].append(r["where"])
    ahead, behind = groups["ahead on"], groups["behind on"]
    word = ("mixed" if ahead and behind else "yes" if ahead else "no" if behind
            else "not shown")
    return f"{word}: " + "; ".join(f"{label} {', '.join(where_)}"
                                   for label, where_ in groups.items() if where_)


def headline(key: str, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A question's headline measurement: the language curve's last point at equal tokens,
    else recall at its largest depth."""
    mine = [r for r in rows if r["question"] == key]
    language = [r for r in mine if r["stage"] == "language" and "equal time" not in r["where"]]
    if language:
        return language[-1]
    return mine[-1] if mine else None


def context_answer(analysis: dict[str, Any], rows: list[dict[str, str]]) -> str:
    ctx = analysis["context"]
    if not ctx.get("measured"):
        return "not measured at this budget"
    if not any(p["sensitive"] for p in ctx["points"].values()):
        gains = {p: statistics.fmean(v["transformer"].values())
                 for p, v in ctx["points"].items()}
        text = (f"not measurable at this budget: the transformer's own gain "
                f"({', '.join(f'{g:+.4f} at {p} steps' for p, g in gains.items())}) never "
                f"clears {ctx['threshold_bits']} bits/byte in every seed")
        text += extrapolation_text(ctx)
        if not (ctx["extrapolation"] or {}).get("grows"):
            text += " (the Results page extrapolates Evidence III's longer runs instead)"
        return text
    return answer(CONTEXT[0], rows)


def extrapolation_text(ctx: dict[str, Any]) -> str:
    """What ``ctx["extrapolation"]`` says of the budget that would measure the context
    question, in steps and in hours of the transformer's measured step time."""
    ext = ctx["extrapolation"]
    if ext and ext["grows"] and ext["steps"] is not None:
        hours = ext["steps"] * ctx["transformer_step_s"] / 3600
        return (f"; growing as it did (linear in log steps), it would clear it near "
                f"{ext['steps']:,.0f} steps, about {hours:,.1f} hours of this CPU per seed "
                f"for the transformer alone (an extrapolation)")
    if ext and ext["grows"]:
        return f"; growing as it did, it would not clear it within {FAR:.0e} steps"
    if ext:
        return ("; it is not a positive gain growing from point to point, so these points "
                "name no budget that would measure it")
    return ""


def earlier_context(curve: Path) -> dict[str, Any]:
    """Evidence III's curve (``evidence/curve/full``: N = 2,048, one rate per model, the
    validation split both chose and scored) read for the context question: the transformer's
    gain per point and seed, and where it extrapolates to. The longest run of the
    transformer on this machine, so the best estimate of the budget the question needs."""
    from ecp_lm.experiments.long_context.measure import SENSITIVE_BITS

    points: dict[str, dict[str, Any]] = {}
    for path in sorted((curve / "curve" / "transformer").glob("seed*/result.json")):
        run = json.loads(path.read_text())
        for p in run["points"]:
            points.setdefault(str(p["steps"]), {"transformer": {}})["transformer"][
                str(run["seed"])] = p["context_gain_bits"]
    return {"points": points, "threshold_bits": SENSITIVE_BITS,
            "extrapolation": extrapolate(points, SENSITIVE_BITS),
            "transformer_step_s": json.loads((curve / "step_s.json").read_text())[
                "transformer"]}


def earlier_context_line(ctx: dict[str, Any]) -> str:
    """The sentence the report gives ``earlier_context``."""
    gains = ", ".join(f"{statistics.fmean(v['transformer'].values()):+.4f} at {p} steps"
                      for p, v in sorted(ctx["points"].items(), key=lambda kv: int(kv[0])))
    return (f"Evidence III's curve (N = 2,048, {len(ctx['points'])} points, one rate per "
            f"model): the transformer's mean gain {gains}, below {ctx['threshold_bits']} "
            f"bits/byte" + extrapolation_text(ctx) + ".")


def answer_lines(analysis: dict[str, Any]) -> list[str]:
    """The verdict table (what the README shows): each question, its one-line answer, and its
    headline measurement's effect (ECP − other, + where ECP is ahead) with the corrected
    interval, seeds and what it holds equal."""
    rows = verdict_rows(analysis)
    answers = [(key, text, answer(key, rows)) for key, text, _ in QUESTIONS]
    answers.append((*CONTEXT, context_answer(analysis, rows)))
    lines = ["| question | answer | headline: ECP − other [interval] | seeds | held equal |",
             "|---|---|---|---|---|"]
    for key, text, said in answers:
        top = headline(key, rows)
        cells = ("-", "-", "-") if top is None else (
            f"{top['where']}: {top['effect']}", top["seeds"], top["held"])
        lines.append(f"| {text} | {said} | " + " | ".join(cells) + " |")
    return lines


def chance_lines(analysis: dict[str, Any], stages: dict[str, dict[str, Any]]) -> list[str]:
    """A sentence per stage naming the models at chance at their chosen rate's trial."""
    lines = []
    for stage, models in analysis["at_chance"].items():
        if not models:
            continue
        s = stages[stage]
        where_ = (f"recall's trials (L = {s['select_depth']}, {s['select_steps']:,} steps)"
                  if stage == "recall" else
                  f"the language trials ({s['select_steps']:,} steps)")
        lines.append(f"At chance in {where_} at every rate tried, the learners' rates among "
                     f"them: {', '.join(models)}. Their seeds ran at the best of those rates, "
                     "so their comparisons measure a model that may not have started to "
                     "learn the task.")
    return lines


def comparison_lines(analysis: dict[str, Any]) -> list[str]:
    """Every comparison behind the answers: its call, effect, interval, seeds, and in how many
    seeds ECP was ahead."""
    return (["| question | versus | measurement | call | ECP − other [interval] | seeds | "
             "ECP ahead in | held equal | level |", "|---|---|---|---|---|---|---|---|---|"]
            + [f"| {r['question']} | {r['versus']} | {r['where']} | {r['call']} | "
               f"{r['effect']} | {r['seeds']} | {r['ahead_in']} | {r['held']} | "
               f"{r['level']} |" for r in verdict_rows(analysis)])


def report_markdown(analysis: dict[str, Any], stages: dict[str, dict[str, Any]]) -> str:
    budget = next(iter(stages.values()))["budget"] if stages else "-"
    lines = [f"# Evidence IV (budget `{budget}`)", "",
             f"{analysis['family']} paired comparisons, one Holm family at α = "
             f"{analysis['alpha']}. Effect: ECP − other, signed so that + is ECP ahead, with "
             "its Holm-corrected t interval over the seeds (level in the last column).", "",
             *answer_lines(analysis), "", *chance_lines(analysis, stages), "",
             *comparison_lines(analysis)]
    return "\n".join(lines) + "\n"


def rate_cell(model: dict[str, Any] | None) -> str:
    """A model's chosen rate, where it lies among those it tried, and any rescue."""
    if model is None:
        return "-"
    tried = ", ".join(model["trials"])
    where_ = "inside" if model["inside"] else "at the edge"
    rescued = (f"; tried again at {', '.join(f'{lr:g}' for lr in model['rescued_at'])}"
               if model.get("rescued_at") else "")
    return f"{model['lr']:g} ({where_} of {tried}{rescued})"


def model_lines(stages: dict[str, dict[str, Any]]) -> list[str]:
    """Each model's parameters and step time at the language size, and its rates in both
    stages with the trials they were chosen from."""
    language, recall = stages.get("language"), stages.get("recall")
    names = list(dict.fromkeys([*(language or {}).get("models", {}),
                                *(recall or {}).get("models", {})]))
    lines = ["| model | parameters (language) | step s (language) | language rate | recall "
             "rate | parameters (recall) |", "|---|---|---|---|---|---|"]
    for name in names:
        lang = (language or {}).get("models", {}).get(name)
        rec = (recall or {}).get("models", {}).get(name)
        lines.append(f"| {name} | {'-' if lang is None else format(lang['params'], ',')} | "
                     f"{'-' if lang is None else format(lang['step_s'], '.3f')} | "
                     f"{rate_cell(lang)} | {rate_cell(rec)} | "
                     f"{'-' if rec is None else format(rec['params'], ',')} |")
    return lines


def dropout_gaps(evidence3: Path, other: str = "transformer") -> dict[str, Any]:
    """Evidence III's implicit-dropout runs at dropout 0 (``evidence/dropout/full``) analysed as
    this report analyses its own: per epoch, ECP's train−validation gap minus ``other``'s,
    paired by seed, Holm-corrected over the epochs (a family of its own). The claim predicts a
    smaller gap for ECP. Not re-measured: the runs are Evidence III's (one rate for every
    model, validation the slice it reports)."""
    def gaps(arch: str) -> dict[int, dict[int, float]]:
        out: dict[int, dict[int, float]] = {}
        for path in sorted((evidence3 / "runs" / arch / "dropout0").glob("seed*/result.json")):
            run = json.loads(path.read_text())
            for point in run["curve"]:
                out.setdefault(int(point["epoch"]), {})[run["seed"]] = point["gap_bits"]
        return out

    ecp, rival = gaps("ecp"), gaps(other)
    epochs = sorted(set(ecp) & set(rival))
    tests = holm([Paired.from_seeds(f"epoch {e}", ecp[e], rival[e]) for e in epochs])
    return {"other": other, "epochs": epochs, "tests": tests}


def dropout_lines(gaps: dict[str, Any]) -> list[str]:
    """The per-epoch table of ``dropout_gaps``."""
    lines = [f"| epoch | ECP's gap − {gaps['other']}'s [interval], bits/byte | seeds | call |",
             "|---|---|---|---|"]
    for epoch, t in zip(gaps["epochs"], gaps["tests"], strict=True):
        call = ("ECP's larger" if t["called"] and t["mean"] > 0 else
                "ECP's smaller" if t["called"] else "no difference called")
        lines.append(f"| {epoch} | {t['mean']:+.4f} [{t['low']:+.4f}, {t['high']:+.4f}] | "
                     f"{t['n']} | {call} |")
    return lines
