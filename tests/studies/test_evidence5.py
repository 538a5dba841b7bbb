"""Evidence V's mechanism stage: recall with each query's key at a declared distance, scored per
distance; PerceiverAR answering the queries it predicts; the report reading each distance as a
point of its own (values, fits, bootstrap); the declared primary family; and the tiny budget end
to end."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.studies import report, stats
from ecp_lm.studies.__main__ import main
from ecp_lm.studies.specs import evidence5
from ecp_lm.studies.specs.evidence5 import DISTANCE_TASK, STUDY, reach
from ecp_lm.training.mqar import MQARSpec, mqar_batch, query_logits

TINY = STUDY.stages("tiny")["mechanism"]


def test_queries_lie_at_the_declared_distances_in_the_second_half():
    spec = MQARSpec(**DISTANCE_TASK)
    b = mqar_batch(spec, 256, torch.Generator().manual_seed(1))
    rows = torch.arange(256)[:, None]
    assert torch.equal(b.tokens[rows, b.key_pos], b.keys)
    assert torch.equal(b.tokens[rows, b.key_pos + 1], b.values)
    assert torch.equal(b.tokens[rows, b.query_pos], b.keys)
    assert torch.equal(b.tokens[rows, b.query_pos + 1], b.values)
    assert (b.query_pos >= 32).all() and (b.query_pos <= 62).all()
    assert set((b.query_pos - b.key_pos).unique().tolist()) == {2, 4, 8, 16, 32}


def test_the_default_task_draws_the_sequences_it_always_drew():
    """Evidence IV's runs stay reproducible: a spec without distances draws as before."""
    b = mqar_batch(MQARSpec(), 8, torch.Generator().manual_seed(5))
    assert b.tokens.sum().item() == 17112
    assert (b.tokens * torch.arange(64)).sum().item() == 545412
    assert b.query_pos[0].tolist() == [40, 51, 30, 25] and b.key_pos[0].tolist() == [14, 32, 10, 1]


@pytest.mark.parametrize("fields", [dict(distances=(1, 4)), dict(distances=(4, 63)),
                                    dict(query_start=63), dict(query_start=-1)])
def test_bad_distances_are_refused(fields):
    with pytest.raises(ValueError, match="distances="):
        MQARSpec(**{**DISTANCE_TASK, **fields})


def perceiver():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="perceiver_ar", vocab_size=48, d_model=16, n_heads=2, n_layers=2,
                      seq_len=64, num_segments=16)
    return build_model(cfg).eval()


def test_perceiver_ar_answers_from_the_query_and_not_from_the_answer():
    """Its logits cover the window's last l positions: the prediction read for a query changes
    with the query's token and not with the answer after it."""
    model, spec = perceiver(), MQARSpec(**DISTANCE_TASK)
    b = mqar_batch(spec, 4, torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = query_logits(model, b)
        for token_at, changes in ((b.query_pos, True), (b.query_pos + 1, False)):
            tokens = b.tokens.clone()
            tokens[torch.arange(4), token_at[:, 0]] = 47
            b2 = type(b)(tokens, b.targets, b.query_pos, b.key_pos, b.keys, b.values)
            moved = (query_logits(model, b2)[:, 0] - base[:, 0]).abs().amax().item()
            assert (moved > 1e-6) == changes


def test_a_query_the_model_does_not_predict_is_refused():
    from ecp_lm.training.mqar import _check_model

    with pytest.raises(ValueError, match="predicts positions 32 on"):
        _check_model(perceiver(), MQARSpec(**{**DISTANCE_TASK, "query_start": 8}))


def write_runs(folder, accuracies):
    """Result files of the tiny mechanism stage: each query's correctness drawn with the
    cell's accuracy at its distance."""
    g = torch.Generator().manual_seed(0)
    distances = [2, 4, 8, 16, 32] * 20
    for (model, depth, seed), by_distance in accuracies.items():
        correct = [int(torch.rand(1, generator=g).item() < by_distance[d]) for d in distances]
        per = {d: statistics.fmean(c for c, x in zip(correct, distances, strict=True)
                                   if x == d)
               for d in sorted(set(distances))}
        path = folder / "runs" / model / f"L{depth}" / f"seed{seed}" / "result.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({
            "model": model, "n_layers": depth, "seed": seed, "lr": 1e-3, "steps": 30,
            "eval_seed": 1, "accuracy": statistics.fmean(correct), "loss": 1.0,
            "s_per_step": 0.01, "accuracy_by_distance": {str(d): a for d, a in per.items()},
            "curve": [{"step": step, "accuracy_by_distance": {str(d): a - late for d, a in
                                                              per.items()}}
                      for step, late in ((0, 0.5), (20, 0.2), (24, 0.1 * (1 + seed)), (30, 0))],
            "per_query": {"correct": "".join(map(str, correct)),
                          "loss": " ".join("1" for _ in correct),
                          "distance": " ".join(map(str, distances))}}))
    return distances


