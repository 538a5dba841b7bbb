"""Evidence IV end to end at ``--budget tiny`` on the real long-document corpus (fetched through
the package registry, marked ``integration``): rates chosen on validation and every reported
number from the test split, recall's selection and report sequences apart, more seeds where a
margin needs them, every interval of the report recomputed here from the run files with scipy
and Holm's procedure written out, and a resumed stage that trains nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_integration import fetched

from ecp_lm.evaluate import checkpoints
from ecp_lm.experiments import evidence4
from ecp_lm.experiments.evidence4 import language, recall
from ecp_lm.experiments.evidence4.language import LANGUAGE_BUDGETS
from ecp_lm.experiments.evidence4.recall import RECALL_BUDGETS, REPORT_SEED, SELECT_SEED
from evidence4_reference import check_report

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """The tiny budget run once, with every split each checkpoint scoring read."""
    from ecp_lm.data.sources import open_source

    fetched(lambda: open_source("sympy-code"))
    out = tmp_path_factory.mktemp("ev4") / "ev4"
    reads: list[tuple[str, str]] = []
    score = checkpoints.evaluate_checkpoint

    def recording(path, split="valid", *args, **kwargs):
        reads.append((str(path), split))
        return score(path, split, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoints, "evaluate_checkpoint", recording)
        mp.setattr("ecp_lm.experiments.long_context.measure.evaluate_checkpoint", recording)
        assert evidence4.main(["--stage", "all", "--budget", "tiny", "--out", str(out),
                               "--quiet"]) == 0
    return out, reads


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_rates_are_chosen_on_validation_and_nothing_else_reads_it(stage):
    out, reads = stage
    summary = read(out / "language" / "tiny" / "language.json")
    budget = LANGUAGE_BUDGETS["tiny"]
    for name, model in summary["models"].items():
        trials = {float(lr): bits for lr, bits in model["trials"].items()}
        assert set(budget.grid.rates) <= set(trials)
        assert model["lr"] == min(trials, key=lambda lr: (trials[lr], lr))
        for lr in trials:
            result = read(out / "language" / "tiny" / "select" / name / f"lr{lr:g}" /
                          "result.json")
            assert result["split"] == "valid" and result["bits_per_byte"] == trials[lr]
    for path, split in reads:
        kind = "select" if "/select/" in path else "runs"
        assert split == ("valid" if kind == "select" else "test"), (path, split)
    assert {split for _, split in reads} == {"valid", "test"}


def test_every_reported_point_is_the_test_split(stage):
    out, _ = stage
    summary = read(out / "language" / "tiny" / "language.json")
    test_bytes = min(LANGUAGE_BUDGETS["tiny"].report_tokens,
                     _split_bytes("test"))
    for name, model in summary["models"].items():
        for seed in model["points"]["8"]["bits_per_byte"]:
            result = read(out / "language" / "tiny" / "runs" / name / f"seed{seed}" /
                          "result.json")
            assert result["lr"] == model["lr"]
            for point in result["points"]:
                assert point["split"] == "test" and point["bytes_scored"] <= test_bytes
                reported = model["points"][str(point["steps"])]["bits_per_byte"][seed]
                assert reported == point["bits_per_byte"]
    for name in language.CONTEXT_MODELS:
        assert "context_gain_bits" in summary["models"][name]["points"]["4"]


def _split_bytes(split: str) -> int:
    from ecp_lm.data.sources import open_source

    return open_source("sympy-code").split_bytes(split)


def test_the_mixers_have_ecps_parameters(stage):
    out, _ = stage
    models = read(out / "language" / "tiny" / "language.json")["models"]
    for name in ("mamba2", "gated_deltanet"):
        assert abs(models[name]["params"] / models["ecp"]["params"] - 1) < 0.05, name


def test_recall_selects_on_one_set_of_sequences_and_reports_on_another(stage):
    from ecp_lm.experiments.mqar.budgets import BUDGETS
    from ecp_lm.experiments.mqar.task import mqar_batch

    out, _ = stage
    base = out / "recall" / "tiny"
    summary = read(base / "recall.json")
    assert "perceiver_ar" not in summary["models"]
    for result in base.glob("select/*/*/result.json"):
        assert read(result)["eval_seed"] == SELECT_SEED
    runs = list(base.glob("runs/*/*/*/result.json"))
    assert runs and all(read(r)["eval_seed"] == REPORT_SEED for r in runs)
    task = BUDGETS[RECALL_BUDGETS["tiny"].mqar]
    chosen, reported = (mqar_batch(task.spec, task.train.eval_size,
                                   torch.Generator().manual_seed(seed)).tokens
                        for seed in (SELECT_SEED, REPORT_SEED))
    shared = (chosen[:, None, :] == reported[None, :, :]).all(-1)
    assert not shared.any()  # no report sequence is a selection one


def test_a_close_margin_got_more_seeds(stage):
    """A comparison left at fewer than the budget's largest number of seeds has a margin of
    at least twice the seeds' spread (the larger standard deviation of its two sides)."""
    import statistics

    out, _ = stage
    verdicts = read(out / "report" / "tiny" / "verdicts.json")
    budgets = {"language": LANGUAGE_BUDGETS["tiny"], "recall": RECALL_BUDGETS["tiny"]}
    more = 0
    for c in verdicts["comparisons"]:
        budget = budgets[c["stage"]]
        assert c["n"] in (budget.seeds, budget.max_seeds), c["name"]
        a, b = ({int(k): v for k, v in side.items()} for side in c["values"])
        seeds = sorted(set(a) & set(b))
        mean = statistics.fmean(a[s] - b[s] for s in seeds)
        spread = max(statistics.stdev(a[s] for s in seeds),
                     statistics.stdev(b[s] for s in seeds))
        if c["n"] < budget.max_seeds:
            assert abs(mean) >= 2 * spread, c["name"]
        else:
            more += 1
    assert more  # at two seeds, some margin of the tiny budget is always that close


def test_every_interval_is_recomputed_from_the_run_files(stage):
    out, _ = stage
    assert check_report(out, "tiny") > 20


def test_a_finished_stage_trains_nothing_again(stage, monkeypatch, capsys):
    out, _ = stage

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage trained again")

    before = read(out / "report" / "tiny" / "verdicts.json")
    monkeypatch.setattr(language, "annealed_curve", no_training)
    monkeypatch.setattr(language, "select_job", no_training)
    monkeypatch.setattr(recall, "recall_job", no_training)
    assert evidence4.main(["--stage", "all", "--budget", "tiny", "--out", str(out),
                           "--quiet"]) == 0
    assert read(out / "report" / "tiny" / "verdicts.json") == before
    assert "| question | answer |" in capsys.readouterr().out
