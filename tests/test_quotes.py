"""Numbers the README and docs/results.md quote are the report files' numbers: each quote is
rendered here from its JSON (or from the analytic cost model) and must appear in the text as
written. A report rerun with other numbers fails this test until the text follows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
README, RESULTS = ROOT / "README.md", ROOT / "docs" / "results.md"


def report(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def train_rows(path: str) -> dict[tuple[str, int], dict]:
    return {(r["arch"], r["seq_len"]): r for r in report(path)["train"]}


def throughput_ratio() -> str:
    """ECP's training tokens/s over the transformer's at N = 16,384 (bench_cpu.json)."""
    rows = train_rows("benchmarks/results/bench_cpu.json")
    ratio = rows["ecp", 16384]["tokens_per_s"] / rows["transformer", 16384]["tokens_per_s"]
    return f"{ratio:.2f}"


def segment_probe(layers: int = 4) -> dict[str, str]:
    """The 9,600-step ECP's segment-end probe at L = ``layers``: the accuracy range over the
    offsets each layer reaches (0 … l), the same without layer 1's one segment back, and the
    range beyond the reach."""
    [run] = [r for r in report("docs/study2/mqar_9600/ecp.json")["runs"]
             if r["n_layers"] == layers]
    acc = run["segment_probe"]["accuracy"]
    inside = [acc[k][o] for k in range(1, layers + 1) for o in range(k + 1)]
    rest = [acc[k][o] for k in range(1, layers + 1) for o in range(k + 1) if (k, o) != (1, 1)]
    beyond = [acc[k][o] for k in range(1, layers + 1) for o in range(k + 1, len(acc[k]))]
    return {"low": f"{min(inside):.2f}", "high": f"{max(inside):.2f}",
            "layer1": f"{acc[1][1]:.2f}", "rest": f"{min(rest):.2f}–{max(rest):.2f}",
            "beyond": f"{min(beyond):.2f}–{max(beyond):.2f}"}


def cost(arch: str) -> str:
    """The attention cost relative to full attention at the Study II size (N = 2048, m = 256)."""
    cfg = ModelConfig(arch=arch, vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                      seq_len=2048, num_segments=8)
    return f"{attention_cost(cfg).ratio_to_full:.3f}"


def tile_ratio_window_to_ecp() -> str:
    """The entry-matched sliding window's cost over ECP's, counted in tiles."""
    cfgs = [ModelConfig(arch=a, vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                        seq_len=2048, num_segments=8) for a in ("sliding_window", "ecp")]
    window, ecp = (attention_cost(c).tile_entries for c in cfgs)
    return f"{window / ecp:.2f}"


def evidence_costs(name: str, label: str) -> str:
    """A row of the README's Evidence III cost table (``experiments.evidence.models.costs``)."""
    from ecp_lm.experiments.evidence.models import costs, model_config

    c = costs(ModelConfig(**model_config(name, dict(d_model=128, n_layers=4, n_heads=4,
                                                    seq_len=2048, num_segments=8))))
    return (f"| {label} | {c['entries']:.3f} | {c['research_tiles']:.3f} | "
            f"{c['kernel_tiles']:.3f} |")


EVIDENCE_ROWS = {"transformer": "transformer", "ecp": "ecp",
                 "sliding_window": "sliding_window (entries)",
                 "sliding_window_tiles": "sliding_window_tiles (w = m)",
                 "block_local": "block_local", "s2": "s2"}

def window_tile_range() -> str:
    """The entry-matched window's research tiles over ECP's across the baselines' N."""
    rows = train_rows("benchmarks/results/bench_baselines_cpu.json")
    ratios = [rows["sliding_window", n]["tile_ratio_to_full"] / rows["ecp", n]["tile_ratio_to_full"]
              for n in (1024, 2048, 4096, 8192, 16384)]
    return f"{min(ratios):.2f}–{max(ratios):.2f}× ECP\n({ratios[1]:.2f}× at 2048)"


QUOTES = {
    "README: the window in tiles across N": (README, lambda: (
        f"key blocks, what a block-sparse kernel with blocks of the segment pays) it costs "
        f"{window_tile_range()}")),
    **{f"README: Evidence III cost of {name}": (README, lambda name=name, label=label:
                                                 evidence_costs(name, label))
       for name, label in EVIDENCE_ROWS.items()},
    "README: throughput at 16k": (README, lambda: (
        f"ECP's training tokens/s at N = 16384 is **{throughput_ratio()}×** the transformer's")),
    "results.md: throughput at 16k": (RESULTS, lambda: (
        f"{throughput_ratio()}× the transformer's training throughput at N = 16,384")),
    "results.md: segment probe": (RESULTS, lambda: (
        "holds the value at offsets 0 … l with {low}–{high} accuracy ({layer1} in layer 1 one "
        "segment back, the\nrest {rest}) and at chance beyond ({beyond})".format(
            **segment_probe()))),
    "README: costs of the cheaper baselines": (README, lambda: (
        f"which cost less ({cost('block_local')} and\n{cost('s2')} of full attention at "
        f"N = 2048, m = 256, against ECP's {cost('ecp')} and the transformer's "
        f"{cost('transformer')},")),
    "results.md: the window in tiles": (RESULTS, lambda: (
        f"counted in tiles, {tile_ratio_window_to_ecp()}× ECP's")),
}


@pytest.mark.parametrize("name", list(QUOTES))
def test_quote_matches_its_report(name):
    path, render = QUOTES[name]
    assert render() in path.read_text(), f"{path.name} no longer quotes {render()!r}"
