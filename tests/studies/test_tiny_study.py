"""Evidence IV end to end at ``--budget tiny`` on the real ``sympy-code`` corpus (fetched through
the package registry, marked ``integration``), run once for the module: rates chosen on the
validation split (every trial on both selection seeds) and every reported number from the test
split, recall's selection and report sequences apart, every model on the same seeds at every
depth, every query's result stored, the report's runs the result files', and a second
invocation that trains nothing."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ecp_lm.data.sources import open_source
from ecp_lm.evaluate import checkpoints
from ecp_lm.studies import specs
from ecp_lm.studies.__main__ import main
from ecp_lm.studies.recall import task_specs
from ecp_lm.studies.spec import Recall
from ecp_lm.training.mqar import mqar_batch, unpack_queries
from helpers import load_script

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]
STAGES = specs.load("evidence4").stages("tiny")
LANGUAGE, RECALL = STAGES["language"], STAGES["recall"]
ARGV = ["evidence4", "--stage", "all", "--budget", "tiny", "--quiet"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The tiny study's folder, and every (checkpoint, split) that was scored."""
    integration = load_script(TESTS / "data" / "test_integration.py", "studies_integration")
    integration.fetched(lambda: open_source("sympy-code"))
    out = tmp_path_factory.mktemp("ev4") / "ev4"
    reads: list[tuple[str, str]] = []
    score = checkpoints.evaluate_checkpoint

    def recording(path, split="valid", *args, **kwargs):
        reads.append((str(path), split))
        return score(path, split, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoints, "evaluate_checkpoint", recording)
        assert main([*ARGV, "--out", str(out)]) == 0
    return out, reads


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def trials(folder: Path) -> dict[str, dict[float, dict[int, dict]]]:
    """{model: {lr: {seed: result}}} of a stage's rate trials."""
    found: dict = {}
    for path in folder.glob("select/*/lr*/**/result.json"):
        r = read(path)
        seed = int(path.parent.name[4:]) if path.parent.name.startswith("seed") else 0
        assert r["seed"] == seed, path
        found.setdefault(r["model"], {}).setdefault(r["lr"], {})[seed] = r
    return found


def run_results(folder: Path, timed: bool = False) -> dict[tuple[str, int | None, int], dict]:
    """{(model, depth or None, seed): result} of a stage's seeds (``timed``: of its
    equal-time runs instead)."""
    found = {}
    for path in folder.glob("runs/**/result.json"):
        r = read(path)
        if r.get("equal_time", False) == timed:
            found[r["model"], r.get("n_layers"), r["seed"]] = r
    return found


@pytest.mark.parametrize("stage", [LANGUAGE, RECALL], ids=["language", "recall"])
def test_rates_are_chosen_on_the_selection_data_on_both_seeds(study, stage):
    """Every trial ran on selection seeds 0 and 1 on the selection data alone; each model's
    seeds ran at the rate of its best mean (ties: the smaller rate), inside the grid's rates
    tried; a model at chance has tried every rate a learner chose."""
    out, reads = study
    folder = out / stage.name / "tiny"
    task, found = stage.task, trials(folder)
    runs = run_results(folder)
    assert set(found) == set(stage.models)
    sign = 1 if task.lower_is_better else -1
    chosen, means = {}, {}
    for model, by_rate in found.items():
        assert set(stage.grid.rates) <= set(by_rate)
        for lr, seeds in by_rate.items():
            assert set(seeds) == {0, 1}, (model, lr)
            for r in seeds.values():
                if isinstance(task, Recall):
                    assert (r["eval_seed"], r["n_layers"], r["steps"]) == (
                        task.select_sequences, task.select_depth, task.select_steps)
                else:
                    assert (r["split"], r["steps"]) == ("valid", task.select_steps)
        means[model] = {lr: statistics.fmean(r[task.metric] for r in seeds.values())
                        for lr, seeds in by_rate.items()}
        chosen[model] = min(means[model], key=lambda lr: (sign * means[model][lr], lr))
        assert {r["lr"] for (m, _, _), r in runs.items() if m == model} == {chosen[model]}
    if isinstance(task, Recall):
        level = 1 / task.task["num_values"] + task.chance_margin
        at_chance = {m for m in chosen if means[m][chosen[m]] <= level}
    else:
        from ecp_lm.studies.language import unigram_bits

        level = unigram_bits(task.source)
        at_chance = {m for m in chosen if means[m][chosen[m]] >= level}
        scored = {split for path, split in reads if f"/{stage.name}/tiny/select/" in path}
        assert scored == {"valid"}  # the trials read validation, nothing else does
        assert {split for path, split in reads if "/select/" not in path} == {"test"}
    learners = {chosen[m] for m in chosen if m not in at_chance}
    for m in at_chance:
        assert learners <= set(means[m]), m


