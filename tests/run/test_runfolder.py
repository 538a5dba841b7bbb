"""Run folders after a crash: a run killed before its first checkpoint starts again, metrics.jsonl
is cut back to the checkpoint on resume, and ``--stop-at 0`` writes the initial checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from ecp_lm.cli import main
from ecp_lm.plot import read_metrics
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train, train_or_resume
from helpers import tiny_run_config


def killed_before_first_checkpoint(tmp_path, cfg):
    """What a kill during the first steps leaves: config.yaml and a metrics.jsonl whose last
    line was cut short."""
    run = tmp_path / "run"
    run.mkdir()
    cfg.to_yaml(run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.5}\n'
                                       '{"kind": "train", "st')
    return run


@pytest.mark.parametrize("resume", [False, True], ids=["start-again", "resume"])
def test_a_run_killed_before_its_first_checkpoint_starts_again(tmp_path, resume):
    cfg = tiny_run_config(tmp_path, steps=4)
    run = killed_before_first_checkpoint(tmp_path, cfg)
    result = train(cfg, run, resume=resume, progress=False)
    reference = train(cfg, tmp_path / "reference", progress=False)
    assert result.step == 4 and result.steps_run == 4
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(tensor, result.model.state_dict()[name]), name
    assert (run / "metrics.jsonl").read_text() != ""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]


def test_resume_needs_a_run(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=2)
    with pytest.raises(ValueError, match="holds no run to resume"):
        train(cfg, tmp_path / "nothing", resume=True, progress=False)


def test_resume_cuts_metrics_back_to_the_checkpoint(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=6, checkpoint_every=2, eval_every=3)
    reference = train(cfg, tmp_path / "reference", progress=False)
    run = tmp_path / "run"
    train(cfg, run, progress=False, stop_at=4)
    # A kill after step 5 was logged (and validated at step 3... then 6): records past the
    # checkpoint and a half line remain.
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "loss": 9.0}\n{"kind": "valid", "ste')
    train(cfg, run, resume=True, progress=False)
    text = (run / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]  # no half line anywhere
    for kind in ("train", "valid"):
        steps = [r["step"] for r in records if r["kind"] == kind]
        assert steps == sorted(set(steps)), kind  # each step once
    assert [r["loss"] for r in read_metrics(run)["train"]] == \
        [r["loss"] for r in read_metrics(reference.out_dir)["train"]]
    assert main(["plot", str(run), "--out", str(tmp_path / "curves.png")]) == 0


def test_stop_at_zero_writes_the_initial_checkpoint(tmp_path, capsys):
    cfg = tiny_run_config(tmp_path, steps=3)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    out = tmp_path / "run"
    assert main(["train", "--config", str(path), "--out", str(out), "--quiet",
                 "--stop-at", "0"]) == 0
    assert "trained 0 steps" in capsys.readouterr().out
    ckpt = read_checkpoint(out / "latest")
    assert ckpt.meta["step"] == 0
    torch.manual_seed(cfg.train.seed)
    from ecp_lm import build_model

    initial = build_model(cfg.model)
    for name, tensor in initial.state_dict().items():
        assert torch.equal(tensor, ckpt.load_model().state_dict()[name]), name
    # Resuming from it equals an uninterrupted run.
    resumed = train(cfg, out, resume=True, progress=False)
    reference = train(cfg, tmp_path / "reference", progress=False)
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    # At its end, --stop-at names no step to run: it says no checkpoint was written.
    assert main(["train", "--config", str(path), "--out", str(out), "--quiet", "--resume",
                 "--stop-at", "3"]) == 0
    assert "trained 0 steps" in (text := capsys.readouterr().out) and \
        "no checkpoint written" in text
    code = main(["train", "--config", str(path), "--out", str(out), "--quiet", "--resume",
                 "--stop-at", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--stop-at 1 is before step 3" in err and err.count("\n") == 1


def test_train_or_resume_after_a_kill_before_the_first_checkpoint(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=2)
    run = killed_before_first_checkpoint(tmp_path, cfg)
    (run / "best").mkdir()  # from an attempt killed between best/ and latest/
    (run / "best" / "meta.json").write_text('{"format": "ecp-lm-checkpoint/1", "step": 1}')
    train_or_resume(cfg, run, progress=False)
    assert read_checkpoint(run / "latest").meta["step"] == 2
    assert read_checkpoint(run / "best").meta["kind"] == "best"


@pytest.mark.parametrize("with_checkpoint", [False, True], ids=["none-yet", "kept"])
def test_a_second_ctrl_c_says_what_is_kept(tmp_path, capsys, monkeypatch, with_checkpoint):
    import ecp_lm.training.loop
    from ecp_lm.interrupts import Interrupted

    cfg = tiny_run_config(tmp_path, steps=2)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    out = tmp_path / "run"
    if with_checkpoint:
        train(cfg, out, progress=False, stop_at=1)

    def stopped_at_once(*args, **kwargs):  # a second Ctrl-C: no checkpoint on the way out
        raise Interrupted(2, None)

    monkeypatch.setattr(ecp_lm.training.loop, "train", stopped_at_once)
    argv = ["train", "--config", str(path), "--out", str(out), "--quiet", "--resume"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("checkpoint in" in err and "is kept" in err) == \
        with_checkpoint, err
