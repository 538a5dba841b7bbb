"""Evidence III's scaling-curve stage (`python -m ecp_lm.experiments.evidence --stage curve
--budget tiny`) end to end on the real long-document corpus, fetched through the package
registry (marked ``integration``): learning rates chosen on validation, three seeds per model,
every budget point an annealed model, costs three ways, orderings only where the seeds'
ranges separate, and a resumed stage that trains nothing."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from test_integration import fetched

from ecp_lm.experiments.evidence import curve as curve_module
from ecp_lm.experiments.evidence import main
from ecp_lm.experiments.evidence.curve import CURVE_BUDGETS, MODELS
from ecp_lm.plot import read_metrics
from ecp_lm.run.config import RunConfig
from helpers import committed_copy

pytestmark = pytest.mark.integration


def test_tiny_curve_runs_every_step_and_resumes(tmp_path, monkeypatch, capsys):
    from ecp_lm.data.sources import open_source

    fetched(lambda: open_source("sympy-code"))
    budget = CURVE_BUDGETS["tiny"]
    assert main(["--stage", "curve", "--budget", "tiny", "--out", str(tmp_path / "ev"),
                 "--quiet"]) == 0
    out = tmp_path / "ev" / "curve" / "tiny"
    summary = json.loads((out / "curve.json").read_text())
    assert list(summary["models"]) == list(MODELS) and summary["seeds"] == 3
    m = budget.size["seq_len"] // budget.size["num_segments"]
    for name, model in summary["models"].items():
        trials = {float(lr): bits for lr, bits in model["trials"].items()}
        assert set(trials) == set(budget.lrs)
        assert model["lr"] == min(trials, key=lambda lr: (trials[lr], lr))  # the best on valid
        assert set(model["points"]) == {str(p) for p in budget.points}
        for point in model["points"].values():
            assert len(point["per_seed"]) == 3 and point["bits_per_byte"]["n"] == 3
            assert point["bits_per_byte"]["min"] == min(point["per_seed"])
        for seed in range(3):  # each point: its own annealed run, decayed to 0 at its end
            for steps in budget.points:
                run = out / "curve" / name / f"seed{seed}" / f"decay{steps}"
                train = read_metrics(run)["train"]
                assert train[-1]["step"] == steps and train[-1]["lr"] == 0.0
                assert max(r["lr"] for r in train) == model["lr"]
        assert model["costs"]["entries"] > 0 and model["step_s"] > 0
    tiles = RunConfig.load(str(out / "curve" / "sliding_window_tiles" / "seed0" / "decay4" /
                               "config.yaml"), saved=True)
    assert (tiles.model.arch, tiles.model.window) == ("sliding_window", m)
    assert summary["models"]["sliding_window_tiles"]["costs"]["window"] == m
    assert summary["models"]["sliding_window"]["costs"]["window"] > m
    seeds = [load_file(out / "curve" / "ecp" / f"seed{s}" / "decay8" / "latest" /
                       "model.safetensors")["embed.weight"] for s in range(3)]
    assert not seeds[0].equal(seeds[1]) and not seeds[1].equal(seeds[2])  # three seeds
    for steps, calls in summary["orderings"].items():
        for call in calls:
            a, _, b = call.split()
            pa, pb = (summary["models"][k]["points"][steps]["bits_per_byte"] for k in (a, b))
            assert pa["max"] < pb["min"]
    text = (out / "curve.md").read_text()
    assert "| sliding_window_tiles |" in text and "Orderings called" in text
    assert "At equal training time" in text and isinstance(summary["equal_time"], list)
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage trained again")

    monkeypatch.setattr(curve_module, "annealed_curve", no_training)
    monkeypatch.setattr(curve_module, "select_job", no_training)
    again = curve_module.run_curve("tiny", out)
    assert again == summary
    # A new checkout of what a commit keeps (evidence/.gitignore: results, step times and
    # reports, no checkpoints) trains nothing and writes the same summary.
    committed_copy(tmp_path / "ev", tmp_path / "clone")
    assert not list((tmp_path / "clone").rglob("*.safetensors"))
    assert curve_module.run_curve("tiny", tmp_path / "clone" / "curve" / "tiny") == summary
