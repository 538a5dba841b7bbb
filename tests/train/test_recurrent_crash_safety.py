"""Crash safety of the recurrent mixers and a hybrid of them, for real: training in a subprocess,
by ``ecp train`` and by ``ecp_lm.train`` in turn, receives SIGINT and SIGKILL at random
instants and is started again (resuming the folder once it holds a run); it ends with exactly
the weights, best checkpoint and metrics of an uninterrupted run, dropout on. A full disk and a
read-only folder under the same training are one line, the last good checkpoint intact and
named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ecp_lm.run.checkpoint import read_checkpoint
from helpers import in_namespace, tiny_run_config, tree_hashes
from interrupting import assert_same_run, interrupt_until_done, random_instants

STEPS = 10
ARCHS = {"mamba2": [], "gated_deltanet": [], "rwkv7": [],
         "hybrid": ["model.layer_pattern=mamba2,gated_deltanet,rwkv7,ecp", "model.n_layers=4"]}
API = """
import sys

import ecp_lm
from ecp_lm.interrupts import Interrupted

config, out, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
try:
    ecp_lm.train(config, out=out, resume=resume)
except Interrupted as err:
    print(f"interrupted, checkpoint {err.saved_step}", file=sys.stderr)
    sys.exit(err.exit_code)
"""


def run_config(tmp_path, arch: str):
    name, overrides = ("hybrid" if arch == "hybrid" else arch), ARCHS[arch]
    cfg = tiny_run_config(tmp_path, name, ["model.dropout=0.1", *overrides], steps=STEPS,
                          checkpoint_every=3, eval_every=4, log_every=1)
    path = tmp_path / f"{arch}.yaml"
    cfg.to_yaml(path)
    return path


def start(config_path, out, api: bool) -> subprocess.Popen:
    """``ecp train`` or a script calling ``ecp_lm.train``, resuming once ``out`` holds a run."""
    resume = (out / "config.yaml").exists()
    if api:
        script = out.parent / "train_api.py"
        script.write_text(API)
        argv = [sys.executable, str(script), str(config_path), str(out), str(int(resume))]
    else:
        argv = [sys.executable, "-m", "ecp_lm", "train", "--config", str(config_path), "--out",
                str(out), "--quiet", *(["--resume"] if resume else [])]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=default_sigint)


def default_sigint() -> None:
    """In the child: SIGINT's default action, as under a terminal. A suite started from a
    background shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_sigint_and_sigkill_through_both_entry_points_resume_exactly(tmp_path, arch):
    """Eight interruptions, alternating SIGINT and SIGKILL and, by pairs, the command line and
    the Python API, so that each signal meets each entry point; then the run to its end."""
    config_path = run_config(tmp_path, arch)
    reference = tmp_path / "reference"
    proc = start(config_path, reference, api=False)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    out = tmp_path / "interrupted"
    steps = [None, None, 1, 3, 4, 6, 8, 9]
    signals = [signal.SIGINT, signal.SIGKILL] * 4
    instants = [(step, delay, signum) for (step, delay), signum
                in zip(random_instants(len(arch), steps), signals, strict=True)]
    stopped = interrupt_until_done(
        lambda attempt: start(config_path, out, api=attempt % 4 >= 2), out, instants)
    assert len(stopped) >= 5, stopped
    for code, err in stopped:
        # 130: the run stopped at a step boundary; before the run began, Python's own
        # KeyboardInterrupt: the script ends by the signal (-SIGINT), or the interpreter's
        # start-up fails (1)
        assert code in (130, -signal.SIGINT, -signal.SIGKILL) or (
            code == 1 and err.rstrip().endswith("KeyboardInterrupt")), err
        if code == 130:
            assert "Traceback" not in err, err
    assert_same_run(reference, out, STEPS)


@pytest.fixture
def mixer_run(tmp_path):
    """A hybrid of the three mixers, stopped at step 2 with its checkpoint."""
    config_path = run_config(tmp_path, "hybrid")
    from ecp_lm.cli import main

    assert main(["train", "--config", str(config_path), "--out", str(tmp_path / "run"),
                 "--quiet", "--stop-at", "2"]) == 0
    return tmp_path / "run"


def test_a_full_disk_under_the_api_is_one_line_and_keeps_the_checkpoint(mixer_run, tmp_path):
    """``ecp_lm.train`` resuming the hybrid on a tmpfs with room for the run, not for its next
    checkpoint: one exception of one line naming the disk's error and the checkpoint kept, which
    is intact; with room again, the run resumes from it."""
    latest = tree_hashes(read_checkpoint(mixer_run / "latest").directory)
    size = int(subprocess.run(["du", "-sk", str(mixer_run)], capture_output=True, text=True,
                              check=True).stdout.split()[0]) + 150
    (tmp_path / "resume.py").write_text(
        "import sys\nimport ecp_lm\n"
        "try:\n    ecp_lm.train(out='disk/run', resume=True)\n"
        "except Exception as err:\n"
        "    print(f'{type(err).__name__}: {err}', file=sys.stderr)\n    sys.exit(1)\n")
    done = in_namespace(f"mkdir disk && mount -t tmpfs -o size={size}k none disk && "
                        f"cp -a run disk/run && {sys.executable} resume.py; code=$?; "
                        f"cp -a disk/run after; exit $code", tmp_path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "No space left on device" in done.stderr and "step 2" in done.stderr, done.stderr
    assert "latest" in done.stderr, done.stderr
    after = tmp_path / "after"
    assert tree_hashes(read_checkpoint(after / "latest").directory) == latest
    import ecp_lm

    assert ecp_lm.train(out=after, resume=True).step == STEPS


def test_a_read_only_folder_is_one_line_and_keeps_the_checkpoint(mixer_run, tmp_path):
    """The run's folder mounted read-only (not even root writes it): ``ecp train --resume`` and
    ``ecp_lm.train`` each stop with one line naming the folder, before any step, and the
    checkpoint is as it was."""
    latest = tree_hashes(read_checkpoint(mixer_run / "latest").directory)
    (tmp_path / "resume.py").write_text(
        "import sys\nimport ecp_lm\n"
        "try:\n    ecp_lm.train(out='run', resume=True)\n"
        "except ValueError as err:\n    print(f'ValueError: {err}', file=sys.stderr)\n"
        "    sys.exit(2)\n")
    done = in_namespace(f"mount --bind run run && mount -o remount,bind,ro run && "
                        f"$ECP train --resume --out run --quiet; echo \"cli=$?\" > codes; "
                        f"{sys.executable} resume.py; echo \"api=$?\" >> codes", tmp_path)
    codes = dict(line.split("=") for line in (tmp_path / "codes").read_text().split())
    assert codes == {"cli": "2", "api": "2"}, (codes, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in done.stderr, done.stderr
    for line in lines:
        assert "run" in line and ("read-only" in line.lower() or "cannot write" in line), line
    assert tree_hashes(read_checkpoint(mixer_run / "latest").directory) == latest
