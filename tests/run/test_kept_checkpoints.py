"""train.keep_every: a kept checkpoint ``step-NNNNNN/`` every K steps beside ``latest/`` and
``best/``, written the way ``latest/`` is, left alone by later saves and by a resume, completed
after a kill between ``latest/`` and it, and scored by ``ecp eval --ckpt RUN/step-NNNNNN``."""

import json

import pytest
import torch

from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training import loop as loop_module
from ecp_lm.training.loop import train
from helpers import run_cli, tiny_run_config


def kept(run_dir):
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step-"))


def test_kept_every_k_steps_and_a_resume_adds_the_later_ones(tmp_path, capsys):
    cfg = tiny_run_config(tmp_path, steps=7, keep_every=2, checkpoint_every=3, eval_every=3)
    run = tmp_path / "run"
    train(cfg, run, progress=False, stop_at=5)
    assert kept(run) == ["step-000002", "step-000004"]
    assert read_checkpoint(run / "latest").meta["step"] == 5
    before = {name: (run / name / "model.safetensors").read_bytes() for name in kept(run)}
    train(cfg, run, resume=True, progress=False)
    assert kept(run) == ["step-000002", "step-000004", "step-000006"]  # not the last step, 7
    for name in kept(run):
        ckpt = read_checkpoint(run / name)
        assert ckpt.meta["step"] == int(name.removeprefix("step-")) and ckpt.meta["kind"] == "kept"
        ckpt.load_model()
        assert ckpt.tokenizer().decode([104, 105]) == "hi"
    for name, weights in before.items():  # the resume left the earlier ones as they were
        assert (run / name / "model.safetensors").read_bytes() == weights
    assert read_checkpoint(run / "latest").meta["step"] == 7
    assert read_checkpoint(run).meta["step"] in (3, 6, 7)  # the run itself still means best/
    # step 4 holds the weights an uninterrupted run had at step 4
    other = train(cfg, tmp_path / "other", progress=False, stop_at=4).model.state_dict()
    for key, tensor in read_checkpoint(run / "step-000004").load_model().state_dict().items():
        assert torch.equal(tensor, other[key]), key
    code, out, _ = run_cli(capsys, "eval", "--ckpt", run / "step-000004", "--json",
                           "--max-tokens", 300, "--quiet")
    assert code == 0 and json.loads(out)["step"] == 4


def test_off_by_default(tmp_path):
    train(tiny_run_config(tmp_path, steps=4), tmp_path / "run", progress=False)
    assert kept(tmp_path / "run") == []


def test_a_kill_before_the_kept_copy_is_completed_on_resume(tmp_path, monkeypatch):
    cfg = tiny_run_config(tmp_path, steps=4, keep_every=2, checkpoint_every=2)
    run = tmp_path / "run"
    real = loop_module.copy_checkpoint

    def killed(src, out, **meta):
        if out.name == "step-000002":
            raise KeyboardInterrupt  # latest/ holds step 2, its kept copy was not written
        real(src, out, **meta)

    with monkeypatch.context() as patch:
        patch.setattr(loop_module, "copy_checkpoint", killed)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, run, progress=False)
    assert read_checkpoint(run / "latest").meta["step"] == 2 and kept(run) == []
    assert not list(run.glob(".step-000002.*"))  # nothing half-written left
    train(cfg, run, resume=True, progress=False, stop_at=3)
    assert kept(run) == ["step-000002"]
    assert read_checkpoint(run / "step-000002").meta["step"] == 2
    train(cfg, run, resume=True, progress=False)
    assert kept(run) == ["step-000002", "step-000004"]


def test_a_folder_the_run_did_not_write_is_refused_before_training(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=4, keep_every=2)
    run = tmp_path / "run"
    train(cfg, run, progress=False, stop_at=1)
    (run / "step-000004").mkdir()
    (run / "step-000004" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"train.keep_every=2 would write .*step-000004, but "
                       r".*step-000004 holds notes.txt, which ecp did not write"):
        train(cfg, run, resume=True, progress=False)
    assert read_checkpoint(run / "latest").meta["step"] == 1  # nothing was trained
    assert (run / "step-000004" / "notes.txt").read_text() == "mine"


def test_force_removes_the_kept_checkpoints_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    train(tiny_run_config(tmp_path, steps=4, keep_every=2), run, progress=False)
    (run / "step-000009").mkdir()
    (run / "step-000009" / "notes.txt").write_text("mine")  # not a checkpoint: not ours
    train(tiny_run_config(tmp_path, steps=3, keep_every=3), run, progress=False, force=True)
    assert kept(run) == ["step-000003", "step-000009"]
    assert (run / "step-000009" / "notes.txt").read_text() == "mine"
    assert not [p.name for p in run.iterdir() if p.name.startswith((".step-000002",
                                                                    ".step-000004"))]


def test_keep_every_must_not_be_negative():
    from ecp_lm.run.config import RunConfig

    with pytest.raises(ValueError, match=r"train.keep_every=-1 must be >= 0"):
        RunConfig.from_dict({"train": {"keep_every": -1}})
