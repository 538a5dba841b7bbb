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
from ecp_lm.experiments.evidence4.report import (
    ahead_in,
    analyse,
    answer,
    earlier_context,
    earlier_context_line,
    extrapolate,
    verdict_rows,
)


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
            **({"points": [100], "chance_bits": 4.5} if stage == "language"
               else {"chance": 0.0625, "chance_margin": 0.02})}


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
    assert answer("window", table) == "yes: ahead on language 100 steps"
    assert [r["ahead_in"] for r in table if r["versus"] == "sliding_window"] == ["3 of 3"]
    assert answer("s2", table) == ("not shown: not called (a rate at its grid's edge) on "
                                   "language 100 steps")
    assert answer("perceiver", table) == (
        "not shown: not called (the model ahead trained longer) on language 100 steps "
        "(equal time)")


def test_ahead_in_counts_the_paired_seeds_where_ecps_own_value_is_ahead():
    a, b = {"0": 2.0, "1": 2.5, "2": 2.1, "3": 1.0}, {"0": 2.2, "1": 2.4, "2": 2.3}
    assert ahead_in({"values": [a, b], "lower_is_better": True}) == "2 of 3"
    assert ahead_in({"values": [a, b], "lower_is_better": False}) == "1 of 3"


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
    negative = {"100": {"transformer": {"0": -0.005}}, "1000": {"transformer": {"0": -0.004}}}
    assert extrapolate(negative, 0.02)["grows"] is False  # a smaller loss is not a gain


def test_the_earlier_curve_names_the_budget_its_transformer_extrapolates_to(tmp_path):
    """Evidence III's transformer gains, one run file per seed, read as the context question
    reads its own: 0.001 at 100 steps and 0.011 at 1,000 reach 0.02 at 10^3.9 steps, at the
    transformer's step time of 2 s; ECP's runs beside them are not read."""
    import json

    for arch, gains in (("transformer", (0.001, 0.011)), ("ecp", (0.5, 0.9))):
        for seed in (0, 1):
            run = tmp_path / "curve" / arch / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "result.json").write_text(json.dumps({"seed": seed, "points": [
                {"steps": 100, "context_gain_bits": gains[0]},
                {"steps": 1000, "context_gain_bits": gains[1]}]}))
    (tmp_path / "step_s.json").write_text(json.dumps({"transformer": 2.0, "ecp": 1.0}))
    line = earlier_context_line(earlier_context(tmp_path))
    steps = 10 ** 3.9
    assert f"{steps:,.0f} steps" in line and f"{steps * 2 / 3600:,.1f} hours" in line
    assert "+0.0010 at 100 steps, +0.0110 at 1000 steps" in line


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


def test_an_answer_names_each_measurement_by_its_call():
    def row(call, where):
        return {"question": "q", "call": call, "where": where}

    behind = [row("sliding_window ahead", "recall L = 4"), row("no difference called",
                                                              "language 400 steps")]
    assert answer("q", behind) == ("no: behind on recall L = 4; no difference called on "
                                   "language 400 steps")
    both = [*behind, row("ECP ahead", "language 200 steps")]
    assert answer("q", both).startswith("mixed: ahead on language 200 steps; behind on")
    assert answer("other", both) == "not measured at this budget"


def test_a_rescued_model_takes_the_best_of_everything_it_tried():
    from ecp_lm.experiments.evidence4.rates import rescue

    chosen = {"ecp": {"lr": 1e-3, "inside": True, "trials": {"0.0003": 0.5, "0.001": 0.9,
                                                             "0.003": 0.6}},
              "stuck": {"lr": 1e-2, "inside": True, "trials": {"0.003": 0.06, "0.01": 0.07,
                                                               "0.03": 0.06}}}
    asked = []

    def trials(rates):
        asked.append(rates)
        return {m: {lr: 0.4 for lr in r} for m, r in rates.items()}

    grid = Grid((3e-3, 1e-2, 3e-2), 3.0, extensions=2)
    out = rescue(chosen, rescue_rates(chosen, lambda acc: acc < 0.1), trials, grid, False)
    # the learner's rate, then one step below it (ties go to the smaller rate)
    assert asked == [{"stuck": [1e-3]}, {"stuck": [3.33e-4]}]
    assert out["stuck"]["lr"] == 3.33e-4 and out["stuck"]["rescued_at"] == [1e-3]
    assert out["stuck"]["trials"]["0.001"] == 0.4 and not out["stuck"]["inside"]
    assert out["ecp"] == chosen["ecp"]
    assert rescue(chosen, {}, trials, grid, False) is chosen


def test_models_at_chance_are_named():
    from ecp_lm.experiments.evidence4.report import at_chance

    recall = summary("recall", {"ecp": {"lr": 1e-3, "trials": {"0.001": 0.07}},
                                "transformer": {"lr": 3e-3, "trials": {"0.003": 0.7}}}, [])
    language = summary("language", {"ecp": {"lr": 1e-3, "trials": {"0.001": 3.1}},
                                    "stuck": {"lr": 1e-3, "trials": {"0.001": 4.6}}}, [])
    assert at_chance({"recall": recall, "language": language}) == {
        "recall": ["ecp"], "language": ["stuck"]}


TIMED = """
import sys, time
from pathlib import Path
import ecp_lm.experiments.evidence4 as evidence4
evidence4.HEARTBEAT_S = 0.1
out = Path(sys.argv[1])
with evidence4.timed_invocation(out, 2):
    (out / "inside").touch()
    time.sleep(120)
"""


def test_an_invocation_killed_by_sigkill_keeps_its_time(tmp_path):
    """Each of three invocations, killed at a random instant of its stage, leaves its own entry
    with the seconds it ran, short by at most a heartbeat; a finished one before them stays."""
    import json
    import random
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "invocations.json").write_text(json.dumps([{"seconds": 7.5, "jobs": 1}]))
    rng = random.Random(0)
    ran = []
    for _ in range(3):
        (tmp_path / "inside").unlink(missing_ok=True)
        child = subprocess.Popen([sys.executable, "-c", TIMED, str(tmp_path)])
        while not (tmp_path / "inside").exists():
            assert child.poll() is None
            time.sleep(0.01)
        start = time.perf_counter()
        time.sleep(rng.uniform(0.5, 1.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        ran.append(time.perf_counter() - start)
    entries = json.loads((tmp_path / "invocations.json").read_text())
    assert entries[0] == {"seconds": 7.5, "jobs": 1} and len(entries) == 4
    for entry, seconds in zip(entries[1:], ran, strict=True):
        assert entry["jobs"] == 2 and seconds - 0.5 <= entry["seconds"] <= seconds + 1.0
