"""Study II (`python -m ecp_lm.experiments.long_context --budget tiny`): every stage end to end on
the real long-document corpus, fetched through the package registry (marked ``integration``)."""

import json

import pytest
from test_integration import fetched

from ecp_lm.experiments.long_context import (
    ARCHS,
    BUDGETS,
    REFERENCE,
    entries,
    run_scaling,
    run_study,
)

pytestmark = pytest.mark.integration


def test_tiny_budget_runs_every_stage_and_resumes(tmp_path, monkeypatch):
    from ecp_lm.data.sources import open_source
    from ecp_lm.experiments import long_context
    from ecp_lm.experiments.long_context import entry  # noqa: F401 (patched below)

    fetched(lambda: open_source("sympy-code"))
    out = tmp_path / "study"
    points = run_scaling("tiny", out, progress=False)
    assert [p["steps"] for p in points] == list(BUDGETS["tiny"].scaling)
    assert (out / "scaling" / "transformer" / "scaling.png").exists()
    points += run_scaling("tiny", out, progress=False, arch="ecp")  # on the same curve
    assert [p["arch"] for p in points] == ["transformer"] * 2 + ["ecp"] * 2
    assert all(p["context_gain_bits"] is not None for p in points)
    summary = run_study("tiny", out, progress=False)
    assert summary["scaling"] == points and "Against the training budget" in (
        out / "results.md").read_text()
    runs = summary["runs"]
    assert [r["name"] for r in runs] == [e["name"] for e in entries(BUDGETS["tiny"])]
    assert {r["arch"] for r in runs} == set(ARCHS)
    assert len({r["params"] for r in runs}) == 1  # matched sizes
    same_tokens = [r for r in runs if r["compare"] == "tokens"]
    assert len({r["train_tokens"] for r in same_tokens}) == 1
    # Same time: steps scale with each architecture's throughput relative to the reference's.
    # (the throughputs measured one after another before the runs, kept for a resumed study)
    speed = json.loads((out / "throughput.json").read_text())
    assert set(speed) == set(ARCHS) and min(speed.values()) > 0
    assert summary["throughput"] == speed
    for r in runs:
        if r["compare"] == "time":
            expected = round(BUDGETS["tiny"].train["steps"] * speed[r["arch"]] / speed[REFERENCE])
            assert r["steps"] == max(1, expected), r["name"]
    for r in same_tokens:
        report = json.loads((out / r["name"] / "per_position.json").read_text())
        assert report["kind"] == "per_position" and report["window"] == 128
        # Architectures without a length limit are also scored at 2N.
        assert (r["longer"] != {}) == (r["arch"] not in ("transformer", "perceiver_ar"))
    assert isinstance(summary["sensitivity"]["sensitive"], bool)
    for r in runs:  # the paired measure: the same targets scored with windows of 2m and of N
        if r["compare"] == "tokens":
            assert r["context_gain_bits"] == r["bits_at_2m"] - r["bits_per_byte"]
        else:  # the same-time runs answer the score question only
            assert r["context_gain_bits"] is None and r["longer"] == {}
        assert r["wall_s"] > 0
    text = (out / "results.md").read_text()
    assert "## Sensitivity" in text and "## Same training time" in text
    for name in ("per_position_tokens.png", "per_position_time.png", "learning_curves.png",
                 "mqar/results.md"):
        assert (out / name).exists(), name

    def no_training(*args, **kwargs):
        raise AssertionError("a finished study trained again")

    monkeypatch.setattr(long_context.entry, "train_or_resume", no_training)
    assert run_study("tiny", out, progress=False)["runs"] == runs
    monkeypatch.undo()

    # --jobs 2: the same entries and results (up to the rounding of another thread count), in
    # worker processes; a same-time run would fail to start before the throughputs it needs.
    parallel = run_study("tiny", tmp_path / "parallel", progress=False, jobs=2, threads=1)
    assert [r["name"] for r in parallel["runs"]] == [r["name"] for r in runs]
    for a, b in zip(runs, parallel["runs"], strict=True):
        if a["compare"] == "tokens":
            assert abs(a["bits_per_byte"] - b["bits_per_byte"]) < 1e-3, a["name"]
        assert (tmp_path / "parallel" / a["name"] / "result.json").exists()
    assert (tmp_path / "parallel" / "mqar" / "results.md").exists()
