"""benchmarks/attention.py: one invocation at tiny sizes writes well-formed JSON, with each
kernel's time per unmasked entry measured against its own entry count."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"
KERNELS = ("ecp", "ecp_flash", "window")


def _ecp_entries(n, m):  # S·m(m+1)/2 + (S−1)·m²
    s = n // m
    return s * m * (m + 1) // 2 + (s - 1) * m * m


def _window_entries(n, w):  # query t sees min(t + 1, w) keys
    return sum(min(t + 1, w) for t in range(n))


def _run(tmp_path, *extra):
    out = tmp_path / "attention.json"
    cmd = [sys.executable, str(SCRIPT), "--seq-lens", "64,128", "--segment-len", "32",
           "--heads", "1", "--head-dim", "8", "--repeats", "1", "--warmup", "0",
           "--json", str(out), *extra]
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return printed, json.loads(out.read_text())


def test_attention_benchmark_writes_json(tmp_path, native_kernel):
    printed, data = _run(tmp_path)
    header = printed.splitlines()[0]
    assert all(f"{k} ÷ entries" in header for k in KERNELS)
    assert data["meta"]["kernels"] == list(KERNELS)
    assert {(c["kernel"], c["seq_len"]) for c in data["cases"]} == {
        (k, n) for k in (*KERNELS, "causal") for n in (64, 128)}
    for row in data["summary"]:
        n = row["seq_len"]
        causal = n * (n + 1) // 2
        ecp = _ecp_entries(n, 32)
        # the default window: as many unmasked entries as ECP, as near as a whole w gets
        w = row["window"]
        assert all(abs(_window_entries(n, w) - ecp) <= abs(_window_entries(n, x) - ecp)
                   for x in range(1, n + 1))
        assert f"N={n}: window (w={w}) ÷ ecp time per unmasked entry" in printed
        assert abs(row["entries_ratio"] - ecp / causal) < 1e-12
        entries = {"ecp": ecp, "ecp_flash": ecp, "window": _window_entries(n, w)}
        for k in KERNELS:
            assert row[f"{k}_ms"] > 0 and row[f"{k}_time_ratio"] > 0
            assert abs(row[f"{k}_entries_ratio"] - entries[k] / causal) < 1e-12
            assert abs(row[f"{k}_over_entries"] * row[f"{k}_entries_ratio"]
                       - row[f"{k}_time_ratio"]) < 1e-9
        assert abs(row["window_over_ecp_per_entry"]
                   - row["window_over_entries"] / row["ecp_over_entries"]) < 1e-12
    assert [row["window"] for row in data["summary"]] == [64, 50]


def test_attention_benchmark_takes_a_window(tmp_path, native_kernel):
    _, data = _run(tmp_path, "--kernels", "window", "--window", "20")
    assert data["meta"]["kernels"] == ["window"]
    for row in data["summary"]:
        assert row["window"] == 20
        assert abs(row["window_entries_ratio"] * row["seq_len"] * (row["seq_len"] + 1) / 2
                   - _window_entries(row["seq_len"], 20)) < 1e-6
        assert "window_over_ecp_per_entry" not in row
