"""Rates that cannot decide a verdict (``studies.rates``): a best rate at the grid's edge extends
the grid until it is inside or the extensions are spent, higher is better for accuracy, ties go
to the smaller rate, every model's trials of a round are asked for together, and a model at
chance is tried at the learners' rates and then takes the best of everything it tried."""

from __future__ import annotations

import math

from ecp_lm.studies.rates import choice, next_rates, rescue, rescue_rates, select_all
from ecp_lm.studies.spec import Grid


def trials_of(score):
    """A ``trials`` callback scoring every rate with ``score(lr)``, and the rounds it was
    asked (each ``{model: rates}``)."""
    asked = []

    def trials(rates):
        asked.append(rates)
        return {m: {lr: score(lr) for lr in r} for m, r in rates.items()}

    return trials, asked


def test_a_best_rate_at_an_edge_extends_the_grid_until_it_is_inside():
    trials, asked = trials_of(lambda lr: (math.log(lr) - math.log(1e-2)) ** 2)
    chosen = select_all(Grid((1e-3, 2e-3, 4e-3), 2.0), ["m"], trials, lower_is_better=True)
    assert asked == [{"m": [1e-3, 2e-3, 4e-3]}, {"m": [8e-3]}, {"m": [1.6e-2]}]
    assert chosen["m"]["lr"] == 8e-3 and chosen["m"]["inside"]
    assert list(chosen["m"]["trials"]) == ["0.001", "0.002", "0.004", "0.008", "0.016"]


def test_the_extensions_stop_and_the_edge_is_reported():
    trials, asked = trials_of(lambda lr: lr)  # lower is better: always the smallest
    chosen = select_all(Grid((1e-3, 2e-3), 2.0, extensions=2), ["m"], trials,
                        lower_is_better=True)
    assert [r["m"] for r in asked] == [[1e-3, 2e-3], [5e-4], [2.5e-4]]
    assert chosen["m"]["lr"] == 2.5e-4 and not chosen["m"]["inside"]


def test_higher_is_better_for_accuracy():
    trials, _ = trials_of(lambda lr: -abs(math.log10(lr) + 3))  # best at 1e-3
    chosen = select_all(Grid((1e-4, 1e-3, 1e-2), 10.0), ["m"], trials, lower_is_better=False)
    assert chosen["m"]["lr"] == 1e-3 and chosen["m"]["inside"]


def test_ties_go_to_the_smaller_rate_and_the_next_rate_is_rounded():
    scores = {1e-3: 0.5, 3e-3: 0.5, 1e-2: 0.9}
    assert choice(scores, lower_is_better=True) == {
        "lr": 1e-3, "trials": {"0.001": 0.5, "0.003": 0.5, "0.01": 0.9}, "inside": False}
    grid = Grid((1e-3, 3e-3, 1e-2), 3.0, extensions=1)
    assert next_rates(scores, grid, lower_is_better=True) == [3.33e-4]
    assert next_rates({**scores, 3.33e-4: 0.5}, grid, lower_is_better=True) == []  # spent
    assert next_rates(scores, grid, lower_is_better=False) == [3e-2]  # 0.9 at the top edge
    assert next_rates({1e-3: 0.1, 3e-3: 0.9, 1e-2: 0.1}, grid, False) == []  # inside


def test_every_models_trials_of_a_round_run_together_and_kept_ones_are_not_run_again():
    """Round one asks both models for their grid's rates at once (less the one ``b`` already
    has); round two only ``a``, whose best sits on the upper edge."""
    grid = Grid((1e-3, 2e-3), 2.0, extensions=1)
    asked = []

    def trials(rates):
        asked.append(rates)
        return {m: {lr: (-lr if m == "a" else 10.0) for lr in r} for m, r in rates.items()}

    chosen = select_all(grid, ["a", "b"], trials, lower_is_better=True,
                        tried={"b": {1e-3: 9.0, 5e-4: 9.5}})
    assert asked == [{"a": [1e-3, 2e-3], "b": [2e-3]}, {"a": [4e-3]}]
    assert chosen["a"]["lr"] == 4e-3 and not chosen["a"]["inside"]
    assert chosen["b"]["trials"] == {"0.0005": 9.5, "0.001": 9.0, "0.002": 10.0}
    assert chosen["b"]["lr"] == 1e-3 and chosen["b"]["inside"]


def test_a_model_at_chance_is_tried_at_the_learners_rates():
    chosen = {"ecp": {"lr": 1e-3, "trials": {"0.001": 0.9, "0.003": 0.5}},
              "window": {"lr": 3e-3, "trials": {"0.003": 0.8, "0.01": 0.2}},
              "stuck": {"lr": 1e-2, "trials": {"0.003": 0.06, "0.01": 0.07}}}
    assert rescue_rates(chosen, lambda acc: acc < 0.1) == {"stuck": [1e-3]}
    assert rescue_rates({"stuck": chosen["stuck"]}, lambda acc: acc < 0.1) == {}
    assert rescue_rates({"ecp": chosen["ecp"]}, lambda acc: acc < 0.1) == {}


def test_a_rescued_model_takes_the_best_of_everything_it_tried():
    chosen = {"ecp": {"lr": 1e-3, "inside": True, "trials": {"0.0003": 0.5, "0.001": 0.9,
                                                             "0.003": 0.6}},
              "stuck": {"lr": 1e-2, "inside": True, "trials": {"0.003": 0.06, "0.01": 0.07,
                                                               "0.03": 0.06}}}
    trials, asked = trials_of(lambda lr: 0.4)
    grid = Grid((3e-3, 1e-2, 3e-2), 3.0, extensions=2)
    out = rescue(chosen, rescue_rates(chosen, lambda acc: acc < 0.1), trials, grid, False)
    # the learner's rate, then one step below it (ties go to the smaller rate)
    assert asked == [{"stuck": [1e-3]}, {"stuck": [3.33e-4]}]
    assert out["stuck"]["lr"] == 3.33e-4 and out["stuck"]["rescued_at"] == [1e-3]
    assert out["stuck"]["trials"]["0.001"] == 0.4 and not out["stuck"]["inside"]
    assert out["stuck"]["trials"]["0.01"] == 0.07  # what it tried before is kept
    assert out["ecp"] == chosen["ecp"]
    assert rescue(chosen, {}, trials, grid, False) is chosen
    assert rescue(chosen, {"stuck": []}, trials, grid, False) is chosen
