"""Evidence III's recall stage (`python -m ecp_lm.experiments.evidence --stage recall --budget
tiny`) end to end: learning rates chosen on held-out accuracy, three seeds per model and depth
scored on the same held-out sequences, the weights kept and reloadable to the same accuracy,
the tile-matched window at w = m, orderings only where the seeds' ranges separate, and a
resumed stage that trains nothing."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from safetensors.torch import load_file

from ecp_lm import build_model
from ecp_lm.config import ModelConfig
from ecp_lm.experiments.evidence import main
from ecp_lm.experiments.evidence import recall as recall_module
from ecp_lm.experiments.evidence.recall import EVAL_SEED, MODELS, RECALL_BUDGETS
from ecp_lm.experiments.mqar.budgets import BUDGETS
from ecp_lm.experiments.mqar.task import mqar_batch
from ecp_lm.experiments.mqar.train import evaluate
from helpers import committed_copy


def test_tiny_recall_stage(tmp_path, monkeypatch, capsys):
    assert main(["--stage", "recall", "--budget", "tiny", "--out", str(tmp_path / "ev"),
                 "--quiet"]) == 0
    out = tmp_path / "ev" / "recall" / "tiny"
    summary = json.loads((out / "recall.json").read_text())
    budget, task = RECALL_BUDGETS["tiny"], BUDGETS["tiny"]
    assert list(summary["models"]) == list(MODELS)
    held_out = mqar_batch(task.spec, task.train.eval_size,
                          torch.Generator().manual_seed(EVAL_SEED))
    for name, model in summary["models"].items():
        trials = [json.loads((out / "select" / name / f"L{budget.select_depth}" /
                              f"lr{lr:g}" / "result.json").read_text()) for lr in budget.lrs]
        best = max(trials, key=lambda t: (t["accuracy"], -t["loss"], -t["lr"]))
        assert model["lr"] == best["lr"]
        for depth in budget.depths:
            point = model["depths"][str(depth)]
            assert len(point["per_seed"]) == 3
            for seed in range(3):
                folder = out / "runs" / name / f"L{depth}" / f"seed{seed}"
                result = json.loads((folder / "result.json").read_text())
                assert (result["lr"], result["steps"], result["seed"]) == (
                    model["lr"], budget.steps, seed)
                cfg = ModelConfig(**result["config"])
                if name == "sliding_window_tiles":
                    assert cfg.window == task.segment_len
                net = build_model(cfg)
                net.load_state_dict(load_file(folder / "model.safetensors"))
                # the kept weights, scored on the one held-out set, give the recorded accuracy
                assert evaluate(net, held_out)["accuracy"] == result["accuracy"]
    for depth, calls in summary["orderings"].items():
        for call in calls:
            a, _, b = call.split()
            pa, pb = (summary["models"][k]["depths"][depth]["accuracy"] for k in (a, b))
            assert pa["min"] > pb["max"]
    assert "| sliding_window_tiles |" in (out / "recall.md").read_text()
    # Step times: every model at every depth timed in this invocation (step_s.json), each
    # seeds' median training step beside it.
    times = json.loads((out / "step_s.json").read_text())
    assert set(times) == {f"{m}/L{d}" for m in MODELS for d in budget.depths}
    for name, model in summary["models"].items():
        for depth in budget.depths:
            point = model["depths"][str(depth)]
            seeds = [json.loads((out / "runs" / name / f"L{depth}" / f"seed{s}" /
                                 "result.json").read_text())["s_per_step"] for s in range(3)]
            assert point["step_s"] == times[f"{name}/L{depth}"] > 0
            assert point["train_step_s"] == sorted(seeds)[1]
    assert "timed one model after another" in (out / "recall.md").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage trained again")

    monkeypatch.setattr(recall_module, "recall_job", no_training)
    assert recall_module.run_recall("tiny", out) == summary
    monkeypatch.undo()

    # The relay stage on these models: every model and depth, the three seeds, every offset.
    assert main(["--stage", "relay", "--budget", "tiny", "--out", str(tmp_path / "ev")]) == 0
    relay = json.loads((tmp_path / "ev" / "relay" / "tiny" / "relay.json").read_text())
    assert set(relay["table"]) == {f"{m}/L{d}" for m in MODELS for d in budget.depths}
    for row in relay["table"].values():
        for cell in row["offsets"].values():
            assert 0 <= cell["clean"]["mean"] <= 1 and 0 <= cell["path_replaced"]["mean"] <= 1
    assert main(["--stage", "relay", "--budget", "small", "--out", str(tmp_path / "ev")]) == 2
    assert "run --stage recall --budget small" in capsys.readouterr().err

    # Each seed's run took the relay stage's measurements when it was trained; measured again
    # from its kept weights (a result without them), the relay stage's tables are the same.
    for folder in (out / "runs").glob("*/*/seed*"):
        result = json.loads((folder / "result.json").read_text())
        del result["relay"]
        (folder / "result.json").write_text(json.dumps(result))
    assert main(["--stage", "relay", "--budget", "tiny", "--out", str(tmp_path / "ev"),
                 "--quiet"]) == 0
    assert json.loads((tmp_path / "ev" / "relay" / "tiny" / "relay.json").read_text()) == relay


def test_a_committed_recall_stage_goes_on_in_a_new_checkout(tmp_path, monkeypatch):
    """What ``evidence/.gitignore`` lets a commit keep (results and reports, no weights and no
    training state) is enough for a new checkout: the recall stage trains nothing again, and
    the relay stage gives the tables it gave where the weights are."""
    ev, clone = tmp_path / "ev", tmp_path / "clone"
    budget = replace(RECALL_BUDGETS["tiny"], models=("ecp", "transformer"))
    monkeypatch.setitem(RECALL_BUDGETS, "tiny", budget)
    assert main(["--stage", "recall", "--budget", "tiny", "--out", str(ev), "--quiet"]) == 0
    assert main(["--stage", "relay", "--budget", "tiny", "--out", str(ev), "--quiet"]) == 0
    kept = committed_copy(ev, clone)
    assert not [k for k in kept if not k.endswith((".json", ".md", ".gitignore", ".ecp-lm"))]
    runs = len(budget.lrs) + len(budget.depths) * budget.seeds
    assert sum(k.endswith("/result.json") for k in kept) == 2 * runs
    assert not list(clone.rglob("*.safetensors")) and not list(clone.rglob("*.pt"))

    def no_training(*args, **kwargs):
        raise AssertionError("a committed run trained again")

    with monkeypatch.context() as patch:
        patch.setattr(recall_module, "recall_job", no_training)
        assert main(["--stage", "recall", "--budget", "tiny", "--out", str(clone),
                     "--quiet"]) == 0
    assert main(["--stage", "relay", "--budget", "tiny", "--out", str(clone), "--quiet"]) == 0
    for stage, name in (("recall", "recall.json"), ("relay", "relay.json")):
        assert (json.loads((clone / stage / "tiny" / name).read_text())
                == json.loads((ev / stage / "tiny" / name).read_text()))
