"""A language stage: every model on one curve of annealed budget points, rates chosen on the
validation split, every reported number from the test split.

1. **rates**: short trials under warmup-stable-decay, one per selection seed, each scored on
   the validation split's first ``select_tokens``; the mean over the seeds chooses, the grid
   extended past an edge and a model at chance tried at the learners' rates (``rates``);
2. **seeds**: every model runs the stage's seeds at its rate, one stable run each with an
   annealed branch at every budget point (``anneal``), each scored once on the test split
   (each document's loss kept, for the bootstrap), with the context gain of
   ``context_models``.

Folders (under the stage's): ``select/MODEL/lrR`` (seed 0's trial; seed s's in ``.../seedS``),
``runs/MODEL/seedS``; each holds the job's ``result.json``. Nothing reported here chose
anything: the rates are fixed before the test split is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ecp_lm.run.config import RunConfig
from ecp_lm.studies.rates import rate_key, rescue, rescue_rates, select_all
from ecp_lm.studies.runner import Job, check_rates, run_jobs, step_times
from ecp_lm.studies.spec import Language, Stage, model_config


def run_config(stage: Stage, model: str, seed: int, lr: float) -> RunConfig:
    task: Language = stage.task
    return RunConfig.from_dict({
        "model": model_config(stage, model).to_dict(),
        "data": {"source": task.source, "tokenizer": "bytes", "path": task.path},
        "train": {**task.train, "seed": seed, "lr": lr, "steps": max(task.points)}})


def trial_name(model: str, lr: float, seed: int) -> str:
    return f"select/{model}/lr{rate_key(lr)}" + (f"/seed{seed}" if seed else "")


def select_job(stage: Stage, model: str, lr: float, seed: int, out: str) -> dict[str, Any]:
    """One rate trial: ``select_steps`` under warmup-stable-decay, scored on validation."""
    from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
    from ecp_lm.studies.anneal import wsd_config
    from ecp_lm.training.loop import train_or_resume

    task: Language = stage.task
    cfg = wsd_config(run_config(stage, model, seed, lr), task.select_steps,
                     task.decay_fraction)
    run = Path(out) / trial_name(model, lr, seed) / "run"
    train_or_resume(cfg, run, progress=False)
    report = evaluate_checkpoint(run / "latest", "valid", max_tokens=task.select_tokens,
                                 progress=False)
    return {"model": model, "lr": lr, "seed": seed, "steps": task.select_steps,
            "split": "valid", task.metric: report[task.metric],
            "bytes_scored": report.get("bytes_scored")}


def context_gain(path: Path, split: str, size: dict[str, Any], max_tokens: int | None,
                 full: dict[str, Any]) -> float:
    """What context beyond 2m is worth on the same targets, bits per byte: the score with
    windows of 2m at stride m minus ``full``, the score with windows of N at stride k. The
    windows of 2m start earlier in the stream so that both score exactly the same targets
    (checked: the same count, the same bytes)."""
    from ecp_lm.evaluate.checkpoints import evaluate_checkpoint

    n, short = size["seq_len"], 2 * size["seq_len"] // size["num_segments"]
    first = n - full["stride"] + 1
    cut = evaluate_checkpoint(path, split, seq_len=short, stride=short // 2,
                              max_tokens=max_tokens, progress=False,
                              start=first - (short - short // 2 + 1))
    same = ("tokens_scored", "bytes_scored")
    if any(cut[k] != full[k] for k in same):
        raise RuntimeError(f"context gain: windows of {short} scored "
                           f"{[cut[k] for k in same]} targets/bytes, of {n} "
                           f"{[full[k] for k in same]}")
    return cut["bits_per_byte"] - full["bits_per_byte"]


def report_score(run: Path, stage: Stage, model: str) -> dict[str, Any]:
    from ecp_lm.evaluate.checkpoints import evaluate_checkpoint

    task: Language = stage.task
    report = evaluate_checkpoint(run / "latest", "test", max_tokens=task.report_tokens,
                                 progress=False, documents=True)
    out = {"split": "test", task.metric: report[task.metric], **{
        k: report[k] for k in ("bytes_scored", "tokens_scored", "documents", "correct")
        if k in report}}
    if model in task.context_models:
        out["context_gain_bits"] = context_gain(run / "latest", "test", task.size,
                                                task.report_tokens, report)
    return out


def seed_job(stage: Stage, model: str, seed: int, lr: float, out: str) -> dict[str, Any]:
    """One seed's annealed curve at the chosen rate, every point scored on the test split."""
    from ecp_lm.studies.anneal import annealed_curve

    task: Language = stage.task
    points = annealed_curve(run_config(stage, model, seed, lr), task.points,
                            task.decay_fraction, Path(out) / "runs" / model / f"seed{seed}",
                            lambda run: report_score(run, stage, model))
    return {"model": model, "seed": seed, "lr": lr, "points": points}


