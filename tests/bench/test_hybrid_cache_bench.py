"""benchmarks/hybrid_cache.py: the decode caches a hybrid allocates, measured, against the
ratio of its layers' slots to a transformer's, with the slots written out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_cache.py"
N, M, LAYERS, HEADS, D_MODEL = 256, 16, 6, 4, 256


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT, "hybrid_cache_script")


def equal_cost_window(n: int, m: int) -> int:
    """The window whose entries over N queries are nearest ECP's (the smaller on a tie), by
    counting both."""
    ecp = sum(min(q % m + 1 + (m if q >= m else 0), q + 1) for q in range(n))
    return min(range(1, n + 1),
               key=lambda w: (abs(sum(min(q + 1, w) for q in range(n)) - ecp), w))


def slot_bytes() -> int:
    """One slot of one layer's cache, batch 1: a key and a value of float32 per head, and the
    int64 position the slot holds."""
    return 2 * D_MODEL * 4 + 8


@pytest.mark.parametrize("name, slots", [
    ("transformer", lambda w: [N] * 6),
    ("hybrid(sliding_window*5,transformer)", lambda w: [w] * 5 + [N]),
    ("hybrid(ecp*5,transformer)", lambda w: [2 * M] * 5 + [N]),
    ("hybrid(block_local*3,transformer)", lambda w: [2 * M] * 3 + [N] + [2 * M] * 2),
    ("hybrid(s2,transformer)", lambda w: [M, N] * 3),
])
def test_caches_are_measured_at_the_analytic_ratio(script, name, slots) -> None:
    row = script.run_case(name, N, M)
    expected = slots(equal_cost_window(N, M))
    assert row["layer_slots"] == expected and row["analytic_slots"] == expected
    assert row["analytic_ratio"] == pytest.approx(sum(expected) / (LAYERS * N), abs=1e-15)
    assert row["allocated_bytes"] == sum(expected) * slot_bytes()
    assert row["storage_bytes"] == row["allocated_bytes"]
    assert row["kv_bytes"] == sum(expected) * 2 * D_MODEL * 4
    assert row["ms_per_token"] is None  # no decode steps asked for


def test_the_named_ratios(script) -> None:
    w = equal_cost_window(N, M)
    rows = [script.run_case(name, N, M) for name in
            ("transformer", "hybrid(sliding_window*5,transformer)", "hybrid(ecp*5,transformer)")]
    script.add_ratios(rows)
    _, window, ecp = rows
    assert window["window"] == w
    assert window["analytic_ratio"] == pytest.approx((5 * w + N) / (6 * N), abs=1e-15)
    assert ecp["analytic_ratio"] == pytest.approx((5 * 2 * M + N) / (6 * N), abs=1e-15)
    for r in rows:
        assert r["ratio"] == pytest.approx(r["analytic_ratio"], abs=1e-12)
        assert abs(r["deviation"]) < 1e-12
    assert script.goal_failures(rows) == []
    window["deviation"] = 0.06  # a measurement 6% off is reported
    assert len(script.goal_failures(rows)) == 1


def test_script_writes_json(script, tmp_path, capsys) -> None:
    out = tmp_path / "hybrid_cache.json"
    assert script.main(["--seq-lens", str(N), "--segment-len", str(M), "--patterns",
                        "ecp*5,transformer", "--prefill", "40", "--steps", "1",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["goal_met"] and data["meta"]["n_layers"] == LAYERS
    assert [r["case"] for r in data["cases"]] == ["transformer", "hybrid(ecp*5,transformer)"]
    assert all(r["ms_per_token"] > 0 for r in data["cases"])
    printed = capsys.readouterr().out
    assert "| hybrid(ecp*5,transformer) | 256 | 32×5, 256 |" in printed and "met" in printed
