"""Every command that writes a folder refuses one that holds another kind of ecp output (a
checkpoint, a run folder, a token cache, an export, a folder of bench results) or that lies
inside a run folder, in one line naming what it would replace, and changes nothing: each
writer is pointed at each other kind's folder, through the real ``ecp`` entry point, and every
file of every output is hashed before and after."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ecp_lm.cli import main
from helpers import tiny_run_config, tree_hashes

BENCH = ["bench", "--archs", "ecp", "--seq-lens", "64", "--d-model", "32", "--n-layers", "1",
         "--segment-len", "16", "--repeats", "1"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """One output of each kind, side by side: a run folder (its latest/ and best/ checkpoints),
    a checkpoint copied out of it (a real folder), a token cache, an export, bench results."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("outputs")
    cfg = tiny_run_config(root, steps=2, logger="none")
    cfg.to_yaml(root / "run.yaml")
    assert main(["train", "--config", str(root / "run.yaml"), "--out", str(root / "run"),
                 "--quiet"]) == 0
    shutil.copytree(root / "run" / "latest", root / "ckpt")  # cp -rL: a real folder
    assert main(["data", "prepare", "text", "--path", str(root / "corpus.txt"), "--out",
                 str(root / "cache"), "--quiet"]) == 0
    assert main(["export", "--ckpt", str(root / "run"), "--out", str(root / "hf")]) == 0
    assert main([*BENCH, "--json", str(root / "bench" / "bench.json"), "--plot",
                 str(root / "bench" / "bench.png")]) == 0
    return root


# target: (path below the outputs, what a refusal says it is)
TARGETS = {
    "run/latest": "checkpoint (step 2)",
    "run/best": "checkpoint (step 2)",
    "ckpt": "checkpoint (step 2)",
    "run": "run folder",
    "cache": "token cache",
    "hf": "Hugging Face export",
    "bench": "bench.json",
    "run/new": "inside the run folder",
}


def refused_everywhere(capsys, root: Path, command, own: tuple[str, ...]) -> None:
    """``command(target)`` (an argv) is refused for every target but the command's ``own``
    kind, in one line naming the target and what it is, and no output changes."""
    before = tree_hashes(root)
    for target, what in TARGETS.items():
        if target in own:
            continue
        path = root / target
        code = main([str(a) for a in command(path)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (target, err)
        assert str(path) in err and what in err, (target, err)
        assert tree_hashes(root) == before, target
    assert not (root / "run" / "new").exists()


def test_export_replaces_only_an_export(outputs, capsys):
    refused_everywhere(capsys, outputs,
                       lambda out: ["export", "--ckpt", outputs / "run", "--out", out], ("hf",))


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_data_prepare_replaces_only_a_token_cache(outputs, capsys, force):
    refused_everywhere(capsys, outputs, lambda out: [
        "data", "prepare", "text", "--path", outputs / "corpus.txt", "--out", out, "--quiet",
        *(["--force"] if force else [])], ("cache",))


@pytest.mark.parametrize("mode", [[], ["--force"], ["--resume"]], ids=["plain", "force",
                                                                        "resume"])
def test_train_writes_only_a_run_folder(outputs, capsys, mode):
    refused_everywhere(capsys, outputs, lambda out: [
        "train", "--config", outputs / "run.yaml", "--out", out, "--quiet", *mode], ("run",))


def test_bench_writes_no_file_into_a_folder_replaced_whole(outputs, capsys):
    """A new file in a checkpoint, a cache or an export would go with its next version (or
    be taken for part of it); beside a run's folders it is fine."""
    before = tree_hashes(outputs)
    for target in ("run/latest", "ckpt", "cache", "hf"):
        for option, name in (("--json", "bench.json"), ("--plot", "bench.png")):
            path = outputs / target / name
            code = main([*BENCH, option, str(path)])
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1, (target, err)
            assert str(path) in err and "lies inside" in err and TARGETS[target] in err, err
            assert tree_hashes(outputs) == before, target
    for target in TARGETS:  # a folder itself is no file to write
        if target != "run/new":
            assert main([*BENCH, "--json", str(outputs / target)]) == 2
    capsys.readouterr()
    assert tree_hashes(outputs) == before


def test_a_copied_checkpoint_is_recognised_inside_too(outputs, capsys):
    """Nothing is written inside a checkpoint, be it a run's or a copy of one."""
    before = tree_hashes(outputs)
    for argv in (["export", "--ckpt", outputs / "run", "--out", outputs / "ckpt" / "hf"],
                 ["data", "prepare", "text", "--path", outputs / "corpus.txt", "--out",
                  outputs / "hf" / "cache", "--quiet"],
                 ["train", "--config", outputs / "run.yaml", "--out", outputs / "cache" / "run",
                  "--quiet"]):
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "lies inside" in err, err
    assert tree_hashes(outputs) == before


def test_a_run_whose_best_an_export_replaced_is_refused_before_training(outputs, tmp_path,
                                                                         capsys):
    """What ``ecp export --out run/best`` of an earlier release left (best a link to a version
    holding an export) is named, and no checkpoint replaces it."""
    from ecp_lm.fsutil import atomic_directory

    run = tmp_path / "run"
    shutil.copytree(outputs / "run", run, symlinks=True)
    with atomic_directory(run / "best") as tmp:
        shutil.copytree(outputs / "hf", tmp, dirs_exist_ok=True)
    before = tree_hashes(run)
    code = main(["train", "--resume", "--out", str(run), "--quiet", "train.steps=4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert str(run / "best") in err and "Hugging Face export" in err, err
    assert tree_hashes(run) == before


def test_export_makes_no_folder_directly_under_the_root(outputs, capsys):
    import uuid

    top = Path("/") / f"ecp-lm-test-{uuid.uuid4().hex[:12]}"
    try:
        code = main(["export", "--ckpt", str(outputs / "run"), "--out", str(top / "hf")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "top of the file system" in err, err
        assert not top.exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)
