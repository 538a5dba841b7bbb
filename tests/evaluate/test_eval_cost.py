"""What ``ecp eval`` costs is said before it starts, and a longer window does not multiply it.

With ``--seq-len T`` longer than the run's N, the default stride grows with T in the run's
proportion (min(T/2, l·T/N)), so T = 10N scores about as many windows as N does, not ten times
as many each ten times as long; an explicit ``--stride`` is kept. Before scoring, one line on
stderr gives the windows, the targets and the tokens run through the model; the progress bar
counts windows; ``--quiet`` prints neither."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ecp_lm.data.batches import eval_windows
from ecp_lm.data.cache import open_run_cache
from ecp_lm.evaluate.scoring import default_stride, score_stream
from ecp_lm.run.checkpoint import read_checkpoint
from helpers import TINY, run_cli, trained_runs

N, L = TINY["seq_len"], TINY["seq_len"] // 2  # the run's N = 32 and l = N/2 = 16
TOKENS = 1000


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_runs(tmp_path_factory.mktemp("eval_cost"), ("ecp",), steps=1)["ecp"]


def test_test_split_is_long_enough(run):
    cfg = read_checkpoint(run).config
    assert len(open_run_cache(cfg.data, cfg.model.vocab_size, progress=False)
               .tokens("test")) > TOKENS


def plan_line(windows, seq_len, stride) -> str:
    return (f"scoring {len(windows):,} windows of {seq_len:,} tokens at stride {stride:,}: "
            f"{TOKENS - 1 - (seq_len - stride):,} targets, {len(windows) * seq_len:,} tokens "
            f"through the model")


def test_longer_window_scales_the_default_stride(run, capsys):
    t = 10 * N
    code, out, err = run_cli(capsys, "eval", "--ckpt", run, "--split", "test", "--seq-len", t,
                             "--max-tokens", TOKENS, "--json")
    assert code == 0, err
    report = json.loads(out)
    stride = min(t // 2, L * t // N)  # 160: half the window, as N/2 is of N
    assert report["seq_len"] == t and report["stride"] == stride
    windows = eval_windows(TOKENS, t, stride)
    assert len(windows) <= len(eval_windows(TOKENS, N, L))  # no more windows than at N
    [line] = err.splitlines()  # stderr is not a terminal here: no bar, the one line
    assert line.startswith(plan_line(windows, t, stride)), line
    ckpt = read_checkpoint(run)
    cfg = ckpt.config
    tokens = np.asarray(open_run_cache(cfg.data, cfg.model.vocab_size, progress=False)
                        .tokens("test"))[:TOKENS]
    nll, count = score_stream(ckpt.load_model().eval(), tokens, t, stride, batch_size=4)
    assert report["tokens_scored"] == count == TOKENS - 1 - (t - stride)
    assert report["nll_sum"] == pytest.approx(nll, rel=1e-5)


def test_explicit_stride_is_kept_and_its_cost_said(run, capsys):
    t = 10 * N
    code, out, err = run_cli(capsys, "eval", "--ckpt", run, "--split", "test", "--seq-len", t,
                             "--stride", L, "--max-tokens", TOKENS, "--json")
    assert code == 0, err
    assert json.loads(out)["stride"] == L
    windows = eval_windows(TOKENS, t, L)
    assert len(windows) > 5 * len(eval_windows(TOKENS, t, t // 2))
    assert err.splitlines()[0].startswith(plan_line(windows, t, L)), err


def test_progress_bar_counts_windows_and_quiet_prints_nothing(run, capsys, monkeypatch):
    import ecp_lm.progress

    monkeypatch.setattr(ecp_lm.progress, "interactive", lambda: True)  # as on a terminal
    argv = ("eval", "--ckpt", run, "--split", "test", "--max-tokens", TOKENS, "--batch-size", 4)
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    windows = len(eval_windows(TOKENS, N, L))  # 62 windows in 16 batches of 4
    assert plan_line(eval_windows(TOKENS, N, L), N, L) in err
    assert re.search(rf"\b{windows}/{windows} \[.*(window/s|s/window)", err), err
    code, _, err = run_cli(capsys, *argv, "--quiet")
    assert code == 0 and err == ""


@pytest.mark.parametrize("window, latent_len, expected", [
    (32, 16, 16), (16, 16, 8), (8, 16, 4),  # T <= N: min(T/2, l), as before
    (64, 16, 32), (320, 16, 160), (100_000, 16, 50_000),  # T > N: half the window
    (64, 4, 8), (320, 4, 40),  # l < N/2: the run's share of the window, l/N
])
def test_default_stride(window, latent_len, expected):
    assert default_stride(window, latent_len, N) == expected
    if window <= N:
        assert default_stride(window, latent_len) == expected


@pytest.mark.parametrize("mode, line", [
    (("--per-position",), f"scoring {(TOKENS - 1) // N} windows of {N} tokens, one after the "
                          f"other"),
    (("--stream", "--chunk-len", 64), f"scoring {TOKENS - 1} targets as one stream in chunks "
                                      f"of 64 tokens"),
])
def test_per_position_and_stream_say_what_they_score(run, capsys, mode, line):
    code, _, err = run_cli(capsys, "eval", "--ckpt", run, "--split", "test", "--max-tokens",
                           TOKENS, "--json", *mode)
    assert code == 0, err
    assert err.splitlines() == [line]
