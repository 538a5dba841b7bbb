"""Annealed models at several budgets from one stable run (warmup-stable-decay).

Under ``train.schedule: wsd`` the learning rate before the decay does not depend on the run's
length, and training resumes exactly where it stopped, so the model annealed at budget s (a
decay over the last d = round(fraction * s) steps) is the stable run at step s - d, continued
with the schedule of a run of s steps. ``annealed_curve`` trains one stable run up to each
branch point in turn, copies its folder there (``branch``) and finishes the copy with the
decay: every budget point is an annealed model, for the cost of one run plus the decays.

Everything resumes: the stable run and the branches are run folders, a branch is copied into
a temporary sibling and renamed into place (a kill leaves the whole copy or none), and a point
whose branch has finished is not trained again.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.run.config import RunConfig
from ecp_lm.run.folder import CONFIG, has_checkpoint
from ecp_lm.studies.runner import read_json, write_json
from ecp_lm.training.loop import train, train_or_resume

TEMPORARY = ".branching-"
"""Prefix of the temporary copy of a branch being made (ours: removed when found)."""


def decay_steps(steps: int, fraction: float) -> int:
    return max(1, round(steps * fraction))


def wsd_config(cfg: RunConfig, steps: int, fraction: float) -> RunConfig:
    """``cfg`` trained for ``steps`` under warmup-stable-decay, the decay ``fraction`` of it."""
    out = copy.deepcopy(cfg)
    out.train.steps, out.train.schedule = steps, "wsd"
    out.train.decay_steps = decay_steps(steps, fraction)
    return out


def checkpoint_step(run: Path) -> int | None:
    return read_checkpoint(run / "latest").meta["step"] if has_checkpoint(run) else None


def branch(stable: Path, at: int, cfg: RunConfig, out: Path, progress: bool) -> None:
    """Bring the run ``stable`` (trained with ``cfg``) to step ``at`` and copy its folder to
    ``out``; ValueError when the stable run is already past ``at``."""
    step = checkpoint_step(stable)
    if step is None or step < at:
        train(cfg, stable, resume=step is not None, progress=progress, stop_at=at)
    elif step > at:
        raise ValueError(f"{stable} is at step {step}, past the branch point {at} of {out}")
    tmp = out.parent / f"{TEMPORARY}{out.name}-{os.getpid()}"
    shutil.copytree(stable, tmp, symlinks=True)
    os.replace(tmp, out)


def check_started_with(run: Path, cfg: RunConfig) -> None:
    """ValueError when the run folder ``run`` was started at another learning rate or seed
    than ``cfg``'s: a rate chosen anew (another grid) would otherwise resume it at the new rate
    from a checkpoint trained at the old one, and mix the two silently."""
    saved = run / CONFIG
    if not saved.is_file():
        return
    old, new = RunConfig.load(str(saved), saved=True).train, cfg.train
    if (old.lr, old.seed) != (new.lr, new.seed):
        raise ValueError(f"{run} was started at lr {old.lr:g}, seed {old.seed}, not lr "
                         f"{new.lr:g}, seed {new.seed}: move it away or use another --out")


def clear_leftovers(folder: Path) -> None:
    """Remove the temporary copies a killed ``branch`` left in ``folder``."""
    for path in folder.glob(f"{TEMPORARY}*") if folder.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True)


def annealed_curve(cfg: RunConfig, points: Sequence[int], fraction: float, out: Path,
                   measure: Callable[[Path], dict[str, Any]], progress: bool = False
                   ) -> list[dict[str, Any]]:
    """For each budget s of ``points`` (ascending), the annealed model of s steps in
    ``out/decay<s>`` and ``measure(its folder)``; the stable run is ``out/stable``. A point's
    measure is kept in the branch folder's ``measure.json`` so that it is taken once."""
    points = sorted(points)
    out.mkdir(parents=True, exist_ok=True)
    clear_leftovers(out)
    stable_cfg = wsd_config(cfg, points[-1], fraction)
    for run in (out / "stable", *(out / f"decay{steps}" for steps in points)):
        check_started_with(run, cfg)
    results = []
    for steps in points:
        run = out / f"decay{steps}"
        done = run / "measure.json"
        if not done.exists():
            if not run.exists():
                branch(out / "stable", steps - decay_steps(steps, fraction), stable_cfg, run,
                       progress)
            train_or_resume(wsd_config(cfg, steps, fraction), run, progress)
            write_json(done, {"steps": steps, **measure(run)})
        results.append(read_json(done))
    return results

