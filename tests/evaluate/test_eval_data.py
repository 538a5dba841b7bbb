"""``ecp eval`` on data other than the run's own, and under the run's precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ecp_lm.cli import main
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.training.loop import train
from helpers import tiny_run_config, write_corpus


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_another_corpus_never_touches_the_run_cache(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("ECP_LM_CACHE", str(tmp_path / "user-cache"))
    overrides = [f"data.tokenizer={tokenizer}", "data.bpe_vocab_size=300",
                 "model.vocab_size=300"] if tokenizer == "bpe" else []
    cfg = tiny_run_config(tmp_path, overrides=overrides, steps=2)
    train(cfg, tmp_path / "run", progress=False)
    run_cache = tmp_path / "cache"
    before = snapshot(run_cache)
    own = evaluate_checkpoint(tmp_path / "run", max_tokens=400, progress=False)

    other = write_corpus(tmp_path / "other.txt", seed=7)
    report = evaluate_checkpoint(tmp_path / "run", max_tokens=400, data_path=str(other),
                                 progress=False)
    assert snapshot(run_cache) == before  # the run's cache is as it was
    assert report["data"] != own["data"] and report["loss"] != own["loss"]
    assert Path(report["data"]).is_relative_to(tmp_path / "user-cache")
    manifest = json.loads((Path(report["data"]) / "manifest.json").read_text())
    from ecp_lm.run.checkpoint import read_checkpoint

    assert manifest["tokenizer"]["identity"] == \
        read_checkpoint(tmp_path / "run").tokenizer().identity  # the checkpoint's tokenizer

    moved = tmp_path / "moved" / "corpus.txt"  # the same corpus elsewhere: the run's cache
    moved.parent.mkdir()
    moved.write_bytes((tmp_path / "corpus.txt").read_bytes())
    again = evaluate_checkpoint(tmp_path / "run", max_tokens=400, data_path=str(moved),
                                progress=False)
    assert again["data"] == own["data"] and again["loss"] == own["loss"]
    assert snapshot(run_cache) == before


def test_data_path_that_would_be_ignored_is_an_error(tmp_path, capsys):
    cfg = tiny_run_config(tmp_path, steps=1)
    train(cfg, tmp_path / "run", progress=False)
    config = tmp_path / "run" / "best" / "config.yaml"
    config.write_text(config.read_text().replace("source: text", "source: enwiki-mini")
                      .replace(f"path: {tmp_path / 'corpus.txt'}", "path: null"))
    code = main(["eval", "--ckpt", str(tmp_path / "run" / "best"), "--data-path",
                 str(tmp_path / "corpus.txt"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--data-path: the checkpoint's source enwiki-mini takes no path" in err


def test_eval_scores_under_the_precision_validation_used(tmp_path):
    """best/ is chosen by validation under train.precision; ecp eval reports it under the same
    precision by default, so the validation loss is reproduced exactly."""
    cfg = tiny_run_config(tmp_path, overrides=["train.precision=bf16"], steps=2)
    train(cfg, tmp_path / "run", progress=False)
    from ecp_lm.run.checkpoint import read_checkpoint

    best = read_checkpoint(tmp_path / "run" / "best")
    assert best.meta["precision"] == "bf16"
    kwargs = dict(max_tokens=cfg.train.eval_max_tokens, batch_size=cfg.train.eval_batch_size,
                  progress=False)
    report = evaluate_checkpoint(tmp_path / "run" / "best", **kwargs)
    assert report["precision"] == "bf16"
    assert report["loss"] == best.meta["validation"]["loss"]
    fp32 = evaluate_checkpoint(tmp_path / "run" / "best", precision="fp32", **kwargs)
    assert fp32["precision"] == "fp32" and fp32["loss"] != report["loss"]
    assert fp32["loss"] == pytest.approx(report["loss"], rel=0.02)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_generate_in_half_precision_with_caches(tmp_path, capsys, precision):
    cfg = tiny_run_config(tmp_path, steps=1)
    train(cfg, tmp_path / "run", progress=False)
    code = main(["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "the model",
                 "--max-new-tokens", "40", "--precision", precision, "--temperature", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("the model") and f"cached, {precision}" in captured.err
