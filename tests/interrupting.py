"""Interrupting real subprocesses at chosen instants: waiting until the child's Python runs, the
step a run has logged, signalling a run until it is done (a new process each time, resuming the
folder), and the checks that an interrupted run ended as an uninterrupted one."""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ecp_lm.plot import read_metrics
from ecp_lm.run.checkpoint import read_checkpoint


def wait_until_python_runs(proc) -> None:
    """Until the child's interpreter has installed its SIGINT handler (Linux: the SigCgt mask in
    /proc): a signal before that meets no Python code at all."""
    status = Path(f"/proc/{proc.pid}/status")
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            caught = int(re.search(r"SigCgt:\s*([0-9a-f]+)", status.read_text()).group(1), 16)
        except (OSError, AttributeError):
            time.sleep(0.5)
            return
        if caught >> (signal.SIGINT - 1) & 1:
            return
        time.sleep(0.002)


def logged_step(out) -> int:
    """The last step whose training record is complete in metrics.jsonl (0: none yet)."""
    try:
        lines = (out / "metrics.jsonl").read_text().split("\n")[:-1]
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        with contextlib.suppress(ValueError):
            steps.append(json.loads(line)["step"])
    return max(steps)


def best_within_latest(out) -> None:
    """What a stopped run leaves: ``best/``, if any, holds a step ``latest/`` holds too."""
    if (out / "best").exists():
        latest = read_checkpoint(out / "latest").meta["step"]
        assert read_checkpoint(out / "best").meta["step"] <= latest


def interrupt_until_done(start: Callable[[int], subprocess.Popen], out: Path,
                         instants: list[tuple[int | None, float, int]]) -> list[tuple[int, str]]:
    """For each instant (a step to reach, or None for start-up, a delay after it and the signal
    to send): start the run (``start(attempt)``: a process that trains into ``out``, resuming
    it once it holds a run), signal it then, let it exit, and check that ``best/`` is within
    ``latest/``; finally run it to the end. Returns (exit code, output) of every attempt the
    signal stopped."""
    stopped = []
    for attempt, (step, delay, signum) in enumerate(instants):
        proc = start(attempt)
        wait_until_python_runs(proc)
        deadline = time.monotonic() + 120
        while step is not None and proc.poll() is None and logged_step(out) < step \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signum)
        out_text, err = proc.communicate(timeout=600)
        if proc.returncode != 0:  # 0: it had finished before the signal came
            stopped.append((proc.returncode, err + out_text))
        best_within_latest(out)
    proc = start(len(instants))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return stopped


def random_instants(seed: int, steps: list[int | None]) -> list[tuple[int | None, float]]:
    """During start-up (None: 0.05 to 2 s after the interpreter is up, once its own start-up
    code, which runs before any program, is done) or within the step after a given one."""
    rng = random.Random(seed)
    return [(s, rng.uniform(0.05, 2.0) if s is None else rng.uniform(0.0, 0.2)) for s in steps]


def assert_same_run(reference: Path, out: Path, steps: int) -> None:
    """``out`` ended as ``reference``: the same latest and best checkpoints, bit for bit, and
    every step logged once, in order, with the same losses."""
    ckpt = read_checkpoint(out / "latest")
    assert ckpt.meta["step"] == steps
    model = ckpt.load_model()
    expected = read_checkpoint(reference / "latest").load_model()
    for name, tensor in expected.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    best, expected_best = read_checkpoint(out / "best"), read_checkpoint(reference / "best")
    assert best.meta["step"] == expected_best.meta["step"]
    for name, tensor in expected_best.load_model().state_dict().items():
        assert torch.equal(tensor, best.load_model().state_dict()[name]), name
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is complete JSON
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == list(range(1, steps + 1))  # each step once, in order
    expected = read_metrics(reference)
    for kind in ("train", "valid"):
        got = read_metrics(out)[kind]
        assert [r["step"] for r in got] == [r["step"] for r in expected[kind]]
        assert [r["loss"] for r in got] == [r["loss"] for r in expected[kind]], kind
