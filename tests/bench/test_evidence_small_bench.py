"""benchmarks/evidence_small.py: the stages' wall times, kept across sessions, never a time of a
stage that resumed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence_small.py"
_spec = importlib.util.spec_from_file_location("evidence_small_bench_script", SCRIPT)
evidence_small = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(evidence_small)


@pytest.fixture
def launched(monkeypatch) -> list[list[str]]:
    """The stage commands the script starts, none of them run: each 'succeeds' at once."""
    commands: list[list[str]] = []

    def run(cmd, env):
        assert env["HF_HUB_OFFLINE"] == "1"
        commands.append(cmd)
        return 0

    monkeypatch.setattr(evidence_small, "run_stage", run)
    return commands


def test_times_read_as_the_readme_writes_them():
    assert evidence_small.minutes(1389) == "23 min"
    assert evidence_small.minutes(8723) == "2 h 25 min"
    assert evidence_small.table({"recall": 1389.0, "relay": 332.0}).splitlines()[-1] == (
        "| all 2 | 29 min (1,721 s) |")


def test_every_stage_runs_in_order_into_one_folder(tmp_path, launched):
    out, js = tmp_path / "out", tmp_path / "t.json"
    assert evidence_small.main(["--out", str(out), "--json", str(js)]) == 0
    assert [c[c.index("--stage") + 1] for c in launched] == [
        "recall", "relay", "curve", "dropout", "hybrid"]
    assert all(c[c.index("--out") + 1] == str(out) and "small" in c for c in launched)
    assert list(json.loads(js.read_text())["seconds"]) == [
        "recall", "relay", "curve", "dropout", "hybrid"]


def test_a_second_session_times_only_what_is_left(tmp_path, launched):
    out, js = tmp_path / "out", tmp_path / "t.json"
    (out / "recall" / "small").mkdir(parents=True)
    js.write_text(json.dumps({"budget": "small", "jobs": 2, "out": str(out),
                              "seconds": {"recall": 1389.0}}))
    assert evidence_small.main(["--out", str(out), "--json", str(js),
                                "--stages", "recall,relay"]) == 0
    assert [c[c.index("--stage") + 1] for c in launched] == ["relay"]
    seconds = json.loads(js.read_text())["seconds"]
    assert seconds["recall"] == 1389.0 and set(seconds) == {"recall", "relay"}


def test_a_stage_stopped_mid_way_is_refused(tmp_path, launched, capsys):
    out, js = tmp_path / "out", tmp_path / "t.json"
    (out / "relay" / "small").mkdir(parents=True)
    assert evidence_small.main(["--out", str(out), "--json", str(js)]) == 2
    assert not launched and not js.exists()
    assert "relay" in capsys.readouterr().err


def test_another_runs_times_are_not_mixed_in(tmp_path, launched):
    js = tmp_path / "t.json"
    js.write_text(json.dumps({"budget": "small", "jobs": 1, "out": str(tmp_path / "out"),
                              "seconds": {"recall": 1.0}}))
    assert evidence_small.main(["--out", str(tmp_path / "out"), "--json", str(js)]) == 2
    assert not launched


def test_a_failed_stage_is_not_timed(tmp_path, monkeypatch):
    js = tmp_path / "t.json"
    monkeypatch.setattr(evidence_small, "run_stage", lambda cmd, env: 3)
    assert evidence_small.main(["--out", str(tmp_path / "out"), "--json", str(js)]) == 3
    assert not js.exists()


def test_the_times_name_the_cpu(tmp_path, launched):
    """The JSON says which CPU it timed: its model, family and widest vector extension, read
    from /proc/cpuinfo (runs on another instruction set round differently)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n"
                    "model\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert evidence_small.cpu(info) == "AMD EPYC, family 26, model 2, avx2"
    out, js = tmp_path / "out", tmp_path / "t.json"
    assert evidence_small.main(["--out", str(out), "--json", str(js), "--stages", "relay"]) == 0
    assert json.loads(js.read_text())["cpu"] == evidence_small.cpu()
