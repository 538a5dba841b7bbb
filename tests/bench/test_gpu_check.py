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


def script_words() -> list[str]:
    """The words of gpu_check.sh's commands, its comments left out and its line
    continuations joined."""
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return " ".join(lines).split()


def test_every_path_the_script_names_exists():
    named = [w.strip("\"'") for w in script_words() if re.match(r"[\"']?(tests|benchmarks)/", w)]
    assert any(w.startswith("tests/") for w in named), named
    missing = [w for w in named if not (ROOT / w).exists()]
    assert not missing, f"gpu_check.sh names {missing}, which do not exist"


def test_its_pytest_selection_collects_the_gpu_tests():
    """What the script hands pytest collects tests (on the CPU they are collected and skipped):
    a moved or emptied file fails here rather than on the GPU machine."""
    words = script_words()
    start = words.index("pytest") + 1
    selection = [w for w in words[start:words.index("2>&1", start)]
                 if w.startswith("tests/")]
    assert selection, words[start:]
    for path in selection:
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               "-p", "no:cacheprovider", path], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        collected = [line for line in done.stdout.splitlines() if "::" in line]
        assert collected, f"{path} collects no test"
    gpu = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *selection], capture_output=True, text=True,
                         cwd=ROOT, timeout=300).stdout
    assert "test_gpu.py::test_cuda_kernels_equal_reference[ecp-flash]" in gpu
    assert "test_cuda_flex_training_and_validation_stay_within_the_graph_budget" in gpu


def test_measurements_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--device", "cpu", "--quick", "--sections",
                           "device,train,kernels,block_masks,mixers", "--json", str(out)],
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
    kernels = report["kernels"]
    timed = {(c["arch"], c["kernel"]) for c in kernels["cases"] if "ms" in c}
    assert {("ecp", "flex"), ("ecp", "flash"), ("ecp", "mask"), ("s2", "flex")} <= timed
    for arch in ("ecp", "sliding_window", "block_local", "s2", "longformer",
                 "sparse_transformer"):
        choice = kernels["fastest"][arch]["256"]
        assert (arch, choice["fastest"]) in timed and choice["auto_picks"]
    mixers = report["mixers"]
    archs = ("mamba2", "gated_deltanet", "rwkv7", "rwkv4", "mamba", "mlstm", "slstm", "performer",
             "compressive", "routing")
    assert {(c["arch"], c["kernel"]) for c in mixers["cases"] if "ms" in c} == {
        (arch, "chunked") for arch in archs}
    skipped = {c["arch"]: (c["kernel"], c["skipped"]) for c in mixers["cases"]
               if c["kernel"] != "chunked"}
    fla = "flash-linear-attention's kernels run on CUDA, not cpu"
    assert {a: skipped[a] for a in ("mamba2", "gated_deltanet", "rwkv7", "rwkv4", "performer")
            } == {a: ("fla", fla) for a in ("mamba2", "gated_deltanet", "rwkv7", "rwkv4",
                                            "performer")}
    assert skipped["mamba"] == ("mamba_ssm", "mamba-ssm's selective scan runs on CUDA, not cpu")
    assert skipped["mlstm"][0] == "mlstm_kernels" and "CUDA" in skipped["mlstm"][1]
    assert {a: skipped[a] for a in ("slstm", "compressive", "routing")} == {
        a: ("fla", f"arch={a!r} has no 'fla' kernel") for a in ("slstm", "compressive", "routing")}
    assert "| mamba2 | 256 | chunked |" in done.stdout
    assert mixers["fastest"] == {a: {"256": {"fastest": "chunked", "auto_picks": "chunked"}}
                                 for a in archs}
    steps = {(r["arch"], r["compiled"]): r for r in mixers["steps"]}  # quick: mamba2's only
    assert set(steps) == {("mamba2", False), ("mamba2", True)}
    assert all(r["tokens_per_s"] > 0 and r["kernel"] == "chunked" for r in steps.values())
    assert "| mamba2 | 256 | compiled | chunked |" in done.stdout
