"""``ecp bench --pattern``: hybrid cases beside the pure ones, sized as they are, in the training
table and JSON (named ``hybrid(P)``, carrying the pattern) and in the decoding benchmark (each
layer's cache its own ring or window)."""

from __future__ import annotations

import json

import pytest

from ecp_lm.bench import decode
from ecp_lm.bench.complexity import compare
from ecp_lm.bench.core import BenchSpec, model_config, split_label
from ecp_lm.cli import main


def test_model_config_sizes_a_hybrid_as_the_pure_architectures() -> None:
    spec = BenchSpec(d_model=32, n_layers=6, n_heads=2, segment_len=16)
    cfg = model_config("hybrid(sliding_window*2,block_local,transformer)", 128, spec)
    assert (cfg.arch, cfg.layer_pattern, cfg.num_segments) == \
        ("hybrid", "sliding_window*2,block_local,transformer", 8)
    resolved = cfg.resolved()
    assert resolved.window == model_config("sliding_window", 128, spec).resolved().window
    assert resolved.block_len == 32  # 2m
    assert split_label("ecp") == ("ecp", None)
    with pytest.raises(ValueError, match=r"^hybrid\(ecp,transformer\): seq_len=100 is not "
                                         r"divisible by segment_len=16"):
        model_config("hybrid(ecp,transformer)", 100, spec)


def test_bench_adds_hybrid_rows(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--archs", "transformer", "--pattern", "ecp,transformer",
                 "--pattern", "sliding_window*3,transformer", "--seq-lens", "64", "--d-model",
                 "32", "--n-layers", "4", "--n-heads", "2", "--segment-len", "16",
                 "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["train"]
    assert [(r["arch"], r["layer_pattern"]) for r in rows] == [
        ("transformer", None), ("hybrid(ecp,transformer)", "ecp,transformer"),
        ("hybrid(sliding_window*3,transformer)", "sliding_window*3,transformer")]
    assert rows[1]["layer_archs"] == ["ecp", "transformer", "ecp", "transformer"]
    assert report["meta"]["patterns"] == ["ecp,transformer", "sliding_window*3,transformer"]
    kernels = report["meta"]["kernels"]
    assert {k.split(":")[0] for k in kernels["hybrid(ecp,transformer)"].split(",")} == \
        {"ecp", "transformer"}
    base = dict(vocab_size=256, d_model=32, n_layers=4, n_heads=2, seq_len=64, num_segments=4)
    full, *hybrids = compare(base, ["transformer"], ["ecp,transformer",
                                                     "sliding_window*3,transformer"])
    for r, cost in zip(rows[1:], hybrids, strict=True):
        assert r["tokens_per_s"] > 0 and r["peak_mib"] >= 0
        assert r["params"] == rows[0]["params"]  # the same weights, other masks
        assert r["attention_entries"] == cost.entries
        assert r["attention_entries_ratio"] == cost.entries / full.entries
        assert r["arch"] in printed


def test_bench_refuses_a_bad_pattern_before_any_work(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--archs", "", "--pattern", "ecp*2,ssplit", "--seq-lens", "64",
                 "--segment-len", "16", "--json", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "hybrid(ecp*2,ssplit)" in lines[0] and not out.exists()
    assert main(["bench", "--loss-memory", "--pattern", "ecp,transformer"]) == 2
    assert "does not take --pattern" in capsys.readouterr().err


def test_decode_measures_each_hybrid_beside_the_transformer() -> None:
    d, heads, layers, m, steps = 32, 2, 3, 16, 2
    spec = BenchSpec(d_model=d, n_layers=layers, n_heads=heads, segment_len=m)
    lengths = [40, 72]
    rows = decode.run_decode(lengths, steps, spec, progress=False,
                             patterns=("sliding_window,transformer", "ecp*2,block_local"))
    assert list(rows) == ["ecp", "transformer", "hybrid(sliding_window,transformer)",
                          "hybrid(ecp*2,block_local)"]
    slot = 2 * heads * (d // heads) * 4  # a key and a value of float32 per head
    # with a global layer the window is the least multiple of m that holds the longest
    # sequence (72 + 2 -> N = 80, S = 5); local layers only: ECP's window of 8m
    global_n = 80
    window = model_config("sliding_window", global_n, spec).resolved().window
    expected = {"hybrid(sliding_window,transformer)": (global_n, [window, global_n, window]),
                "hybrid(ecp*2,block_local)": (8 * m, [2 * m, 2 * m, 2 * m])}
    for name, (n, capacities) in expected.items():
        for point, length in zip(rows[name], lengths, strict=True):
            assert point["layer_pattern"] == split_label(name)[1] and point["seq_len"] == n
            assert point["cache_bytes_allocated"] == sum(capacities) * slot
            filled = length - 1 + steps  # the prompt and the decoded tokens
            assert point["cache_bytes"] == sum(min(c, filled) for c in capacities) * slot
            assert point["ms_per_token"] > 0
    table = decode.format_decode(rows)
    assert "hybrid(sliding_window,transformer)" in table and "hybrid(ecp*2,block_local)" in table