def equal_time_steps(stage: Stage, times: dict[str, float]) -> dict[str, int]:
    """Steps of each ``equal_time`` model that take as long as the reference's last point."""
    last, ref = max(stage.task.points), stage.reference
    return {m: max(1, round(last * times[ref] / times[m])) for m in stage.task.equal_time}


def time_job(stage: Stage, model: str, seed: int, lr: float, steps: int, out: str
             ) -> dict[str, Any]:
    """One seed at ``steps`` (an annealed run of its own), scored as the curve's points are,
    with its training seconds (scoring excluded)."""
    import time

    from ecp_lm.studies.anneal import annealed_curve

    task: Language = stage.task
    scoring, start = [], time.perf_counter()

    def measure(run: Path) -> dict[str, Any]:
        begin = time.perf_counter()
        result = report_score(run, stage, model)
        scoring.append(time.perf_counter() - begin)
        return result

    points = annealed_curve(run_config(stage, model, seed, lr), (steps,), task.decay_fraction,
                            Path(out) / "runs" / model / f"time-seed{seed}", measure)
    return {"model": model, "seed": seed, "lr": lr, "equal_time": True, "points": points,
            "train_s": time.perf_counter() - start - sum(scoring)}


def split_bytes(source: str, split: str, limit: int | None = None) -> bytes:
    from ecp_lm.data.sources import open_source

    data = b"".join(open_source(source).chunks(split))
    return data if limit is None else data[:limit]


def chance_level(task: Language) -> float:
    """Language: the bytes' unigram entropy; classification: 1 / classes + 0.02 (a margin)."""
    if task.metric == "bits_per_byte":
        return unigram_bits(task.source)
    return 1 / task.size["num_classes"] + 0.02


def unigram_bits(source: str) -> float:
    """The entropy of the training split's byte distribution, bits per byte: what a model
    that learned only the bytes' frequencies scores, the stage's chance level."""
    import numpy as np

    counts = np.bincount(np.frombuffer(split_bytes(source, "train"), dtype=np.uint8),
                         minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def compressors(source: str, limit: int | None) -> dict[str, float]:
    """Bits per byte of zlib (level 9) and xz (preset 9, extreme) on the test split the models
    are scored on: how much of the corpus a general-purpose compressor captures."""
    import lzma
    import zlib

    data = split_bytes(source, "test", limit)
    return {"zlib -9": 8 * len(zlib.compress(data, 9)) / len(data),
            "xz -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)}


def run_language(stage: Stage, out: Path, jobs: int, threads: int | None,
                 progress: bool) -> None:
    """Every model's step time (``step_s.json``), its rate trials, then its seeds."""
    from ecp_lm.runtime import torch_threads

    task: Language = stage.task
    with torch_threads(threads):
        times = step_times({m: (model_config(stage, m), task.train["batch_size"])
                            for m in stage.models}, out / "step_s.json")
    chance = chance_level(task)

    def trials(asked: dict[str, list[float]]) -> dict[str, dict[float, float]]:
        done = run_jobs([Job(trial_name(m, lr, s), select_job, (stage, m, lr, s, str(out)))
                         for m, rates in asked.items() for lr in rates
                         for s in stage.select_seeds], out, jobs, threads, progress)
        return trial_means(done.values(), task.metric)

    low = task.lower_is_better
    chosen = select_all(stage.grid, list(stage.models), trials, low)
    chosen = rescue(chosen, rescue_rates(chosen, lambda v: (v >= chance) == low), trials,
                    stage.grid, low)
    lrs = {m: c["lr"] for m, c in chosen.items()}
    steps = equal_time_steps(stage, times)
    run_jobs([Job(f"runs/{m}/seed{s}", seed_job, (stage, m, s, lrs[m], str(out)))
              for m in stage.models for s in stage.seeds]
             + [Job(f"runs/{m}/time-seed{s}", time_job, (stage, m, s, lrs[m], k, str(out)))
                for m, k in steps.items() for s in stage.seeds], out, jobs, threads, progress,
             check=lambda kept: check_rates(kept, lrs, out))


def trial_means(results, metric: str) -> dict[str, dict[float, float]]:
    """{model: {lr: the mean of ``metric`` over the trials' seeds}}."""
    found: dict[str, dict[float, list[float]]] = {}
    for r in results:
        found.setdefault(r["model"], {}).setdefault(r["lr"], []).append(r[metric])
    return {m: {lr: sum(v) / len(v) for lr, v in by.items()} for m, by in found.items()}
