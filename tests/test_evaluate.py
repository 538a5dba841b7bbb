"""SPEC §6 evaluation: exact scoring on a hand-made stream, the same targets for every
architecture, and one-line errors for bad checkpoints and strides."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from ecp_lm import build_model
from ecp_lm.cli import main
from ecp_lm.data.tokenizers import ByteTokenizer
from ecp_lm.evaluate import lm_report, score_stream, scored_text
from ecp_lm.train import train
from helpers import tiny_run_config


class Bigram(nn.Module):
    """Predicts token t+1 from token t with a fixed table; returns the last ``predicted``
    positions (``None``: all), like the perceiver family (last l) or ecp (all)."""

    def __init__(self, vocab: int, predicted: int | None, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.log_probs = torch.randn(vocab, vocab, generator=gen).log_softmax(-1)
        self.predicted = predicted

    def forward(self, tokens):
        logits = self.log_probs[tokens]  # (B, T, V)
        return logits if self.predicted is None else logits[:, -self.predicted:]


@pytest.mark.parametrize("num_tokens, seq_len, stride", [(101, 16, 8), (64, 16, 4),
                                                         (17, 16, 8), (200, 32, 16)])
def test_bigram_nll_is_exact(num_tokens, seq_len, stride):
    vocab = 300
    tokens = np.arange(num_tokens) * 7 % vocab  # every (previous, target) pair distinct
    model = Bigram(vocab, predicted=None)
    expected = -sum(model.log_probs[tokens[j - 1], tokens[j]].item()
                    for j in range(seq_len - stride + 1, num_tokens))
    for predicted in (None, stride, seq_len // 2 if stride <= seq_len // 2 else None):
        model.predicted = predicted
        for batch_size in (1, 3):
            nll, count = score_stream(model, tokens, seq_len, stride, batch_size)
            assert count == num_tokens - (seq_len - stride + 1)
            assert nll == pytest.approx(expected, rel=1e-6)  # float32 logits; one term is ~5


def test_report_normalisations():
    tokens = np.frombuffer(b"one two\nthree four five\nsix", dtype=np.uint8)
    text = scored_text(tokens, ByteTokenizer(), seq_len=4, stride=2)  # scored from index 3
    assert text.num_bytes == len(tokens) - 3
    assert text.num_words == len(b" two\nthree four five\nsix".split()) + 2
    report = lm_report(nll_sum=10 * math.log(2), tokens_scored=5, text=text)
    assert report["bits_per_byte"] == pytest.approx(10 / text.num_bytes)
    assert report["ppl_word"] == pytest.approx(math.exp(10 * math.log(2) / text.num_words))
    assert report["loss"] == pytest.approx(2 * math.log(2))


def test_same_targets_for_perceiver_ar_and_ecp(tmp_path):
    """Real models of both kinds, at the same N and K, score the same number of targets (the
    bigram test shows that the scored set does not depend on the predicted positions)."""
    counts = {}
    tokens = np.arange(500) % 256
    for arch in ("perceiver_ar", "ecp"):
        cfg = tiny_run_config(tmp_path, arch)
        model = build_model(cfg.model)
        stride = min(cfg.model.seq_len // 2, cfg.model.latent_len)
        counts[arch] = score_stream(model, tokens, cfg.model.seq_len, stride)[1]
    assert counts["perceiver_ar"] == counts["ecp"] == 500 - (32 - 16 + 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    cfg = tiny_run_config(tmp, "perceiver_ar", steps=2)
    train(cfg, tmp / "run", progress=False)
    return tmp / "run"


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_cli_json(trained, capsys):
    code, out, _ = run_cli(capsys, "eval", "--ckpt", trained, "--split", "test", "--json",
                           "--quiet")
    report = json.loads(out)
    assert code == 0 and report["arch"] == "perceiver_ar" and report["stride"] == 16
    for key in ("tokens_scored", "nll_sum", "loss", "ppl_token", "bits_per_byte", "ppl_word"):
        assert math.isfinite(report[key])
    assert report["loss"] == pytest.approx(report["nll_sum"] / report["tokens_scored"])


def test_stride_larger_than_predicted(trained, capsys):
    code, _, err = run_cli(capsys, "eval", "--ckpt", trained, "--stride", "17", "--quiet")
    assert code == 2 and "stride=17 is outside 1..16" in err and err.count("\n") == 1


def test_missing_checkpoint(tmp_path, capsys):
    code, _, err = run_cli(capsys, "eval", "--ckpt", tmp_path / "nope")
    assert code == 2 and "does not exist" in err and err.count("\n") == 1


def test_truncated_checkpoint(trained, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained / "best", copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, _, err = run_cli(capsys, "eval", "--ckpt", copy, "--quiet")
    assert code == 2 and "truncated or corrupt" in err and err.count("\n") == 1


def test_incompatible_checkpoint_version(trained, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained / "best", copy)
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "format": "ecp-lm-checkpoint/99"}))
    code, _, err = run_cli(capsys, "eval", "--ckpt", copy, "--quiet")
    assert code == 2 and "checkpoint format 'ecp-lm-checkpoint/99'" in err