def test_the_report_reads_each_distance_as_a_point(tmp_path):
    near = {2: 0.9, 4: 0.9, 8: 0.8, 16: 0.6, 32: 0.3}
    cells = {(m, d, s): {k: v * (1 - 0.1 * i) for k, v in near.items()}
             for i, m in enumerate(TINY.models) for d in (2, 4) for s in (0, 1)}
    write_runs(tmp_path, cells)
    data = report.load_stage(TINY, tmp_path)
    assert sorted(data.values) == sorted(["30", "d2", "d4", "d8", "d16", "d32"])
    analysis = report.analyse(STUDY, {"mechanism": data})
    runs = {(r["point"], r["model"], r["seed"]): r["value"] for r in analysis["runs"]}
    for (m, d, s) in cells:
        result = json.loads((tmp_path / "runs" / m / f"L{d}" / f"seed{s}" /
                             "result.json").read_text())
        for dist, acc in result["accuracy_by_distance"].items():
            assert runs[f"d{dist}", f"{m}@L{d}", s] == acc
    [primary] = [c for c in analysis["comparisons"] if c["family"] == "primary"
                 and c["b"] == "sliding_window_tiles@L4"]
    assert primary["point"] == "d16"
    mean = {c: statistics.fmean(runs["d16", c, s] for s in (0, 1))
            for c in ("ecp@L4", "sliding_window_tiles@L4")}
    assert primary["estimate"] == pytest.approx(mean["ecp@L4"] - mean["sliding_window_tiles@L4"])
    low, high = primary["bootstrap"]
    assert low <= primary["estimate"] <= high
    text = report.report_markdown(STUDY, "tiny", analysis, {"mechanism": data}, tmp_path)
    # ECP's accuracy at d ≤ 2m = 8 rose by 0.1·(1 + seed) from step 24 (80% of 30) to 30
    assert "- L = 2: +0.100, +0.200\n- L = 4: +0.100, +0.200" in text
    # one table of every cell at every distance: the mean over the seeds [lowest, highest]
    at = {d: [runs[f"d{d}", "ecp@L4", s] for s in (0, 1)] for d in near}
    assert "| ecp@L4 | " + " | ".join(
        f"{statistics.fmean(v):.3f} [{min(v):.3f}, {max(v):.3f}]" for v in at.values()) + " |" \
        in text.split("## Accuracy by distance: mechanism")[1].split("## Stages")[0]


SMALL = STUDY.stages("small")["mechanism"]


