"""Evidence III's hybrid stage: every hybrid model is three local layers of its kind and one
global layer per unit of four, at every depth the stage trains (the curve's included), and the
tile-matched hybrid window is w = m."""

from __future__ import annotations

import pytest

from ecp_lm.config import ModelConfig, tile_pattern
from ecp_lm.experiments.evidence.curve import CURVE_BUDGETS
from ecp_lm.experiments.evidence.models import HYBRIDS, model_config
from ecp_lm.experiments.evidence.recall import RECALL_BUDGETS
from ecp_lm.experiments.evidence.recall import model_config as recall_config

LOCAL = {"hybrid_ecp": "ecp", "hybrid_sliding_window": "sliding_window",
         "hybrid_sliding_window_tiles": "sliding_window", "hybrid_block_local": "block_local"}


def test_every_hybrid_has_its_global_layer():
    assert set(HYBRIDS) == set(LOCAL)
    for name in ("tiny", "small", "full"):
        budget = CURVE_BUDGETS[f"hybrid-{name}"]
        assert budget.models == HYBRIDS
        recall = RECALL_BUDGETS[f"hybrid-{name}"]
        assert recall.depths == (4, 8) and recall.models == (*HYBRIDS, "transformer")
        for model in HYBRIDS:
            configs = [ModelConfig(**model_config(model, budget.size))]
            configs += [recall_config(recall, model, depth) for depth in recall.depths]
            for cfg in configs:
                layers = tile_pattern(cfg.layer_pattern, cfg.n_layers)
                unit = [LOCAL[model]] * 3 + ["transformer"]
                assert layers == unit * (cfg.n_layers // 4), (model, cfg.n_layers)
                if model == "hybrid_sliding_window_tiles":
                    assert cfg.window == cfg.seq_len // cfg.num_segments


def test_the_stage_runs_recall_and_the_curve_on_the_hybrid_budgets(tmp_path, monkeypatch,
                                                                    capsys):
    from ecp_lm.experiments import evidence
    from ecp_lm.experiments.evidence import curve, recall

    calls = []
    monkeypatch.setattr(recall, "run_recall", lambda name, out, *a: calls.append((name, out)))
    monkeypatch.setattr(curve, "run_curve", lambda name, out, *a: calls.append((name, out)))
    monkeypatch.setattr(recall, "recall_markdown", lambda summary: "")
    monkeypatch.setattr(curve, "curve_markdown", lambda summary: "")
    assert evidence.main(["--stage", "hybrid", "--budget", "small", "--out",
                          str(tmp_path / "ev"), "--quiet"]) == 0
    stage = tmp_path / "ev" / "hybrid" / "small"
    assert calls == [("hybrid-small", stage / "recall"), ("hybrid-small", stage / "curve")]
    with pytest.raises(SystemExit) as exit_:
        evidence.main(["--stage", "hybrid", "--budget", "huge", "--out", str(tmp_path / "ev")])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
