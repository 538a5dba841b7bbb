"""Evidence IV's rules apart from training: rates inside their grid and rescued from chance
(``evidence4.rates``), equal-time pairs and the five-seed rule (``evidence4.paired``), and the
report's calls (``evidence4.report``) on summaries written here by hand."""

from __future__ import annotations

import math

import pytest

from ecp_lm.experiments.evidence4.paired import (
    Paired,
    comparisons_needing_seeds,
    equal_time_points,
)
from ecp_lm.experiments.evidence4.rates import Grid, rescue_rates, select_rates
from ecp_lm.experiments.evidence4.report import analyse, answer, extrapolate, verdict_rows


def trials_of(score):
    tried = []

    def trial(rates):
        tried.extend(rates)
        return {lr: score(lr) for lr in rates}

    return trial, tried


def test_a_best_rate_at_an_edge_extends_the_grid_until_it_is_inside():
    trial, tried = trials_of(lambda lr: (math.log(lr) - math.log(1e-2)) ** 2)
    chosen = select_rates(Grid((1e-3, 2e-3, 4e-3), 2.0), trial, lower_is_better=True)
    assert tried == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
    assert chosen["lr"] == 8e-3 and chosen["inside"]
    assert list(chosen["trials"]) == ["0.001", "0.002", "0.004", "0.008", "0.016"]


def test_the_extensions_stop_and_the_edge_is_reported():
    trial, tried = trials_of(lambda lr: lr)  # lower is better: always the smallest
    chosen = select_rates(Grid((1e-3, 2e-3), 2.0, extensions=2), trial, lower_is_better=True)
    assert tried == [1e-3, 2e-3, 5e-4, 2.5e-4]
    assert chosen["lr"] == 2.5e-4 and not chosen["inside"]


def test_higher_is_better_for_accuracy():
    trial, _ = trials_of(lambda lr: -abs(math.log10(lr) + 3))  # best at 1e-3
    chosen = select_rates(Grid((1e-4, 1e-3, 1e-2), 10.0), trial, lower_is_better=False)
    assert chosen["lr"] == 1e-3 and chosen["inside"]


def test_a_model_at_chance_is_tried_at_the_learners_rates():
    chosen = {"ecp": {"lr": 1e-3, "trials": {"0.001": 0.9, "0.003": 0.5}},
              "window": {"lr": 3e-3, "trials": {"0.003": 0.8, "0.01": 0.2}},
              "stuck": {"lr": 1e-2, "trials": {"0.003": 0.06, "0.01": 0.07}}}
    assert rescue_rates(chosen, lambda acc: acc < 0.1) == {"stuck": [1e-3]}
    assert rescue_rates({"stuck": chosen["stuck"]}, lambda acc: acc < 0.1) == {}


def test_equal_time_pairs_show_only_the_side_that_had_less_time():
    # ECP 2 s a step, PerceiverAR 1 s: at 100 steps ECP took 200 s, PerceiverAR's 200 steps
    # take 200 s; PerceiverAR's last point (200 steps, 200 s) against ECP's first at >= 200 s.
    assert equal_time_points((100, 200), 2.0, 1.0) == [(100, 200, "b")]
    assert equal_time_points((100, 200, 400), 1.0, 2.0) == [(400, 200, "a")]
    assert equal_time_points((100, 200), 1.0, 1.0) == [(200, 200, "a"), (200, 200, "b")]


def test_five_seeds_are_asked_for_both_models_of_a_close_margin():
    close = {"name": "c", "a": "ecp", "b": "window",
             "values": [{0: 3.00, 1: 3.10, 2: 3.20}, {0: 3.02, 1: 3.13, 2: 3.19}]}
    far = {"name": "f", "a": "ecp", "b": "s2",
           "values": [{0: 3.00, 1: 3.01, 2: 3.02}, {0: 3.50, 1: 3.52, 2: 3.51}]}
    assert comparisons_needing_seeds([close, far]) == {"ecp", "window"}
    five = {**close, "values": [{**close["values"][0], 3: 3.1, 4: 3.2},
                                {**close["values"][1], 3: 3.1, 4: 3.2}]}
    assert comparisons_needing_seeds([five]) == set()


def test_pairs_follow_the_seeds_both_sides_have():
    c = Paired.from_seeds("x", {"0": 1.0, "1": 2.0, "4": 5.0}, {0: 0.5, 1: 1.0, 2: 9.0})
    assert (c.a, c.b) == ((1.0, 2.0), (0.5, 1.0))


def summary(stage, models, comparisons):
    return {"stage": stage, "budget": "tiny", "models": models, "comparisons": comparisons,
            **({"points": [100]} if stage == "language" else {})}


