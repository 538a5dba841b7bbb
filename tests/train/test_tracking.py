"""Experiment tracking: TensorBoard event files by default, a Weights & Biases run (offline here)
that a resume continues, train.logger's values and errors, and each log_every record as a plain
line in a redirected log."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ecp_lm.run import checkpoint as checkpoint_module
from ecp_lm.run.config import RunConfig
from ecp_lm.training.loop import train
from helpers import in_namespace, run_cli, tiny_run_config, tree_hashes


def records(run_dir: Path, kind: str) -> dict[int, dict]:
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in lines if r["kind"] == kind}


def board_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every event of ``tag`` TensorBoard shows for the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_by_default_holds_the_logged_losses(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=4)
    assert cfg.train.logger == "auto"
    train(cfg, tmp_path / "run", progress=False)
    logged = records(tmp_path / "run", "train")
    assert sorted(logged) == [1, 2, 3, 4]
    shown = board_scalars(tmp_path / "run", "train/loss")
    assert [step for step, _ in shown] == [1, 2, 3, 4]
    for step, value in shown:
        assert value == pytest.approx(logged[step]["loss"], rel=1e-6)
    valid = records(tmp_path / "run", "valid")
    assert [s for s, _ in board_scalars(tmp_path / "run", "valid/loss")] == sorted(valid) == [2, 4]
    assert [s for s, _ in board_scalars(tmp_path / "run", "train/lr")] == [1, 2, 3, 4]


def test_a_resume_shows_each_step_once_in_tensorboard(tmp_path, monkeypatch):
    """The steps a killed attempt logged past its checkpoint are purged when they run again."""
    cfg = tiny_run_config(tmp_path, steps=4)
    run = tmp_path / "run"
    train(cfg, run, progress=False, stop_at=2)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # steps 3 and 4 are logged; latest/ stays at step 2

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module, "save_file", killed)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, run, resume=True, progress=False)
    assert [s for s, _ in board_scalars(run, "train/loss")] == [1, 2, 3, 4]
    train(cfg, run, resume=True, progress=False)
    logged = records(run, "train")
    shown = board_scalars(run, "train/loss")
    assert [step for step, _ in shown] == [1, 2, 3, 4]
    assert [v for _, v in shown] == pytest.approx([logged[s]["loss"] for s in (1, 2, 3, 4)])
    assert [s for s, _ in board_scalars(run, "valid/loss")] == [2, 4]


@pytest.mark.parametrize("mode", ["resume", "force"])
def test_an_unwritable_tensorboard_folder_is_one_line_before_training(tmp_path, mode):
    """A read-only tensorboard/ (not even root can write it) is found before any work, not by
    TensorBoard's writer thread once training runs, and with --force before the run is
    removed: the run stays as it was."""
    pytest.importorskip("tensorboard")
    cfg = tiny_run_config(tmp_path, steps=4, logger="tensorboard")
    cfg.to_yaml(tmp_path / "run.yaml")
    train(cfg, tmp_path / "run", progress=False, stop_at=2)
    before = tree_hashes(tmp_path / "run")
    option = "--resume" if mode == "resume" else "--force"
    done = in_namespace("mount --bind -o ro run/tensorboard run/tensorboard && "
                        f"$ECP train --config run.yaml --out run {option} --quiet", tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr
    assert "train.logger=tensorboard" in done.stderr and "run/tensorboard" in done.stderr
    assert tree_hashes(tmp_path / "run") == before


def test_logger_none_writes_no_tensorboard(tmp_path):
    train(tiny_run_config(tmp_path, steps=2, logger="none"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert sorted(records(tmp_path / "run", "train")) == [1, 2]


@pytest.mark.parametrize("value", ["wandb,wandb", "mlflow", "none,wandb", "", "tensorboard,"])
def test_an_unknown_logger_is_a_one_line_error(value):
    with pytest.raises(ValueError, match=r"train.logger=.* is not auto, none, or one or more of "
                       r"tensorboard, wandb joined by commas"):
        RunConfig.from_dict({"train": {"logger": value}})


def test_tracking_keys_are_listed_in_the_help(capsys):
    code, out, _ = run_cli(capsys, "train", "--help")
    assert code == 0
    text = " ".join(out.split())
    for key in ("train.logger=auto", "train.wandb_project=null", "train.wandb_name=null",
                "train.keep_every=0"):
        assert key in text, key
    assert "tensorboard when it is installed" in text


def test_wandb_requested_but_not_installed(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, find_spec finds none
    cfg = tiny_run_config(tmp_path)
    cfg.to_yaml(tmp_path / "run.yaml")
    code, out, err = run_cli(capsys, "train", "--config", tmp_path / "run.yaml", "--out",
                             tmp_path / "r", "--quiet", "train.logger=tensorboard,wandb")
    assert code == 2 and out == ""
    assert err == ("ecp: error: train.logger=tensorboard,wandb needs the wandb package, which "
                   "is not installed: pip install wandb (or choose another train.logger, e.g. "
                   "none)\n")
    assert not (tmp_path / "r").exists()  # refused before anything was written


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in its offline mode, every file it writes under ``tmp_path``."""
    pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                        "WANDB_DIR": tmp_path / "wandb-dir",
                        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                        "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
                        "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def wandb_records(path: Path):
    """The records of an offline run's ``run-ID.wandb`` file (W&B's log format: a 7-byte
    header, then blocks of 32 KiB holding records of 4-byte CRC, 2-byte length, 1-byte type:
    full, or first, middle and last parts)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def run_folders(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline folders of one W&B run, found by the ``run-ID.wandb`` file each holds: a
    folder's own name gains a ``-1`` suffix when two parts start within the same second."""
    return sorted(path.parent for path in wandb_dir.glob(f"offline-run-*/run-{run_id}.wandb"))


