"""benchmarks/stream_chunks.py: each path runs what it names (the kernel path never attends
densely over a filled ring, the dense path does), both score the same loss, and the table and
JSON carry every (chunk length, path) with the ratio of the longest chunk's ms per token to the
shortest's. Tiny sizes, every case in this process."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from ecp_lm.model import attention as skeleton
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stream_chunks.py"
TINY = ["--seq-len", "32", "--segments", "4", "--tokens", "200", "--d-model", "32",
        "--layers", "2", "--heads", "2", "--threads", "1"]  # m = 8


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT, "stream_chunks_script")


def test_each_path_runs_what_it_names(script, monkeypatch):
    dense = []
    real = skeleton.cached_attention
    monkeypatch.setattr(skeleton, "cached_attention",
                        lambda *a, **k: dense.append(1) or real(*a, **k))
    args = script.parse_args(TINY)
    rows = {}
    for path in script.PATHS:
        dense.clear()
        rows[path] = script.run_case(args, 24, path)
        assert bool(dense) == (path == "dense"), path
    kernel, dense_row = rows["kernel"], rows["dense"]
    assert kernel["tokens_scored"] == dense_row["tokens_scored"] == 200
    assert kernel["loss"] == pytest.approx(dense_row["loss"], rel=1e-6)
    assert kernel["forward_ms_per_token"] > 0 and dense_row["forward_ms_per_token"] is None
    assert script.run_case(args, 12, "kernel")["forward_ms_per_token"] is None  # off period


def test_the_table_and_json(script, tmp_path, monkeypatch, capsys):
    def in_process(cmd, capture_output, text):  # a case's subprocess, run here
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = script.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, code, out.getvalue(), "")

    monkeypatch.setattr(script.subprocess, "run", in_process)
    out = tmp_path / "stream_chunks.json"
    assert script.main([*TINY, "--chunk-lens", "8,64", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 8 | 0.25 |" in table and "| 64 | 2 |" in table
    assert "ms/token at C = 64 ÷ at C = 8: kernel" in table
    report = json.loads(out.read_text())
    assert [(r["chunk_len"], r["path"]) for r in report["results"]] == \
        [(8, "kernel"), (8, "dense"), (64, "kernel"), (64, "dense")]
    by = {(r["chunk_len"], r["path"]): r for r in report["results"]}
    assert report["ratios"]["kernel"] == pytest.approx(
        by[64, "kernel"]["ms_per_token"] / by[8, "kernel"]["ms_per_token"])
    losses = [r["loss"] for r in report["results"]]
    assert max(losses) - min(losses) < 1e-5 * max(losses)
    assert report["meta"]["config"]["seq_len"] == 32 and report["meta"]["tokens"] == 200


def test_default_chunk_lengths(script):
    assert script.default_chunk_lens(1024, 16) == [64, 256, 1024, 4096, 8192]
    assert script.default_chunk_lens(32, 4) == [8, 32, 128, 256]  # 4m = N


def test_the_performance_page_quotes_the_recorded_table(script):
    """The performance page's table is the script's table of its recorded JSON, row for row."""
    root = SCRIPT.parents[1]
    report = json.loads((root / "benchmarks/results/stream_chunks_cpu.json").read_text())
    rows = script.format_table(report["results"], report["meta"]["config"]["seq_len"])
    page = (root / "docs" / "performance.md").read_text()
    for line in rows.splitlines():
        if line.startswith("|"):
            assert line in page, line
    dense = [r for r in report["results"] if r["path"] == "dense"][-1]
    kernel = [r for r in report["results"] if r["path"] == "kernel"][-1]
    assert f"{dense['ms_per_token'] / kernel['ms_per_token']:.1f}× slower" in page
    assert f"{dense['peak_bytes'] / kernel['peak_bytes']:.1f}× the peak memory" in page
    first = {r["path"]: r["ms_per_token"] for r in report["results"][:2]}  # C = m
    assert f"{first['kernel'] / first['dense'] - 1:.0%} slower than the dense one" in page
