"""A full disk is one line, and the last complete checkpoint stays intact and is named: ``ecp
train`` on a small tmpfs that fills up while it writes a checkpoint, ``ecp export`` on one that
has no room for a second export (both in a namespace of their own: ``helpers.in_namespace``),
and the same failure simulated where torch writes, where no tmpfs can be mounted."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from ecp_lm.cli import main
from ecp_lm.run.checkpoint import read_checkpoint
from helpers import in_namespace, tiny_run_config, tree_hashes


def kilobytes(folder) -> int:
    return int(subprocess.run(["du", "-sk", str(folder)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


@pytest.fixture
def run_at_step_2(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=4, logger="none")
    cfg.to_yaml(tmp_path / "run.yaml")
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--out",
                 str(tmp_path / "run"), "--quiet", "--stop-at", "2"]) == 0
    return tmp_path / "run"


def test_a_full_disk_during_training(run_at_step_2, tmp_path, capsys):
    latest = tree_hashes(read_checkpoint(run_at_step_2 / "latest").directory)
    # Room for the run and some metrics, not for a second checkpoint (about 540 kB).
    size = kilobytes(run_at_step_2) + 200
    done = in_namespace(f"mkdir disk && mount -t tmpfs -o size={size}k none disk && "
                        f"cp -a run disk/run && $ECP train --resume --out disk/run --quiet; "
                        f"code=$?; cp -a disk/run after; exit $code", tmp_path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and "No space left on device" in done.stderr
    assert "step 2" in done.stderr and "latest" in done.stderr and "--resume" in done.stderr
    after = tmp_path / "after"
    assert tree_hashes(read_checkpoint(after / "latest").directory) == latest
    assert not [p for p in os.listdir(after) if ".tmp-" in p]  # the failed version is gone
    # Once there is room, the run resumes from it.
    assert main(["train", "--resume", "--out", str(after), "--quiet"]) == 0
    assert read_checkpoint(after / "latest").meta["step"] == 4


def test_a_full_disk_where_torch_writes(run_at_step_2, monkeypatch, capsys):
    """The same as torch.save reports it (its RuntimeError, the system's error its context)."""
    latest = tree_hashes(read_checkpoint(run_at_step_2 / "latest").directory)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "optimizer" in obj:  # the trainer state of a checkpoint
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "
                                   "pos 704 vs 598") from None
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    code = main(["train", "--resume", "--out", str(run_at_step_2), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err, err
    assert "step 2" in err and str(run_at_step_2 / "latest") in err, err
    assert tree_hashes(read_checkpoint(run_at_step_2 / "latest").directory) == latest


def test_a_full_disk_during_export(run_at_step_2, tmp_path):
    pytest.importorskip("transformers")
    # Room for one export (about 180 kB), not for a second one beside it.
    done = in_namespace("mkdir disk && mount -t tmpfs -o size=280k none disk && "
                        "$ECP export --ckpt run --out disk/hf > /dev/null && "
                        "cp -rL disk/hf before && ls -a disk > /dev/null && "
                        "$ECP export --ckpt run --out disk/hf; "
                        "code=$?; cp -rL disk/hf after; ls -a disk > listing; exit $code",
                        tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and "No space left on device" in done.stderr
    assert "disk/hf" in done.stderr, done.stderr
    assert tree_hashes(tmp_path / "after") == tree_hashes(tmp_path / "before")
    assert ".tmp-" not in (tmp_path / "listing").read_text()


def test_a_full_disk_while_preparing_a_token_cache(tmp_path):
    """``ecp data prepare`` on a tmpfs too small for its tokens: one line naming the cache, and
    nothing left of the half-built version."""
    from helpers import write_corpus

    write_corpus(tmp_path / "corpus.txt", n_lines=20_000)  # about 1 MB of text, 8 MB of ids
    done = in_namespace("mkdir disk && mount -t tmpfs -o size=1024k none disk && $ECP data "
                        "prepare text --path corpus.txt --out disk/cache --quiet; code=$?; "
                        "ls -a disk > left.txt; exit $code", tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "cannot write disk/cache: No space left on device" in done.stderr, done.stderr
    assert (tmp_path / "left.txt").read_text().split() == [".", ".."]