def model(lr=1e-3, inside=True, gain=None):
    out = {"lr": lr, "inside": inside, "trials": {"0.001": 1.0}, "points": {}, "step_s": 0.5}
    if gain is not None:
        out["points"]["100"] = {"context_gain_bits": gain}
    return out


def lang(name, b, a_vals, b_vals, **extra):
    return {"name": f"language: ecp vs {b} {name}", "a": "ecp", "b": b, "held": "entries",
            "measure": "bits_per_byte", "lower_is_better": True, "points": [100, 100],
            "values": [dict(enumerate(a_vals)), dict(enumerate(b_vals))], **extra}


def test_the_report_calls_only_what_the_rules_allow():
    ahead = lang("at 100 steps", "sliding_window", [2.00, 2.01, 2.02], [2.50, 2.52, 2.51])
    edge = lang("at 100 steps", "s2", [2.00, 2.01, 2.02], [2.50, 2.52, 2.51])
    longer = lang("at 100 steps (equal time)", "perceiver_ar", [2.00, 2.01, 2.02],
                  [2.50, 2.52, 2.51], only="b")
    stages = {"language": summary("language", {
        "ecp": model(gain={"0": 0.001, "1": 0.002, "2": 0.0}),
        "transformer": model(gain={"0": 0.03, "1": 0.01, "2": 0.04}),
        "sliding_window": model(), "s2": model(inside=False), "perceiver_ar": model()},
        [ahead, edge, longer])}
    result = analyse(stages)
    rows = {c["b"]: c for c in result["comparisons"]}
    assert result["family"] == 3  # the transformer's gain is not above 0.02 in every seed
    assert rows["sliding_window"]["ahead"] == "a"
    assert rows["s2"]["ahead"] is None
    assert rows["s2"]["not_called_because"] == ["s2's rate 0.001 is at the edge of the 1 it "
                                               "tried"]
    assert rows["perceiver_ar"]["ahead"] is None  # ECP ahead, but it trained longer
    assert rows["perceiver_ar"]["not_called_because"] == ["the model ahead trained longer"]
    table = verdict_rows(result)
    assert answer("window", table).startswith("yes where called (1 of 1")
    assert answer("s2", table).startswith("not shown")


def test_the_context_question_is_asked_where_the_transformer_is_sensitive():
    stages = {"language": summary("language", {
        "ecp": model(gain={"0": 0.01, "1": 0.012, "2": 0.011}),
        "transformer": model(gain={"0": 0.03, "1": 0.025, "2": 0.04})}, [])}
    result = analyse(stages)
    assert [c["name"] for c in result["comparisons"]] == [
        "context: ecp's gain vs none at 100 steps",
        "context: ecp's gain vs the transformer's at 100 steps"]
    none, transformer = result["comparisons"]
    assert none["ahead"] == "a" and transformer["ahead"] == "b"


def test_an_extrapolation_is_named_and_bounded():
    points = {"100": {"transformer": {"0": 0.001}}, "1000": {"transformer": {"0": 0.011}}}
    ext = extrapolate(points, 0.02)
    assert ext["grows"] and ext["steps"] == pytest.approx(10 ** (3 + 0.9))
    flat = {"100": {"transformer": {"0": 0.01}}, "1000": {"transformer": {"0": 0.005}}}
    assert extrapolate(flat, 0.02)["grows"] is False


def test_a_folder_not_its_own_is_refused_in_one_line(tmp_path, capsys):
    from ecp_lm.experiments import evidence4

    (tmp_path / "mine.txt").write_text("not ecp's")
    assert evidence4.main(["--stage", "language", "--budget", "tiny", "--out",
                           str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mine.txt" in err[0] and (tmp_path / "mine.txt").exists()


@pytest.mark.parametrize("argv", [["--stage", "everything"], ["--stage", "all", "--jobs", "0"],
                                  ["--stage", "report", "--budget", "huge"]])
def test_bad_options_exit_2(argv, capsys):
    from ecp_lm.experiments import evidence4

    with pytest.raises(SystemExit) as stop:
        evidence4.main(argv)
    assert stop.value.code == 2


def test_the_report_needs_its_stages(tmp_path, capsys):
    from ecp_lm.experiments import evidence4

    assert evidence4.main(["--stage", "report", "--budget", "tiny", "--out",
                           str(tmp_path / "e")]) == 2
    assert "run them first" in capsys.readouterr().err


def test_the_plan_sizes_both_stages_before_anything_runs(tmp_path, capsys):
    from ecp_lm.experiments import evidence4

    assert evidence4.main(["--stage", "all", "--budget", "tiny", "--out", str(tmp_path / "e"),
                           "--plan"]) == 0
    out = capsys.readouterr().out
    assert "--stage language --budget tiny" in out and "--stage recall --budget tiny" in out
    assert "| mamba2 |" in out and "| rwkv7 L2 |" in out and "At most" in out
    assert not (tmp_path / "e").exists()  # nothing written
