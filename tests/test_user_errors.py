"""Bad input at the command line: one line on stderr, exit code 2, nothing written first."""

from __future__ import annotations

import shutil

import pytest
import yaml

from ecp_lm.cli import main
from ecp_lm.train import train
from helpers import tiny_run_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    cfg = tiny_run_config(tmp, steps=2)
    train(cfg, tmp / "run", progress=False)
    cfg.to_yaml(tmp / "run.yaml")
    return tmp


def one_line_error(capsys, argv, *fragments):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("ecp: error:"), captured.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return captured


@pytest.mark.parametrize("device, fragment", [
    ("gpu", "unknown device 'gpu'"), ("cuda:x", "unknown device 'cuda:x'"),
    ("cuda", "no CUDA device is available"), ("cuda:7", "cuda:7")])
def test_devices(run, capsys, device, fragment):
    import torch

    if torch.cuda.is_available() and fragment != device and "unknown" not in fragment:
        pytest.skip("CUDA is present here")
    ckpt = run / "run" / "best"
    one_line_error(capsys, ["eval", "--ckpt", ckpt, "--device", device, "--quiet"], fragment)
    out = one_line_error(capsys, ["generate", "--ckpt", ckpt, "--device", device,
                                  "--prompt", "hi"], fragment).out
    assert out == ""
    one_line_error(capsys, ["train", "--config", run / "run.yaml", "--out", run / "new",
                            "--quiet", f"train.device={device}"], fragment)
    assert not (run / "new").exists()


@pytest.mark.parametrize("flag, value", [("--stride", 0), ("--max-tokens", -3),
                                         ("--batch-size", 0)])
def test_eval_numbers(run, capsys, flag, value):
    name = flag.lstrip("-").replace("-", "_")
    one_line_error(capsys, ["eval", "--ckpt", run / "run", flag, value, "--quiet"],
                   f"{name}={value} must be >= 1")


def edited_checkpoint(run, tmp_path, **model):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "run" / "latest", ckpt)
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["model"].update(model)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    return ckpt


def test_checkpoint_config_with_other_shapes(run, tmp_path, capsys):
    ckpt = edited_checkpoint(run, tmp_path, d_model=64)
    one_line_error(capsys, ["eval", "--ckpt", ckpt, "--quiet"], "other parameter shapes")


def test_checkpoint_config_with_another_arch_over_the_same_shapes(run, tmp_path, capsys):
    ckpt = edited_checkpoint(run, tmp_path, arch="transformer")  # same parameters as ecp
    one_line_error(capsys, ["eval", "--ckpt", ckpt, "--quiet"],
                   "arch='transformer'", "arch='ecp'")


def test_weights_that_do_not_fit(run, tmp_path):
    """Without the recorded digest (a checkpoint of an earlier version), the shapes themselves
    are compared and named."""
    import json

    from ecp_lm.checkpoint import read_checkpoint

    ckpt = edited_checkpoint(run, tmp_path, d_model=64)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["param_shapes_sha256"], meta["arch"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    fits = r"weight has shape \(32, 32\), the config gives \(64, 64\)"
    with pytest.raises(ValueError, match=fits):
        read_checkpoint(ckpt).load_model()


def test_demo_steps_zero(capsys):
    one_line_error(capsys, ["demo", "--steps", "0", "--out", "unused"], "steps=0 must be >= 1")


def test_validation_split_shorter_than_a_window_is_found_before_training(run, capsys):
    out = run / "short-valid"
    one_line_error(capsys, ["train", "--config", run / "run.yaml", "--out", out, "--quiet",
                            "train.eval_max_tokens=20"],
                   "validation split has 20 tokens", "seq_len+1=33")
    assert not (out / "metrics.jsonl").exists()


def test_prompt_file_that_is_not_utf8(run, tmp_path, capsys):
    prompt = tmp_path / "prompt.bin"
    prompt.write_bytes(b"caf\xe9 au lait")
    out = one_line_error(capsys, ["generate", "--ckpt", run / "run", "--prompt-file", prompt],
                         str(prompt), "not UTF-8").out
    assert out == ""


@pytest.mark.parametrize("argv, fragment", [
    (["--temperature", "-1"], "temperature=-1.0"), (["--top-p", "2"], "top_p=2.0"),
    (["--top-k", "0"], "top_k=0"), (["--max-new-tokens", "-1"], "max_new_tokens=-1")])
def test_generate_checks_arguments_before_echoing_the_prompt(run, capsys, argv, fragment):
    captured = one_line_error(capsys, ["generate", "--ckpt", run / "run", "--prompt",
                                       "the prompt", *argv], fragment)
    assert captured.out == ""


def test_data_path_for_a_source_that_takes_none(tmp_path, capsys):
    one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r", "--quiet",
                            "data.path=/some/where"], "enwiki-mini takes no data.path")
