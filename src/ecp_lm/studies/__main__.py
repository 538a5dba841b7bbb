"""Run, plan or report a study.

    python -m ecp_lm.studies STUDY --stage STAGE|report|all --budget BUDGET --out DIR

Each stage resumes where it stopped (``runner``); ``--plan`` prints the CPU time a budget's
training and evaluation take on this machine before anything runs; ``report`` writes
``DIR/report/BUDGET/{verdicts.json,report.md}`` from what has run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ecp_lm.studies import specs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ecp_lm.studies",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("study", help=f"a live study ({', '.join(specs.NAMES)}: its spec is "
                   "ecp_lm/studies/specs/STUDY.py) or a .py file that defines STUDY")
    p.add_argument("--stage", required=True, help="a stage of the study (evidence4: language, "
                   "recall; evidence5: mechanism, language, replication, pixels), report (the "
                   "verdicts from what has run) or all (every stage, then the report)")
    p.add_argument("--budget", default="small", help="the spec's budget: tiny (every code "
                   "path in minutes), small or full (default small)")
    p.add_argument("--out", default=None, help="the study's folder (default runs/STUDY); "
                   "resumable: a stage goes on where it stopped")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process "
                   "(default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per run (default: the cores divided by --jobs)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plan", action="store_true", help="run nothing: time one training step "
                   "of each model here and print each stage's training hours at --jobs")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        return run(p, args)
    except (ValueError, OSError) as err:
        print(f"{p.prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted; the same command goes on where it stopped",
              file=sys.stderr)
        return 130


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ecp_lm.outputs import output_folder
    from ecp_lm.studies.runner import timed_invocation

    study = specs.load(args.study)
    stages = study.stages(args.budget)
    names = [*stages, "report"] if args.stage == "all" else [args.stage]
    for name in names:
        if name not in (*stages, "report"):
            p.error(f"--stage {name}: study {study.name} has stages "
                    f"{', '.join(stages)}, report and all")
    for option in ("jobs", "threads"):
        value = getattr(args, option)
        if value is not None and value < 1:
            p.error(f"--{option} {value} must be positive")
    threads = args.threads or (max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1
                               else None)
    if args.plan:
        from ecp_lm.studies.runner import plan, plan_markdown

        plans = {name: plan(works(stages[name]), args.jobs, threads)
                 for name in names if name != "report"}
        for name, stage_plan in plans.items():
            print(plan_markdown(name, stage_plan), end="")
        if len(plans) > 1:
            print(plan_total(plans, args.jobs))
        return 0
    root = output_folder(args.out or f"runs/{study.name}", study.name)
    for name in names:
        out = root / name / args.budget
        if name == "report":
            write_report(study, args.budget, root, out)
            continue
        out.mkdir(parents=True, exist_ok=True)
        with timed_invocation(out, args.jobs):
            from ecp_lm.studies.language import run_language
            from ecp_lm.studies.recall import run_recall
            from ecp_lm.studies.spec import Language

            stage = stages[name]
            stage_run = run_language if isinstance(stage.task, Language) else run_recall
            stage_run(stage, out, args.jobs, threads, not args.quiet)
    return 0


def plan_total(plans: dict[str, dict], jobs: int) -> str:
    """One line: every stage's hours together, training and evaluation."""
    train = sum(p["hours"] for p in plans.values())
    unknown = [n for n, p in plans.items() if p["eval_hours"] is None]
    evaluation = sum(p["eval_hours"] or 0 for p in plans.values())
    return (f"### every stage: {train:.2f} hours of training at --jobs {jobs}, "
            f"{evaluation:.2f} of evaluation, {train + evaluation:.2f} in all"
            + (f" (evaluation not estimated for {', '.join(unknown)})" if unknown else "")
            + "\n")


def write_report(study, budget: str, root: Path, out: Path) -> None:
    from ecp_lm.fsutil import write_bytes_atomic
    from ecp_lm.studies import report
    from ecp_lm.studies.runner import write_json

    data = report.load(study, budget, root)
    if not data:
        raise ValueError(f"--stage report reads the study's stages: run them first (nothing "
                         f"under {root} at budget {budget})")
    analysis = report.analyse(study, data, budget=budget)
    write_json(out / "verdicts.json", analysis)
    text = report.report_markdown(study, budget, analysis, data, root)
    write_bytes_atomic(out / "report.md", text.encode())
    print(text, end="")


def works(stage) -> list[dict]:
    """Each model's training steps in ``stage``: its grid's trials on every selection seed
    and its seeds (an annealed curve: the stable run and each point's decay); and the tokens
    its evaluations run through it (``eval_tokens``, None where the data are not here)."""
    from ecp_lm.studies.anneal import decay_steps
    from ecp_lm.studies.spec import Language, model_config

    t = stage.task
    runs = len(stage.grid.rates) * len(stage.select_seeds)
    trials = runs * t.select_steps
    if isinstance(t, Language):
        last = max(t.points)
        per_seed = last - decay_steps(last, t.decay_fraction) + sum(
            decay_steps(p, t.decay_fraction) for p in t.points)
        sizes = eval_sizes(t)
        return [{"name": m, "cfg": model_config(stage, m), "batch": t.train["batch_size"],
                 "steps": trials + len(stage.seeds) * per_seed,
                 "eval_tokens": None if sizes is None else
                 runs * (sizes["select"] + t.select_steps // t.train["eval_every"]
                         * sizes["during"])
                 + len(stage.seeds) * (len(t.points) * sizes["test"]
                                       * (2 if m in t.context_models else 1)
                                       + last // t.train["eval_every"] * sizes["during"])}
                for m in stage.models]
    from ecp_lm.studies.recall import task_specs

    spec, train = task_specs(stage)
    per_eval = train.eval_size * spec.seq_len

    def evals(steps: int) -> int:
        return (steps // train.eval_every + 2) * per_eval  # step 0, each eval_every, the end

    return [{"name": f"{m} L{d}", "cfg": model_config(stage, m, d), "batch": train.batch_size,
             "steps": (trials if d == t.select_depth else 0) + len(stage.seeds) * t.steps,
             "eval_tokens": (runs * evals(t.select_steps) if d == t.select_depth else 0)
             + len(stage.seeds) * evals(t.steps)}
            for m in stage.models for d in stage.depths(m)]


def eval_sizes(task) -> dict[str, int] | None:
    """Tokens one evaluation of a language stage runs through a model: on the test split
    (``test``), on validation for a rate trial (``select``) and during training (``during``,
    at most ``eval_max_tokens``). A text is scored in windows of N moved by N/2 (SPEC §6's
    stride), so each byte goes through twice; an image once, every image of the split each
    time. None where the files are not here."""
    from ecp_lm.data.images import PIXEL_DATASETS, load_pixel_dataset
    from ecp_lm.studies.language import split_bytes

    try:
        if task.source in PIXEL_DATASETS:  # every image of the split, each time
            splits = load_pixel_dataset(task.source, task.path, seed=0).splits
            n = {s: len(splits[s][1]) * task.size["seq_len"] for s in ("valid", "test")}
            return {"test": n["test"], "select": n["valid"], "during": n["valid"]}
        n = {s: 2 * len(split_bytes(task.source, s)) for s in ("valid", "test")}
    except (ValueError, OSError):
        return None
    cap = task.train.get("eval_max_tokens")
    return {"test": n["test"] if task.report_tokens is None else 2 * task.report_tokens,
            "select": n["valid"] if task.select_tokens is None else 2 * task.select_tokens,
            "during": n["valid"] if cap is None else min(n["valid"], 2 * cap)}


if __name__ == "__main__":
    raise SystemExit(main())
