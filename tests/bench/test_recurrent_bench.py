"""The recurrent mixers' measurements on the performance page: ``benchmarks/state_decode.py``
(its table the script's own rendering of its recorded JSON, and a small run that shows a state's
bytes do not move with the position while the transformer's cache grows), the training table
of ``ecp bench`` for the mixers beside ECP, and benchmarks/mixer_groups.py's table of what the
chunked kernel's groups and their recomputation cost and keep (rows rendered from the recorded
JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "state_decode.py"
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"
TRAIN = RESULTS / "bench_recurrent_cpu.json"
RIVALS = RESULTS / "bench_rivals_cpu.json"
RIVAL_ARCHS = ("ecp", "rwkv4", "mamba", "mlstm", "slstm", "xlstm", "performer",
               "sparse_transformer", "longformer", "compressive", "routing")
GROUPS = ROOT / "benchmarks" / "mixer_groups.py"


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
    """The page's training table, rendered from its recorded ``ecp bench`` JSON: each row's
    tokens/s over the same architecture's at the shortest N, and its peak memory over ECP's at
    the same N."""
    rows = json.loads(path.read_text())["train"]
    first = {r["arch"]: r["tokens_per_s"] for r in rows if r["seq_len"] == rows[0]["seq_len"]}
    ecp = {r["seq_len"]: r["peak_mib"] for r in rows if r["arch"] == "ecp"}
    lines = [f"| arch | N | kernel | parameters | tokens/s | tokens/s ÷ at {rows[0]['seq_len']:,} "
             "| peak MiB | peak ÷ ECP's |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arch']} | {r['seq_len']:,} | {r['kernel']} | {r['params']:,} | "
              f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / first[r['arch']]:.2f} | "
              f"{r['peak_mib']:,.0f} | {r['peak_mib'] / ecp[r['seq_len']]:.2f} |" for r in rows]
    return lines


@pytest.mark.parametrize("path", [TRAIN, RIVALS], ids=lambda p: p.stem)
def test_the_page_quotes_the_recorded_training_table(path):
    page = PAGE.read_text()
    for line in train_rows(path):
        assert line in page, line


@pytest.mark.parametrize("path, archs", [(TRAIN, ("ecp", "mamba2", "gated_deltanet", "rwkv7")),
                                         (RIVALS, RIVAL_ARCHS)], ids=["recurrent", "rivals"])
def test_the_training_run_is_the_one_the_page_describes(path, archs):
    """One thread, glibc's allocator as it comes, the architectures at 1k, 4k and 16k; the
    page gives the command that wrote it."""
    report = json.loads(path.read_text())
    assert report["meta"]["threads"] == 1 and report["meta"]["malloc_env"] == {}
    assert {(r["arch"], r["seq_len"]) for r in report["train"]} == {
        (a, n) for a in archs for n in (1024, 4096, 16384)}
    command = (f"`ecp bench --archs {','.join(archs)} --seq-lens 1024,4096,16384 --threads 1 "
               f"--json benchmarks/results/{path.name}`")
    assert command in PAGE.read_text()


@pytest.fixture(scope="module")
def groups():
    return load_script(GROUPS, "mixer_groups")


def test_the_page_quotes_the_recorded_groups_table(groups):
    report = json.loads((RESULTS / "mixer_groups_cpu.json").read_text())
    page = PAGE.read_text()
    for line in groups.format_table(report["results"]).splitlines():
        if line.strip():
            assert line in page, line


def test_a_small_groups_run_shows_what_each_mode_keeps(groups, tmp_path, capsys):
    """Two lengths of mamba2 in the three modes: the kept bytes per token of ``whole`` and
    ``groups`` are the kernel's intermediates, ``recompute``'s a state per group past one group
    (a small call of one group is not recomputed, so it keeps what ``groups`` keeps); the
    module's settings are put back after."""
    from ecp_lm.model.archs import recurrent

    out = tmp_path / "groups.json"
    assert groups.main(["--archs", "mamba2", "--seq-lens", "64,1024", "--repeats", "1",
                        "--json", str(out)]) == 0
    rows = {(r["seq_len"], r["mode"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {(n, m) for n in (64, 1024) for m in groups.MODES}
    assert rows[1024, "recompute"]["kept_bytes_per_token"] < \
        rows[1024, "groups"]["kept_bytes_per_token"] / 20
    assert rows[64, "recompute"]["kept_bytes_per_token"] == \
        rows[64, "groups"]["kept_bytes_per_token"]
    assert (recurrent.GROUP_TOKENS, recurrent.RECOMPUTE_GROUPS) == (512, True)
    assert "| mamba2 | 1,024 | recompute |" in capsys.readouterr().out


def _span(values, spec: str, unit: str = "") -> str:
    low, high = min(values), max(values)
    return f"{low:{spec}}{unit}" if f"{low:{spec}}" == f"{high:{spec}}" else \
        f"{low:{spec}}–{high:{spec}}{unit}"


def training_claims() -> list[str]:
    """The page's sentences about the training table, rendered from its JSON."""
    rows = {(r["arch"], r["seq_len"]): r for r in json.loads(TRAIN.read_text())["train"]}
    mixers = ("mamba2", "gated_deltanet", "rwkv7")

    def flat(arch: str) -> float:
        return rows[arch, 16384]["tokens_per_s"] / rows[arch, 1024]["tokens_per_s"]

    def memory(arch: str, n: int) -> float:
        return rows[arch, n]["peak_mib"] / rows["ecp", n]["peak_mib"]

    within = max(abs(1 - flat(a)) for a in mixers)
    faster = [rows["ecp", n]["tokens_per_s"] / rows[a, n]["tokens_per_s"]
              for a in mixers for n in (1024, 4096, 16384)]
    return [
        f"Each mixer's tokens/s at 16,384 is within {within:.0%} of its tokens/s at 1,024: "
        + ", ".join(f"`{a}` {flat(a):.2f}" for a in mixers) + f"; ECP {flat('ecp'):.2f}.",
        f"Their peak memory at 16,384 is {_span([memory(a, 16384) for a in mixers], '.2f')}× "
        "ECP's.",
        f"At 1,024 it is {_span([memory(a, 1024) for a in mixers], '.2f')}× ECP's",
        f"ECP's band kernel trains {_span(faster, '.1f')}× faster than the chunked mixers",
    ]


def groups_claims() -> list[str]:
    """The page's sentences about benchmarks/mixer_groups.py's table, rendered from its JSON."""
    rows = {(r["arch"], r["seq_len"], r["mode"]): r
            for r in json.loads((RESULTS / "mixer_groups_cpu.json").read_text())["results"]}
    archs = dict.fromkeys(a for a, _, _ in rows)
    lengths = sorted({n for _, n, _ in rows})
    fall = [1 - rows[a, lengths[0], "whole"]["us_per_token"]
            / rows[a, lengths[-1], "whole"]["us_per_token"] for a in archs]
    cost = [rows[a, n, "recompute"]["us_per_token"] / rows[a, n, "groups"]["us_per_token"]
            for a in archs for n in lengths]
    kept = [rows[a, n, "recompute"]["kept_bytes_per_token"] for a in archs for n in lengths]
    whole = [rows[a, n, "groups"]["kept_bytes_per_token"] / 1000 for a in archs
             for n in lengths]
    return [f"its tokens/s fall by {_span([100 * f for f in fall], '.0f', '%')}.",
            f"Recomputation keeps {_span(kept, '.0f')} bytes per token instead of "
            f"{_span(whole, '.0f')} KB.",
            f"the layer takes {_span(cost, '.2f')}× as long as with groups alone"]


@pytest.mark.parametrize("claims", [training_claims, groups_claims])
def test_the_pages_sentences_are_the_recorded_numbers(claims):
    page = " ".join(PAGE.read_text().split())
    for claim in claims():
        assert claim in page, claim
