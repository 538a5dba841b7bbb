"""The command line as people type it: overrides among the options, usage errors against the
subcommand's own usage, ``ecp train --help`` listing a preset's values in a form that can be typed
back, and ``ecp train --resume --out DIR`` without ``--config``."""

from __future__ import annotations

import re

import pytest
import yaml

from ecp_lm.cli import build_parser, main
from ecp_lm.run.config import RunConfig
from ecp_lm.training.loop import train
from helpers import tiny_run_config


def test_overrides_anywhere_among_the_options():
    argv = ["train", "--config", "tiny", "train.steps=30", "--out", "R", "--quiet",
            "model.arch=sliding_window", "--stop-at", "3", "train.steps=31"]
    args = build_parser().parse_args(argv)
    assert args.overrides == ["train.steps=30", "model.arch=sliding_window", "train.steps=31"]
    assert (args.config, args.out, args.quiet, args.stop_at) == ("tiny", "R", True, 3)
    cfg = RunConfig.load(args.config, args.overrides)
    assert cfg.model.arch == "sliding_window"
    assert cfg.train.steps == 31  # the later of two overrides of one key wins
    assert cfg.train.batch_size == 4  # the rest is tiny's


def usage_error(capsys, argv, command):
    """Exit 2; stderr is the usage of ``ecp COMMAND`` (its continuation lines indented), then
    one line ``ecp: error: ...``, which is returned."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.rstrip("\n").split("\n")
    assert captured.out == ""
    assert lines[0].startswith(f"usage: ecp {command} "), captured.err
    assert all(line.startswith(" ") for line in lines[1:-1]), captured.err
    assert lines[-1].startswith("ecp: error: "), captured.err
    return lines[-1]


def test_a_stray_token_is_a_usage_error_of_train(capsys):
    line = usage_error(capsys, ["train", "--config", "tiny", "oops", "--out", "R"], "train")
    assert "'oops'" in line and "section.key=value" in line


@pytest.mark.parametrize("argv, command, fragment", [
    (["train", "--config", "tiny"], "train", "--out"),
    (["train", "--config", "tiny", "--out", "R", "--bogus"], "train", "--bogus"),
    (["train", "--out", "R"], "train", "--config"),
    (["eval", "--ckpt", "x", "--split", "bogus"], "eval", "'bogus'"),
    (["eval", "--split", "test"], "eval", "--ckpt"),
    (["eval", "--ckpt", "x", "--bogus", "3"], "eval", "--bogus 3"),
    (["data", "prepare", "nowhere"], "data prepare", "'nowhere'"),
    (["data", "prepare", "enwiki-mini", "--bogus"], "data prepare", "--bogus"),
    (["generate", "--ckpt", "x"], "generate", "--prompt"),
    (["generate", "--ckpt", "x", "--prompt", "a", "--top-k", "many"], "generate", "--top-k"),
    (["bench", "--precision", "fp8"], "bench", "'fp8'"),
    (["bench", "--bogus"], "bench", "--bogus"),
    (["export", "--ckpt", "x", "--out", "a", "--out", "b"], "export",
     "argument --out: given twice (--out a and --out b)"),
    (["data", "prepare", "text", "--out", "a", "--path", "p", "--out=b"], "data prepare",
     "argument --out: given twice (--out a and --out b)"),
])
def test_usage_errors_name_the_subcommand(capsys, argv, command, fragment):
    assert fragment in usage_error(capsys, argv, command)


def help_text(capsys, monkeypatch, argv, columns=72):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(argv) == 0
    return capsys.readouterr().out


def shown_values(text):
    """The ``section.key=value`` tokens the help lists under "config keys"."""
    return re.findall(r"^  ((?:model|data|train)\.\w+=\S*)", text, flags=re.MULTILINE)


def test_train_help_shows_the_presets_values_as_overrides(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, ["train", "--config", "demo", "--help"])
    shown = shown_values(text)
    # The demo preset: the 0.86M-parameter byte model of the README (d_model 128, 4 layers,
    # N = 256, S = 8), trained for 1,500 steps at lr 2e-3.
    for token in ("model.d_model=128", "model.n_layers=4", "model.seq_len=256",
                  "model.num_segments=8", "train.steps=1500", "train.lr=0.002",
                  "model.latent_len=null", "train.compile=false", "data.source=enwiki-mini"):
        assert token in shown, token
    assert not [t for t in shown if t.endswith(("=None", "=True", "=False"))]
    # typed back as overrides, the listed values are the preset itself
    assert RunConfig.from_dict({}, shown) == RunConfig.load("demo")
    assert len(shown) == len(RunConfig().to_dict()["model"]) + len(
        RunConfig().to_dict()["data"]) + len(RunConfig().to_dict()["train"])


def test_train_help_without_config_shows_the_defaults_wrapped(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, ["train", "--help"], columns=64)
    shown = shown_values(text)
    assert "train.eval_max_tokens=null" in shown and "train.fsdp=false" in shown
    assert RunConfig.from_dict({}, shown) == RunConfig()
    keys = text[text.index("config keys"):text.index("examples:")]
    assert max(len(line) for line in keys.splitlines()) <= 64
    assert "Micro-batches per optimiser step" in " ".join(text.split())


def test_train_help_applies_the_overrides_on_the_line(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, ["train", "--help", "--config", "tiny",
                                           "model.arch=s2", "train.lr=3e-4"])
    shown = shown_values(text)
    assert "model.arch=s2" in shown and "model.seq_len=64" in shown
    assert RunConfig.from_dict({}, shown).train.lr == 3e-4


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    train(tiny_run_config(tmp, steps=2, checkpoint_every=2), tmp / "run", progress=False)
    return tmp / "run"


def test_resume_reads_the_runs_own_config(started, capsys):
    assert main(["train", "--resume", "--out", str(started), "train.steps=3", "--quiet"]) == 0
    assert "trained 1 steps, now at step 3/3" in capsys.readouterr().out  # from step 2 on
    saved = yaml.safe_load((started / "config.yaml").read_text())
    assert saved["train"]["steps"] == 3 and saved["train"]["checkpoint_every"] == 2


def test_resume_without_config_in_a_folder_without_one(tmp_path, capsys):
    assert main(["train", "--resume", "--out", str(tmp_path / "empty"), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ecp: error: ")
    assert str(tmp_path / "empty" / "config.yaml") in lines[0] and "--config" in lines[0]
    assert not (tmp_path / "empty").exists()