def offline_run(folder: Path) -> dict:
    """What one offline W&B run folder holds: its run record and its history rows."""
    (path,) = folder.glob("run-*.wandb")
    run, history = None, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return {"id": run.run_id, "project": run.project, "name": run.display_name,
            "config": config, "history": history}


@pytest.mark.parametrize("same_second", [False, True])
def test_wandb_logs_the_records_and_a_resume_continues_its_run(tmp_path, wandb_offline,
                                                               monkeypatch, same_second):
    if same_second:  # both parts stamped with one second: W&B suffixes the second's folder
        from datetime import datetime

        from wandb.sdk import wandb_settings

        class OneSecond(datetime):
            @classmethod
            def fromtimestamp(cls, *args, **kwargs):
                return datetime(2026, 1, 1, 12, 0, 0)

        monkeypatch.setattr(wandb_settings, "datetime", OneSecond)
    cfg = tiny_run_config(tmp_path, steps=4, logger="wandb", wandb_project="ecp-tests",
                          wandb_name="tiny-ecp")
    run = tmp_path / "run"
    train(cfg, run, progress=False, stop_at=2)
    run_id = (run / "wandb-run-id").read_text().strip()
    train(cfg, run, resume=True, progress=False)
    assert (run / "wandb-run-id").read_text().strip() == run_id
    assert not (run / "tensorboard").exists()  # only the logger named
    parts = [offline_run(f) for f in run_folders(run / "wandb", run_id)]
    assert len(parts) == 2  # the start and the resume, one W&B run
    logged_train, logged_valid = records(run, "train"), records(run, "valid")
    rows = [row for part in parts for row in part["history"]]
    for part in parts:
        assert (part["id"], part["project"], part["name"]) == (run_id, "ecp-tests", "tiny-ecp")
        assert part["config"]["train"] == cfg.to_dict()["train"]
        assert part["config"]["model"]["arch"] == "ecp"
    train_rows = {row["step"]: row for row in rows if "train/loss" in row}
    assert sorted(train_rows) == [1, 2, 3, 4]
    for step, row in train_rows.items():
        for key in ("loss", "lr", "tokens", "tokens_per_s"):
            assert row[f"train/{key}"] == pytest.approx(logged_train[step][key]), (step, key)
    valid_rows = {row["step"]: row for row in rows if "valid/loss" in row}
    assert sorted(valid_rows) == [2, 4]
    for step, row in valid_rows.items():
        assert row["valid/bits_per_byte"] == pytest.approx(logged_valid[step]["bits_per_byte"])


