"""benchmarks/attention.py: one invocation at tiny sizes writes well-formed JSON."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"


def test_attention_benchmark_writes_json(tmp_path, native_kernel):
    out = tmp_path / "attention.json"
    cmd = [sys.executable, str(SCRIPT), "--seq-lens", "64,128", "--segment-len", "32",
           "--heads", "1", "--head-dim", "8", "--repeats", "1", "--warmup", "0",
           "--json", str(out)]
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    assert "ecp_flash ÷ entries" in printed.splitlines()[0]
    data = json.loads(out.read_text())
    assert data["meta"]["kernels"] == ["ecp", "ecp_flash"]
    assert {(c["kernel"], c["seq_len"]) for c in data["cases"]} == {
        (k, n) for k in ("ecp", "ecp_flash", "causal") for n in (64, 128)}
    for row in data["summary"]:
        # (S·m(m+1)/2 + (S−1)·m²) / (N(N+1)/2) with m = 32
        n = row["seq_len"]
        s = n // 32
        expected = (s * 32 * 33 // 2 + (s - 1) * 32 * 32) / (n * (n + 1) // 2)
        assert abs(row["entries_ratio"] - expected) < 1e-12
        for k in ("ecp", "ecp_flash"):
            assert row[f"{k}_ms"] > 0 and row[f"{k}_time_ratio"] > 0
            assert abs(row[f"{k}_over_entries"] * expected - row[f"{k}_time_ratio"]) < 1e-9
