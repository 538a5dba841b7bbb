"""Evidence IV's spec (``studies.specs.evidence4``): the matched mixers (mamba2, gated_deltanet)
have ECP's parameter count to within 2% at every stage and depth of the budgets that are
reported, and where a tiny size leaves no width that close, the matched width is the smallest
there is (the report states the difference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ecp_lm.model.matching import parameter_count
from ecp_lm.studies import specs
from ecp_lm.studies.spec import Recall, model_config

MATCHED = ("mamba2", "gated_deltanet")


def sizes(budget: str, study: str = "evidence4"):
    """(stage, depth) of every model size the budget trains."""
    for stage in specs.load(study).stages(budget).values():
        depths = stage.task.depths if isinstance(stage.task, Recall) else (None,)
        yield from ((stage, d) for d in depths)


@pytest.mark.parametrize("budget", ["small", "full"])
def test_the_matched_mixers_have_ecps_parameters(budget):
    for stage, depth in sizes(budget):
        ecp = parameter_count(model_config(stage, "ecp", depth))
        for name in MATCHED:
            ratio = parameter_count(model_config(stage, name, depth)) / ecp
            assert abs(ratio - 1) <= 0.02, (stage.name, depth, name, ratio)


@pytest.mark.parametrize("budget", ["small", "full"])
def test_evidence_v_matches_what_it_declares_matched(budget):
    """Every model of Evidence V with a ``"matched"`` width has ECP's parameter count within
    2% at every stage and depth; a Llama-style model keeps its skeleton."""
    for stage, depth in sizes(budget, "evidence5"):
        ecp = parameter_count(model_config(stage, "ecp", depth))
        for name, fields in stage.models.items():
            if "matched" in fields.values():
                cfg = model_config(stage, name, depth)
                ratio = parameter_count(cfg) / ecp
                assert abs(ratio - 1) <= 0.02, (stage.name, depth, name, ratio)
        if "llama" in stage.models:
            cfg = model_config(stage, "llama", depth)
            assert (cfg.norm, cfg.mlp, cfg.bias) == ("rmsnorm", "swiglu", False)


def test_a_width_that_cannot_match_is_the_smallest_one():
    for stage, depth in sizes("tiny"):
        ecp = parameter_count(model_config(stage, "ecp", depth))
        for name in MATCHED:
            cfg = model_config(stage, name, depth)
            if abs(parameter_count(cfg) / ecp - 1) > 0.02:
                assert parameter_count(cfg) > ecp and cfg.mixer_width == cfg.n_heads, \
                    (stage.name, depth, name)


def test_the_engine_and_its_specs_stay_within_their_line_budget():
    """One study engine: its modules and every live spec in at most 2,500 lines, and the model
    module in at most 450."""
    src = Path(__file__).resolve().parents[2] / "src" / "ecp_lm"
    files = [*(src / "studies").glob("*.py"), *(src / "studies" / "specs").glob("*.py")]
    assert sum(len(f.read_text().splitlines()) for f in files) <= 2500
    assert len((src / "model" / "model.py").read_text().splitlines()) <= 450
