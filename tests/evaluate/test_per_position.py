"""Loss against position (``ecp eval --per-position``), scoring with windows of another length
(``--seq-len``), and the per-position plot."""

from __future__ import annotations

import json
import math
from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ecp_lm.data.cache import open_run_cache
from ecp_lm.evaluate.positions import per_position_loss, position_report
from ecp_lm.evaluate.scoring import score_stream, window_length
from ecp_lm.run.checkpoint import read_checkpoint
from helpers import (
    PERCEIVER_FAMILY,
    random_tokens,
    run_cli,
    sharp_model,
    trained_runs,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# A stream in which the token at index j is x[j - LAG] + 1 or x[j - LAG] + 2 (mod V), and an
# oracle that predicts x[j - LAG] + 1 whenever x[j - LAG] is inside its input: its loss at a
# target is then one of three closed-form values.
V, LAG, CONF, W = 50, 5, 3.0, 32
UNIFORM = math.log(V)  # x[j - LAG] is not in the window: all-zero logits
RIGHT = math.log(1 + (V - 1) * math.exp(-CONF))  # the rule was +1: predicted with logit CONF
WRONG = math.log(math.exp(CONF) + V - 1)  # the rule was +2: the target has logit 0


def right_at(p: int) -> bool:
    """Whether the target at window position p follows the +1 rule (not shift-invariant, so a
    window cut at the wrong place shows)."""
    return p % 3 != 1 and p not in (20, 21)


def lag_stream(num_windows: int, tail: int, seed: int = 0) -> np.ndarray:
    """num_windows * W + 1 + tail tokens. The target of stream index j is scored at window
    position (j - 1) mod W; it follows the +1 rule where ``right_at`` that position, +2
    elsewhere and everywhere in the tail (so scoring a partial last window would show)."""
    rng = np.random.default_rng(seed)
    n = num_windows * W + 1 + tail
    x = np.zeros(n, dtype=np.int64)
    x[:LAG] = rng.integers(0, V, LAG)
    for j in range(LAG, n):
        step = 1 if j <= num_windows * W and right_at((j - 1) % W) else 2
        x[j] = (x[j - LAG] + step) % V
    return x


def expected_curve(window: int = W, predicted: int | None = None) -> list[float | None]:
    """The oracle's loss at each window position: the target after position p is token p + 1,
    whose source p + 1 - LAG is an input of the window from p = LAG - 1 on."""
    first = 0 if predicted is None else window - predicted
    return [None if p < first else UNIFORM if p + 1 - LAG < 0 else
            RIGHT if right_at(p) else WRONG for p in range(window)]


class LagOracle(nn.Module):
    """Logit CONF on (token LAG - 1 positions back) + 1, 0 elsewhere; all zeros where that token
    is not in the input. Returns the last ``predicted`` positions (None: all), like the
    perceiver family."""

    def __init__(self, predicted: int | None = None):
        super().__init__()
        self.predicted = predicted
        self.calls: list[int] = []

    def forward(self, tokens):
        b, t = tokens.shape
        self.calls.append(b)
        logits = torch.zeros(b, t, V)
        source = (tokens[:, :t - LAG + 1] + 1) % V  # predicts positions LAG-1 .. t-1
        logits[:, LAG - 1:].scatter_(2, source[..., None], CONF)
        return logits if self.predicted is None else logits[:, t - self.predicted:]


def bucket_means(curve: list[float | None], edges: list[int]) -> list[tuple[int, int, float]]:
    """(start, stop, mean) over the predicted positions of each bucket that has some."""
    out = []
    for a, b in pairwise(edges):
        values = [(p, v) for p, v in enumerate(curve[a:b], a) if v is not None]
        if values:
            out.append((values[0][0], b, sum(v for _, v in values) / len(values)))
    return out


@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize("predicted", [None, 12])
def test_oracle_curve_is_known_in_closed_form(batch_size, predicted):
    num_windows = 7
    tokens = lag_stream(num_windows, tail=W - 3)
    model = LagOracle(predicted)
    result = per_position_loss(model, tokens, W, batch_size=batch_size)
    assert result.windows == num_windows and sum(model.calls) == num_windows
    assert len(model.calls) == -(-num_windows // batch_size)
    report = position_report(result, segment_len=8)
    curve = expected_curve(W, predicted)
    assert report["per_position"] == pytest.approx(curve, abs=1e-5)
    assert report["window"] == W and report["windows"] == num_windows
    assert report["tokens_scored"] == num_windows * sum(v is not None for v in curve)
    pow2 = bucket_means(curve, [0, 1, 2, 4, 8, 16, 32])
    segments = bucket_means(curve, [0, 8, 16, 24, 32])
    for name, expected in (("pow2", pow2), ("segments", segments)):
        got = report["buckets"][name]
        assert [(b["start"], b["stop"]) for b in got] == [(a, b) for a, b, _ in expected]
        assert [b["loss"] for b in got] == pytest.approx([m for *_, m in expected], abs=1e-5)
        assert [b["bits_per_token"] for b in got] == pytest.approx(
            [m / math.log(2) for *_, m in expected], abs=1e-5)
        assert [b["count"] for b in got] == [num_windows * (b - a) for a, b, _ in expected]
    values = [v for v in curve if v is not None]
    assert report["loss"] == pytest.approx(sum(values) / len(values), abs=1e-5)


def test_oracle_buckets_at_a_glance():
    """Positions 0 .. LAG-2 cannot see their source: uniform; the pow2 buckets [0,1) .. [2,4)
    lie wholly before it."""
    report = position_report(per_position_loss(LagOracle(), lag_stream(3, 0), W), 8)
    first = report["buckets"]["pow2"][:3]
    assert [(b["start"], b["stop"]) for b in first] == [(0, 1), (1, 2), (2, 4)]
    assert [b["loss"] for b in first] == pytest.approx([UNIFORM] * 3, abs=1e-5)


def test_too_short_a_stream_is_refused():
    with pytest.raises(ValueError, match="fewer than one window"):
        per_position_loss(LagOracle(), np.zeros(W, dtype=np.int64), W)


@pytest.mark.parametrize("arch", ["transformer", "ecp", "perceiver_ar", "s2"])
def test_mean_over_positions_is_the_loss_of_the_same_windows(arch):
    model = sharp_model(arch)
    n = model.cfg.seq_len
    tokens = random_tokens(1, 5 * n + 1 + 7, seed=3)[0].numpy()  # 5 windows and a tail
    report = position_report(per_position_loss(model, tokens, n, batch_size=2))
    with torch.no_grad():
        losses = [model.loss(torch.from_numpy(tokens[i * n:(i + 1) * n + 1])[None]).item()
                  for i in range(5)]
    assert report["windows"] == 5
    assert report["loss"] == pytest.approx(sum(losses) / 5, rel=1e-5)
    curve = [v for v in report["per_position"] if v is not None]
    assert sum(curve) / len(curve) == pytest.approx(sum(losses) / 5, rel=1e-5)


@pytest.mark.parametrize("arch", PERCEIVER_FAMILY)
def test_perceiver_family_scores_only_its_predicted_positions(arch):
    model = sharp_model(arch)
    n, m = model.cfg.seq_len, model.cfg.segment_len
    first = n - model.cfg.latent_len
    tokens = random_tokens(1, 3 * n + 1, seed=1)[0].numpy()
    report = position_report(per_position_loss(model, tokens, n), m)
    curve = report["per_position"]
    assert curve[:first] == [None] * first
    assert all(isinstance(v, float) and v > 0 for v in curve[first:])
    assert report["first_predicted"] == first and report["tokens_scored"] == 3 * (n - first)
    assert [(b["start"], b["stop"]) for b in report["buckets"]["pow2"]] == [(16, 32)]
    segments = [(a, min(a + m, n)) for a in range(first, n, m)]  # first = 16 is a multiple of m
    assert [(b["start"], b["stop"]) for b in report["buckets"]["segments"]] == segments


def test_window_length_refuses_longer_windows_for_bounded_archs():
    transformer, ecp = sharp_model("transformer"), sharp_model("ecp")
    assert window_length(transformer) == 32 and window_length(transformer, 16) == 16
    assert window_length(ecp, 100) == 100
    with pytest.raises(ValueError, match=r"arch='transformer' .* at most 32"):
        window_length(transformer, 64)
    with pytest.raises(ValueError, match="seq_len=1"):
        window_length(ecp, 1)


# Through checkpoints and the command line ---------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny trained ecp run and transformer run (N = 32, m = 8, byte tokens)."""
    return trained_runs(tmp_path_factory.mktemp("per_position"), ("ecp", "transformer"), steps=2)


def checkpoint_and_tokens(run, split="test"):
    ckpt = read_checkpoint(run)
    model = ckpt.load_model("cpu").eval()
    cfg = ckpt.config
    tokens = np.asarray(open_run_cache(cfg.data, cfg.model.vocab_size, progress=False)
                        .tokens(split))
    return model, tokens


def test_cli_per_position_ecp_longer_window_matches_hand_computation(runs, tmp_path, capsys):
    out = tmp_path / "ecp.json"
    code, stdout, _ = run_cli(capsys, "eval", "--ckpt", runs["ecp"], "--split", "test",
                              "--seq-len", 64, "--per-position", out, "--max-tokens", 400,
                              "--batch-size", 2, "--quiet", "--json")
    assert code == 0
    report = json.loads(out.read_text())
    assert json.loads(stdout) == report
    assert report["kind"] == "per_position" and report["arch"] == "ecp"
    assert report["run"] == "ecp" and report["window"] == 64 and report["segment_len"] == 8
    model, tokens = checkpoint_and_tokens(runs["ecp"])
    tokens = tokens[:400]
    num_windows = (400 - 1) // 64
    assert report["windows"] == num_windows
    with torch.no_grad():
        rows = torch.stack([torch.tensor(tokens[i * 64:i * 64 + 65], dtype=torch.long)
                            for i in range(num_windows)])
        nll = F.cross_entropy(model(rows[:, :-1]).transpose(1, 2), rows[:, 1:],
                              reduction="none")
    assert report["per_position"] == pytest.approx(nll.mean(0).tolist(), rel=1e-5)
    segments = report["buckets"]["segments"]
    assert [(b["start"], b["stop"]) for b in segments] == [(a, a + 8) for a in range(0, 64, 8)]
    assert segments[3]["loss"] == pytest.approx(nll[:, 24:32].mean().item(), rel=1e-5)
    assert [(b["start"], b["stop"]) for b in report["buckets"]["pow2"]] == [
        (0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64)]


def test_cli_per_position_table(runs, capsys):
    code, stdout, _ = run_cli(capsys, "eval", "--ckpt", runs["ecp"], "--per-position",
                              "--max-tokens", 300, "--quiet")
    assert code == 0
    assert "bits/byte" in stdout and "[0, 1)" in stdout and "[16, 32)" in stdout
    assert "segments of m=8" in stdout and "[24, 32)" in stdout
    assert "9 windows of 32" in stdout


def test_cli_seq_len_standard_protocol_for_ecp(runs, capsys):
    code, stdout, _ = run_cli(capsys, "eval", "--ckpt", runs["ecp"], "--split", "test",
                              "--seq-len", 64, "--max-tokens", 500, "--json", "--quiet")
    assert code == 0
    report = json.loads(stdout)
    stride = min(64 // 2, 16 * 64 // 32)  # min(T/2, l·T/N) with the run's l = N/2 = 16
    assert report["seq_len"] == 64 and report["stride"] == stride
    model, tokens = checkpoint_and_tokens(runs["ecp"])
    nll, count = score_stream(model, tokens[:500], 64, stride, batch_size=4)
    assert report["tokens_scored"] == count == 500 - (64 - stride + 1)
    assert report["nll_sum"] == pytest.approx(nll, rel=1e-5)


@pytest.mark.parametrize("extra", [(), ("--per-position",)])
def test_cli_seq_len_longer_than_n_is_refused_for_transformer(runs, capsys, extra):
    code, stdout, err = run_cli(capsys, "eval", "--ckpt", runs["transformer"], "--seq-len", 64,
                                "--quiet", *extra)
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("ecp: error: ")
    assert "'transformer'" in err and "at most 32" in err


def test_cli_stride_with_per_position_is_refused(runs, capsys):
    code, _, err = run_cli(capsys, "eval", "--ckpt", runs["ecp"], "--per-position",
                           "--stride", 4, "--quiet")
    assert code == 2 and "--stride" in err and err.count("\n") == 1


def test_plot_two_per_position_reports(runs, tmp_path, capsys):
    files = []
    for arch, run in runs.items():
        files.append(tmp_path / f"{arch}.json")
        assert run_cli(capsys, "eval", "--ckpt", run, "--per-position", files[-1],
                       "--max-tokens", 300, "--quiet")[0] == 0
    out = tmp_path / "plots" / "curve.png"
    code, stdout, _ = run_cli(capsys, "plot", "--per-position", *files, "--out", out)
    assert code == 0 and stdout.strip() == str(out)
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 10_000
    detected = tmp_path / "detected.png"
    assert run_cli(capsys, "plot", *files, "--out", detected)[0] == 0  # detected as reports
    assert detected.read_bytes().startswith(PNG_SIGNATURE)
    code, _, err = run_cli(capsys, "plot", runs["ecp"], files[0], "--out", tmp_path / "x.png")
    assert code == 2 and "not both" in err
    not_a_report = tmp_path / "other.json"
    not_a_report.write_text(json.dumps({"loss": 1.0}))
    code, _, err = run_cli(capsys, "plot", "--per-position", not_a_report)
    assert code == 2 and "not a per-position report" in err and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()
