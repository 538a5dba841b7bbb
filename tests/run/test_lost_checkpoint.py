"""A run folder that shows it had a checkpoint it no longer holds (a copy made with ``cp -r
run/* copy/``, whose links name version folders it left behind) is refused, in one line, never
started over at step 0 (which would remove ``best/`` and cut ``metrics.jsonl``); a
``metrics.jsonl`` that is not a run's log is reported, never cleared; ``--force`` checks that
it can remove what it removes before it removes anything."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ecp_lm.cli import main
from ecp_lm.run.checkpoint import read_checkpoint
from helpers import in_namespace, tiny_run_config, tree_hashes


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 4 steps (checkpoints at steps 2 and 4, best/ of step 4) and its config file."""
    root = tmp_path_factory.mktemp("finished")
    cfg = tiny_run_config(root, steps=4, logger="none")
    cfg.to_yaml(root / "run.yaml")
    assert main(["train", "--config", str(root / "run.yaml"), "--out", str(root / "run"),
                 "--quiet"]) == 0
    return root


def refused(capsys, argv, *fragments) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def plain_copy(finished, tmp_path):
    """What ``cp -r runs/mine/* copy/`` makes: the links, not the dot-named versions."""
    copy = tmp_path / "copy"
    copy.mkdir()
    subprocess.run(f"cp -r '{finished / 'run'}'/* '{copy}'/", shell=True, check=True)
    assert (copy / "latest").is_symlink() and not (copy / "latest").exists()
    return copy


@pytest.mark.parametrize("best", ["link", "intact"])
def test_a_copy_without_its_versions_is_refused(finished, tmp_path, capsys, best):
    copy = plain_copy(finished, tmp_path)
    if best == "intact":  # best/ copied whole (cp -rL), latest/ a link to nothing
        (copy / "best").unlink()
        shutil.copytree(finished / "run" / "best", copy / "best")
    before = tree_hashes(copy)
    for argv in (["train", "--resume", "--out", copy, "--quiet"],
                 ["train", "--config", finished / "run.yaml", "--out", copy, "--quiet"]):
        err = refused(capsys, argv, str(copy), "latest is a link to", "cp -a", "--force")
        assert ("best/ holds the checkpoint of step 4" in err) == (best == "intact"), err
        assert tree_hashes(copy) == before
    if best == "intact":
        assert read_checkpoint(copy / "best").meta["step"] == 4


@pytest.mark.parametrize("left", ["best", "metrics"])
def test_a_run_whose_latest_was_removed_is_refused(finished, tmp_path, capsys, left):
    """No link at all: best/ of a step past the first checkpoint, or metrics past it, show
    that latest/ was there."""
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run, symlinks=True)
    shutil.rmtree(run / read_checkpoint(run / "latest").directory.name)
    (run / "latest").unlink()
    if left == "metrics":
        shutil.rmtree(run / read_checkpoint(run / "best").directory.name)
        (run / "best").unlink()
    before = tree_hashes(run)
    sign = "best/ holds the checkpoint of step 4" if left == "best" else \
        "metrics.jsonl records steps up to 4"
    refused(capsys, ["train", "--resume", "--out", run, "--quiet"], sign)
    assert tree_hashes(run) == before
    # --force starts it over, as asked.
    assert main(["train", "--out", str(run), "--config", str(finished / "run.yaml"), "--quiet",
                 "--force", "--stop-at", "1"]) == 0
    assert read_checkpoint(run / "latest").meta["step"] == 1


@pytest.mark.parametrize("content", [
    b"\x8f\x02random bytes\n\xff\xfe and more\n",
    b'{"kind": "train", "step": 1, "loss": 5.5}\nnot a record\n{"kind": "train", "step": 2}\n',
    b'{"kind": "train", "step": 1, "loss": 5.5}\n\x00\x01\x02',
], ids=["random", "a-line-in-between", "a-tail-that-is-no-record"])
def test_metrics_that_are_not_a_run_s_log_are_reported_not_cleared(finished, tmp_path, capsys,
                                                                    content):
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run, symlinks=True)
    (run / "metrics.jsonl").write_bytes(content)
    before = tree_hashes(run)
    for mode in (["--resume"], ["--force"]):
        refused(capsys, ["train", "--config", finished / "run.yaml", "--out", run, "--quiet",
                         *mode], "metrics.jsonl", "nothing was changed")
        assert tree_hashes(run) == before


def test_force_checks_it_can_remove_before_it_removes(finished, tmp_path):
    """A tensorboard/ that cannot be written (a read-only mount: even root cannot) would be
    left half removed: --force is refused first, and the run is as it was."""
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run, symlinks=True)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"events of an earlier run")
    before = tree_hashes(run)
    shutil.copy(finished / "run.yaml", tmp_path / "run.yaml")
    done = in_namespace("mount --bind -o ro run/tensorboard run/tensorboard && "
                        "$ECP train --config run.yaml --out run --force --quiet", tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "tensorboard" in done.stderr and "nothing was changed" in done.stderr, done.stderr
    assert tree_hashes(run) == before
    # A run folder that cannot be written at all: one line, nothing changed.
    done = in_namespace("mount --bind -o ro run run && "
                        "$ECP train --config run.yaml --out run --force --quiet", tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot be written" in done.stderr, done.stderr
    assert tree_hashes(run) == before
