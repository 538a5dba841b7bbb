"""One writer per run folder, and a ``best/`` that belongs to the trajectory being resumed.

A second ``ecp train`` into a folder another one is writing is refused with the holder's pid;
the lock dies with its holder (SIGKILL), so the run can be resumed at once. On resume ``best/``
never holds a step past ``latest/``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

from ecp_lm.cli import main
from ecp_lm.fsutil import current_version, remove_directory
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train
from helpers import tiny_run_config


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path, capsys):
    cfg = tiny_run_config(tmp_path, steps=100_000, eval_every=100_000, checkpoint_every=2)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "ecp_lm", "train", "--config", str(path),
                              "--out", str(out), "--quiet"], stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not _has_checkpoint(out) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
        for extra in ([], ["--resume"]):  # (train.steps=1: nothing left to run if it ran)
            code = main(["train", "--config", str(path), "--out", str(out), "--quiet",
                         "train.steps=1", *extra])
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1, err
            assert f"being written by another ecp train (pid {first.pid})" in err, err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The lock died with its holder: the run resumes, and every step is logged once.
    cfg.train.steps = read_checkpoint(out / "latest").meta["step"] + 2
    cfg.to_yaml(path)
    assert main(["train", "--config", str(path), "--out", str(out), "--quiet", "--resume"]) == 0
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == list(range(1, cfg.train.steps + 1))
    assert not (out / ".ecp-lm.lock").exists()


def _has_checkpoint(run):
    """Whether ``run`` holds a readable ``latest/`` (the first run wrote its first checkpoint)."""
    try:
        read_checkpoint(run / "latest")
    except ValueError:
        return False
    return True


def _replace_best(run, source):
    """Put ``source``'s best checkpoint in ``run/best``, as a real folder (as a kill in an
    earlier release, or a copy, leaves it)."""
    remove_directory(run / "best", lambda p: True)
    shutil.copytree(current_version(source / "best"), run / "best")


def _weights(path):
    return read_checkpoint(path).load_model().state_dict()


def test_a_best_past_latest_is_not_kept(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=8, eval_every=2, checkpoint_every=100, lr=3e-3)
    ahead = train(cfg, tmp_path / "ahead", progress=False, stop_at=6)
    assert read_checkpoint(ahead.out_dir / "best").meta["step"] == 6  # validation improved
    run = tmp_path / "run"
    train(cfg, run, progress=False, stop_at=3)
    _replace_best(run, ahead.out_dir)  # a best from steps the resumed run has not reached
    train(cfg, run, resume=True, progress=False, stop_at=3)
    assert not (run / "best").exists()  # its own best (step 2) was overwritten: none is kept
    train(cfg, run, resume=True, progress=False, stop_at=4)
    best = read_checkpoint(run / "best")
    assert best.meta["step"] == 4 == read_checkpoint(run / "latest").meta["step"]
    trainer = read_checkpoint(run / "latest").trainer_state()
    assert trainer["best_step"] == 4 and trainer["best_val_loss"] == \
        best.meta["validation"]["loss"]


def test_a_kill_between_latest_and_best_is_completed_on_resume(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=8, eval_every=2, checkpoint_every=100, lr=3e-3)
    run, behind = tmp_path / "run", tmp_path / "behind"
    train(cfg, run, progress=False, stop_at=4)
    assert read_checkpoint(run / "best").meta["step"] == 4
    train(cfg, behind, progress=False, stop_at=2)
    _replace_best(run, behind)  # latest/ at the new best, best/ not written yet
    train(cfg, run, resume=True, progress=False, stop_at=5)
    best = read_checkpoint(run / "best")
    assert best.meta["step"] == 4 and best.meta["kind"] == "best"
    reference = train(cfg, tmp_path / "reference", progress=False, stop_at=5)
    for name, tensor in _weights(reference.out_dir / "best").items():
        assert torch.equal(tensor, _weights(run / "best")[name]), name
