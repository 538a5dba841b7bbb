"""What Study II measures beside the test score: training throughput and the same-time step
counts it sets, the loss near and far in a window, the context gain on the same targets, and
the sensitivity check."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ecp_lm.bench.core import BenchSpec, step_seconds
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.experiments.long_context.budgets import (
    ARCHS,
    FULL_ATTENTION,
    REFERENCE,
    Budget,
    run_config,
)
from ecp_lm.experiments.study import write_json
from ecp_lm.plot import read_metrics

SENSITIVE_BITS = 0.02
"""How much lower (bits per byte) the transformer's test score with windows of N must be than with
windows of 2m, on the same targets, in every seed, for the experiment to count as able to see
long context."""


def train_tokens_per_s(run: Path) -> float:
    """The median training throughput logged by the run (validation excluded)."""
    return statistics.median(r["tokens_per_s"] for r in read_metrics(run)["train"])


def measure_throughputs(budget: Budget, out: Path, progress: bool) -> dict[str, float]:
    """Training tokens/s of every architecture at the budget's size, measured one after another
    in this process on random windows (median of 5 steps after 2 untimed ones), before any run
    starts: the same-time comparison's yardstick, free of what else ran beside each training
    run. Kept in ``DIR/throughput.json`` so that a resumed study keeps it."""
    path = out / "throughput.json"
    if path.exists():
        return json.loads(path.read_text())
    spec = BenchSpec(batch_size=budget.train["batch_size"], warmup=2, repeats=5)
    speeds = {}
    for arch in ARCHS:
        cfg = run_config(budget, arch, 0).model
        speeds[arch] = spec.batch_size * cfg.seq_len / step_seconds(cfg, spec)
        if progress:
            print(f"throughput: {arch} {speeds[arch]:,.0f} tokens/s", flush=True)
    write_json(path, speeds)
    return speeds


def same_time_steps(budget: Budget, out: Path, arch: str) -> int:
    """Steps that take ``arch`` as long as the reference's same-token run:
    ``steps × (its tokens/s ÷ the reference's)``, from ``measure_throughputs``."""
    speeds = json.loads((out / "throughput.json").read_text())
    return max(1, round(budget.train["steps"] * speeds[arch] / speeds[REFERENCE]))


def near_far(report: dict[str, Any]) -> dict[str, float | None]:
    """Mean loss over positions [m, 2m) and over [2m, N) of a per-position report."""
    m = report["segment_len"]
    values = report["per_position"]

    def mean(start: int, stop: int) -> float | None:
        scored = [v for v in values[start:stop] if v is not None]
        return statistics.fmean(scored) if scored else None

    near, far = mean(m, 2 * m), mean(2 * m, len(values))
    return {"near_loss": near, "far_loss": far,
            "far_minus_near": None if near is None or far is None else far - near}


def context_gain(path: Path, split: str, model: dict[str, Any], max_tokens: int | None,
                 progress: bool, full: dict[str, Any] | None = None) -> dict[str, float]:
    """What the context beyond 2m is worth, on the same targets: the SPEC §6 score with windows
    of N at stride k (every target seen with N - k to N tokens of context) against windows of
    2m at stride m (m to 2m tokens), in bits per byte. The windows of N score the targets from
    N - k + 1 on; those of 2m would start at m + 1, so they read the stream from N - k - m on and
    score exactly the same targets (checked: the same count, the same bytes). The difference is
    then the model's own use of the longer context, free of the position effects a comparison
    across positions in a window mixes in. ``full``: the score at N, where the caller has it
    already."""
    n = model["seq_len"]
    short = 2 * n // model["num_segments"]
    if full is None:
        full = evaluate_checkpoint(path, split, max_tokens=max_tokens, progress=progress)
    first = n - full["stride"] + 1  # the first target the windows of N score
    cut = evaluate_checkpoint(path, split, seq_len=short, stride=short // 2,
                              max_tokens=max_tokens, progress=progress,
                              start=first - (short - short // 2 + 1))
    same = ("tokens_scored", "bytes_scored")
    if any(cut[k] != full[k] for k in same):
        raise RuntimeError(f"context gain: the windows of {short} scored "
                           f"{[cut[k] for k in same]} targets/bytes, those of {n} "
                           f"{[full[k] for k in same]}")
    return {"bits_at_n": full["bits_per_byte"], "bits_at_2m": cut["bits_per_byte"],
            "context_gain_bits": cut["bits_per_byte"] - full["bits_per_byte"],
            "targets": full["tokens_scored"]}


def sensitivity(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the transformer scores clearly better with N tokens of context than with 2m, on
    the same targets (``context_gain``), in every seed; with the per-position comparison of its
    loss over [2m, N) and over [m, 2m) beside it."""
    runs = [r for r in results if r["compare"] == "tokens" and r["arch"] == FULL_ATTENTION]
    gains = [r["context_gain_bits"] for r in runs]
    return {"context_gain_bits": gains, "far_minus_near": [r["far_minus_near"] for r in runs],
            "threshold_bits": SENSITIVE_BITS,
            "sensitive": bool(gains) and all(g > SENSITIVE_BITS for g in gains)}
