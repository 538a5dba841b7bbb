"""Bad input at the command line: one line on stderr, exit code 2, nothing written first."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from ecp_lm.cli import main
from ecp_lm.training.loop import train
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

    from ecp_lm.run.checkpoint import read_checkpoint

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


@pytest.mark.parametrize("argv, fragment", [
    (["--temperature", "nan"], "temperature=nan"), (["--temperature", "inf"], "temperature=inf"),
    (["--top-p", "nan"], "top_p=nan"), (["--top-p", "inf"], "top_p=inf"),
    (["--top-k", "257"], "top_k=257")])
def test_generate_refuses_values_that_cannot_sample(run, capsys, argv, fragment):
    captured = one_line_error(capsys, ["generate", "--ckpt", run / "run", "--prompt",
                                       "the prompt", *argv], fragment)
    assert captured.out == ""  # refused before the prompt is echoed


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(temperature=1.0, top_p=float("nan")), "top_p=nan"),
    (dict(temperature=1.0, top_k=257), "top_k=257"),
    (dict(eos_id=256), "eos_id=256"), (dict(eos_id=-1), "eos_id=-1")])
def test_generate_api_refuses_them_too(run, kwargs, fragment):
    import torch

    from ecp_lm.generation import generate
    from ecp_lm.run.checkpoint import read_checkpoint

    model = read_checkpoint(run / "run").load_model()
    assert model.cfg.vocab_size == 256
    with pytest.raises(ValueError, match=re.escape(fragment)):
        generate(model, torch.tensor([[1, 2, 3]]), 4, **kwargs)
    generate(model, torch.tensor([[1, 2, 3]]), 2, temperature=1.0, top_k=256, eos_id=255)


@pytest.mark.parametrize("argv, fragment", [
    (["--repeats", "0"], "--repeats 0 must be >= 1"),
    (["--warmup", "-1"], "--warmup -1 must be >= 0"),
    (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["--seq-lens", ""], "--seq-lens names no length"),
    (["--seq-lens", "256,0"], "--seq-lens 0 must be >= 1"),
    (["--d-model", "0"], "--d-model 0 must be >= 1"),
    (["--n-layers", "0"], "--n-layers 0 must be >= 1"),
    (["--n-heads", "-2"], "--n-heads -2 must be >= 1"),
    (["--segment-len", "0"], "--segment-len 0 must be >= 1"),
    (["--decode-only", "--decode-lengths", ""], "--decode-lengths names no length"),
    (["--decode-only", "--decode-window", "0"], "--decode-window 0 must be >= 1")])
def test_bench_checks_its_numbers_before_any_work(tmp_path, capsys, argv, fragment):
    out = tmp_path / "bench.json"
    captured = one_line_error(capsys, ["bench", "--archs", "ecp", "--json", out, *argv],
                              fragment)
    assert captured.out == "" and not out.exists()


def test_bench_on_a_device_that_is_not_here(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    captured = one_line_error(capsys, ["bench", "--archs", "ecp", "--device", "cuda"],
                              "no CUDA device is available", "--device cpu")
    assert captured.out == ""


@pytest.mark.parametrize("override, fragment", [
    ("train.lr=inf", "train.lr=inf"), ("train.lr=.nan", "train.lr=nan"),
    ("train.lr=0", "train.lr=0.0 must be > 0"), ("train.lr=-1e-3", "train.lr=-0.001"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0"),
    ("train.weight_decay=-3", "train.weight_decay=-3.0"),
    ("train.beta1=1.5", "train.beta1=1.5"), ("train.beta2=1", "train.beta2=1.0"),
    ("train.beta1=-0.1", "train.beta1=-0.1"), ("train.min_lr_ratio=2", "train.min_lr_ratio")])
def test_optimiser_values_are_checked_when_the_config_is_built(tmp_path, capsys, override,
                                                               fragment):
    from ecp_lm.run.config import RunConfig

    with pytest.raises(ValueError, match=re.escape(fragment)):
        RunConfig.load("tiny", [override])
    one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r", "--quiet",
                            override], fragment)
    assert not (tmp_path / "r").exists()


def test_the_edges_of_those_ranges_are_accepted():
    from ecp_lm.run.config import TrainConfig

    cfg = TrainConfig(grad_clip=0.0, weight_decay=0.0, beta1=0.0, beta2=0.999, lr=1e-9)
    assert (cfg.grad_clip, cfg.beta1) == (0.0, 0.0)


def test_num_classes_on_a_text_source(run, tmp_path, capsys):
    cfg = tiny_run_config(tmp_path, overrides=["model.num_classes=10"])
    with pytest.raises(ValueError, match=r"model.num_classes=10 .*data.source=text"):
        train(cfg, tmp_path / "api", progress=False)
    assert not (tmp_path / "api" / "metrics.jsonl").exists()
    one_line_error(capsys, ["train", "--config", run / "run.yaml", "--out", tmp_path / "cli",
                            "--quiet", "model.num_classes=10"], "model.num_classes=10",
                   "data.source=text")


def test_data_prepare_refuses_a_path_for_a_source_that_takes_none(tmp_path, capsys):
    from ecp_lm.data.sources import open_source

    given = tmp_path / "x.txt"
    given.write_text("text")
    one_line_error(capsys, ["data", "prepare", "enwiki-mini", "--path", given, "--quiet",
                            "--out", tmp_path / "cache"], "enwiki-mini takes no --path",
                   str(given))
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="enwiki-mini takes no data.path"):
        open_source("enwiki-mini", given)


def test_hints_from_a_run_config_name_its_keys(tmp_path, capsys):
    line = one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r",
                                   "data.source=wikitext103"], "data.path").err
    assert "--path" not in line
    import torch

    if torch.cuda.is_available():
        return
    line = one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r",
                                   "train.device=cuda"], "use train.device=cpu").err
    assert "--device" not in line


def test_a_checkpoint_config_that_is_not_yaml(run, tmp_path, capsys):
    ckpt = edited_checkpoint(run, tmp_path)
    (ckpt / "config.yaml").write_text("model:\n  arch: [ecp\n")
    one_line_error(capsys, ["eval", "--ckpt", ckpt, "--quiet"], str(ckpt / "config.yaml"),
                   "not valid YAML", "line 3")
    (ckpt / "config.yaml").write_text("model: 7\n")
    one_line_error(capsys, ["generate", "--ckpt", ckpt, "--prompt", "a"],
                   str(ckpt / "config.yaml"), "model must be a mapping")


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00", b"model:\n  arch: \xff\n"])
def test_a_config_file_that_is_not_text(tmp_path, capsys, content):
    config = tmp_path / "run.yaml"
    config.write_bytes(content)
    one_line_error(capsys, ["train", "--config", config, "--out", tmp_path / "r"],
                   str(config), "not a UTF-8 YAML file")


def test_a_window_on_an_architecture_without_one(tmp_path, capsys):
    from ecp_lm.config import ModelConfig

    for arch in ("ecp", "transformer", "perceiver_ar", "s2"):
        with pytest.raises(ValueError, match=rf"window=8 .*arch='{arch}'"):
            ModelConfig(arch=arch, window=8)
    assert ModelConfig(arch="sliding_window", window=8).window == 8
    one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r",
                            "model.window=8"], "model.window=8", "arch='ecp'")
    one_line_error(capsys, ["train", "--config", "tiny", "--out", tmp_path / "r",
                            "model.block_len=8", "model.arch=s2"], "model.block_len=8",
                   "arch='s2'", "only block_local")
    assert not (tmp_path / "r").exists()


def test_block_local_s_block_set_as_window_points_to_block_len(tmp_path, capsys):
    """A new config names block_local's block block_len; window (sliding_window's) is refused
    with the new name, on one line, before anything is written."""
    out = tmp_path / "r"
    one_line_error(capsys, ["train", "--config", "tiny", "--stop-at", "0",
                            "model.arch=block_local", "model.window=8", "--out", out],
                   "model.window=8", "arch='block_local'", "set block_len=8")
    assert not out.exists()
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  arch: block_local\n  window: 8\n")  # a user's file: new
    one_line_error(capsys, ["train", "--config", config, "--stop-at", "0", "--out", out],
                   "window=8", "block_len")
    assert not out.exists()


def test_stop_at_past_the_last_step(run, tmp_path, capsys):
    from ecp_lm.run.config import RunConfig

    cfg = RunConfig.load(str(run / "run.yaml"))
    assert cfg.train.steps == 2
    with pytest.raises(ValueError, match=r"stop_at=3 is outside 0..train.steps=2"):
        train(cfg, tmp_path / "api", progress=False, stop_at=3)
    one_line_error(capsys, ["train", "--config", run / "run.yaml", "--out", tmp_path / "cli",
                            "--quiet", "--stop-at", "3"], "stop_at=3", "train.steps=2")
    assert not (tmp_path / "cli" / "latest").exists()
