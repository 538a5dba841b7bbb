"""Resumable jobs, one after another or several at a time in worker processes (``--jobs``).

A job is a name and a top-level function with its arguments. Its result is written to
``DIR/<name>/result.json`` when it completes, and a job whose result exists is not run again,
so an interrupted stage resumes where it stopped (each job resumes its own training from its
last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ecp_lm.experiments.study import write_json
from ecp_lm.runtime import torch_threads


@dataclass(frozen=True)
class Job:
    name: str
    fn: Callable[..., dict[str, Any]]
    """A module-level function (worker processes import it by name)."""
    args: tuple = ()


def _follow_parent(parent: int) -> None:
    """In a worker: exit as soon as the process that started it is gone (killed, even by
    SIGKILL), so that no orphan goes on training and writing into a stage that a later
    invocation runs again."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, daemon=True).start()


def _run(job: Job, threads: int | None) -> dict[str, Any]:
    with torch_threads(threads):
        return job.fn(*job.args)


def run_jobs(jobs: list[Job], out: Path, workers: int = 1, threads: int | None = None,
             progress: bool = False,
             check: Callable[[dict[str, dict[str, Any]]], None] | None = None
             ) -> dict[str, dict[str, Any]]:
    """Every job's result by name, in the order given: read back where a result exists, else
    run (``workers`` at a time, each on ``threads`` torch threads) and written as it
    completes. ``check`` sees the results read back before anything runs (and raises to
    refuse them)."""
    results: dict[str, dict[str, Any]] = {}
    for job in jobs:
        path = out / job.name / "result.json"
        if path.exists():
            results[job.name] = json.loads(path.read_text())
    if check is not None:
        check(results)
    todo = [job for job in jobs if job.name not in results]
    start = time.perf_counter()

    def finish(job: Job, result: dict[str, Any]) -> None:
        write_json(out / job.name / "result.json", result)
        results[job.name] = result
        if progress:
            print(f"[{(time.perf_counter() - start) / 60:6.1f} min] finished {job.name}",
                  flush=True)

    if workers <= 1:
        for job in todo:
            finish(job, _run(job, threads))
    elif todo:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_follow_parent,
                                 initargs=(os.getpid(),)) as pool:
            running: dict[Future, Job] = {pool.submit(_run, job, threads): job for job in todo}
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    finish(running.pop(future), future.result())
    return {job.name: results[job.name] for job in jobs}


def check_rates(results: dict[str, dict[str, Any]], rates: dict[str, float], out: Path
                ) -> None:
    """ValueError for a kept result trained at another learning rate than its model's chosen
    one (``rates``, by model): the choice changed since (another grid), and the result would
    be mixed in silently."""
    for name, result in results.items():
        if result["lr"] != rates[result["model"]]:
            raise ValueError(f"{out / name} was trained at lr {result['lr']:g}, but the rate "
                             f"chosen for {result['model']} is now {rates[result['model']]:g}: "
                             f"move it away or use another --out")


def stage_parser(prog: str, doc: str, stages: tuple[str, ...], stage_help: str,
                 budgets: tuple[str, ...], budget_help: str, out: str, out_help: str
                 ) -> argparse.ArgumentParser:
    """A staged experiment's command line: ``--stage`` (one of ``stages`` or all), ``--budget``
    (default small), ``--out`` and the pool's options (``add_pool_options``)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--stage", choices=(*stages, "all"), required=True, help=stage_help)
    parser.add_argument("--budget", choices=budgets, default="small", help=budget_help)
    parser.add_argument("--out", default=out, help=out_help)
    add_pool_options(parser)
    return parser


def add_pool_options(parser: argparse.ArgumentParser) -> None:
    """A stage command's ``--jobs``, ``--threads``, ``--quiet`` and ``--plan``."""
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per run (default: the cores divided by --jobs)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--plan", action="store_true",
                        help="run nothing: time one training step of each model here and "
                             "print the stage's training steps and the hours they take at "
                             "--jobs")


def pool_threads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """The torch threads of each run: ``--threads``, or the cores shared among ``--jobs``
    (None, torch's default, for one job); a ``--jobs`` or ``--threads`` below 1 is a usage
    error."""
    for name in ("jobs", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value} must be positive")
    if args.threads:
        return args.threads
    return max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
