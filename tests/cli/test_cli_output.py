"""What ``ecp generate`` tells a user besides the text: a rate that leaves out the prompt's
prefill and the compiler's wait, a note when the prompt is longer than the model's window, and an
interrupt line that starts on a line of its own."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest
import torch

from ecp_lm import generation
from ecp_lm.cli import main
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train
from helpers import tiny_run_config

COMPILE_SECONDS = 1.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One step of a tiny ecp and a tiny transformer (N = 32) on byte tokens."""
    tmp = tmp_path_factory.mktemp("runs")
    for arch in ("ecp", "transformer"):
        train(tiny_run_config(tmp, arch, steps=1), tmp / arch, progress=False)
    return tmp


def report(err: str) -> dict[str, float]:
    """The numbers of the closing line ``[N tokens in T s: the first after F s, ...]``."""
    line = err.strip().splitlines()[-1]
    numbers = {"tokens": r"\[(\d+) tokens", "total": r"in ([\d.]+) s", "first": r"first after "
               r"([\d.]+) s", "rate": r"then ([\d.]+) tokens/s", "compiling": r"\(compiling "
               r"the decode step\) ([\d.]+) s later"}
    found = {k: re.search(p, line) for k, p in numbers.items()}
    return {k: float(m.group(1)) for k, m in found.items() if m}


def slow_compiler(monkeypatch):
    """A "compiled" decode step whose first call waits as a compiler would."""
    def compiled(model):
        calls = []

        def step(*args):
            if not calls:
                time.sleep(COMPILE_SECONDS)
            calls.append(1)
            return model.decode_step(*args)
        return step
    monkeypatch.setattr(generation, "compiled_decode_step", compiled)


def test_compiled_rate_leaves_out_the_compile(runs, capsys, monkeypatch):
    slow_compiler(monkeypatch)
    n = 24
    assert main(["generate", "--ckpt", str(runs / "ecp"), "--prompt", "the model reads",
                 "--max-new-tokens", str(n), "--compile"]) == 0
    numbers = report(capsys.readouterr().err)
    assert numbers["tokens"] == n and numbers["compiling"] >= COMPILE_SECONDS
    # the rate over the tokens after the compiled step's first call: at least what those n - 2
    # tokens give over the whole run less the compiler's wait (the line rounds the total to
    # 0.01 s and the rate to 0.1 token/s)
    assert numbers["rate"] + 0.05 >= (n - 2) / (numbers["total"] + 0.005 - COMPILE_SECONDS)


def test_eager_rate_starts_after_the_first_token(runs, capsys):
    n = 16
    assert main(["generate", "--ckpt", str(runs / "ecp"), "--prompt", "the model reads",
                 "--max-new-tokens", str(n)]) == 0
    numbers = report(capsys.readouterr().err)
    assert "compiling" not in numbers and numbers["first"] <= numbers["total"]
    assert numbers["rate"] + 0.05 >= (n - 1) / (numbers["total"] + 0.005)  # as rounded


def test_a_prompt_longer_than_the_window_is_cut_and_says_so(runs, capsys):
    prompt = "the model reads a long context and predicts what comes next"  # 59 bytes, N = 32
    assert main(["generate", "--ckpt", str(runs / "transformer"), "--prompt", prompt,
                 "--max-new-tokens", "4", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if "prompt cut" in line]
    assert notes == ["ecp: prompt cut to its last 32 tokens (the window of "
                     "arch='transformer'); it has 59"]
    assert out.startswith(prompt)
    # what the note says is what happens: the continuation of the last 32 tokens alone
    model = read_checkpoint(runs / "transformer").load_model()
    ids = torch.tensor([list(prompt.encode())])
    whole = generation.generate(model, ids, 4)[:, ids.size(1):]
    last = generation.generate(model, ids[:, -32:], 4)[:, 32:]
    assert torch.equal(whole, last)
    assert main(["generate", "--ckpt", str(runs / "ecp"), "--prompt", prompt,
                 "--max-new-tokens", "4"]) == 0
    assert "prompt cut" not in capsys.readouterr().err  # ecp reads any length


def interrupted_after(monkeypatch, tokens):
    """``generation.stream`` stopped by Ctrl-C after ``tokens`` tokens."""
    real = generation.stream

    def stream(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == tokens:
                raise KeyboardInterrupt
            yield item
    monkeypatch.setattr(generation, "stream", stream)


def test_interrupt_line_starts_on_its_own_line_after_streamed_text(runs, monkeypatch):
    """stdout and stderr into one file, as ``ecp generate ... > out.txt 2>&1`` does."""
    interrupted_after(monkeypatch, 5)
    both = io.StringIO()
    monkeypatch.setattr(sys, "stdout", both)
    monkeypatch.setattr(sys, "stderr", both)
    code = main(["generate", "--ckpt", str(runs / "ecp"), "--prompt", "the prompt",
                 "--max-new-tokens", "20", "--temperature", "0"])
    text = both.getvalue()
    assert code == 130
    assert text.startswith("the prompt") and text.endswith("\necp: interrupted\n"), text


def test_interrupt_ends_the_streamed_line_on_stdout(runs, monkeypatch, capsys):
    """stdout and stderr apart: the text keeps its line end, stderr holds only the line."""
    interrupted_after(monkeypatch, 5)
    assert main(["generate", "--ckpt", str(runs / "ecp"), "--prompt", "the prompt",
                 "--max-new-tokens", "20", "--temperature", "0"]) == 130
    out, err = capsys.readouterr()
    assert out.startswith("the prompt") and out.endswith("\n")
    assert err == "ecp: interrupted\n"
