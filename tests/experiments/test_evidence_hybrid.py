"""Evidence III's hybrid stage: every hybrid model is three local layers of its kind and one
global layer per unit of four, at every depth the stage trains (the curve's included), and the
tile-matched hybrid window is w = m."""

from __future__ import annotations

import json

import pytest

from ecp_lm.config import ModelConfig, tile_pattern
from ecp_lm.experiments.evidence import recall as recall_module
from ecp_lm.experiments.evidence.curve import CURVE_BUDGETS
from ecp_lm.experiments.evidence.models import HYBRIDS, model_config
from ecp_lm.experiments.evidence.recall import RECALL_BUDGETS
from ecp_lm.experiments.evidence.recall import model_config as recall_config

LOCAL = {"hybrid_ecp": "ecp", "hybrid_sliding_window": "sliding_window",
         "hybrid_sliding_window_tiles": "sliding_window", "hybrid_block_local": "block_local"}


def test_every_hybrid_has_its_global_layer():
    assert set(HYBRIDS) == set(LOCAL)
    for name in ("tiny", "small", "full"):
        budget = CURVE_BUDGETS[f"hybrid-{name}"]
        assert budget.models == HYBRIDS
        recall = RECALL_BUDGETS[f"hybrid-{name}"]
        assert recall.depths == (4, 8) and recall.models == (*HYBRIDS, "transformer")
        for model in HYBRIDS:
            configs = [ModelConfig(**model_config(model, budget.size))]
            configs += [recall_config(recall, model, depth) for depth in recall.depths]
            for cfg in configs:
                layers = tile_pattern(cfg.layer_pattern, cfg.n_layers)
                unit = [LOCAL[model]] * 3 + ["transformer"]
                assert layers == unit * (cfg.n_layers // 4), (model, cfg.n_layers)
                if model == "hybrid_sliding_window_tiles":
                    assert cfg.window == cfg.seq_len // cfg.num_segments


def test_the_stage_runs_recall_and_the_curve_on_the_hybrid_budgets(tmp_path, monkeypatch,
                                                                    capsys):
    from ecp_lm.experiments import evidence
    from ecp_lm.experiments.evidence import curve, recall

    calls = []
    monkeypatch.setattr(recall, "run_recall",
                        lambda name, out, *a: calls.append((name, out, *a[3:])))
    monkeypatch.setattr(curve, "run_curve", lambda name, out, *a: calls.append((name, out)))
    monkeypatch.setattr(recall, "recall_markdown", lambda summary: "")
    monkeypatch.setattr(curve, "curve_markdown", lambda summary: "")
    assert evidence.main(["--stage", "hybrid", "--budget", "small", "--out",
                          str(tmp_path / "ev"), "--quiet"]) == 0
    stage = tmp_path / "ev" / "hybrid" / "small"
    assert calls == [("hybrid-small", stage / "recall", tmp_path / "ev" / "recall" / "small"),
                     ("hybrid-small", stage / "curve")]
    with pytest.raises(SystemExit) as exit_:
        evidence.main(["--stage", "hybrid", "--budget", "huge", "--out", str(tmp_path / "ev")])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def fake_curve(budget, models, bits, points=None):
    """A curve summary as the curve stage writes it, with ``bits[m]`` the seeds' bits/byte
    of model ``m`` at every point."""
    from ecp_lm.experiments.evidence.stats import spread

    points = points or budget.points
    return {"budget": "small", "size": dict(budget.size), "seeds": 3,
            "decay_fraction": budget.decay_fraction, "valid_tokens": budget.valid_tokens,
            "models": {m: {"lr": 2e-3, "costs": {"entries": 0.5}, "step_s": 0.5, "points": {
                str(p): {"bits_per_byte": spread(bits[m]), "context_gain_bits": spread([0.0] * 3),
                         "per_seed": bits[m]} for p in points}} for m in models}}


def test_the_hybrids_curve_sets_the_curve_stages_models_beside_its_own():
    from ecp_lm.experiments.evidence.curve import reference_models, summarise

    budget = CURVE_BUDGETS["hybrid-small"]
    pure = fake_curve(CURVE_BUDGETS["small"], ("ecp", "transformer"),
                      {"ecp": [3.0, 3.1, 3.2], "transformer": [3.5, 3.6, 3.7]},
                      points=(*budget.points, 400))
    beside, note = reference_models(budget, pure)
    assert list(beside) == ["ecp", "transformer"] and "curve stage's own runs" in note
    assert all(set(r["points"]) == set(map(str, budget.points)) and r["from"] == "curve"
               for r in beside.values())  # the hybrids' points only
    assert reference_models(budget, None) == ({}, None)
    assert reference_models(budget, {})[1].startswith("The curve stage has not run")
    for change in ({"size": {**budget.size, "d_model": 64}}, {"seeds": 2},
                   {"valid_tokens": 1024}, {"budget": "tiny"}):
        assert reference_models(budget, {**pure, **change}) == ({}, reference_models(
            budget, {**pure, "seeds": 2})[1])  # not measured alike: nothing beside
    short = fake_curve(CURVE_BUDGETS["small"], ("ecp",), {"ecp": [3.0] * 3}, points=(100,))
    assert reference_models(budget, short)[0] == {}
    # The summary calls orderings across both: every hybrid (3.2-3.4) is ahead of the
    # transformer (3.5-3.7) and level with ECP (3.0-3.2: the ranges touch).
    own = fake_curve(budget, HYBRIDS, {m: [3.2, 3.3, 3.4] for m in HYBRIDS})
    seeds = {f"curve/{m}/seed{s}": {"points": [
        {"steps": p, "bits_per_byte": own["models"][m]["points"][str(p)]["per_seed"][s],
         "context_gain_bits": 0.0} for p in budget.points]} for m in HYBRIDS for s in range(3)}
    trials = {f"select/{m}/lr{lr:g}": {"bits_per_byte": 4.0} for m in HYBRIDS
              for lr in budget.lrs}
    args = (budget, trials, {m: 2e-3 for m in HYBRIDS}, seeds, {m: 0.4 for m in HYBRIDS})
    summary = summarise("hybrid-small", *args, reference=pure)
    for p in map(str, budget.points):
        assert {f"{m} < transformer" for m in HYBRIDS} <= set(summary["orderings"][p])
        assert not [c for c in summary["orderings"][p] if "ecp" in c.split()
                    and set(c.split()) & set(HYBRIDS)]
        assert "ecp < transformer" in summary["orderings"][p]
    alone = summarise("hybrid-small", *args)
    assert "reference" not in alone and not any("transformer" in c for p in alone["orderings"]
                                                for c in alone["orderings"][p])


def test_the_models_beside_the_hybrids_are_timed_with_them(tmp_path, monkeypatch):
    """Equal-time calls across the two stages compare step times taken in one invocation: the
    curve stage's models set beside the hybrids carry the times measured with the hybrids'
    (the machine's speed moves between invocations), not the curve stage's own."""
    from ecp_lm.bench import core
    from ecp_lm.experiments.evidence import curve

    budget = CURVE_BUDGETS["hybrid-small"]
    measured = []

    def fake_step_seconds(cfg, spec):
        measured.append(cfg.layer_pattern or cfg.arch)
        return 0.1

    monkeypatch.setattr(core, "step_seconds", fake_step_seconds)
    (tmp_path / "step_s.json").write_text(json.dumps({m: 0.4 for m in HYBRIDS}))
    times = curve.step_times(budget, tmp_path, ("ecp", "transformer"))
    assert set(times) == {*HYBRIDS, "ecp", "transformer"} and set(times.values()) == {0.1}
    assert measured[-2:] == ["ecp", "transformer"]

    # With the transformer's own step time (0.5 s) a hybrid (0.4 s a step, 3.2-3.4 at every
    # point) is ahead of it (3.5-3.7) at equal time; timed beside the hybrids (0.1 s: its 200
    # steps take half a hybrid's 100) no point of the hybrid took as little time, so no call.
    pure = fake_curve(CURVE_BUDGETS["small"], ("ecp", "transformer"),
                      {"ecp": [3.0, 3.1, 3.2], "transformer": [3.5, 3.6, 3.7]},
                      points=budget.points)
    beside, note = curve.reference_models(budget, pure, {"ecp": 0.1, "transformer": 0.2})
    assert {m: r["step_s"] for m, r in beside.items()} == {"ecp": 0.1, "transformer": 0.2}
    assert "measured again in this invocation" in note
    assert "measured in its invocation" in curve.reference_models(budget, pure)[1]
    own = fake_curve(budget, HYBRIDS, {m: [3.2, 3.3, 3.4] for m in HYBRIDS})
    seeds = {f"curve/{m}/seed{s}": {"points": [
        {"steps": p, "bits_per_byte": own["models"][m]["points"][str(p)]["per_seed"][s],
         "context_gain_bits": 0.0} for p in budget.points]} for m in HYBRIDS for s in range(3)}
    trials = {f"select/{m}/lr{lr:g}": {"bits_per_byte": 4.0} for m in HYBRIDS
              for lr in budget.lrs}
    lrs = {m: 2e-3 for m in HYBRIDS}
    stale = curve.summarise("hybrid-small", budget, trials, lrs, seeds,
                            {m: 0.4 for m in HYBRIDS}, pure)
    fresh = curve.summarise("hybrid-small", budget, trials, lrs, seeds,
                            {**{m: 0.4 for m in HYBRIDS}, "ecp": 0.1, "transformer": 0.1}, pure)
    assert fresh["models"]["transformer"]["step_s"] == 0.1
    assert any(c.startswith("hybrid_ecp < transformer") for c in stale["equal_time"])
    assert not any(c.startswith("hybrid_ecp < transformer") for c in fresh["equal_time"])


def test_the_shared_runs_are_the_transformers_trials_and_l4_seeds():
    for name in ("tiny", "small", "full"):
        b = RECALL_BUDGETS[name]
        expected = [f"select/transformer/L4/lr{lr:g}" for lr in b.lrs] + [
            f"runs/transformer/L4/seed{s}" for s in range(3)]
        assert recall_module.shared_runs(f"hybrid-{name}") == expected
        assert recall_module.shared_runs(name) == []


def fake_recall_job(calls):
    """A recall job that trains nothing: its accuracy says which stage ran it."""
    def job(budget_name, name, depth, seed, lr, steps, folder, relay=False):
        calls.append((budget_name, folder.rsplit("/", 4)[-4:]))
        # the relay stage measures the recall stage's seeds, not the trials or the hybrids
        assert relay == (calls[-1][1][0] == "runs" and not budget_name.startswith("hybrid"))
        cfg = recall_module.model_config(RECALL_BUDGETS[budget_name], name, depth)
        own = 0.25 if budget_name.startswith("hybrid") else 0.5
        return {"model": name, "n_layers": depth, "seed": seed, "lr": lr, "steps": steps,
                "config": cfg.to_dict(), "accuracy": own + lr, "loss": 1.0 - lr,
                "accuracy_by_offset": {}, "curve": [], "s_per_step": 0.1}
    return job


def test_the_hybrid_stage_reads_the_recall_stages_shared_runs(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(recall_module, "recall_job", fake_recall_job(calls))
    reference = tmp_path / "recall" / "tiny"
    recall_module.run_recall("tiny", reference)
    calls.clear()
    summary = recall_module.run_recall("hybrid-tiny", tmp_path / "hybrid", reference=reference)
    trained = {"/".join(folder) for _, folder in calls}
    shared = set(recall_module.shared_runs("hybrid-tiny"))
    every = set(recall_module.run_specs(RECALL_BUDGETS["hybrid-tiny"]))
    assert trained == every - shared and len(shared) == 5
    assert summary["borrowed"] == {"from": str(reference), "runs": sorted(shared)}
    transformer = summary["models"]["transformer"]
    assert transformer["depths"]["4"]["per_seed"] == [0.5 + transformer["lr"]] * 3
    assert transformer["depths"]["8"]["per_seed"] == [0.25 + transformer["lr"]] * 3
    assert "read from" in recall_module.recall_markdown(summary)
    # A reference run trained with another model config is not the same run: trained here.
    path = reference / "runs" / "transformer" / "L4" / "seed1" / "result.json"
    result = json.loads(path.read_text())
    path.write_text(json.dumps({**result, "config": {**result["config"], "d_model": 8}}))
    calls.clear()
    again = recall_module.run_recall("hybrid-tiny", tmp_path / "hybrid2", reference=reference)
    assert sorted(again["borrowed"]["runs"]) == sorted(shared - {"runs/transformer/L4/seed1"})
    assert ("hybrid-tiny", ["runs", "transformer", "L4", "seed1"]) in calls
    # Without a reference (or before the recall stage has run) the hybrid trains them all.
    calls.clear()
    alone = recall_module.run_recall("hybrid-tiny", tmp_path / "hybrid3",
                                     reference=tmp_path / "nothing")
    assert "borrowed" not in alone and len(calls) == len(every)
