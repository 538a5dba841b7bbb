"""Evidence III's hybrid stage (`python -m ecp_lm.experiments.evidence --stage hybrid --budget
tiny`) end to end, two jobs at a time, on the real long-document corpus fetched through the
package registry (marked ``integration``): recall at L = 4 and 8 for the four hybrids and the
transformer, the hybrids' curve, three seeds each, the curve stage's runs set beside the
hybrids' only when measured alike, and a resumed stage that trains nothing."""

from __future__ import annotations

import json

import pytest
from test_integration import fetched

from ecp_lm.experiments.evidence import curve as curve_module
from ecp_lm.experiments.evidence import main
from ecp_lm.experiments.evidence import recall as recall_module
from ecp_lm.experiments.evidence.models import HYBRIDS

pytestmark = pytest.mark.integration


def test_tiny_hybrid_stage_runs_and_resumes(tmp_path, monkeypatch, capsys):
    from ecp_lm.data.sources import open_source

    fetched(lambda: open_source("sympy-code"))
    argv = ["--stage", "hybrid", "--budget", "tiny", "--out", str(tmp_path / "ev"), "--quiet"]
    assert main([*argv, "--jobs", "2"]) == 0
    stage = tmp_path / "ev" / "hybrid" / "tiny"
    recall = json.loads((stage / "recall" / "recall.json").read_text())
    assert list(recall["models"]) == [*HYBRIDS, "transformer"] and recall["depths"] == [4, 8]
    for model in recall["models"].values():
        for depth in ("4", "8"):
            assert len(model["depths"][depth]["per_seed"]) == 3
    for name in recall["models"]:  # the weights are kept, at both depths
        for depth in (4, 8):
            assert (stage / "recall" / "runs" / name / f"L{depth}" / "seed2" /
                    "model.safetensors").exists()
    assert not list((stage / "recall").rglob("train-state.pt"))  # finished runs leave none
    curve = json.loads((stage / "curve" / "curve.json").read_text())
    assert list(curve["models"]) == list(HYBRIDS)
    assert curve["reference"].startswith("The curve stage has not run")
    assert all(len(p["per_seed"]) == 3 for m in curve["models"].values()
               for p in m["points"].values())
    # The curve stage's tiny runs are two layers deep, the hybrids' four: not set beside them.
    pure = tmp_path / "ev" / "curve" / "tiny" / "curve.json"
    pure.parent.mkdir(parents=True)
    pure.write_text(json.dumps({**curve, "budget": "tiny", "size": {**curve["size"],
                                                                    "n_layers": 2}}))
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage trained again")

    for module, name in ((curve_module, "annealed_curve"), (curve_module, "select_job"),
                         (recall_module, "recall_job")):
        monkeypatch.setattr(module, name, no_training)
    assert main(argv) == 0
    again = json.loads((stage / "curve" / "curve.json").read_text())
    assert again["reference"].startswith("The curve stage's runs were not measured like these")
    assert {k: v for k, v in again.items() if k != "reference"} == {
        k: v for k, v in curve.items() if k != "reference"}
    assert json.loads((stage / "recall" / "recall.json").read_text()) == recall