def test_a_new_start_gets_a_new_wandb_run(tmp_path, wandb_offline):
    cfg = tiny_run_config(tmp_path, steps=2, logger="wandb")
    train(cfg, tmp_path / "run", progress=False)
    first = (tmp_path / "run" / "wandb-run-id").read_text().strip()
    train(cfg, tmp_path / "run", progress=False, force=True)
    second = (tmp_path / "run" / "wandb-run-id").read_text().strip()
    assert first != second
    names = {offline_run(f)["name"] for f in (tmp_path / "run" / "wandb").glob("offline-run-*")}
    assert names == {"run"}  # the run folder's name
    assert len(run_folders(tmp_path / "run" / "wandb", first)) == 1


def train_redirected(tmp_path, *options) -> tuple[str, Path]:
    """``ecp train ... > log.txt 2>&1`` in a subprocess: (the log, the run folder)."""
    config = tmp_path / "run.yaml"
    tiny_run_config(tmp_path, steps=4, eval_every=4).to_yaml(config)
    out, log = tmp_path / "run", tmp_path / "log.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log, "wb") as f:
        subprocess.run([sys.executable, "-m", "ecp_lm", "train", "--config", str(config),
                        "--out", str(out), *options], stdout=f, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, env=env, check=True, timeout=300)
    return log.read_text(), out


def test_a_redirected_log_has_a_line_per_log_record(tmp_path):
    text, out = train_redirected(tmp_path)
    assert "\r" not in text  # no progress bar
    lines = [line for line in text.splitlines() if "  lr " in line]
    logged = records(out, "train")
    assert len(lines) == len(logged) == 4
    for line, step in zip(lines, sorted(logged), strict=True):
        record = logged[step]
        assert line.startswith(f"step {step}/4  train loss {record['loss']:.4f}  "
                               f"lr {record['lr']:.3g}  "), line
        assert f"  {record['tokens']:,} tokens  elapsed 0:" in line, line
        assert f"  {record['tokens_per_s']:,.0f} tokens/s  " in line, line
    assert "step 4/4  train loss" in text and "valid loss" in text  # the validation line too
    assert text.rstrip().endswith("checkpoint in " + str(out) + "/latest")


def test_quiet_prints_no_log_lines(tmp_path):
    text, out = train_redirected(tmp_path, "--quiet")
    assert "train loss" not in text and "valid loss" not in text
    assert len(records(out, "train")) == 4
    assert text.startswith("trained 4 steps")


def test_a_terminal_keeps_the_bar_without_log_lines(tmp_path, capsys, monkeypatch):
    from ecp_lm import progress

    monkeypatch.setattr(progress, "interactive", lambda: True)
    train(tiny_run_config(tmp_path, steps=4, eval_every=4, logger="none"), tmp_path / "run")
    err = capsys.readouterr().err
    assert "  lr " not in err  # no record lines
    assert "step 4/4  train loss" in err and "valid loss" in err  # the validation line
    assert "| 4/4 [" in err and "step/s" in err  # the bar


def test_a_failing_wandb_init_is_a_one_line_error(tmp_path, capsys, wandb_offline, monkeypatch):
    import wandb

    def refused(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refused)
    tiny_run_config(tmp_path).to_yaml(tmp_path / "run.yaml")
    code, _, err = run_cli(capsys, "train", "--config", tmp_path / "run.yaml", "--out",
                           tmp_path / "r", "--quiet", "train.logger=wandb")
    assert code == 2
    assert err == ("ecp: error: train.logger=wandb: wandb.init failed: No API key configured. "
                   "Use `wandb login` to log in. (without an account, WANDB_MODE=offline keeps "
                   "the run for wandb sync)\n")
    assert not (tmp_path / "r" / "latest").exists()
