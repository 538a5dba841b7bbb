"""The runner (``studies.runner``): kept results are read back instead of run and new ones are
written; a kept result trained at another learning rate than its model's chosen one is refused
before anything runs (a changed grid would otherwise mix rates silently); workers exit when the
process that started them is killed; step times are kept only when they cover every model; and
an invocation killed by SIGKILL keeps its wall time."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ecp_lm.bench import core
from ecp_lm.config import ModelConfig
from ecp_lm.studies.runner import Job, check_rates, run_jobs, step_times

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
    more = [Job("c/seed0", fake, ("c", 3e-3)), *jobs]
    with pytest.raises(ValueError, match=r"a/seed0 was trained at lr 0.001, but the rate "
                                         r"chosen for a is now 0.0003"):
        run_jobs(more, tmp_path, check=lambda kept: check_rates(
            kept, {"a": 3e-4, "b": 2e-3, "c": 3e-3}, tmp_path))
    assert RAN == ["a", "b"]  # refused before anything ran
    results = run_jobs(more, tmp_path, check=lambda kept: check_rates(
        kept, {"a": 1e-3, "b": 2e-3, "c": 3e-3}, tmp_path))
    assert RAN == ["a", "b", "c"]
    assert list(results) == ["c/seed0", "a/seed0", "b/seed0"]  # in the order asked


def test_jobs_in_worker_processes_write_the_same_results(tmp_path):
    jobs = [Job(f"m{i}/seed0", fake, (f"m{i}", i * 1e-3)) for i in range(3)]
    pooled = run_jobs(jobs, tmp_path / "pool", workers=2, threads=1)
    assert pooled == run_jobs(jobs, tmp_path / "one")
    assert list(pooled) == [job.name for job in jobs]


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from ecp_lm.studies.runner import Job, run_jobs
from test_runner import sleeper
run_jobs([Job(f"j{{i}}", sleeper, ({out!r}, i)) for i in range(2)], Path({out!r}), workers=2)
"""


def sleeper(out: str, index: int) -> dict:
    Path(out, f"worker{index}.pid").write_text(str(os.getpid()))
    time.sleep(120)
    return {}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waits for its reaper, not for work
        return f.read().split()[2] != "Z"


def test_workers_exit_when_the_parent_is_killed(tmp_path):
    script = CHILD.format(tests=str(Path(__file__).parent), out=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", script])
    pids = [tmp_path / f"worker{i}.pid" for i in range(2)]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
        assert parent.poll() is None
        time.sleep(0.2)
    workers = [int(p.read_text()) for p in pids]
    assert all(alive(pid) for pid in workers)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers)  # no orphan goes on with its job
    assert not list(tmp_path.glob("j*/result.json"))


CTRL_C = """
import signal
import sys
# as a terminal starts a command: SIGINT raises (this process may inherit it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from pathlib import Path
from ecp_lm.studies.runner import Job, run_jobs
from test_runner import sleeper
try:
    run_jobs([Job(f"j{{i}}", sleeper, ({out!r}, i % 2)) for i in range(6)], Path({out!r}),
             workers=2)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_ctrl_c_stops_the_workers_at_once_not_after_the_queued_jobs(tmp_path):
    """SIGINT to the process group, as a terminal sends it, while two workers run and four
    jobs wait: the invocation ends within seconds, its workers with it, and nothing is written
    (each job goes on from its own checkpoint when the stage runs again)."""
    script = CTRL_C.format(tests=str(Path(__file__).parent), out=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        pids = [tmp_path / f"worker{i}.pid" for i in range(2)]
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text() for p in pids) and \
                time.monotonic() < deadline:
            assert parent.poll() is None
            time.sleep(0.2)
        workers = [int(p.read_text()) for p in pids]
        os.killpg(parent.pid, signal.SIGINT)
        assert parent.wait(timeout=90) == 130  # a job sleeps 120 s: not waited for
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in workers)
        assert not list(tmp_path.glob("j*/result.json"))
    finally:  # whatever failed, nothing of it goes on sleeping
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


def test_step_times_are_kept_only_when_they_cover_every_model(tmp_path, monkeypatch):
    measured = []

    def fake_step_seconds(cfg, spec):
        measured.append((cfg.arch, spec.batch_size, spec.warmup, spec.repeats))
        return 0.1 * len(measured)

    monkeypatch.setattr(core, "step_seconds", fake_step_seconds)
    ecp = ModelConfig(arch="ecp", vocab_size=256, d_model=32, n_layers=2, n_heads=2,
                      seq_len=64, num_segments=4)
    models = {"ecp": (ecp, 4), "transformer": (ModelConfig(**{**ecp.to_dict(),
                                                              "arch": "transformer"}), 8)}
    path = tmp_path / "step_s.json"
    path.write_text(json.dumps({"ecp": 9.0}))
    times = step_times(models, path)  # the kept file lacks the transformer: both timed again
    assert measured == [("ecp", 4, 1, 3), ("transformer", 8, 1, 3)]
    assert times == {"ecp": 0.1, "transformer": 0.2} == json.loads(path.read_text())
    assert step_times({"ecp": models["ecp"]}, path) == times and len(measured) == 2
    assert step_times(models, path) == times and len(measured) == 2
    assert step_times({"ecp": models["ecp"]}) == {"ecp": pytest.approx(0.3)}  # no file:
    assert len(measured) == 3 and json.loads(path.read_text()) == times  # timed, not kept


TIMED = """
import sys, time
from pathlib import Path
import ecp_lm.studies.runner as runner
runner.HEARTBEAT_S = 0.1
out = Path(sys.argv[1])
with runner.timed_invocation(out, 2):
    (out / "inside").touch()
    time.sleep(120)
"""


def test_an_invocation_killed_by_sigkill_keeps_its_time(tmp_path):
    """Each of three invocations, killed at a random instant of its stage, leaves its own entry
    with the seconds it ran, short by at most a heartbeat; a finished one before them stays."""
    (tmp_path / "invocations.json").write_text(json.dumps([{"seconds": 7.5, "jobs": 1}]))
    rng = random.Random(0)
    ran = []
    for _ in range(3):
        (tmp_path / "inside").unlink(missing_ok=True)
        child = subprocess.Popen([sys.executable, "-c", TIMED, str(tmp_path)])
        while not (tmp_path / "inside").exists():
            assert child.poll() is None
            time.sleep(0.01)
        start = time.perf_counter()
        time.sleep(rng.uniform(0.5, 1.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        ran.append(time.perf_counter() - start)
    entries = json.loads((tmp_path / "invocations.json").read_text())
    assert entries[0] == {"seconds": 7.5, "jobs": 1} and len(entries) == 4
    for entry, seconds in zip(entries[1:], ran, strict=True):
        assert entry["jobs"] == 2 and seconds - 0.5 <= entry["seconds"] <= seconds + 1.0


def test_a_finished_invocation_adds_its_whole_time(tmp_path):
    from ecp_lm.studies.runner import timed_invocation

    for jobs in (1, 3):
        start = time.perf_counter()
        with timed_invocation(tmp_path, jobs):
            time.sleep(0.2)
        took = time.perf_counter() - start
    entries = json.loads((tmp_path / "invocations.json").read_text())
    assert [e["jobs"] for e in entries] == [1, 3]
    assert all(0.2 <= e["seconds"] <= took + 0.05 for e in entries)
