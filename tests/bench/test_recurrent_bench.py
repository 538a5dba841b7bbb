"""The recurrent mixers' measurements on the performance page: ``benchmarks/state_decode.py``
(its table the script's own rendering of its recorded JSON, and a small run that shows a state's
bytes do not move with the position while the transformer's cache grows), and the training
table of ``ecp bench`` for the mixers beside ECP and the transformer (rows rendered from its
recorded JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "state_decode.py"
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"
TRAIN = {"glibc's defaults": RESULTS / "bench_recurrent_cpu.json",
         "a heap that keeps its pages": RESULTS / "bench_recurrent_heap_cpu.json"}


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT, "state_decode")


def test_a_small_run_keeps_the_states_bytes(script, tmp_path, capsys):
    out = tmp_path / "state.json"
    assert script.main(["--archs", "ecp,transformer,mamba2", "--positions", "128,512",
                        "--steps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    by = {(r["arch"], r["position"]): r for r in rows}
    assert by["mamba2", 128]["cache_bytes"] == by["mamba2", 512]["cache_bytes"]
    assert by["ecp", 128]["cache_bytes"] == by["ecp", 512]["cache_bytes"]
    assert by["transformer", 512]["cache_bytes"] > 3 * by["transformer", 128]["cache_bytes"]
    assert all(r["ms_per_token"] > 0 for r in rows)
    assert "| mamba2 |" in capsys.readouterr().out


def test_a_transformer_cache_past_the_limit_is_sized_not_built(script):
    row = script.run_case("transformer", 1 << 20, 4, max_cache_bytes=1 << 20)
    assert row == {"arch": "transformer", "position": 1 << 20, "params": None,
                   "cache_bytes": script.transformer_bytes(1 << 20, 4), "ms_per_token": None,
                   "run": False}


def test_the_page_quotes_the_recorded_decode_table(script):
    report = json.loads((ROOT / "benchmarks/results/state_decode_cpu.json").read_text())
    page = PAGE.read_text()
    for line in script.format_table(report["results"]).splitlines():
        if line.strip():
            assert line in page, line


def train_rows(path: Path) -> list[str]:
    """One of the page's training tables, rendered from its recorded ``ecp bench`` JSON."""
    rows = json.loads(path.read_text())["train"]
    lines = ["| arch | N | kernel | parameters | tokens/s | peak MiB | step time / transformer |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arch']} | {r['seq_len']:,} | {r['kernel']} | {r['params']:,} | "
              f"{r['tokens_per_s']:,.0f} | {r['peak_mib']:,.0f} | "
              f"{r['time_ratio_to_transformer']:.3f} |" for r in rows]
    return lines


@pytest.mark.parametrize("run", TRAIN)
def test_the_page_quotes_the_recorded_training_tables(run):
    page = PAGE.read_text()
    for line in train_rows(TRAIN[run]):
        assert line in page, line


def test_the_heap_run_kept_its_pages():
    """The second run is the one the page says: glibc's allocator told never to return memory
    to the system (``malloc_env`` in its JSON), the first with the allocator as it comes."""
    heap = json.loads(TRAIN["a heap that keeps its pages"].read_text())["meta"]
    assert heap["malloc_env"] == {"MALLOC_MMAP_MAX_": "0",
                                  "MALLOC_TRIM_THRESHOLD_": "100000000000"}
    assert not json.loads(TRAIN["glibc's defaults"].read_text())["meta"].get("malloc_env")


@pytest.mark.parametrize(("arch", "kernels", "attends"), [
    ("mamba2", "chunked", False),
    ("rwkv7", "chunked", False),
    ("hybrid(gated_deltanet,ecp)", "ecp:native,gated_deltanet:chunked", True),
])
def test_bench_names_a_mixers_kernel_and_gives_it_no_attention(arch, kernels, attends):
    """``ecp bench`` records the kernel each recurrent layer ran, and a model without attention
    has an attention share of exactly 0 (not the noise of timing the same step twice)."""
    from ecp_lm.bench.core import BenchSpec
    from ecp_lm.bench.training import run_case

    spec = BenchSpec(d_model=32, n_layers=2, n_heads=2, segment_len=32, warmup=0, repeats=1,
                     threads=1)
    row = run_case(arch, 128, spec)
    assert row["kernel"] == kernels
    if attends:
        assert row["attention_s"] is not None and row["attention_entries"] > 0
    else:
        assert row["attention_s"] == 0.0 and row["attention_share"] == 0.0
        assert row["attention_entries"] == 0


def fall_text(path: Path) -> str:
    """Each model's tokens/s at its longest N over its shortest, as the page words it."""
    rows = json.loads(path.read_text())["train"]
    first, last = min(r["seq_len"] for r in rows), max(r["seq_len"] for r in rows)
    by = {(r["arch"], r["seq_len"]): r["tokens_per_s"] for r in rows}
    ratio = {a: f"{by[a, last] / by[a, first]:.2f}" for a in ("mamba2", "gated_deltanet",
                                                             "rwkv7", "ecp")}
    return (f"`mamba2` {ratio['mamba2']}, `gated_deltanet` {ratio['gated_deltanet']}, "
            f"`rwkv7` {ratio['rwkv7']}; ECP {ratio['ecp']}")


@pytest.mark.parametrize("run", TRAIN)
def test_the_page_quotes_each_runs_fall_with_n(run):
    assert fall_text(TRAIN[run]) in PAGE.read_text()
