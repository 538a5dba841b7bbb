"""benchmarks/block_masks.py: one invocation at a tiny size writes well-formed JSON, with each
band architecture's block mask measured in its own process."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "block_masks.py"


def test_block_mask_benchmark_writes_json(tmp_path):
    out = tmp_path / "block_masks.json"
    cmd = [sys.executable, str(SCRIPT), "--seq-lens", "512", "--heads", "4",
           "--predicate-archs", "", "--forward-lens", "", "--json", str(out)]
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    data = json.loads(out.read_text())
    assert "| arch | T | heads | BlockMask tensors KiB |" in printed
    assert data["meta"]["seq_lens"] == [512] and data["forward"] == []
    assert {(r["arch"], r["builder"]) for r in data["block_masks"]} == {
        (a, "band") for a in ("ecp", "sliding_window", "block_local", "s2")}
    for r in data["block_masks"]:
        assert r["seq_len"] == 512 and r["heads"] == 4
        assert 0 < r["table_bytes"] <= r["allocated_bytes"] < 2**20
        assert r["build_s"] > 0 and r["build_peak_growth_bytes"] >= 0
