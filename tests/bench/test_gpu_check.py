"""The offline GPU check: its script installs nothing (a GPU node has no network), and its
measurements run end to end, here on the CPU at tiny sizes (``--quick``)."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_needs_no_network():
    lines = [line for line in (ROOT / "benchmarks" / "gpu_check.sh").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert not [line for line in lines if re.search(r"\b(pip|venv)\b", line)], lines
    assert any("PYTHONPATH" in line for line in lines)


def test_measurements_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--device", "cpu", "--quick", "--sections",
                           "device,train,block_masks", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {}
    rows = report["train"]
    assert {(r["arch"], r["seq_len"]) for r in rows} >= {("ecp", 64), ("transformer", 128),
                                                          ("sliding_window", 256)}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["step_flops"] > 0 and r["ratio_to_matmul"] > 0
    assert report["block_masks"]["cases"]
    assert "| ecp | 64 |" in done.stdout
