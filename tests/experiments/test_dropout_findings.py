"""The dropout stage's findings on a constructed table: the claim's second prediction (ECP's
validation advantage at dropout 0 against the one with every model at its own best dropout)
is stated with its sign and the seeds' verdict, computed by hand here."""

from __future__ import annotations

from ecp_lm.experiments.evidence.dropout import findings
from ecp_lm.experiments.evidence.stats import spread


def cell(arch: str, dropout: float, valid: list[float], gap: list[float]) -> dict:
    return {"arch": arch, "dropout": dropout, "best_valid_bits": spread(valid),
            "final_gap": spread(gap)}


def table() -> dict:
    rows = [
        # ecp: best at dropout 0.
        cell("ecp", 0.0, [3.30, 3.31, 3.32], [0.50, 0.52, 0.54]),
        cell("ecp", 0.1, [3.50, 3.51, 3.52], [0.40, 0.41, 0.42]),
        cell("ecp", 0.2, [3.60, 3.61, 3.62], [0.30, 0.31, 0.32]),
        # sliding_window: ahead of ecp at dropout 0, best there too.
        cell("sliding_window", 0.0, [3.25, 3.26, 3.27], [0.51, 0.53, 0.55]),
        cell("sliding_window", 0.1, [3.45, 3.46, 3.47], [0.40, 0.41, 0.42]),
        cell("sliding_window", 0.2, [3.55, 3.56, 3.57], [0.30, 0.31, 0.32]),
        # transformer: behind ecp at dropout 0 (separated), best at 0.1 where it overlaps ecp.
        cell("transformer", 0.0, [3.40, 3.41, 3.42], [0.70, 0.71, 0.72]),
        cell("transformer", 0.1, [3.31, 3.32, 3.36], [0.45, 0.46, 0.47]),
        cell("transformer", 0.2, [3.38, 3.39, 3.40], [0.35, 0.36, 0.37]),
    ]
    return {f"{r['arch']}/{r['dropout']:g}": r for r in rows}


def test_the_second_prediction_is_stated_at_dropout_0_and_at_each_ones_best():
    lines = findings(table())
    assert ("ecp's best-validation advantage over transformer: +0.1000 bits/byte (ecp ahead, "
            "ranges separate) at dropout 0; +0.0200 bits/byte (not separated by the seeds) "
            "with each at its best dropout (ecp 0, transformer 0.1)") in lines
    assert ("ecp's best-validation advantage over sliding_window: -0.0500 bits/byte (ecp "
            "behind, ranges separate) at dropout 0; -0.0500 bits/byte (ecp behind, ranges "
            "separate) with each at its best dropout (ecp 0, sliding_window 0)") in lines
    assert "transformer: best validation 3.3300 bits/byte at dropout 0.1" in lines


def test_the_first_prediction_compares_the_gaps_at_dropout_0():
    lines = findings(table())
    assert ("dropout 0, final train-validation gap: ecp 0.5200 against transformer 0.7100 "
            "bits/byte: ecp's is smaller (ranges separate)") in lines
    assert ("dropout 0, final train-validation gap: ecp 0.5200 against sliding_window 0.5300 "
            "bits/byte: not separated by the seeds") in lines


def runs_of(valid: list[list[float]], train: list[list[float]]) -> list[dict]:
    """Constructed runs: seed by seed, validation and training bits/byte at each epoch."""
    return [{"curve": [{"epoch": e + 1.0, "valid_bits": v, "train_bits": t, "gap_bits": v - t}
                       for e, (v, t) in enumerate(zip(vs, ts, strict=True))]}
            for vs, ts in zip(valid, train, strict=True)]


def test_by_epoch_spreads_each_epoch_over_the_seeds():
    from ecp_lm.experiments.evidence.dropout import by_epoch

    rows = by_epoch(runs_of([[3.0, 2.5, 2.6], [3.2, 2.7, 2.4]],
                            [[2.9, 2.0, 1.5], [3.0, 2.1, 1.6]]))
    assert [r["epoch"] for r in rows] == [1.0, 2.0, 3.0]
    # Epoch 2: validation 2.5 and 2.7; gaps 0.5 and 0.6.
    assert rows[1]["valid_bits"]["mean"] == 2.6
    assert abs(rows[1]["valid_bits"]["half_range"] - 0.1) < 1e-12
    assert abs(rows[1]["gap_bits"]["mean"] - 0.55) < 1e-12
    assert abs(rows[2]["gap_bits"]["max"] - 1.1) < 1e-12  # 2.6 - 1.5


def turned_cell(best_epochs: list[float], last_valid: list[float], best: list[float]) -> dict:
    return {"arch": "ecp", "dropout": 0.0, "best_epoch": spread(best_epochs),
            "best_valid_bits": spread(best),
            "by_epoch": [{"epoch": 10.0, "valid_bits": spread(last_valid)}]}


def test_a_cell_has_turned_only_where_every_seed_peaked_before_its_last_epoch():
    from ecp_lm.experiments.evidence.dropout import turning

    # Bests 2.40 and 2.42 (mean 2.41) at epochs 8 and 9; last epoch 2.45 and 2.47 (mean 2.46).
    assert turning(turned_cell([8.0, 9.0], [2.45, 2.47], [2.40, 2.42])) == (
        "ecp at dropout 0: best validation at epochs 8-9 of 10, then +0.0500 bits/byte by the "
        "last (every seed overfits)")
    assert turning(turned_cell([9.0, 10.0], [2.4, 2.4], [2.4, 2.4])).endswith(
        "(some seeds still improving)")
    assert turning(turned_cell([10.0, 10.0], [2.4, 2.4], [2.4, 2.4])) == (
        "ecp at dropout 0: best validation at epoch 10 of 10 (still improving in every seed)")


def test_the_report_has_the_gap_over_training_when_the_table_has_its_epochs():
    from ecp_lm.experiments.evidence.dropout import by_epoch, dropout_markdown

    row = {"arch": "ecp", "dropout": 0.1, "step_s": 0.5, "best_valid_bits": spread([2.5, 2.6]),
           "best_epoch": spread([2.0, 2.0]), "gap_at_best": spread([0.5, 0.6]),
           "final_gap": spread([0.5, 0.6]),
           "by_epoch": by_epoch(runs_of([[3.0, 2.5], [3.2, 2.6]], [[2.9, 2.0], [3.0, 2.0]]))}
    summary = {"budget": "tiny", "size": {"seq_len": 64, "d_model": 32, "n_layers": 2},
               "epochs": 2, "steps_per_epoch": 8, "train_bytes": 100, "seeds": 2,
               "costs": {}, "table": {"ecp/0.1": row}, "findings": []}
    text = dropout_markdown(summary)
    assert "| model | dropout | measure | 1 | 2 |" in text
    assert "| ecp | 0.1 | gap | 0.150 | 0.550 |" in text
    assert "| ecp | 0.1 | valid | 3.100 | 2.550 |" in text
    del row["by_epoch"]
    assert "| measure |" not in dropout_markdown(summary)
