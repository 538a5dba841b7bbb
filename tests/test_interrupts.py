"""Interrupted training, for real: ``ecp train`` in a subprocess receives SIGINT or SIGKILL at
random instants, is started again with the same command (``--resume`` once the folder holds a
run), and ends with exactly the weights and metrics of an uninterrupted run, dropout on."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import interrupting
from ecp_lm.plot import read_metrics
from ecp_lm.run.checkpoint import read_checkpoint
from helpers import tiny_run_config, write_corpus
from interrupting import logged_step, random_instants, wait_until_python_runs

STEPS = 24


def run_config(tmp_path):
    cfg = tiny_run_config(tmp_path, "ecp", ["model.dropout=0.1"], steps=STEPS, grad_accum=2,
                          checkpoint_every=5, eval_every=6, log_every=1)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    return cfg, path


def start(config_path, out):
    argv = [sys.executable, "-m", "ecp_lm", "train", "--config", str(config_path), "--out",
            str(out), "--quiet"]
    if (out / "config.yaml").exists():  # the folder holds a run, or the start of one
        argv.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def interrupt_until_done(config_path, out, signum, instants):
    """``interrupting.interrupt_until_done`` of ``ecp train`` with one signal throughout."""
    return interrupting.interrupt_until_done(
        lambda attempt: start(config_path, out), out,
        [(step, delay, signum) for step, delay in instants])


def assert_same_run(reference, out):
    interrupting.assert_same_run(reference, out, STEPS)


@pytest.fixture
def reference(tmp_path):
    """The uninterrupted run, by the same command in the same kind of process."""
    _, config_path = run_config(tmp_path)
    out = tmp_path / "reference"
    proc = start(config_path, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out


def test_sigint_at_random_instants_resumes_exactly(tmp_path, reference):
    _, config_path = run_config(tmp_path)
    out = tmp_path / "interrupted"
    instants = random_instants(0, [None, None, None, 2, 5, 9, 10, 14, 17, 21, 23])
    messages = interrupt_until_done(config_path, out, signal.SIGINT, instants)
    assert len(messages) >= 6, messages
    for code, err in messages:
        assert code == 130, err
        assert "Traceback" not in err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ecp: interrupted"), err
    assert_same_run(reference, out)


def test_sigkill_at_random_instants_resumes_exactly(tmp_path, reference):
    _, config_path = run_config(tmp_path)
    out = tmp_path / "killed"
    instants = random_instants(1, [None, None, 3, 6, 9, 12, 16, 19, 22])
    messages = interrupt_until_done(config_path, out, signal.SIGKILL, instants)
    assert len(messages) >= 6 and all(code == -signal.SIGKILL for code, _ in messages)
    assert_same_run(reference, out)
    from ecp_lm.cli import main

    assert main(["plot", str(out), "--out", str(tmp_path / "curves.png")]) == 0


def ctrl_c_at(argv, delays, env=None):
    """Run ``ecp ARGV`` once per delay and send SIGINT that long after the interpreter is up;
    returns (exit code, stderr) of each run."""
    results = []
    for delay in delays:
        proc = subprocess.Popen([sys.executable, "-m", "ecp_lm", *map(str, argv)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})})
        wait_until_python_runs(proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)
        results.append((proc.returncode, err))
    return results


def assert_one_line_or_done(results, hint="", at_least=None):
    """Every run either finished (exit 0) or stopped with one ``ecp: interrupted`` line and
    exit 130; at least ``at_least`` of them (default: half) were interrupted."""
    interrupted = 0
    for code, err in results:
        assert "Traceback" not in err, err
        if code == 0:
            continue
        interrupted += 1
        lines = err.strip().splitlines()
        assert code == 130 and len(lines) == 1 and lines[0].startswith("ecp: interrupted"), err
        assert hint in lines[0] or lines[0] == "ecp: interrupted", err
    assert interrupted >= (len(results) // 2 if at_least is None else at_least), results


def test_ctrl_c_during_data_prepare(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"a long line of text for the token cache to hold\n" * 400_000)  # 20 MB

    def command(out):
        return ["data", "prepare", "text", "--path", corpus, "--out", out, "--tokenizer", "bpe",
                "--vocab-size", "300"]

    # Interrupts within the time an uninterrupted build takes on this machine (the faster of
    # two: the first also pays for cold imports), each into its own folder (a finished cache
    # would make every later run return at once).
    took = math.inf
    for i in range(2):
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "ecp_lm", *map(str, command(tmp_path / f"t{i}"))],
                       check=True, capture_output=True)
        took = min(took, time.monotonic() - start)
    rng = random.Random(2)
    results, outs = [], [tmp_path / f"cache{i}" for i in range(6)]
    for out in outs:
        results += ctrl_c_at(command(out), [rng.uniform(0.05, 0.8 * took)])
    # Building the cache is mostly tokenizer training and encoding in native threads, whose
    # length varies from run to run on a shared machine; at least one instant must land in it.
    assert_one_line_or_done(results, "run the same command again", at_least=1)
    for out, (code, _) in zip(outs, results, strict=True):
        if code == 130:  # interrupted: nothing half-built is kept
            assert not out.exists() or (out / "manifest.json").exists()


def test_ctrl_c_during_eval(tmp_path):
    cfg = tiny_run_config(tmp_path, steps=1)
    from ecp_lm.training.loop import train

    train(cfg, tmp_path / "run", progress=False)
    delays = random_instants(3, [None] * 6)
    results = ctrl_c_at(["eval", "--ckpt", tmp_path / "run", "--split", "train", "--quiet",
                         "--batch-size", "1", "--stride", "1"], [d for _, d in delays])
    assert_one_line_or_done(results, "nothing was scored")


def test_demo_interrupted_says_to_rerun_the_same_command(monkeypatch, capsys):
    import ecp_lm.demo
    from ecp_lm.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ecp_lm.demo, "run_demo", interrupted)
    assert main(["demo", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err == "ecp: interrupted; run the same command again to continue where it stopped\n"


def test_ctrl_c_during_a_long_validation_stops_at_once_and_resumes_exactly(tmp_path):
    """A validation of many batches is abandoned at its next batch, not finished first; the
    checkpoint notes it is due, and the resumed run validates that step before going on, so it
    ends as an uninterrupted run: the same weights, validation records and best step."""
    write_corpus(tmp_path / "corpus.txt", n_lines=12_000)  # a validation split of ~30k bytes
    cfg = tiny_run_config(tmp_path, "ecp", steps=3, eval_every=2, checkpoint_every=3,
                          log_every=1, eval_batch_size=1, eval_max_tokens=9_000)
    cfg.to_yaml(tmp_path / "run.yaml")
    reference, out = tmp_path / "reference", tmp_path / "stopped"
    assert start(tmp_path / "run.yaml", reference).wait(timeout=300) == 0
    proc = start(tmp_path / "run.yaml", out)
    while proc.poll() is None and logged_step(out) < 2:  # step 2 is logged, then validated
        time.sleep(0.005)
    time.sleep(0.2)  # into a validation of about 300 batches (over a second, idle)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "Traceback" not in err, err
    stopped = read_checkpoint(out / "latest")
    assert stopped.meta["step"] == 2 and stopped.trainer_state()["validation_due"] is True
    assert read_metrics(out)["valid"] == []  # abandoned, not finished first
    assert start(tmp_path / "run.yaml", out).wait(timeout=300) == 0
    expected, got = read_metrics(reference)["valid"], read_metrics(out)["valid"]
    assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in expected]
    assert read_checkpoint(out / "best").meta["step"] == \
        read_checkpoint(reference / "best").meta["step"]
    for name, tensor in read_checkpoint(reference / "latest").load_model().state_dict().items():
        assert torch.equal(tensor, read_checkpoint(out / "latest").load_model().state_dict()[name])
