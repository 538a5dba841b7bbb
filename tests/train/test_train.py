"""Training: every architecture trains and checkpoints, resume is exact, saves are atomic, and
bad runs stop with one-line errors without overwriting anything."""

import json
import math

import pytest
import torch

from ecp_lm.cli import main
from ecp_lm.config import ARCHS
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.plot import read_metrics
from ecp_lm.run import checkpoint as checkpoint_module
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.run.config import TrainConfig
from ecp_lm.training.loop import TrainingDivergedError, lr_at, train
from helpers import tiny_run_config


def losses(run_dir):
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


@pytest.mark.parametrize("arch", ARCHS)
def test_two_steps_write_a_loadable_checkpoint(tmp_path, arch):
    cfg = tiny_run_config(tmp_path, arch, steps=2)
    result = train(cfg, tmp_path / "run", progress=False)
    assert result.step == 2 and math.isfinite(result.best_val_loss)
    ckpt = read_checkpoint(tmp_path / "run" / "latest")
    assert ckpt.config == cfg and ckpt.meta["step"] == 2
    model = ckpt.load_model()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, result.model.state_dict()[name])
    assert ckpt.tokenizer().decode([104, 105]) == "hi"
    assert (tmp_path / "run" / "best" / "model.safetensors").is_file()


@pytest.mark.parametrize("arch", ["ecp", "perceiver_ar", "mamba2", "gated_deltanet", "rwkv7"])
def test_resume_equals_uninterrupted(tmp_path, arch):
    overrides = ["model.dropout=0.1"]  # RNG state must be restored too
    cfg = tiny_run_config(tmp_path, arch, overrides, steps=6, grad_accum=2)
    full = train(cfg, tmp_path / "full", progress=False)
    train(cfg, tmp_path / "split", progress=False, stop_at=3)
    resumed = train(cfg, tmp_path / "split", resume=True, progress=False)
    assert losses(tmp_path / "full") == losses(tmp_path / "split")
    assert len(losses(tmp_path / "full")) == 6
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_run_config(tmp_path, steps=4)
    train(cfg, tmp_path / "run", progress=False, stop_at=2)
    real = checkpoint_module.save_file

    def crash(state, path):
        real(state, path)  # the new weights are half way to disk when the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", resume=True, progress=False)
    ckpt = read_checkpoint(tmp_path / "run" / "latest")
    assert ckpt.meta["step"] == 2
    ckpt.load_model()
    assert not list((tmp_path / "run").glob(".latest.tmp-*"))


def test_nan_loss_stops_without_overwriting(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=4)
    train(cfg, tmp_path / "run", progress=False, stop_at=2)
    before = (tmp_path / "run" / "latest" / "model.safetensors").read_bytes()
    bad = tiny_run_config(tmp_path, steps=4, warmup_steps=0)
    bad.train.lr = math.inf  # the first update turns every weight into nan
    with pytest.raises(TrainingDivergedError, match="loss is nan at step 2; stopped without "
                       "writing, no checkpoint had been written"):
        train(bad, tmp_path / "run2", progress=False)
    assert not (tmp_path / "run2" / "latest").exists()
    with pytest.raises(TrainingDivergedError, match=r"the last good checkpoint \(step 2\) in "):
        train(bad, tmp_path / "run", resume=True, progress=False)
    assert (tmp_path / "run" / "latest" / "model.safetensors").read_bytes() == before


def test_classification_run(tmp_path):
    pytest.importorskip("sklearn")
    cfg = tiny_run_config(tmp_path, steps=3, overrides=[
        "data.source=digits", "data.path=null", "model.seq_len=64", "model.vocab_size=17",
        "model.num_classes=10", "model.arch=perceiver_ar"])
    result = train(cfg, tmp_path / "run", progress=False)
    record = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
              .splitlines() if '"valid"' in x][-1]
    assert 0.0 <= record["accuracy"] <= 1.0 and result.step == 3


