"""``--plan``: a stage's training steps per model, counted by hand here from the tiny budgets
(points, decays, trials, seeds, epochs), and the hours as steps times the measured step time
spread over the jobs."""

from __future__ import annotations

import pytest

from ecp_lm.experiments import evidence
from ecp_lm.experiments.evidence import plan as plan_module


@pytest.fixture
def fixed_step(monkeypatch):
    """Every model's step takes 0.5 s per example of its batch (no timing in a test)."""
    import ecp_lm.bench.core as core

    monkeypatch.setattr(core, "step_seconds", lambda cfg, spec: 0.5 * spec.batch_size)


def steps(stage: str) -> dict[str, int]:
    return {w.model: w.steps for w in plan_module.stage_work(stage, "tiny")}


def test_steps_counted_by_hand():
    # curve tiny: points 4 and 8, decays of a fifth (1 and 2 steps): a stable run to 6 plus
    # decays of 1 and 2 is 9 steps per seed, 3 seeds; 2 trials of 4 steps.
    assert steps("curve") == {m: 9 * 3 + 2 * 4 for m in (
        "ecp", "sliding_window", "sliding_window_tiles", "transformer", "s2")}
    # recall tiny: 3 seeds of 40 steps at L = 2 and 4, 2 trials of 20 at L = 4.
    recall = steps("recall")
    assert len(recall) == 10
    assert recall["ecp L2"] == 3 * 40 and recall["ecp L4"] == 3 * 40 + 2 * 20
    # dropout tiny: 16,384 bytes in batches of 32 x 64 is 8 steps an epoch, 2 epochs, 3 seeds,
    # for each rate apart, each timed at its own rate.
    assert steps("dropout") == {f"{a} dropout {p}": 8 * 2 * 3 for a in
                                ("ecp", "sliding_window", "sliding_window_tiles", "transformer")
                                for p in (0, 0.1, 0.2)}
    assert {w.cfg.dropout for w in plan_module.stage_work("dropout", "tiny")} == {0, 0.1, 0.2}
    # hybrid: recall at L = 4 (trials there) and 8, then the curve at 4 layers; the
    # transformer's trials and L = 4 seeds are the recall stage's runs, not counted again.
    hybrid = plan_module.stage_work("hybrid", "tiny")
    assert {w.model: w.steps for w in hybrid[:9]} == {
        **{f"{m} L4": 3 * 40 + 2 * 20 for m in ("hybrid_ecp", "hybrid_sliding_window",
                                                  "hybrid_sliding_window_tiles",
                                                  "hybrid_block_local")},
        **{f"{m} L8": 3 * 40 for m in ("hybrid_ecp", "hybrid_sliding_window",
                                        "hybrid_sliding_window_tiles", "hybrid_block_local",
                                        "transformer")}}
    assert [w.steps for w in hybrid[9:]] == [35] * 4
    assert all(w.cfg.n_layers == 4 for w in hybrid[9:])
    assert plan_module.stage_work("relay", "tiny") == []


def test_hours_are_steps_times_step_time_over_jobs(fixed_step, capsys):
    p = plan_module.plan("dropout", "tiny", jobs=2, threads=1)
    assert [r["step_s"] for r in p["rows"]] == [16.0] * 12  # batch 32
    assert p["hours"] == pytest.approx(12 * 48 * 16.0 / 3600 / 2)
    assert evidence.main(["--stage", "dropout", "--budget", "tiny", "--plan", "--jobs", "2",
                          "--threads", "1", "--out", "/nonexistent/not-written"]) == 0
    text = capsys.readouterr().out
    assert "| transformer dropout 0.2 | 48 | 16.000 | 0.21 |" in text
    assert "About 1.3 hours at 2 job" in text


def test_all_runs_every_stage_after_the_stages_it_reads(fixed_step, tmp_path, monkeypatch,
                                                         capsys):
    calls = []
    monkeypatch.setattr(evidence, "run_stage",
                        lambda stage, args, out, threads: calls.append((stage, out)))
    assert evidence.main(["--stage", "all", "--budget", "tiny", "--out", str(tmp_path / "ev"),
                          "--quiet"]) == 0
    order = ["recall", "relay", "curve", "dropout", "hybrid"]  # relay reads recall, hybrid both
    assert calls == [(stage, tmp_path / "ev" / stage / "tiny") for stage in order]
    # --plan: every stage's plan, one after another, in that order; nothing is written
    assert evidence.main(["--stage", "all", "--budget", "tiny", "--plan", "--jobs", "2",
                          "--out", str(tmp_path / "none")]) == 0
    text = capsys.readouterr().out
    heads = [text.index(f"`--stage {stage} --budget tiny`") for stage in order]
    assert heads == sorted(heads) and not (tmp_path / "none").exists()