def masks(model: str, n: int = 64, m: int = 4, heads: int = 4) -> list[list[list[bool]]]:
    """Each head's mask, ``mask[q][kv]``, written from the spec's table (docs/spec.md §3, §3b)
    at the small task's N = 64, m = 4: ECP sees its segment and the one before; a window the
    last w positions (w = 7, ECP's entries; w = m, tiles); block_local its block of 2m; S² its
    group of m in half the heads and the group shifted by m/2 in the other half."""
    rules = {"ecp": lambda q, k: q // m - 1 <= k // m,
             "sliding_window": lambda q, k: q - 7 < k,
             "sliding_window_tiles": lambda q, k: q - m < k,
             "block_local": lambda q, k: q // (2 * m) == k // (2 * m)}
    shifted = lambda q, k: (q + m // 2) // m == (k + m // 2) // m  # noqa: E731
    per_head = ([lambda q, k: q // m == k // m] * (heads // 2) + [shifted] * (heads // 2)
                if model == "s2" else [rules[model]] * heads)
    return [[[k <= q and rule(q, k) for k in range(n)] for q in range(n)] for rule in per_head]


def seen_back(model: str, depth: int) -> list[int]:
    """How far back each query position 32 … 62 depends, through ``depth`` layers of the masks:
    the positions a query sees, grown one layer at a time by what any head of each sees."""
    mask = masks(model)
    out = []
    for q in range(32, 63):
        seen = {q}
        for _ in range(depth):
            seen = {k for p in seen for head in mask for k, on in enumerate(head[p]) if on}
        out.append(q - min(seen))
    return out


@pytest.mark.parametrize("depth", [2, 4, 8])
@pytest.mark.parametrize("model", ["ecp", "sliding_window", "sliding_window_tiles",
                                   "block_local", "s2"])
def test_each_reach_is_what_the_masks_let_a_query_see(model, depth):
    back = seen_back(model, depth)
    assert reach(SMALL, model, depth) == (min(back), max(back))


def test_the_spec_states_each_reach():
    def span(r):
        return f"{r[0]}" if r[0] == r[1] else f"{r[0]}–{r[1]}"

    text = " ".join(evidence5.__doc__.split())
    for model, name in (("ecp", "ECP"), ("sliding_window_tiles", "the tile window"),
                        ("sliding_window", "the window of ECP's entries"), ("s2", "S²")):
        assert f"{name} {', '.join(span(reach(SMALL, model, d)) for d in (2, 4, 8))}" in text
    assert {reach(SMALL, "block_local", d) for d in (2, 4, 8)} == {(0, 7)}
    assert "block_local 0–7 at any depth" in text


def test_a_model_that_may_read_every_position_has_no_reach():
    for model in ("transformer", "perceiver_ar", "mamba2", "gated_deltanet", "rwkv7"):
        assert reach(SMALL, model, 2) is None


def test_the_primary_family_is_declared_within_the_limit():
    """Ten contrasts; on the mechanism both at L = 4, d = 16: past every query's reach in the
    tile window, within every query's in ECP, and within every query's in the window of ECP's
    entries (w = 7)."""
    assert len(STUDY.primary) == 10 <= stats.MAX_PRIMARY
    assert ModelConfig(arch="sliding_window", seq_len=64, num_segments=16).resolved().window == 7
    assert reach(SMALL, "sliding_window_tiles", 4)[1] < 16 <= reach(SMALL, "ecp", 4)[0]
    assert reach(SMALL, "sliding_window", 4)[0] >= 16
    mechanism = [c for c in STUDY.primary if c.stage == "mechanism"]
    assert {(c.point, c.a) for c in mechanism} == {("d16", "ecp@L4")}


def test_the_scifar_recipe_is_sized_without_its_files():
    """``full``'s pixel stage is sCIFAR-10 as the research ran it (1,024 grayscale pixels, ten
    classes, rates chosen on validation); its plan needs only the configs, not the images."""
    from ecp_lm.studies.__main__ import works

    stage = STUDY.stages("full")["pixels"]
    assert (stage.task.source, stage.task.path, stage.task.metric) == (
        "scifar10", "hf:uoft-cs/cifar10", "accuracy")
    rows = works(stage)
    assert {r["name"] for r in rows} == set(stage.models) and all(
        (r["cfg"].seq_len, r["cfg"].num_classes, r["cfg"].vocab_size) == (1024, 10, 256)
        for r in rows)
    assert STUDY.stages("small")["pixels"].task.source == "mnist-5k"


@pytest.mark.integration
def test_the_tiny_budget_runs_and_reports_every_distance_and_every_image(tmp_path):
    """The mechanism and pixel stages at ``tiny`` (digits for the pixels), then the report:
    every distance a point of every cell, each image's result kept on the test split, the rates
    chosen on validation."""
    out = tmp_path / "ev5"
    for stage in ("mechanism", "pixels", "report"):
        assert main(["evidence5", "--stage", stage, "--budget", "tiny", "--out", str(out),
                     "--quiet", "--jobs", "2", "--threads", "1"]) == 0
    verdicts = json.loads((out / "report" / "tiny" / "verdicts.json").read_text())
    points = {(r["point"], r["model"]) for r in verdicts["runs"] if r["stage"] == "mechanism"}
    assert points == {(p, c) for p in TINY.points() for c in TINY.cells()}
    assert "the queries at distance 32" in (out / "report" / "tiny" / "report.md").read_text()
    result = json.loads((out / "mechanism" / "tiny" / "runs" / "ecp" / "L2" / "seed0" /
                         "result.json").read_text())
    assert [sorted(c["accuracy_by_distance"], key=int) for c in result["curve"]] == \
        [["2", "4", "8", "16", "32"]] * len(result["curve"]) and len(result["curve"]) >= 2
    pixels = json.loads((out / "pixels" / "tiny" / "runs" / "ecp" / "seed0" /
                         "result.json").read_text())["points"][-1]
    assert pixels["split"] == "test" and set(pixels["correct"]) <= {0, 1}
    assert pixels["accuracy"] == pytest.approx(statistics.fmean(pixels["correct"]))
    trial = json.loads((out / "pixels" / "tiny" / "select" / "ecp" / "lr0.001" /
                        "result.json").read_text())
    assert trial["split"] == "valid" and "accuracy" in trial
    assert "pixels at 8 steps: accuracy (test split)" in (out / "report" / "tiny" /
                                                          "report.md").read_text()


def test_the_plan_counts_every_evaluated_token():
    """--plan's evaluation: on recall, every held-out scoring of every run (step 0, each
    eval_every, the end); on language, the test split twice per point (windows moved by N/2),
    once more for a context model, the validation bytes of each trial and of each evaluation
    during training; none where the files are not here."""
    from ecp_lm.data.images import load_pixel_dataset
    from ecp_lm.studies.__main__ import works
    from ecp_lm.studies.language import split_bytes

    tiny = STUDY.stages("tiny")
    stage = tiny["mechanism"]
    t = stage.task
    runs, seeds = len(stage.grid.rates) * len(stage.select_seeds), len(stage.seeds)
    size = t.train["eval_size"] * t.task["seq_len"]
    rows = {r["name"]: r["eval_tokens"] for r in works(stage)}
    every = t.train["eval_every"]
    assert rows[f"ecp L{t.select_depth}"] == size * (
        runs * (t.select_steps // every + 2) + seeds * (t.steps // every + 2))
    assert rows["ecp L2"] == size * seeds * (t.steps // every + 2)

    stage = tiny["language"]
    t = stage.task
    runs, seeds = len(stage.grid.rates) * len(stage.select_seeds), len(stage.seeds)
    valid = len(split_bytes(t.source, "valid"))
    during = 2 * min(valid, t.train["eval_max_tokens"])
    rows = {r["name"]: r["eval_tokens"] for r in works(stage)}
    every = t.train["eval_every"]
    for model in stage.models:
        test = 2 * t.report_tokens * len(t.points) * (2 if model in t.context_models else 1)
        assert rows[model] == runs * (2 * t.select_tokens + t.select_steps // every * during) \
            + seeds * (test + max(t.points) // every * during), model
    stage = tiny["pixels"]
    t = stage.task
    runs, seeds = len(stage.grid.rates) * len(stage.select_seeds), len(stage.seeds)
    splits = load_pixel_dataset(t.source, seed=0).splits
    valid, test = (len(splits[s][1]) * t.size["seq_len"] for s in ("valid", "test"))
    every = t.train["eval_every"]
    assert {r["eval_tokens"] for r in works(stage)} == {  # every image, each time
        runs * (valid + t.select_steps // every * valid)
        + seeds * (len(t.points) * test + max(t.points) // every * valid)}
    assert all(r["eval_tokens"] is None for r in works(STUDY.stages("full")["pixels"]))


def test_a_declared_comparison_not_run_or_not_in_the_budget_is_named_so():
    """Before any run, every primary comparison of ``small`` is left out: those of its models
    as not run yet, those with Mamba or RWKV-4 (``full`` only) as not in this budget."""
    analysis = report.analyse(STUDY, {}, budget="small")
    assert analysis["comparisons"] == []
    why = {(e["stage"], e["contrast"]): {k: v for k, v in e.items()
                                         if k in ("not_run", "not_in_budget", "did_not_learn")}
           for e in analysis["excluded"]}
    assert len(why) == len(STUDY.primary) == 10
    for corpus in ("language", "replication"):
        for rival in ("mamba", "rwkv4"):
            assert why[corpus, f"ecp − {rival}"] == {"not_in_budget": [rival],
                                                     "did_not_learn": []}
        assert why[corpus, "ecp − llama"] == {"not_run": ["ecp", "llama"], "did_not_learn": []}
    assert why["mechanism", "ecp@L4 − sliding_window@L4"]["not_run"] == [
        "ecp@L4", "sliding_window@L4"]
    table = "\n".join(report.verdict_lines(analysis))
    assert "| ecp − mamba | language, final | — | — | — | not in this budget: mamba |" in table


def test_a_model_at_fewer_depths_runs_is_planned_and_is_compared_only_there(tmp_path):
    """``Recall.depths_of``: ``small`` runs the recurrent mixers at L = 2 and 4 only, and a
    stage's cells, its plan, its result files and its secondary comparisons leave the other
    depths out; depths without the selection depth are refused."""
    from dataclasses import replace

    from ecp_lm.studies.__main__ import works

    small = STUDY.stages("small")["mechanism"]
    assert [c for c in small.cells() if c.startswith("rwkv7")] == ["rwkv7@L2", "rwkv7@L4"]
    planned = {r["name"] for r in works(small)}
    assert "ecp L8" in planned and "rwkv7 L8" not in planned and "rwkv7 L2" in planned
    stage = replace(TINY, task=replace(TINY.task, depths_of={"mamba2": (4,)}))
    near = {2: 0.9, 4: 0.9, 8: 0.8, 16: 0.6, 32: 0.3}
    write_runs(tmp_path, {(m, d, s): near for m in stage.models for d in stage.depths(m)
                          for s in (0, 1)})
    data = report.load_stage(stage, tmp_path)
    assert data.missing == [] and "mamba2@L4" in data.values["30"]
    names = {c.name for c in report.secondary(data, [])}
    assert "ecp@L4 − mamba2@L4" in names and "ecp@L2 − perceiver_ar@L2" in names
    assert not any("mamba2@L2" in n or "(mamba2:" in n for n in names)
    with pytest.raises(ValueError, match="selection depth 4"):
        replace(TINY, task=replace(TINY.task, depths_of={"mamba2": (2,)}))


def test_a_cell_whose_seeds_are_still_running_is_shown_but_not_analysed(tmp_path):
    """Mid-stage, a cell with some of its seeds is in the stage table with the seeds it has and
    in no fit or comparison: a primary comparison with it is left out as not run yet."""
    near = {2: 0.9, 4: 0.9, 8: 0.8, 16: 0.6, 32: 0.3}
    cells = {(m, d, s): near for m in TINY.models for d in (2, 4) for s in (0, 1)}
    del cells["sliding_window_tiles", 4, 1]
    write_runs(tmp_path, cells)
    data = report.load_stage(TINY, tmp_path)
    analysis = report.analyse(STUDY, {"mechanism": data})
    [left] = [e for e in analysis["excluded"] if e["contrast"].endswith("tiles@L4")]
    assert left["not_run"] == ["sliding_window_tiles@L4"]
    assert {c["b"] for c in analysis["comparisons"]} >= {"sliding_window@L4", "mamba2@L2"}
    assert all("sliding_window_tiles@L4" not in (c["a"], c["b"]) and
               "sliding_window_tiles@L4" not in c["contrast"]
               for c in analysis["comparisons"])
    text = report.report_markdown(STUDY, "tiny", analysis, {"mechanism": data}, tmp_path)
    assert "| sliding_window_tiles@L4 (1 of 2 seeds) |" in text