def test_lr_schedules():
    cosine = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cosine) == pytest.approx(0.1) and lr_at(9, cosine) == pytest.approx(1.0)
    assert lr_at(99, cosine) == pytest.approx(0.1, abs=1e-3)
    halving = TrainConfig(lr=1.0, warmup_steps=0, schedule="halving", halve_every=5)
    assert [lr_at(s, halving) for s in (0, 4, 5, 12)] == [1.0, 1.0, 0.5, 0.25]
    # wsd: warm-up 2, stable, then 4 linear steps down to 0.2 ending at the last step (9).
    wsd = TrainConfig(lr=1.0, warmup_steps=2, steps=10, schedule="wsd", decay_steps=4,
                      min_lr_ratio=0.2)
    assert [lr_at(s, wsd) for s in range(10)] == pytest.approx(
        [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2])
    longer = TrainConfig(lr=1.0, warmup_steps=2, steps=50, schedule="wsd", decay_steps=4)
    assert [lr_at(s, longer) for s in range(6)] == [lr_at(s, wsd) for s in range(6)]
    assert lr_at(9, TrainConfig(lr=1.0, warmup_steps=0, steps=10, schedule="wsd",
                                min_lr_ratio=0.0)) == 0.0  # default decay: the last fifth
    with pytest.raises(ValueError, match="decay_steps=11 exceeds"):
        TrainConfig(steps=10, schedule="wsd", decay_steps=11)


# Bad input at the command line: one line, exit code 2, nothing overwritten ------------------

def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def write_config(tmp_path, cfg):
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    return path


def test_cli_resume_with_changed_model(tmp_path, capsys):
    path = write_config(tmp_path, tiny_run_config(tmp_path, steps=2))
    assert cli(capsys, "train", "--config", path, "--out", tmp_path / "run", "--quiet")[0] == 0
    before = (tmp_path / "run" / "latest" / "meta.json").read_text()
    code, err = cli(capsys, "train", "--config", path, "--out", tmp_path / "run", "--resume",
                    "--quiet", "model.d_model=64")
    assert code == 2 and "changed model config (d_model)" in err and err.count("\n") == 1
    assert (tmp_path / "run" / "latest" / "meta.json").read_text() == before


def test_cli_refuses_to_overwrite_a_run(tmp_path, capsys):
    path = write_config(tmp_path, tiny_run_config(tmp_path, steps=2))
    cli(capsys, "train", "--config", path, "--out", tmp_path / "run", "--quiet")
    code, err = cli(capsys, "train", "--config", path, "--out", tmp_path / "run", "--quiet")
    assert code == 2 and "already holds a run" in err


def test_cli_vocabulary_mismatch(tmp_path, capsys):
    path = write_config(tmp_path, tiny_run_config(tmp_path, steps=2))
    code, err = cli(capsys, "train", "--config", path, "--out", tmp_path / "run", "--quiet",
                    "model.vocab_size=100")
    assert code == 2 and "set model.vocab_size=256" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_cli_unknown_key_and_wrong_type(tmp_path, capsys):
    path = write_config(tmp_path, tiny_run_config(tmp_path, steps=2))
    for override, message in (("train.stepz=3", "unknown config key train.stepz"),
                              ("train.steps=abc", "config key train.steps expects int")):
        code, err = cli(capsys, "train", "--config", path, "--out", tmp_path / "r", override)
        assert code == 2 and message in err and err.count("\n") == 1


def test_eval_train_tokens_scores_the_train_split_at_each_validation(tmp_path):
    cfg = tiny_run_config(tmp_path, "ecp", steps=4, eval_every=2, eval_train_tokens=300,
                          logger="none")
    train(cfg, tmp_path / "run", progress=False)
    valid = read_metrics(tmp_path / "run")["valid"]
    assert [r["step"] for r in valid] == [2, 4]
    last = valid[-1]
    assert last["train_loss"] > 0 and last["train_bits_per_byte"] > 0
    scored = evaluate_checkpoint(tmp_path / "run" / "latest", "train", max_tokens=300,
                                 progress=False)
    assert last["train_loss"] == pytest.approx(scored["loss"], rel=1e-6)
    assert last["train_bits_per_byte"] == pytest.approx(scored["bits_per_byte"], rel=1e-6)
    assert "train_loss" not in read_metrics_without(tmp_path)


def read_metrics_without(tmp_path):
    """A run without eval_train_tokens logs no train scores."""
    train(tiny_run_config(tmp_path, "ecp", steps=2, eval_every=2, logger="none"),
          tmp_path / "plain", progress=False)
    return read_metrics(tmp_path / "plain")["valid"][-1]
