"""Evidence III's implicit-dropout stage (`--stage dropout --budget tiny`) end to end on the
real corpus (enwiki-mini, fetched through the package registry; marked ``integration``): the
overfitting corpus is a prefix of each split cut at a line end, every run scores validation
and its training text at every epoch, the gap is their difference, and a resumed stage trains
nothing."""

from __future__ import annotations

import json

import pytest
from test_integration import fetched

from ecp_lm.experiments.evidence import dropout as dropout_module
from ecp_lm.experiments.evidence import main
from ecp_lm.experiments.evidence.dropout import (
    DROPOUT_BUDGETS,
    DROPOUTS,
    FILES,
    MODELS,
    steps_per_epoch,
)
from ecp_lm.run.config import RunConfig
from helpers import committed_copy

pytestmark = pytest.mark.integration


def test_tiny_dropout_stage(tmp_path, monkeypatch):
    from ecp_lm.data.sources import open_source

    source = fetched(lambda: open_source("enwiki-mini"))
    budget = DROPOUT_BUDGETS["tiny"]
    assert main(["--stage", "dropout", "--budget", "tiny", "--out", str(tmp_path / "ev"),
                 "--quiet"]) == 0
    out = tmp_path / "ev" / "dropout" / "tiny"
    for split, name in FILES.items():
        data = (out / "corpus" / name).read_bytes()
        limit = budget.train_bytes if split == "train" else budget.eval_bytes
        whole = b"".join(source.chunks(split))
        assert whole.startswith(data) and data.endswith(b"\n")
        assert limit - 4096 < len(data) <= limit  # cut at the last line end before the limit
    summary = json.loads((out / "dropout.json").read_text())
    epoch = steps_per_epoch(budget)
    assert set(summary["table"]) == {f"{a}/{d:g}" for a in MODELS for d in DROPOUTS}
    for arch in MODELS:
        for dropout in DROPOUTS:
            for seed in range(3):
                folder = out / "runs" / arch / f"dropout{dropout:g}" / f"seed{seed}"
                result = json.loads((folder / "result.json").read_text())
                cfg = RunConfig.load(str(folder / "run" / "config.yaml"), saved=True)
                assert (cfg.model.arch, cfg.model.dropout, cfg.train.seed) == (
                    "sliding_window" if arch.startswith("sliding") else arch, dropout, seed)
                m = budget.size["seq_len"] // budget.size["num_segments"]
                if arch == "sliding_window_tiles":  # matched in tiles: w = m
                    assert cfg.model.window == m
                elif arch == "sliding_window":  # matched in entries: the default, wider
                    assert cfg.model.window is None or cfg.model.window > m
                assert [c["step"] for c in result["curve"]] == [
                    epoch * (k + 1) for k in range(budget.epochs)]
                for c in result["curve"]:
                    assert c["gap_bits"] == c["valid_bits"] - c["train_bits"]
                assert result["best_valid_bits"] == min(c["valid_bits"]
                                                        for c in result["curve"])
    # The two predictions for each other model, each one's best dropout, each cell's turn.
    assert len(summary["findings"]) == 2 * (len(MODELS) - 1) + len(MODELS) + len(summary["table"])
    for row in summary["table"].values():
        assert [e["epoch"] for e in row["by_epoch"]] == [k + 1.0 for k in range(budget.epochs)]
    assert summary["costs"]["transformer"]["entries"] > summary["costs"]["ecp"]["entries"]
    times = json.loads((out / "step_s.json").read_text())  # every cell timed in one invocation
    assert set(times) == {f"{a}/{p:g}" for a in MODELS for p in DROPOUTS}
    for key, row in summary["table"].items():
        assert row["step_s"] == times[key] > 0 and row["train_step_s"] > 0
    assert "timed one model after another" in (out / "dropout.md").read_text()
    assert "| ecp | 0.1 |" in (out / "dropout.md").read_text()
    assert "| ecp | 0.1 | gap |" in (out / "dropout.md").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage trained again")

    monkeypatch.setattr(dropout_module, "dropout_job", no_training)
    assert dropout_module.run_dropout("tiny", out) == summary
    # A new checkout of what a commit keeps (evidence/.gitignore: results and reports; no
    # checkpoints, logs or corpus) trains nothing and writes the same summary.
    committed_copy(tmp_path / "ev", tmp_path / "clone")
    assert not (tmp_path / "clone" / "dropout" / "tiny" / "corpus").exists()
    assert dropout_module.run_dropout("tiny", tmp_path / "clone" / "dropout" / "tiny") == summary
