"""One entry of the study: train it (or resume it), then score its best checkpoint on test."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint, per_position_checkpoint
from ecp_lm.experiments.long_context.budgets import Budget, run_config
from ecp_lm.experiments.long_context.measure import (
    context_gain,
    near_far,
    same_time_steps,
    train_tokens_per_s,
)
from ecp_lm.experiments.study import write_json
from ecp_lm.model.archs import architecture
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train_or_resume


def run_entry(budget: Budget, entry: dict[str, Any], out: Path, progress: bool
              ) -> dict[str, Any]:
    """Train one entry (or resume it), then score its best checkpoint once on test. The
    same-token runs carry the context questions, so only they are also scored with windows of 2m
    and of 2N, 4N; a same-time run gets its score and its loss against position."""
    start = time.perf_counter()
    run = out / entry["name"]
    steps = same_time_steps(budget, out, entry["arch"]) if entry["compare"] == "time" else None
    cfg = run_config(budget, entry["arch"], entry["seed"], steps)
    train_or_resume(cfg, run, progress)
    best = run / "best"
    report = evaluate_checkpoint(best, "test", max_tokens=budget.test_max_tokens,
                                 progress=progress)
    positions = per_position_checkpoint(best, "test", max_tokens=budget.test_max_tokens,
                                        progress=progress)
    write_json(run / "per_position.json", positions)
    tokens = read_checkpoint(run / "latest").meta["tokens_seen"]
    result = {**entry, "steps": cfg.train.steps, "params": report["params"],
              "best_step": report["step"], "bits_per_byte": report["bits_per_byte"],
              "test_loss": report["loss"], "tokens_scored": report["tokens_scored"],
              "train_tokens": tokens, "train_tokens_per_s": train_tokens_per_s(run),
              "train_s": tokens / train_tokens_per_s(run),
              "attention_ratio_to_full": attention_cost(cfg.model).ratio_to_full,
              **near_far(positions), "context_gain_bits": None, "bits_at_2m": None,
              "longer": {}}
    if entry["compare"] == "tokens":
        gain = context_gain(best, "test", budget.model, budget.test_max_tokens, progress,
                            report)
        result.update(context_gain_bits=gain["context_gain_bits"],
                      bits_at_2m=gain["bits_at_2m"])
        if architecture(cfg.model.arch)(cfg.model).max_len is None:
            for k in budget.longer:
                longer = per_position_checkpoint(best, "test", seq_len=k * cfg.model.seq_len,
                                                 max_tokens=budget.test_max_tokens,
                                                 progress=progress)
                write_json(run / f"per_position_{k}N.json", longer)
                result["longer"][f"{k}N"] = {"loss": longer["loss"], **near_far(longer)}
    result["wall_s"] = time.perf_counter() - start
    return result
