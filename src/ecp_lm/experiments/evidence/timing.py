"""The step times Evidence III's tables set side by side: one training step of each model at a
stage's size and batch, timed one model after another in one process (``bench.core.
step_seconds``: a fresh model under AdamW, the median of 3 steps after 1 untimed) and kept in
the stage's ``step_s.json``.

A stage's runs may span invocations and sessions, and this machine's pace moves between them by
more than the models differ (the small recall stage took 2,007 s in one session and 1,389 s in
another, with the same results), so the median training steps of runs trained at different
times are not comparable with each other; these times are, and each run's own median stays in
its result. Times kept without one of the models asked for are measured again, all of them.
"""

from __future__ import annotations

import json
from pathlib import Path

from ecp_lm.config import ModelConfig


def timed_steps(models: dict[str, tuple[ModelConfig, int]], path: Path) -> dict[str, float]:
    """Seconds per training step of each ``name: (config, batch size)``, kept in ``path``."""
    from ecp_lm.bench.core import BenchSpec, step_seconds
    from ecp_lm.experiments.study import write_json

    if path.exists():
        kept = json.loads(path.read_text())
        if set(models) <= set(kept):
            return kept
    times = {name: step_seconds(cfg, BenchSpec(batch_size=batch, warmup=1, repeats=3))
             for name, (cfg, batch) in models.items()}
    write_json(path, times)
    return times
