"""Running a study: resumable jobs one after another or several at once (``--jobs``), with a
progress bar; the wall time of every invocation; each model's step time; the plan.

A job is a name and a module-level function with its arguments. Its result is written to
``DIR/<name>/result.json`` when it completes, and a job whose result exists is read back, not
run again, so an interrupted stage resumes where it stopped (each job resumes its own training
from its last checkpoint). A worker exits as soon as the process that started it is gone, even
by SIGKILL, so no orphan goes on writing into a stage that a later invocation runs again; on
Ctrl-C (or a job that fails) the workers are stopped at once, not after the jobs still queued.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ecp_lm import progress as prog
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.runtime import torch_threads


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Job:
    name: str
    fn: Callable[..., dict[str, Any]]
    """A module-level function (worker processes import it by name)."""
    args: tuple = ()


def _follow_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, daemon=True).start()


def _run(job: Job, threads: int | None) -> dict[str, Any]:
    with torch_threads(threads):
        return job.fn(*job.args)


def run_jobs(jobs: list[Job], out: Path, workers: int = 1, threads: int | None = None,
             progress: bool = False, check: Callable[[dict[str, dict]], None] | None = None
             ) -> dict[str, dict[str, Any]]:
    """Every job's result by name, in the order given: read back where a result exists, else
    run (``workers`` at a time, each on ``threads`` torch threads) and written as it completes.
    ``check`` sees the results read back before anything runs (and raises to refuse them)."""
    results = {job.name: read_json(out / job.name / "result.json") for job in jobs
               if (out / job.name / "result.json").exists()}
    if check is not None:
        check(results)
    todo = [job for job in jobs if job.name not in results]
    bar = prog.bar(total=len(todo), enabled=progress and bool(todo), desc=out.name,
                   unit="run")

    def finish(job: Job, result: dict[str, Any]) -> None:
        write_json(out / job.name / "result.json", result)
        results[job.name] = result
        bar.update(1)
        bar.set_postfix_str(job.name)

    try:
        if workers <= 1:
            for job in todo:
                finish(job, _run(job, threads))
        elif todo:
            context = multiprocessing.get_context("spawn")
            pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_follow_parent,
                                       initargs=(os.getpid(),))
            try:
                running: dict[Future, Job] = {pool.submit(_run, job, threads): job
                                              for job in todo}
                while running:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        finish(running.pop(future), future.result())
            except BaseException:
                # A pool left by an exception would wait for every queued job: stop them
                # now (each resumes from its own checkpoint when the stage runs again).
                for process in list((pool._processes or {}).values()):
                    process.kill()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown()
    finally:
        bar.close()
    return {job.name: results[job.name] for job in jobs}


def check_rates(results: dict[str, dict[str, Any]], rates: dict[str, float], out: Path
                ) -> None:
    """ValueError for a kept result trained at another rate than its model's chosen one: the
    choice changed since (another grid), and the result would be mixed in silently."""
    for name, result in results.items():
        if result["lr"] != rates[result["model"]]:
            raise ValueError(f"{out / name} was trained at lr {result['lr']:g}, but the rate "
                             f"chosen for {result['model']} is now {rates[result['model']]:g}: "
                             f"move it away or use another --out")


HEARTBEAT_S = 30.0
"""How often a running invocation rewrites its time: a killed one keeps it to within this."""


@contextmanager
def timed_invocation(out: Path, jobs: int) -> Iterator[None]:
    """Add this invocation's wall time to the stage's ``invocations.json`` (a stage resumed
    across invocations took their sum), rewritten every ``HEARTBEAT_S`` so that an invocation
    killed by SIGKILL still counts, short by at most that much."""
    path = out / "invocations.json"
    kept = read_json(path) if path.exists() else []
    start, stop = time.perf_counter(), threading.Event()

    def record() -> None:
        write_json(path, [*kept, {"seconds": time.perf_counter() - start, "jobs": jobs}])

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            record()

    record()
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        record()


def step_times(models: dict[str, tuple[Any, int]], path: Path | None = None
               ) -> dict[str, float]:
    """Seconds per training step of each ``name: (ModelConfig, batch size)``, timed one model
    after another in this process (``bench.core.step_seconds``: the median of 3 steps after
    1 untimed), so that they compare with each other; kept in ``path`` where given (times
    kept without one of the models asked for are measured again, all of them)."""
    from ecp_lm.bench.core import BenchSpec, step_seconds

    if path is not None and path.exists():
        kept = read_json(path)
        if set(models) <= set(kept):
            return kept
    times = {name: step_seconds(cfg, BenchSpec(batch_size=batch, warmup=1, repeats=3))
             for name, (cfg, batch) in models.items()}
    if path is not None:
        write_json(path, times)
    return times


FORWARD_SHARE = 1 / 3
"""A forward pass's share of a training step's time per token (backward about twice the
forward): what ``plan`` charges each evaluated token."""


def plan(works: list[dict[str, Any]], jobs: int, threads: int | None) -> dict[str, Any]:
    """The hours a stage's training steps and evaluations take here at ``jobs`` runs at once:
    ``works`` holds each model's ``name``, ``cfg``, ``batch``, ``steps`` (trials and seeds
    together) and ``eval_tokens`` (None: not estimated); one step of each is timed now, and an
    evaluated token costs ``FORWARD_SHARE`` of a trained one."""
    with torch_threads(threads):
        times = step_times({w["name"]: (w["cfg"], w["batch"]) for w in works})
    rows = []
    for w in works:
        step_s, tokens = times[w["name"]], w.get("eval_tokens")
        per_token = step_s / (w["batch"] * w["cfg"].seq_len)
        rows.append({"model": w["name"], "steps": w["steps"], "step_s": step_s,
                     "hours": w["steps"] * step_s / 3600,
                     "eval_hours": None if tokens is None else
                     tokens * per_token * FORWARD_SHARE / 3600})
    evaluated = all(r["eval_hours"] is not None for r in rows)
    return {"jobs": jobs, "threads": threads, "rows": rows,
            "hours": sum(r["hours"] for r in rows) / jobs,
            "eval_hours": sum(r["eval_hours"] for r in rows) / jobs if evaluated else None}


def plan_markdown(stage: str, p: dict[str, Any]) -> str:
    evaluation = ("evaluation not estimated: the data are not here" if p["eval_hours"] is None
                  else f"{p['eval_hours']:.2f} of evaluation")
    lines = [f"### {stage}: {p['hours']:.2f} hours of training at --jobs {p['jobs']}, "
             f"{evaluation}", "",
             "| model | steps | s/step | hours | evaluation hours |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['steps']:,} | {r['step_s']:.3f} | {r['hours']:.2f} | "
              + ("–" if r["eval_hours"] is None else f"{r['eval_hours']:.2f}") + " |"
              for r in p["rows"]]
    return "\n".join(lines) + "\n\nAn evaluated token is charged a third of a trained " \
        "one's time. Rate trials past the grid's edges and equal-time runs come on top (each " \
        "about one seed's curve).\n\n"