def test_every_reported_point_is_scored_on_the_test_split(study):
    out, _ = study
    runs = run_results(out / "language" / "tiny")
    scored, documents = set(), set()
    for (model, _, _), r in runs.items():
        assert [p["steps"] for p in r["points"]] == list(LANGUAGE.task.points)
        for p in r["points"]:
            assert p["split"] == "test"
            assert p["bytes_scored"] == p["tokens_scored"] <= LANGUAGE.task.report_tokens
            scored.add(p["tokens_scored"])
            assert ("context_gain_bits" in p) == (model in LANGUAGE.task.context_models)
            docs = p["documents"]
            assert sum(docs["bytes"]) == sum(docs["tokens"]) == p["bytes_scored"]
            assert sum(docs["nll"]) / math.log(2) / sum(docs["bytes"]) == pytest.approx(
                p["bits_per_byte"], rel=1e-9)
            documents.add(tuple(docs["bytes"]))
    assert len(scored) == len(documents) == 1  # every model, seed and point on the same bytes


def test_the_matched_mixers_have_ecps_parameters_or_the_report_says_otherwise(study):
    """The weights each language model trained, counted from its checkpoint: gated_deltanet
    within 2% of ECP's; mamba2 too, or (at tiny sizes its smallest width is larger) the
    report's table states the difference."""
    out, _ = study
    count = {m: sum(t.numel() for t in load_file(
        out / "language" / "tiny" / "runs" / m / "seed0" / "decay8" / "latest" /
        "model.safetensors").values()) for m in ("ecp", "mamba2", "gated_deltanet")}
    sizes: dict[str, set[str]] = {}
    for line in (out / "report" / "tiny" / "report.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 2:
            sizes.setdefault(cells[0].split(" (")[0], set()).add(cells[1])
    assert sizes["ecp"] == {f"{count['ecp']:,}"}
    for name in ("mamba2", "gated_deltanet"):
        ratio = count[name] / count["ecp"] - 1
        if name == "gated_deltanet":
            assert abs(ratio) <= 0.02, (name, ratio)
        stated = f" ({ratio:+.1%} vs ecp)" if abs(ratio) > 0.02 else ""
        assert sizes[name] == {f"{count[name]:,}{stated}"}, name


def test_recall_selects_on_one_set_of_sequences_and_reports_on_another(study):
    out, _ = study
    runs = run_results(out / "recall" / "tiny")
    assert runs and {r["eval_seed"] for r in runs.values()} == {RECALL.task.report_sequences}
    assert RECALL.task.select_sequences == 3_000_017
    assert RECALL.task.report_sequences == 4_000_037
    spec, train = task_specs(RECALL)
    chosen, reported = (mqar_batch(spec, train.eval_size,
                                   torch.Generator().manual_seed(seed)).tokens
                        for seed in (3_000_017, 4_000_037))
    shared = (chosen[:, None, :] == reported[None, :, :]).all(-1)
    assert not shared.any()  # no report sequence is a selection one


def test_every_model_ran_the_same_seeds_at_every_depth(study):
    out, _ = study
    assert set(run_results(out / "language" / "tiny")) == {
        (m, None, s) for m in LANGUAGE.models for s in (0, 1)}
    assert "perceiver_ar" not in RECALL.models
    assert set(run_results(out / "recall" / "tiny")) == {
        (m, d, s) for m in RECALL.models for d in RECALL.task.depths for s in (0, 1)}
    assert LANGUAGE.seeds == RECALL.seeds == (0, 1)


def test_each_recall_result_stores_every_querys_correctness_and_loss(study):
    out, _ = study
    spec, train = task_specs(RECALL)
    results = [read(p) for p in (out / "recall" / "tiny").glob("*/**/result.json")]
    assert len(results) > len(RECALL.models) * len(RECALL.task.depths) * 2  # trials too
    for r in results:
        correct, loss = unpack_queries(r["per_query"])
        assert len(correct) == len(loss) == train.eval_size * spec.num_queries
        assert set(correct) <= {0, 1}
        assert statistics.fmean(correct) == pytest.approx(r["accuracy"], abs=1e-6)
        assert statistics.fmean(loss) == pytest.approx(r["loss"], abs=1e-4)


def test_the_reports_runs_are_the_result_files(study):
    out, _ = study
    report = out / "report" / "tiny"
    assert sorted(p.name for p in report.iterdir()) == ["report.md", "verdicts.json"]
    assert (report / "report.md").read_text().startswith("# evidence4, budget tiny")
    verdicts = read(report / "verdicts.json")
    expected = set()
    for (m, _, s), r in run_results(out / "language" / "tiny").items():
        expected |= {("language", str(p["steps"]), m, s, key, p[key])
                     for p in r["points"] for key in ("bits_per_byte", "context_gain_bits")
                     if key in p}
    last = str(max(LANGUAGE.task.points))
    timed = run_results(out / "language" / "tiny", timed=True)
    assert {m for m, _, _ in timed} == set(LANGUAGE.task.equal_time)
    for (m, _, s), r in timed.items():
        [p] = r["points"]
        expected.add(("language", f"time{last}", m, s, "bits_per_byte", p["bits_per_byte"]))
        [ref] = [p["bits_per_byte"] for p in run_results(out / "language" / "tiny")[
            "ecp", None, s]["points"] if str(p["steps"]) == last]
        expected.add(("language", f"time{last}", "ecp", s, "bits_per_byte", ref))
    for (m, d, s), r in run_results(out / "recall" / "tiny").items():
        expected.add(("recall", str(r["steps"]), f"{m}@L{d}", s, "accuracy", r["accuracy"]))
    runs = [tuple(r[k] for k in ("stage", "point", "model", "seed", "metric", "value"))
            for r in verdicts["runs"]]
    assert len(runs) == len(set(runs)) and set(runs) == expected
    assert verdicts["comparisons"] and verdicts["study"] == "evidence4"
    finals = {"language": str(max(LANGUAGE.task.points)), "recall": str(RECALL.task.steps)}
    for c in verdicts["comparisons"]:  # every item is stored: each final contrast resamples
        final = c["point"] == finals[c["stage"]]
        assert (c["bootstrap"] is not None) == final, c
        if final:
            assert c["bootstrap"][0] <= c["bootstrap"][1]


def test_the_plan_prints_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["evidence4", "--stage", "all", "--budget", "tiny", "--out", str(out),
                 "--plan", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "### language:" in text and "### recall:" in text
    assert "| perceiver_ar | 34 |" in text and "| rwkv7 L4 | 120 |" in text
    assert not out.exists()


def test_a_second_invocation_trains_nothing(study, monkeypatch, capsys):
    """Last in this module: it adds an invocation to each stage's time."""
    out, _ = study

    def no_training(*args, **kwargs):
        raise AssertionError("a finished study trained (or timed) again")

    kept = {p: p.stat().st_mtime_ns for pattern in ("**/result.json", "**/step_s.json",
                                                    "**/*.safetensors")
            for p in out.glob(pattern)}
    before = read(out / "report" / "tiny" / "verdicts.json")
    for target in ("ecp_lm.studies.language.select_job", "ecp_lm.studies.language.seed_job",
                   "ecp_lm.studies.anneal.annealed_curve", "ecp_lm.studies.recall.recall_job",
                   "ecp_lm.training.mqar.train_mqar", "ecp_lm.bench.core.step_seconds"):
        monkeypatch.setattr(target, no_training)
    assert main([*ARGV, "--out", str(out)]) == 0
    assert "# evidence4, budget tiny" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert read(out / "report" / "tiny" / "verdicts.json") == before
    for stage in ("language", "recall"):
        assert len(read(out / stage / "tiny" / "invocations.json")) == 2
