"""Study II's runs in worker processes (``--jobs``): the entries and the recall stage side by
side, each finished entry's result written as it completes."""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from ecp_lm.experiments.long_context.budgets import BUDGETS, entries
from ecp_lm.experiments.long_context.entry import run_entry
from ecp_lm.experiments.study import write_json
from ecp_lm.runtime import torch_threads


def _entry_job(budget_name: str, entry: dict[str, Any], out: str, threads: int
               ) -> dict[str, Any]:

    with torch_threads(threads):
        return run_entry(BUDGETS[budget_name], entry, Path(out), progress=False)


def _recall_job(budget_name: str, out: str, threads: int) -> list[dict[str, Any]]:
    from ecp_lm.experiments import mqar

    with torch_threads(threads):
        return mqar.run_experiment(budget_name, out, progress=False)


def run_parallel(budget: str, out: Path, jobs: int, threads: int, progress: bool
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The entries and the recall stage, ``jobs`` at a time in worker processes of ``threads``
    torch threads each, in order. Each finished entry's result is written as it completes, so
    the study resumes as the sequential one does."""
    todo, done = entries(BUDGETS[budget]), {}
    for entry in todo:
        path = out / entry["name"] / "result.json"
        if path.exists():
            done[entry["name"]] = json.loads(path.read_text())
    recall = None
    start = time.perf_counter()

    def note(text: str) -> None:
        if progress:
            print(f"[{(time.perf_counter() - start) / 60:6.1f} min] {text}", flush=True)

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        running: dict[Future, dict[str, Any] | None] = {}
        if BUDGETS[budget].mqar is not None:
            running[pool.submit(_recall_job, BUDGETS[budget].mqar, str(out / "mqar"),
                                threads)] = None
        for entry in todo:
            if entry["name"] not in done:
                running[pool.submit(_entry_job, budget, entry, str(out), threads)] = entry
        note(f"{len(running)} jobs queued, {jobs} at a time")
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                entry = running.pop(future)
                if entry is None:
                    recall = future.result()
                    note("finished the recall stage")
                    continue
                result = future.result()
                write_json(out / entry["name"] / "result.json", result)
                done[entry["name"]] = result
                note(f"finished {entry['name']}: {result['bits_per_byte']:.4f} bits/byte, "
                     f"{result['wall_s'] / 60:.1f} min")
    return [done[entry["name"]] for entry in todo], recall
