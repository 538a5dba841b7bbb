"""benchmarks/context_parallel.py: one invocation at a tiny size runs every (T, K) case in gloo
processes and writes JSON whose halo bytes, counted on the tensors sent, equal the analytic
message size; a window the ranks cannot split is a one-line error."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "context_parallel.py"
D, LAYERS, HEADS, M, B = 32, 2, 2, 8, 1
SEQ_LENS, KS = (64, 128), (1, 2)


def _script():
    if "context_parallel_bench" not in sys.modules:  # dataclasses look their module up there
        spec = importlib.util.spec_from_file_location("context_parallel_bench", SCRIPT)
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["context_parallel_bench"]


def test_context_parallel_benchmark_writes_json(tmp_path):
    out = tmp_path / "cp.json"
    cmd = [sys.executable, str(SCRIPT), "--d-model", str(D), "--n-layers", str(LAYERS),
           "--n-heads", str(HEADS), "--segment-len", str(M), "--seq-lens", "64,128",
           "--ks", "1,2", "--steps", "1", "--warmup", "0", "--memory-limit-mib", "1e6",
           "--json", str(out)]
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    data = json.loads(out.read_text())
    assert {(c["seq_len"], c["k"]) for c in data["cases"]} == {
        (t, k) for t in SEQ_LENS for k in KS}
    halo = 2 * B * HEADS * M * (D // HEADS) * 4  # (2, B, H, m, D) float32, per direction
    for c in data["cases"]:
        t, k = c["seq_len"], c["k"]
        assert c["step_s"] > 0 and c["shard_len"] == t // k and len(c["ranks"]) == k
        assert c["ring_bytes_per_layer"] == (k - 1) / k * t * 2 * D * 4
        assert c["halo_bytes_per_layer"] == (halo if k > 1 else 0)
        if k == 1:
            assert c["peak_ratio_to_k1"] == 1.0
        for r, rank in enumerate(c["ranks"]):
            assert rank["rank"] == r and rank["step_s"] > 0 and rank["times_s"][0] > 0
            # every rank but the last sends a halo on; every rank but the first returns one
            assert rank["halo_sent_forward_bytes_per_layer"] == (halo if r < k - 1 else 0)
            assert rank["halo_sent_backward_bytes_per_layer"] == (halo if r > 0 else 0)
    assert data["longest_fitting"] == {str(k): max(SEQ_LENS) for k in KS}
    assert "K=2: longest T within 1e+06 MiB per rank: 128" in printed


def test_window_not_a_multiple_of_k_segments_is_a_one_line_error(capsys):
    code = _script().main(["--d-model", str(D), "--n-heads", str(HEADS), "--segment-len",
                           str(M), "--seq-lens", "64,40", "--ks", "1,2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("error: T=40 is not a multiple of K*segment_len=16")


def test_longest_fitting_window_per_k():
    cases = [{"seq_len": t, "k": k, "peak_mib": t / k} for t in (10, 20, 40) for k in (1, 2, 4)]
    assert _script().longest_fitting(cases, 10.0) == {1: 10, 2: 20, 4: 40}
    assert _script().longest_fitting(cases, 2.0) == {1: None, 2: None, 4: None}
