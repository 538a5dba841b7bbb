"""Resume is bit-exact on a loaded machine too: ``ecp train`` on two CPU threads, SIGKILLed at
random instants and started again with ``--resume`` each time while another process runs matrix
products on every core in bursts of random length (so that threads are preempted at any
instant), ends with exactly the weights, ``best/`` and metrics of an uninterrupted run of the
same command (run at the same time, so under the same load).

Load changes when each thread runs, not how the work is split: torch's OpenMP loops
(``at::parallel_for``, the native kernel's too) cut a range into one static chunk per thread
and combine the chunks' results in chunk order, whichever thread finishes first. What does
change the rounding is the thread count itself: this run on one thread and on two differ by
about 1e-7 in the weights after 24 steps, which this test catches (tried: the reference on one
thread fails it at the first tensor), so every process here is given the same count.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import interrupting
import test_interrupts as runs  # the SIGINT/SIGKILL tests' run and checks

THREADS = "2"  # OpenMP loops split in two, as on any machine with more than one core
LOAD = """
import os, random, sys, time, torch
torch.set_num_threads(os.cpu_count())
a, rng = torch.randn(256, 256), random.Random(0)
done, last = 0, time.monotonic()
while True:  # bursts on every core and pauses, each 0 to 20 ms: threads preempted at any instant
    burst = time.monotonic() + rng.uniform(0, 0.02)
    while time.monotonic() < burst:
        a = torch.tanh(a @ a)
        done += 1
    time.sleep(rng.uniform(0, 0.02))
    if time.monotonic() - last > 0.5:
        open(sys.argv[1], "w").write(str(done))
        last = time.monotonic()
"""


def start(config_path, out):
    argv = [sys.executable, "-m", "ecp_lm", "train", "--config", str(config_path), "--out",
            str(out), "--quiet"]
    if (out / "config.yaml").exists():  # the folder holds a run, or the start of one
        argv.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS,
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def kill_until_done(config_path, out, instants) -> int:
    """Start the run, SIGKILL it at each instant (``interrupting.random_instants``), then run
    it to the end; how many attempts the kill stopped."""
    killed = 0
    for step, delay in instants:
        proc = start(config_path, out)
        interrupting.wait_until_python_runs(proc)
        deadline = time.monotonic() + 120
        while step is not None and proc.poll() is None and interrupting.logged_step(out) < step \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=600)
        killed += proc.returncode == -signal.SIGKILL
        interrupting.best_within_latest(out)
    proc = start(config_path, out)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return killed


def test_sigkill_under_load_resumes_bit_exactly(tmp_path):
    _, config_path = runs.run_config(tmp_path)
    counter = tmp_path / "load.count"
    load = subprocess.Popen([sys.executable, "-c", LOAD, str(counter)])
    try:
        reference = start(config_path, tmp_path / "reference")  # under the same load
        instants = interrupting.random_instants(4, [None, 7, 15, 22])
        killed = kill_until_done(config_path, tmp_path / "killed", instants)
        _, err = reference.communicate(timeout=300)
        assert reference.returncode == 0, err
        assert load.poll() is None and int(counter.read_text()) > 0  # it loaded the cores
    finally:
        load.kill()
        load.wait()
    assert killed >= 3
    runs.assert_same_run(tmp_path / "reference", tmp_path / "killed")


def test_resuming_on_another_thread_count_is_said(tmp_path, capsys):
    """The one difference that does change the rounding is reported in one line when a run
    resumes (the count it was saved on is in its trainer state), and nothing when it is the
    same."""
    import torch

    from ecp_lm.run.checkpoint import read_checkpoint
    from helpers import run_cli, tiny_run_config

    cfg = tiny_run_config(tmp_path, steps=3, logger="none")
    cfg.to_yaml(tmp_path / "run.yaml")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        code, _, err = run_cli(capsys, "train", "--config", tmp_path / "run.yaml", "--out",
                               tmp_path / "run", "--quiet", "--stop-at", "1")
        assert code == 0 and err == "", err
        assert read_checkpoint(tmp_path / "run" / "latest").trainer_state()["threads"] == 1
        code, _, err = run_cli(capsys, "train", "--resume", "--out", tmp_path / "run",
                               "--quiet", "--stop-at", "2")
        assert code == 0 and err == "", err
        torch.set_num_threads(2)
        code, _, err = run_cli(capsys, "train", "--resume", "--out", tmp_path / "run",
                               "--quiet")
    finally:
        torch.set_num_threads(before)
    assert code == 0 and err.count("\n") == 1, err
    assert err.startswith("ecp: warning: resuming on 2 CPU threads, where the run was saved "
                          "on 1") and "OMP_NUM_THREADS=1" in err
