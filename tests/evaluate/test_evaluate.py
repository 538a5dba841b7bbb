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
from ecp_lm.data.batches import eval_windows
from ecp_lm.data.cache import prepare
from ecp_lm.data.sources import open_source
from ecp_lm.evaluate.scoring import lm_report, score_stream, scored_text
from ecp_lm.training.loop import train
from helpers import random_tokens, tiny_config, tiny_run_config


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


def test_report_normalisations(tmp_path):
    text = b"one two\nthree four five\nsix"
    for s in ("train", "valid", "test"):  # one file in two splits is refused
        (tmp_path / f"{s}.txt").write_bytes(text)
    source = open_source("text", splits={s: str(tmp_path / f"{s}.txt") for s in
                                         ("train", "valid", "test")})
    cache = prepare(source, "bytes", out=tmp_path / "cache", progress=False)
    scored = scored_text(cache, "valid", 3, len(text))  # seq_len=4, stride=2: from index 3
    assert scored.num_bytes == len(text) - 3
    # "two", "three four five", "six": the last line counts without its line end
    assert (scored.num_words, scored.num_lines) == (5, 3)
    report = lm_report(nll_sum=10 * math.log(2), tokens_scored=5, text=scored)
    assert report["bits_per_byte"] == pytest.approx(10 / scored.num_bytes)
    assert report["ppl_word"] == pytest.approx(math.exp(10 * math.log(2) / 5))
    assert report["ppl_word_eos"] == pytest.approx(math.exp(10 * math.log(2) / 8))
    assert (report["bytes_scored"], report["words_scored"], report["lines_scored"]) == (
        len(text) - 3, 5, 3)
    assert report["loss"] == pytest.approx(2 * math.log(2))


def spec_targets(num_tokens: int, seq_len: int, stride: int) -> set[int]:
    """SPEC §6 written out: every target from stream index N - k + 1 on, and nothing else."""
    return set(range(seq_len - stride + 1, num_tokens))


def window_targets(window, seq_len: int) -> range:
    """Stream indices of a window's scored targets: the last ``num_scored`` of its targets
    start + 1 .. start + N (``EvalWindow``'s convention; score_stream keeps the last
    ``num_scored`` logits, whose targets are the last tokens of the (N + 1)-token window)."""
    return range(window.start + seq_len - window.num_scored + 1, window.start + seq_len + 1)


STREAMS = [(101, 16, 8), (64, 16, 4), (17, 16, 8), (200, 32, 16), (50, 16, 1), (40, 16, 16),
           (45, 16, 5), (33, 16, 7)]


@pytest.mark.parametrize("num_tokens, seq_len, stride", STREAMS)
def test_eval_windows_score_each_spec_target_once(num_tokens, seq_len, stride):
    windows = eval_windows(num_tokens, seq_len, stride)
    scored = [j for w in windows for j in window_targets(w, seq_len)]
    assert len(scored) == len(set(scored)), "a target is scored twice"
    assert set(scored) == spec_targets(num_tokens, seq_len, stride)
    for w in windows:
        assert w.start >= 0 and w.start + seq_len + 1 <= num_tokens, w  # inside the stream
        for j in window_targets(w, seq_len):
            assert j - w.start >= seq_len - stride, (w, j)  # tokens start .. j-1 of context


class WindowProbe(nn.Module):
    """A model for the stream whose token at stream index j is j, so it knows where each window
    starts. It predicts token i + 1 after token i with certainty (nll exactly 0), except in the
    window starting at ``marked_start``, where the target at window position i (stream index
    start + i + 1) costs exactly 2**(i + 6) nats: the nll sum then names the positions of that
    window that were scored. Records the start of every window it is given; returns the last
    ``predicted`` positions, like the perceiver family (last l) or ecp (all)."""

    def __init__(self, vocab: int, predicted: int):
        super().__init__()
        self.vocab, self.predicted = vocab, predicted
        self.marked_start, self.starts = -1, []

    def forward(self, tokens):
        b, t = tokens.shape
        self.starts += tokens[:, 0].tolist()
        marked = (tokens[:, 0] == self.marked_start)[:, None, None]  # (B, 1, 1)
        target = (tokens + 1)[..., None]  # (B, T, 1)
        cost = 2.0 ** (torch.arange(t, dtype=torch.float32) + 6)[None, :, None]
        logits = torch.full((b, t, self.vocab), -1e4)
        logits.scatter_(2, target + 1, torch.where(marked, 0.0, -1e4).expand(b, t, 1))
        logits.scatter_(2, target, torch.where(marked, -cost, 0.0).expand(b, t, 1))
        return logits[:, t - self.predicted:]


def scored_by_score_stream(probe, num_tokens, seq_len, stride, batch_size
                           ) -> list[tuple[int, int]]:
    """(target stream index, window start) of every target score_stream scores."""
    tokens = np.arange(num_tokens)
    probe.marked_start, probe.starts = -1, []
    nll, count = score_stream(probe, tokens, seq_len, stride, batch_size)
    assert nll == 0.0  # every scored logit lines up with its target
    scored = []
    for start in sorted(set(probe.starts)):
        probe.marked_start = start
        nll = score_stream(probe, tokens, seq_len, stride, batch_size)[0]
        assert nll == int(nll) and int(nll) % 64 == 0, (start, nll)
        bits = int(nll) // 64
        scored += [(start + i + 1, start) for i in range(seq_len) if bits >> i & 1]
    assert len(scored) == count
    return scored


def test_score_stream_scores_the_same_spec_targets_for_every_arch(arch):
    """SPEC §6: at the default stride min(N/2, l) every architecture scores exactly the targets
    N - k + 1 .. end, each once and with at least N - k tokens of context, whether it predicts
    all N positions (ecp, transformer) or only the last l (the perceiver family)."""
    cfg = tiny_config(arch)
    n = cfg.seq_len
    stride = min(n // 2, cfg.resolved().latent_len)
    with torch.no_grad():
        predicted = build_model(cfg)(random_tokens(1, n)).size(1)
    num_tokens = 100  # windows at 0, 16, 32, 48, 64 and a last one at 67
    probe = WindowProbe(num_tokens + 1, predicted)
    for batch_size in (1, 3):
        scored = scored_by_score_stream(probe, num_tokens, n, stride, batch_size)
        targets = [j for j, _ in scored]
        assert len(targets) == len(set(targets)), (arch, batch_size, "a target scored twice")
        assert set(targets) == spec_targets(num_tokens, n, stride), (arch, batch_size)
        for j, start in scored:
            assert j - start >= n - stride, (arch, j, start)  # context: tokens start .. j-1


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
