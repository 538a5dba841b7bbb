"""The Python API (``ecp_lm.prepare``, ``train``, ``load``; ``Run.generate``, ``Run.evaluate``)
against the command line: the two quickstarts run as written, a run made by either is read by
the other with the same numbers and text, resuming either way gives the same weights, and a bad
input is a ValueError naming it."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ecp_lm
from ecp_lm.api import config_key
from ecp_lm.cli import main
from helpers import tiny_run_config, write_corpus

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def run_example(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """An example run as a user runs it, in ``cwd``: one CPU thread, offline, the ``ecp`` of this
    Python on the PATH, the user cache under ``cwd``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "ECP_LM_CACHE": str(cwd / "user-cache"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def code_lines(path: Path) -> int:
    """Lines of a Python file that are code: not blank, not comments, not the docstring."""
    tree = ast.parse(path.read_text())
    doc = tree.body[0] if isinstance(tree.body[0], ast.Expr) else None
    skip = set(range(doc.lineno, doc.end_lineno + 1)) if doc else set()
    return sum(1 for i, line in enumerate(path.read_text().splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in skip)


def test_quickstart_py_runs_as_written(tmp_path):
    script = EXAMPLES / "quickstart.py"
    assert code_lines(script) <= 10
    out = run_example([sys.executable, str(script)], tmp_path).stdout
    scores = ast.literal_eval(out.strip().splitlines()[-1])
    assert set(scores) == {"loss", "ppl_token", "bits_per_byte"}
    assert 0 < scores["loss"] < math.log(256)  # better than uniform over bytes
    assert scores["ppl_token"] == pytest.approx(math.exp(scores["loss"]), rel=1e-2)
    assert out.strip() != out.strip().splitlines()[-1]  # the sampled text came first
    assert (tmp_path / "runs" / "quickstart" / "latest").exists()


def test_quickstart_sh_runs_as_written(tmp_path):
    script = EXAMPLES / "quickstart.sh"
    lines = [line for line in script.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(lines) == 5 and [line.split()[:2] for line in lines[1:]] == [
        ["ecp", "data"], ["ecp", "train"], ["ecp", "generate"], ["ecp", "eval"]]
    out = run_example(["sh", str(script)], tmp_path).stdout
    assert "tok/word" in out  # ecp data prepare's table
    assert "now at step" in out  # ecp train's last line
    assert "def parse_args(self" in out  # ecp generate echoes the prompt
    loss = next(line.split()[1] for line in out.splitlines() if line.split()[:1] == ["loss"])
    assert 0 < float(loss) < math.log(256)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny run trained by ``ecp train`` and one trained by ``ecp_lm.train``, same config."""
    tmp = tmp_path_factory.mktemp("api")
    cfg = tiny_run_config(tmp, steps=4)
    cfg.to_yaml(tmp / "run.yaml")
    assert main(["train", "--config", str(tmp / "run.yaml"), "--out", str(tmp / "cli"),
                 "--quiet"]) == 0
    run = ecp_lm.train(cfg, out=tmp / "api")
    return tmp, run


def cli_eval(capsys, ckpt: Path, *flags: str) -> dict:
    assert main(["eval", "--ckpt", str(ckpt), "--json", "--quiet", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def cli_generate(capsys, ckpt: Path, prompt: str, *flags: str) -> str:
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", prompt, *flags]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt):-1]


def test_a_cli_run_scores_and_samples_the_same_through_the_api(runs, capsys):
    tmp, _ = runs
    run = ecp_lm.load(tmp / "cli")
    assert run.checkpoint == tmp / "cli" / "best" and run.step == 4
    for split in ("valid", "test"):
        assert run.evaluate(split, max_tokens=400) == cli_eval(
            capsys, tmp / "cli", "--split", split, "--max-tokens", "400")
    assert run.evaluate("valid", stream=True, max_tokens=300) == cli_eval(
        capsys, tmp / "cli", "--stream", "--max-tokens", "300")
    text = run.generate("the model", max_new_tokens=20, seed=3)
    assert text == cli_generate(capsys, tmp / "cli", "the model", "--max-new-tokens", "20",
                                "--seed", "3")
    assert text == run.generate("the model", max_new_tokens=20, seed=3)  # seeded


def test_an_api_run_is_read_by_the_cli_with_the_same_numbers(runs, capsys):
    tmp, run = runs
    assert run.path == tmp / "api" and (tmp / "api" / "config.yaml").is_file()
    report = run.evaluate(max_tokens=400)  # ecp eval's defaults: the valid split
    assert report["split"] == "valid" and report == cli_eval(
        capsys, tmp / "api", "--max-tokens", "400")
    assert {"loss", "ppl_token", "bits_per_byte", "ppl_word"} <= set(report)
    assert run.generate("the", max_new_tokens=15, temperature=0) == cli_generate(
        capsys, tmp / "api", "the", "--max-new-tokens", "15", "--temperature", "0")
    # the same config trained either way is the same model
    cli, api = (load_file(tmp / name / "latest" / "model.safetensors") for name in ("cli", "api"))
    assert cli.keys() == api.keys() and all(torch.equal(cli[k], api[k]) for k in cli)


def test_resuming_through_the_api_equals_resuming_through_the_cli(tmp_path, capsys):
    cfg = tiny_run_config(tmp_path, steps=4)
    cfg.to_yaml(tmp_path / "run.yaml")
    for name in ("by-cli", "by-api"):
        assert main(["train", "--config", str(tmp_path / "run.yaml"), "--out",
                     str(tmp_path / name), "--stop-at", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(tmp_path / "by-cli"), "--quiet"]) == 0
    run = ecp_lm.train(out=tmp_path / "by-api", resume=True)  # the run's own config.yaml
    assert run.step == 4 and run.config == ecp_lm.load(tmp_path / "by-cli").config
    cli, api = (load_file(tmp_path / name / "latest" / "model.safetensors")
                for name in ("by-cli", "by-api"))
    assert all(torch.equal(cli[k], api[k]) for k in cli)
    with pytest.raises(ValueError, match="already holds a run"):
        ecp_lm.train(cfg, out=tmp_path / "by-api")


def test_prepare_returns_the_cache_the_cli_builds(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    cache = ecp_lm.prepare("text", path=corpus, out=tmp_path / "cache", split=(0.8, 0.1, 0.1))
    assert cache.manifest["tokenizer"]["kind"] == "bytes" and len(cache.tokens("valid")) > 0
    assert main(["data", "prepare", "text", "--path", str(corpus), "--out",
                 str(tmp_path / "cache"), "--split", "0.8,0.1,0.1", "--quiet"]) == 0
    again = ecp_lm.prepare("text", path=[corpus], out=tmp_path / "cache", split="0.8,0.1,0.1")
    assert again.manifest == cache.manifest  # reused, not rebuilt


@pytest.mark.parametrize("kwargs, message", [
    (dict(source="nowhere"), "unknown source 'nowhere'"),
    (dict(source="text", path="c.txt", split="0.5,0.5"), "--split 0.5,0.5: 2 fraction"),
    (dict(source="text", path="c.txt", split=(0.9, 0.1, 0)), "the test split would be empty"),
    (dict(source="enwik8", path="e", split="0.8,0.1,0.1"), "--split 0.8,0.1,0.1: enwik8"),
    (dict(source="text", path="c.txt", vocab_size=512), "--vocab-size 512 sizes the BPE"),
    (dict(source="digits", tokenizer="bpe"), "--tokenizer bpe: digits is a pixel dataset"),
    (dict(source="text", path="c.txt", train="t.txt"), "--path c.txt and --train t.txt"),
])
def test_prepare_refuses_what_the_cli_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        ecp_lm.prepare(kwargs.pop("source"), **kwargs)


def test_keyword_fields_map_to_their_sections(tmp_path):
    from ecp_lm.api import run_config

    assert config_key("arch") == ("model", "arch")
    assert config_key("steps") == ("train", "steps")
    assert config_key("data_path") == ("data", "path")
    assert config_key("train_seed") == ("train", "seed")
    cfg = run_config("tiny", ["train.lr=3e-4"], {"arch": "s2", "data_path": tmp_path / "c.txt",
                                                "source": "text", "steps": 7})
    assert (cfg.model.arch, cfg.data.path, cfg.data.source) == ("s2", str(tmp_path / "c.txt"),
                                                                 "text")
    assert (cfg.train.steps, cfg.train.lr, cfg.model.d_model) == (7, 3e-4, 64)  # tiny's width


@pytest.mark.parametrize("call, message", [
    (lambda: config_key("seed", {"model": ["seed"], "train": ["seed"]}),
     r"seed=\.\.\. could set model\.seed \(model_seed=\.\.\.\), train\.seed"),
    (lambda: config_key("stepz"), r"stepz=\.\.\. is no config key.*did you mean steps"),
    (lambda: ecp_lm.train("tiny", out="x", steps="many"), "train.steps expects int, got 'many'"),
    (lambda: ecp_lm.train("tiny", out="x", overrides=["train.steps=3"], steps=4),
     r"steps=4 and the override train\.steps=\.\.\. set the same key"),
    (lambda: ecp_lm.train("tiny", out="x", overrides=["steps=3"]), "override 'steps=3'"),
    (lambda: ecp_lm.train("tinier", out="x"), "'tinier' is neither a preset"),
    (lambda: ecp_lm.train(42, out="x"), "config 42 is neither a preset"),
    (lambda: ecp_lm.train(out="nowhere", resume=True), "nowhere/config.yaml, which does not"),
    (lambda: ecp_lm.load("no/such/run"), "checkpoint no/such/run does not exist"),
])
def test_bad_inputs_are_value_errors_naming_them(call, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        call()
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "the prompt is empty"),
    (dict(prompt="a", temperature=-1.0), "temperature"),
    (dict(prompt="a", top_k=0), "top_k"),
    (dict(prompt="a", eos="ab"), "--eos 'ab' is 2 tokens"),
    (dict(prompt="a", compile=True, use_cache=False), "--compile"),
])
def test_bad_generation_inputs(runs, kwargs, message):
    _, run = runs
    with pytest.raises(ValueError, match=message):
        run.generate(**kwargs)


def test_bad_evaluation_inputs(runs):
    _, run = runs
    with pytest.raises(ValueError, match="--stream does not combine with --stride"):
        run.evaluate(stream=True, stride=8)
    with pytest.raises(ValueError, match="split 'dev' is not one of"):
        run.evaluate("dev")


def test_the_package_exports_the_api():
    assert {"prepare", "train", "load", "Run"} <= set(ecp_lm.__all__)
    assert ecp_lm.train is ecp_lm.api.train and ecp_lm.Run is ecp_lm.api.Run


def test_evaluate_takes_ecp_evals_defaults():
    """Every option ``Run.evaluate`` shares with ``ecp eval`` has the command's default (the
    device aside: the Run's own, cpu unless ``load`` was told otherwise)."""
    import argparse
    import inspect

    from ecp_lm.cli.evaluate import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cli = vars(parser.parse_args(["--ckpt", "x"]))
    api = {name: p.default for name, p in inspect.signature(ecp_lm.Run.evaluate).parameters.items()
           if name != "self"}
    shared = set(api) & set(cli) - {"device", "quiet", "per_position"}
    assert {"split", "stride", "seq_len", "batch_size", "max_tokens", "precision", "data_path",
            "stream", "chunk_len"} <= shared
    assert {name: api[name] for name in shared} == {name: cli[name] for name in shared}
    assert cli["per_position"] is None and api["per_position"] is False  # the flag, unset
    assert inspect.signature(ecp_lm.load).parameters["device"].default == cli["device"]


TRAIN_RANKS = """
import json, os, sys
import torch.distributed as dist
import ecp_lm

ours = sys.argv[1] == "ours"
if ours:
    dist.init_process_group("gloo")
run = ecp_lm.train(sys.argv[2], out=sys.argv[3], quiet=True)
report = {"run": None if run is None else run.step, "group": dist.is_initialized()}
if ours:
    dist.barrier()  # the caller's group still works
    dist.destroy_process_group()
with open(f"{sys.argv[3]}-rank{os.environ['RANK']}.json", "w") as f:
    json.dump(report, f)
"""


def test_train_under_torchrun_returns_the_run_on_rank_0_and_keeps_the_callers_group(tmp_path):
    """Two gloo ranks under torchrun: rank 0 gets the Run, rank 1 None; a process group the
    script started is still up after the call (and usable), one ``train`` started is gone."""
    script = tmp_path / "train_ranks.py"
    script.write_text(TRAIN_RANKS)
    tiny_run_config(tmp_path, steps=2).to_yaml(tmp_path / "run.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for whose in ("ours", "its"):
        out = tmp_path / whose
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(script), whose, str(tmp_path / "run.yaml"), str(out)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"{whose}-rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["run"] for r in ranks] == [2, None], whose
        assert [r["group"] for r in ranks] == [whose == "ours"] * 2, whose
