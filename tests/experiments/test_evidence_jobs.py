"""The resumable job pool: kept results are read back instead of run, new ones are written,
and a kept result trained at another learning rate than its model's chosen one is refused
before anything runs (a changed grid would otherwise mix rates silently)."""

from __future__ import annotations

import json

import pytest

from ecp_lm.experiments.evidence.jobs import Job, check_rates, run_jobs

RAN: list[str] = []


def fake(model: str, lr: float) -> dict:
    RAN.append(model)
    return {"model": model, "lr": lr}


def test_kept_results_and_rates(tmp_path):
    RAN.clear()
    jobs = [Job("a/seed0", fake, ("a", 1e-3)), Job("b/seed0", fake, ("b", 2e-3))]
    first = run_jobs(jobs, tmp_path)
    assert RAN == ["a", "b"] and first["b/seed0"] == {"model": "b", "lr": 2e-3}
    assert json.loads((tmp_path / "a/seed0" / "result.json").read_text())["lr"] == 1e-3
    assert run_jobs(jobs, tmp_path) == first and RAN == ["a", "b"]  # read back, not run
    more = [*jobs, Job("c/seed0", fake, ("c", 3e-3))]
    with pytest.raises(ValueError, match=r"a/seed0 was trained at lr 0.001, but the rate "
                                         r"chosen for a is now 0.0003"):
        run_jobs(more, tmp_path, check=lambda kept: check_rates(
            kept, {"a": 3e-4, "b": 2e-3, "c": 3e-3}, tmp_path))
    assert RAN == ["a", "b"]  # refused before anything ran
    run_jobs(more, tmp_path, check=lambda kept: check_rates(
        kept, {"a": 1e-3, "b": 2e-3, "c": 3e-3}, tmp_path))
    assert RAN == ["a", "b", "c"]


CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from ecp_lm.experiments.evidence.jobs import Job, run_jobs
from test_evidence_jobs import sleeper
run_jobs([Job(f"j{{i}}", sleeper, ({out!r}, i)) for i in range(2)], Path({out!r}), workers=2)
"""


def sleeper(out: str, index: int) -> dict:
    import os
    import time
    from pathlib import Path

    Path(out, f"worker{index}.pid").write_text(str(os.getpid()))
    time.sleep(120)
    return {}


def test_workers_exit_when_the_parent_is_killed(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = CHILD.format(tests=str(Path(__file__).parent), out=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", script])
    pids = [tmp_path / f"worker{i}.pid" for i in range(2)]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = [int(p.read_text()) for p in pids]
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # a zombie waits for its reaper, not for work
            return f.read().split()[2] != "Z"

    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers)  # no orphan goes on with its job
