"""The ``ecp`` command line: help, ``ecp complexity`` table and JSON, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ecp_lm.cli import main
from ecp_lm.config import ARCHS


def run_ecp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ecp_lm", *args], capture_output=True,
                          text=True, timeout=120)


def test_help_lists_commands() -> None:
    result = run_ecp("--help")
    assert result.returncode == 0
    assert "complexity" in result.stdout


def test_bad_override_is_one_line_error_in_a_subprocess() -> None:
    result = run_ecp("complexity", "--archs", "ecp", "--num-segments", "7")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ecp: error:")
    assert "num_segments=7" in lines[0]


def test_complexity_json_has_one_entry_per_arch(capsys: pytest.CaptureFixture) -> None:
    assert main(["complexity", "--json", "--num-segments", "16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [entry["arch"] for entry in data] == list(ARCHS)
    ecp = next(entry for entry in data if entry["arch"] == "ecp")
    assert ecp["seq_len"] == 2048 and ecp["num_segments"] == 16
    assert ecp["tile_ratio_to_full"] == pytest.approx(31 / 256, abs=1e-15)
    assert len(ecp["entries_per_layer"]) == ecp["n_layers"] == 12


def test_complexity_table_names_every_arch(capsys: pytest.CaptureFixture) -> None:
    assert main(["complexity"]) == 0
    out = capsys.readouterr().out
    for arch in ARCHS:
        assert arch in out
    assert "23.4%" in out  # ECP at S = 8: 15/64 of full attention in the tile convention


def test_overrides_and_arch_selection(capsys: pytest.CaptureFixture) -> None:
    argv = ["complexity", "--json", "--preset", "tiny", "--archs", "double, ecp",
            "--seq-len", "32", "--latent-len", "8", "--n-layers", "3"]
    assert main(argv) == 0
    double, ecp = json.loads(capsys.readouterr().out)
    assert (double["arch"], ecp["arch"]) == ("double", "ecp")
    assert double["latent_len"] == 8 and double["n_layers"] == 3 and ecp["seq_len"] == 32
    assert double["entries_per_layer"][-1] == 8 * 24 + 8 * 9 // 2  # latents only: l·h + l(l+1)/2


def test_config_file(tmp_path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "model.yaml"
    path.write_text("arch: transformer\nseq_len: 16\nn_layers: 1\nd_model: 8\nn_heads: 2\n")
    assert main(["complexity", "--json", "--config", str(path), "--archs", "transformer"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["entries"] == 16 * 17 // 2 and entry["flops"] == 4 * 8 * entry["entries"]


@pytest.mark.parametrize("argv", [
    ["complexity", "--num-segments", "7"],
    ["complexity", "--archs", "ecp,nope"],
    ["complexity", "--preset", "huge"],
    ["complexity", "--config", "/nonexistent/model.yaml"],
    ["complexity", "--archs", "double", "--latent-len", "4096"],
])
def test_user_errors_print_one_line_and_exit_2(argv: list[str],
                                               capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ecp: error: ")


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    assert "complexity" in capsys.readouterr().err


def test_plot_command(tmp_path, capsys):
    from ecp_lm.cli import main as cli_main
    from ecp_lm.training.loop import train
    from helpers import tiny_run_config

    train(tiny_run_config(tmp_path, steps=2), tmp_path / "run", progress=False)
    out = tmp_path / "curves.png"
    assert cli_main(["plot", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2


def test_bench_command_writes_json(tmp_path, capsys, native_kernel):
    import json

    import torch

    from ecp_lm.cli import main as cli_main

    out = tmp_path / "out.json"
    code = cli_main(["bench", "--archs", "ecp,transformer", "--seq-lens", "256,512", "--json",
                     str(out), "--d-model", "64", "--segment-len", "64", "--repeats", "1",
                     "--warmup", "0"])
    assert code == 0
    report = json.loads(out.read_text())
    # On CPU the native kernel builds in the test environment (the native_kernel fixture):
    # reporting the flash fallback here would be a silent substitute.
    assert report["meta"]["kernels"] == {"ecp": "native", "transformer": "flash"}
    assert report["meta"]["threads"] == torch.get_num_threads()  # torch's default, recorded
    rows = report["train"]
    assert [(r["arch"], r["seq_len"]) for r in rows] == [
        ("ecp", 256), ("transformer", 256), ("ecp", 512), ("transformer", 512)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_mib"] >= 0 and 0 <= r["attention_share"] <= 1
        assert r["params"] == rows[1]["params"]  # equal parameter count
    ecp = rows[2]
    assert ecp["attention_entries_ratio"] < 1 and ecp["time_ratio_to_transformer"] > 0
    assert "ecp" in capsys.readouterr().out
    assert cli_main(["bench", "--archs", "ecp", "--seq-lens", "300"]) == 2  # 300 % 256 != 0


def test_bench_decode_modes_report_the_bandwidth_floor(tmp_path, capsys, monkeypatch):
    """``ecp bench --decode-only``: decode steps at batch 1 and 16 for ECP and the transformer,
    eager on library kernels, eager and compiled, each beside the bytes a step must read and the
    floor those bytes take at the copy bandwidth measured in the same run. (The compiler here is
    dynamo with the eager backend, to stay fast: the real compiler is tested in test_decode.)"""
    import json

    import torch

    from ecp_lm import generation
    from ecp_lm.cli import main as cli_main

    monkeypatch.setattr(generation, "compiled_decode_step", lambda model: torch.compile(
        model.decode_step, backend="eager", fullgraph=True, dynamic=False))
    out = tmp_path / "decode.json"
    d, layers, m, window = 32, 2, 16, 256
    threads = torch.get_num_threads()
    assert cli_main(["bench", "--decode-only", "--d-model", str(d), "--n-layers",
                     str(layers), "--n-heads", "2", "--segment-len", str(m),
                     "--decode-lengths", "64", "--decode-window", str(window),
                     "--threads", "1", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads  # --threads held for the command only
    report = json.loads(out.read_text())
    assert report["train"] == []
    assert report["meta"]["threads"] == 1
    modes = report["decode_modes"]
    bandwidth = modes["copy_bandwidth_gb_s"] * 1e9
    assert bandwidth > 0
    cases = {(r["arch"], r["batch"], r["mode"]): r for r in modes["cases"]}
    assert set(cases) == {(a, b, mode) for a in ("ecp", "transformer") for b in (1, 16)
                          for mode in ("library", "eager", "compiled")}
    # the parameters: embedding + head (256 x d each) and per layer 4 d x d projections, a d x 4d
    # feed-forward with biases, two layer norms; the final norm
    params = 2 * 256 * d + layers * (4 * d * d + 8 * d * d + 5 * d + 4 * d) + 2 * d
    for (arch, batch, _), r in cases.items():
        assert r["param_bytes"] == 4 * params
        # the slots in use after N/2 + 3 + 4 · 2 + 64 positions (warm-up, two warm-up steps
        # in each of four turns, the timed steps): ECP's full ring of 2m; the transformer's
        slots = 2 * m if arch == "ecp" else window // 2 + 75
        assert r["cache_bytes"] == batch * layers * 2 * slots * d * 4, (arch, batch)
        floor = (r["param_bytes"] + r["cache_bytes"]) / bandwidth
        assert abs(r["floor_ms"] - 1e3 * floor) < 1e-9
        assert abs(r["ratio_to_floor"] - r["ms_per_step"] / r["floor_ms"]) < 1e-6
        assert abs(r["tokens_per_s"] - batch / (r["ms_per_step"] / 1e3)) < 1e-6 * r["tokens_per_s"]
    assert modes["steps"] == 64 and modes["rounds"] == 4
    printed = capsys.readouterr().out
    assert "compiled ÷ eager" in printed and "compiled ÷ library" in printed
    assert cli_main(["bench", "--decode-only", "--segment-len", "256",
                     "--decode-window", "1000"]) == 2
    assert cli_main(["bench", "--decode-only", "--threads", "0"]) == 2
