"""``python -m ecp_lm.studies``: a folder that is not the study's is refused in one line, bad
options exit 2, the report needs its stages, ``--stage all`` runs every stage in the spec's
order (each timed) before the report, and ``--plan`` prints each stage's training steps,
counted by hand here from the tiny budget, times the measured step time over the jobs,
without writing anything."""

from __future__ import annotations

import json
import os

import pytest

from ecp_lm.studies.__main__ import main

PROG = "python -m ecp_lm.studies: error:"


def test_a_folder_not_its_own_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("not ecp's")
    assert main(["evidence4", "--stage", "language", "--budget", "tiny", "--out",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PROG) and "mine.txt" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]  # nothing written


@pytest.mark.parametrize(("argv", "names"), [
    (["evidence4", "--stage", "everything"], "--stage everything"),
    (["evidence4", "--stage", "all", "--jobs", "0"], "--jobs 0"),
    (["evidence4", "--stage", "all", "--threads", "0"], "--threads 0"),
    (["evidence4", "--budget", "tiny"], "--stage"),
])
def test_bad_options_exit_2(argv, names, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "e")])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(PROG) and names in last
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(("study", "budget", "message"), [
    ("evidence9", "tiny", "unknown study 'evidence9': studies are evidence4, evidence5, or a "
                          ".py file"),
    ("evidence4", "huge", "study evidence4 has no budget 'huge'; budgets: tiny, small, full"),
    ("missing.py", "tiny", "missing.py does not exist"),
    ("empty.py", "tiny", "empty.py defines no STUDY"),
])
def test_an_unknown_study_or_budget_is_one_line(study, budget, message, tmp_path, capsys):
    (tmp_path / "empty.py").write_text("STUDY = None\n")
    if study.endswith(".py"):
        study = str(tmp_path / study)
    assert main([study, "--stage", "report", "--budget", budget, "--out",
                 str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PROG) and message in err[0]
    assert not (tmp_path / "e").exists()


def test_the_report_needs_its_stages(tmp_path, capsys):
    assert main(["evidence4", "--stage", "report", "--budget", "tiny", "--out",
                 str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run them first" in err[0]
    assert not (tmp_path / "e" / "report").exists()


def test_all_runs_every_stage_in_order_each_timed_then_the_report(tmp_path, monkeypatch,
                                                                  capsys):
    calls = []

    def stage_run(stage, out, jobs, threads, progress):
        calls.append((stage.name, out, jobs, threads, progress))

    monkeypatch.setattr("ecp_lm.studies.language.run_language", stage_run)
    monkeypatch.setattr("ecp_lm.studies.recall.run_recall", stage_run)
    out = tmp_path / "e"
    # Nothing was trained, so the report that follows the stages has nothing to read.
    assert main(["evidence4", "--stage", "all", "--budget", "tiny", "--out", str(out),
                 "--quiet"]) == 2
    assert "run them first" in capsys.readouterr().err
    assert calls == [("language", out / "language" / "tiny", 1, None, False),
                     ("recall", out / "recall" / "tiny", 1, None, False)]
    for stage in ("language", "recall"):
        entries = json.loads((out / stage / "tiny" / "invocations.json").read_text())
        assert [e["jobs"] for e in entries] == [1]
    calls.clear()
    assert main(["evidence4", "--stage", "recall", "--budget", "tiny", "--out", str(out),
                 "--jobs", "2"]) == 0
    assert calls == [("recall", out / "recall" / "tiny", 2,
                      max(1, (os.cpu_count() or 1) // 2), True)]
    entries = json.loads((out / "recall" / "tiny" / "invocations.json").read_text())
    assert [e["jobs"] for e in entries] == [1, 2]  # a resumed stage took the sum


def test_the_plan_counts_each_stages_steps_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """Every step takes 0.5 s per example of its batch here (nothing is timed). Language tiny:
    points 4 and 8, decays of a fifth (1 and 2 steps): a stable run to 6 plus the two decays is
    9 steps a seed, 2 seeds, and 2 rates x 2 selection seeds x 4 steps of trials: 34 steps of
    batch 2. Recall tiny: 2 seeds of 30 steps at L = 2 and 4, the trials (2 rates x 2 seeds x
    15 steps) at L = 4 only, batch 8; no perceiver_ar."""
    import ecp_lm.bench.core as core

    monkeypatch.setattr(core, "step_seconds", lambda cfg, spec: 0.5 * spec.batch_size)
    out = tmp_path / "e"
    assert main(["evidence4", "--stage", "all", "--budget", "tiny", "--out", str(out),
                 "--plan", "--jobs", "2", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    language = ["ecp", "sliding_window", "sliding_window_tiles", "s2", "transformer",
                "perceiver_ar", "mamba2", "gated_deltanet", "rwkv7"]
    recall = [m for m in language if m != "perceiver_ar"]
    assert f"### language: {9 * 34 * 1.0 / 3600 / 2:.2f} hours of training at --jobs 2" in text
    assert f"### recall: {8 * (60 + 120) * 4.0 / 3600 / 2:.2f} hours of training at --jobs " \
           f"2" in text
    assert text.index("### language") < text.index("### recall")
    for m in language:
        assert f"| {m} | 34 | 1.000 | {34 / 3600:.2f} |" in text
    for m in recall:
        assert f"| {m} L2 | 60 | 4.000 | {60 * 4 / 3600:.2f} |" in text
        assert f"| {m} L4 | 120 | 4.000 | {120 * 4 / 3600:.2f} |" in text
    assert "perceiver_ar L" not in text
    train = (9 * 34 * 1.0 + 8 * (60 + 120) * 4.0) / 3600 / 2
    assert f"### every stage: {train:.2f} hours of training at --jobs 2, " in text
    assert not out.exists()  # nothing written
    assert main(["evidence4", "--stage", "recall", "--budget", "tiny", "--out", str(out),
                 "--plan"]) == 0
    text = capsys.readouterr().out
    assert "### recall" in text and "### language" not in text and not out.exists()
    assert "### every stage" not in text
