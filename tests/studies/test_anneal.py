"""Annealed models branched off one stable run (warmup-stable-decay) are the runs trained for
their budget from the start: the same weights, for every budget point; the stable run is
trained once; and a branching killed by SIGKILL at random instants resumes to the same
models."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ecp_lm.studies.anneal import annealed_curve, branch, decay_steps, wsd_config
from ecp_lm.training.loop import train
from helpers import run_child, tiny_run_config

POINTS, FRACTION = (4, 8), 0.25  # decays of 1 and 2 steps: branches at steps 3 and 6


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "latest" / "model.safetensors")


def base_config(tmp_path):
    return tiny_run_config(tmp_path, "ecp", steps=8, warmup_steps=2, checkpoint_every=2,
                           eval_every=4, logger="none", lr=3e-3)


def assert_same(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_a_decay_is_a_fraction_of_the_budget_and_at_least_one_step(tmp_path):
    assert [decay_steps(s, FRACTION) for s in (1, 4, 8, 10)] == [1, 1, 2, 2]  # 2.5 rounds to 2
    cfg = base_config(tmp_path)
    wsd = wsd_config(cfg, 4, FRACTION)
    assert (wsd.train.steps, wsd.train.schedule, wsd.train.decay_steps) == (4, "wsd", 1)
    assert (cfg.train.steps, cfg.train.schedule) == (8, "cosine")  # the config is not changed


def test_each_point_is_the_run_of_its_budget(tmp_path):
    cfg = base_config(tmp_path)
    seen = []
    results = annealed_curve(cfg, POINTS, FRACTION, tmp_path / "curve",
                             lambda run: seen.append(run.name) or {"name": run.name})
    assert [r["steps"] for r in results] == list(POINTS) and seen == ["decay4", "decay8"]
    for steps in POINTS:
        fresh = tmp_path / f"fresh{steps}"
        train(wsd_config(cfg, steps, FRACTION), fresh, progress=False)
        assert_same(tmp_path / "curve" / f"decay{steps}", fresh)
    # The stable run stopped at the last branch point, 8 - 2; measures are not taken again.
    stable = json.loads((tmp_path / "curve" / "stable" / "latest" / "meta.json").read_text())
    assert stable["step"] == 6
    again = annealed_curve(cfg, POINTS, FRACTION, tmp_path / "curve", lambda run: 1 / 0)
    assert again == results


def test_a_branch_point_behind_the_stable_run_is_refused(tmp_path):
    cfg = wsd_config(base_config(tmp_path), 8, FRACTION)
    train(cfg, tmp_path / "stable", progress=False, stop_at=4)
    with pytest.raises(ValueError, match="past the branch point 3"):
        branch(tmp_path / "stable", 3, cfg, tmp_path / "decay4", progress=False)


def test_a_run_started_at_another_rate_is_refused(tmp_path):
    """A curve stopped mid-run and asked to go on at another learning rate (a rate chosen
    anew) is refused before any step, at the stable run and at a branch in progress alike;
    at its own rate it goes on."""
    cfg = base_config(tmp_path)
    curve = tmp_path / "curve"
    train(wsd_config(cfg, 8, FRACTION), curve / "stable", progress=False, stop_at=2)
    other = copy.deepcopy(cfg)
    other.train.lr = 2 * cfg.train.lr
    with pytest.raises(ValueError, match=r"stable was started at lr 0\.003, seed"):
        annealed_curve(other, POINTS, FRACTION, curve, lambda run: {})
    assert json.loads((curve / "stable" / "latest" / "meta.json").read_text())["step"] == 2
    branch(curve / "stable", 3, wsd_config(cfg, 8, FRACTION), curve / "decay4", False)
    shutil.rmtree(curve / "stable")  # only the branch in progress is left to refuse
    with pytest.raises(ValueError, match=r"decay4 was started at lr 0\.003"):
        annealed_curve(other, POINTS, FRACTION, curve, lambda run: {})
    assert [r["steps"] for r in annealed_curve(cfg, POINTS, FRACTION, curve,
                                                lambda run: {})] == list(POINTS)


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from helpers import tiny_run_config
from ecp_lm.studies.anneal import annealed_curve
tmp = Path({tmp!r})
cfg = tiny_run_config(tmp, "ecp", steps=8, warmup_steps=2, checkpoint_every=2, eval_every=4,
                      logger="none", lr=3e-3)
annealed_curve(cfg, {points!r}, {fraction!r}, tmp / "killed", lambda run: {{}})
print("done")
"""


def test_branching_survives_sigkill(tmp_path):
    cfg = base_config(tmp_path)
    annealed_curve(cfg, POINTS, FRACTION, tmp_path / "clean", lambda run: {})
    script = CHILD.format(tests=str(Path(__file__).parents[1]), tmp=str(tmp_path),
                          points=POINTS, fraction=FRACTION)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    start = time.perf_counter()  # how long an uninterrupted child takes here, now
    assert not run_child(script.replace('"killed"', '"timed"'))
    whole = time.perf_counter() - start
    rng = random.Random(0)
    killed = 0
    for _ in range(16):  # random instants of the start-up and the training, until three landed
        start = time.perf_counter()
        killed += run_child(script, kill_after=rng.uniform(0.1, 0.6) * whole)
        done = (tmp_path / "killed" / "decay8" / "measure.json").exists()
        if done and killed < 2:  # done before two kills landed (the timed child ran under
            whole = time.perf_counter() - start  # load): start again, timed by this child
            shutil.rmtree(tmp_path / "killed")
            killed = 0
        elif done or killed == 3:
            break
    assert killed >= 2  # each resumed child has less left to do: a late kill may find it done
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
    for steps in POINTS:
        assert_same(tmp_path / "killed" / f"decay{steps}", tmp_path / "clean" / f"decay{steps}")
    assert not list((tmp_path / "killed").glob(".branching-*"))
