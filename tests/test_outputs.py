"""Commands never delete or overwrite what they did not write: every command that writes a folder
or a file refuses one that is not recognisably its own output, in one line, before any work,
and leaves it byte for byte as it was; ``--force`` replaces only what is ours."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import time
from pathlib import Path

import pytest

from ecp_lm.cli import main
from ecp_lm.outputs import MARKER, check_folder
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train
from helpers import tiny_run_config, tree_hashes


def user_folder(path: Path) -> Path:
    (path / "src").mkdir(parents=True)
    (path / "src" / "a.py").write_text("code\n")
    (path / "notes.txt").write_text("my notes\n")
    return path


def refused(capsys, argv, *expected: str, seconds: float | None = None) -> str:
    start = time.monotonic()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    if seconds is not None:  # refused before any work
        assert time.monotonic() - start < seconds, err
    return err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    train(tiny_run_config(tmp, steps=2), tmp / "run", progress=False)
    return tmp / "run"


def test_export_refuses_a_user_folder(tmp_path, run_dir, capsys):
    pytest.importorskip("transformers")
    proj = user_folder(tmp_path / "proj")
    before = tree_hashes(proj)
    refused(capsys, ["export", "--ckpt", run_dir, "--out", proj], str(proj), "src/")
    assert tree_hashes(proj) == before
    # A folder holding the checkpoint itself: refused too, and the run is untouched.
    run_before = tree_hashes(run_dir)
    refused(capsys, ["export", "--ckpt", run_dir / "latest", "--out", run_dir], str(run_dir))
    assert tree_hashes(run_dir) == run_before
    # Its own earlier export is replaced.
    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(run_dir), "--out", str(out)]) == 0
    assert main(["export", "--ckpt", str(run_dir), "--out", str(out)]) == 0
    assert (out / "config.json").is_file()


def test_data_prepare_refuses_a_user_folder_with_its_own_input(tmp_path, capsys):
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "corpus.txt").write_text("the corpus it was asked to tokenize\n" * 50)
    before = tree_hashes(mydata)
    refused(capsys, ["data", "prepare", "text", "--path", mydata / "corpus.txt", "--out",
                     mydata, "--quiet"], str(mydata), "corpus.txt")
    assert tree_hashes(mydata) == before
    refused(capsys, ["data", "prepare", "text", "--path", mydata / "corpus.txt", "--out",
                     mydata, "--quiet", "--force"], "corpus.txt")
    assert tree_hashes(mydata) == before
    # Its own cache is reused, and rebuilt with --force.
    cache = tmp_path / "cache"
    argv = ["data", "prepare", "text", "--path", str(mydata / "corpus.txt"), "--out", str(cache),
            "--quiet"]
    assert main(argv) == 0 and main(argv) == 0 and main([*argv, "--force"]) == 0


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_train_refuses_a_user_folder(tmp_path, capsys, force):
    userdir = tmp_path / "userdir"
    (userdir / "best").mkdir(parents=True)
    (userdir / "best" / "notes.txt").write_text("keep me\n")
    cfg = tiny_run_config(tmp_path, steps=2)
    cfg.to_yaml(userdir / "config.yaml")  # the user's own config, the one given as --config
    before = tree_hashes(userdir)
    argv = ["train", "--config", userdir / "config.yaml", "--out", userdir, "--stop-at", "0",
            "--quiet", *(["--force"] if force else [])]
    refused(capsys, argv, str(userdir), "best/", "config.yaml")
    assert tree_hashes(userdir) == before


def test_force_starts_a_run_over_and_keeps_what_is_not_ours(tmp_path, capsys):
    cfg = tiny_run_config(tmp_path, steps=2)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    out = tmp_path / "run"
    assert main(["train", "--config", str(path), "--out", str(out), "--quiet"]) == 0
    (out / "notes.txt").write_text("a note of the user's\n")
    refused(capsys, ["train", "--config", path, "--out", out, "--quiet"], "--force")
    assert main(["train", "--config", str(path), "--out", str(out), "--quiet",
                 "--stop-at", "1", "--force"]) == 0
    assert read_checkpoint(out / "latest").meta["step"] == 1
    assert (out / "notes.txt").read_text() == "a note of the user's\n"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().split(
        "\n") if line]
    assert max(steps) == 1  # the earlier run's records are gone with it
    refused(capsys, ["train", "--config", path, "--out", out, "--resume", "--force"],
            "--force", "--resume")


def test_demo_refuses_a_user_folder(tmp_path, capsys):
    userdir = user_folder(tmp_path / "userdir")
    before = tree_hashes(userdir)
    refused(capsys, ["demo", "--out", userdir, "--quiet"], str(userdir), "notes.txt", seconds=30)
    assert tree_hashes(userdir) == before
    # So is any other folder that holds what the demo did not write.
    refused(capsys, ["demo", "--out", tmp_path / "userdir" / "src"], "a.py")


@pytest.mark.skipif(importlib.util.find_spec("ecp_lm.studies.__main__") is None,
                    reason="no study command (python -m ecp_lm.studies) in this checkout")
def test_a_study_refuses_a_user_folder(tmp_path, capsys):
    from ecp_lm.studies.__main__ import main as study_main

    userdir = user_folder(tmp_path / "userdir")
    before = tree_hashes(userdir)
    start = time.monotonic()
    assert study_main(["evidence4", "--stage", "language", "--budget", "tiny", "--out",
                       str(userdir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(userdir) in err and "notes.txt" in err, err
    assert time.monotonic() - start < 30
    assert tree_hashes(userdir) == before


@pytest.mark.parametrize("kind", ["study", "long_context", "mqar", "evidence"])
def test_an_earlier_studys_folder_is_named_and_refused(kind, tmp_path, capsys):
    """No command writes these kinds any more; their folders on users' disks are still
    recognised by the marker, named in the refusal and left as they were."""
    folder = tmp_path / kind
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"kind": kind, "written_by": "ecp-lm 0.1"}) + "\n")
    (folder / "results.json").write_text("{}\n")
    before = tree_hashes(folder)
    refused(capsys, ["demo", "--out", folder, "--quiet"], str(folder), f"a {kind} folder",
            seconds=30)
    refused(capsys, ["train", "--config", "tiny", "--out", folder, "--quiet"], str(folder),
            f"a {kind} folder", seconds=30)
    assert tree_hashes(folder) == before


def test_file_outputs_are_checked_before_any_work(tmp_path, run_dir, capsys):
    folder = tmp_path / "results"
    folder.mkdir()
    notes = tmp_path / "notes.png"  # a user's file with a figure's suffix
    notes.write_text("mine\n")
    user_json = tmp_path / "mine.json"
    user_json.write_text('{"my": "data"}\n')
    before = tree_hashes(tmp_path)
    bench = ["bench", "--archs", "ecp", "--seq-lens", "64", "--d-model", "32", "--n-layers",
             "1", "--segment-len", "16", "--repeats", "1"]
    refused(capsys, [*bench, "--json", folder], "--json", "is a folder", seconds=20)
    refused(capsys, [*bench, "--json", f"{folder}/"], "names a folder", seconds=20)
    refused(capsys, [*bench, "--json", user_json], "not written by ecp", seconds=20)
    refused(capsys, [*bench, "--plot", notes], "--plot", "not written by ecp", seconds=20)
    refused(capsys, [*bench, "--json", "/ecp-lm-no-such-folder/b.json"],
            "/ecp-lm-no-such-folder does not exist", seconds=20)
    assert not Path("/ecp-lm-no-such-folder").exists()
    per_position = ["eval", "--ckpt", run_dir, "--split", "valid", "--quiet", "--per-position"]
    refused(capsys, [*per_position, f"{folder}/"], "--per-position", "names a folder")
    refused(capsys, [*per_position, folder], "is a folder")
    refused(capsys, [*per_position, user_json], "not written by ecp")
    refused(capsys, ["plot", run_dir, "--out", notes], "--out", "not written by ecp")
    refused(capsys, ["plot", run_dir, "--out", f"{folder}/"], "names a folder")
    assert tree_hashes(tmp_path) == before
    # Their own inputs: the checkpoint's meta.json, a report to plot, the run's metrics.
    run_before = tree_hashes(run_dir)
    meta = run_dir / "latest" / "meta.json"
    refused(capsys, [*per_position, meta], "not written by ecp")
    refused(capsys, ["plot", run_dir, "--out", run_dir / "metrics.jsonl"], "not written by ecp")
    assert tree_hashes(run_dir) == run_before
    # Their own outputs are replaced.
    report = tmp_path / "report.json"
    for _ in range(2):
        assert main([str(a) for a in [*per_position, report]]) == 0
        assert main(["plot", str(run_dir), "--out", str(tmp_path / "curves.png")]) == 0
    capsys.readouterr()
    assert json.loads(report.read_text())["kind"] == "per_position"
    report_bytes = report.read_bytes()
    refused(capsys, ["plot", "--per-position", report, "--out", report], "not written by ecp")
    assert report.read_bytes() == report_bytes


def test_weights_honour_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        train(tiny_run_config(tmp_path, steps=1), tmp_path / "run", progress=False)
    finally:
        os.umask(old)
    folder = read_checkpoint(tmp_path / "run" / "latest").directory
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes["model.safetensors"] == modes["meta.json"] == 0o664, modes
    if importlib.util.find_spec("transformers") is not None:
        old = os.umask(0o022)
        try:
            assert main(["export", "--ckpt", str(tmp_path / "run"), "--out",
                         str(tmp_path / "hf")]) == 0
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / "hf" / "model.safetensors").stat().st_mode) == 0o644


def test_no_lock_files_are_left_beside_outputs(tmp_path, run_dir):
    pytest.importorskip("transformers")
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text to tokenize\n" * 100)
    assert main(["data", "prepare", "text", "--path", str(corpus), "--out",
                 str(tmp_path / "cache"), "--quiet"]) == 0
    assert main(["export", "--ckpt", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    train(tiny_run_config(tmp_path, steps=2), tmp_path / "run", progress=False)
    for root in (tmp_path, run_dir.parent):
        locks = [p for p in root.rglob("*") if "lock" in p.name]
        assert locks == [], locks


def test_relative_data_paths_are_stored_resolved(tmp_path, monkeypatch, capsys):
    from ecp_lm.run.config import RunConfig
    from helpers import write_corpus

    work = tmp_path / "work"
    work.mkdir()
    write_corpus(work / "corpus.txt")
    monkeypatch.chdir(work)
    cfg = tiny_run_config(tmp_path, steps=2, overrides=["data.path=corpus.txt",
                                                        "data.cache_dir=cache"])
    train(cfg, "run", progress=False)
    saved = RunConfig.load(str(work / "run" / "config.yaml")).data
    assert saved.path == str(work / "corpus.txt") and saved.cache_dir == str(work / "cache")
    monkeypatch.chdir(tmp_path)  # another folder: the run's data is still found
    assert main(["eval", "--ckpt", str(work / "run"), "--split", "valid", "--quiet"]) == 0
    assert "bits_per_byte" in capsys.readouterr().out
    # Resuming from the first folder with the relative paths is the same run.
    monkeypatch.chdir(work)
    cfg.train.steps = 3
    assert train(cfg, "run", resume=True, progress=False).step == 3


def test_a_folder_another_rank_is_claiming_is_ours(tmp_path):
    """The ranks of one torchrun job check --out while rank 0 claims it: its lock and its marker
    in the middle of being written (the temporary sibling before the rename) are ours."""
    run = tmp_path / "run"
    run.mkdir()
    (run / f"{MARKER}.lock").write_text("123 host\n")
    (run / f".{MARKER}.tmp-host-123-abcdef01").write_text('{"kind": "run"}\n')
    assert check_folder(run, "run", "--out") == run
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        check_folder(run, "run", "--out")
