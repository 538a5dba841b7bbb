"""``ecp complexity --pattern``: a hybrid costs the sum of its layers' costs, each counted as the
layer of the pure architecture it names; its rows name the pattern and every layer kind's
sizes, and a bad pattern is a one-line error."""

from __future__ import annotations

import json

import pytest

from ecp_lm.bench.complexity import attention_cost, compare, format_table
from ecp_lm.cli import main
from ecp_lm.config import ModelConfig


def mask_count(arch: str, n: int, sizes: dict, n_heads: int) -> float:
    """Allowed (query, key) pairs of one layer of ``arch`` over N = ``n``, counted one by one
    from SPEC §3 and §3b (s2: the mean over heads, half of them shifted by G/2)."""
    m = n // sizes["num_segments"] if sizes.get("num_segments") else None
    rules = {
        "transformer": lambda q, kv, h: kv <= q,
        "ecp": lambda q, kv, h: kv <= q and q // m - kv // m <= 1,
        "sliding_window": lambda q, kv, h: q - sizes["window"] < kv <= q,
        "block_local": lambda q, kv, h: kv <= q and q // sizes["block_len"]
        == kv // sizes["block_len"],
        "s2": lambda q, kv, h: kv <= q and (q + shift(h)) // sizes["group_len"]
        == (kv + shift(h)) // sizes["group_len"],
    }

    def shift(h: int) -> int:
        return sizes["group_len"] // 2 if h >= n_heads // 2 else 0

    rule = rules[arch]
    return sum(rule(q, kv, h) for h in range(n_heads) for q in range(n)
               for kv in range(n)) / n_heads


BASE = dict(seq_len=24, num_segments=4, n_layers=5, d_model=16, n_heads=2)
PATTERNS = ["sliding_window*2,transformer", "ecp,block_local*2", "s2*3,transformer",
            "transformer,ecp,sliding_window,block_local,s2"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_hybrid_cost_is_the_sum_of_its_pure_layers(pattern: str) -> None:
    (cost,) = compare(BASE, [], [pattern])
    names = [name.partition("*")[0] for name in pattern.split(",")
             for _ in range(int(name.partition("*")[2] or 1))]
    names = (names * BASE["n_layers"])[:BASE["n_layers"]]  # tiled, cut at the end
    pure = {c.arch: c for c in compare(BASE, sorted(set(names)))}
    assert cost.layer_archs == names and cost.layer_pattern == pattern
    assert list(cost.entries_per_layer) == [pure[a].entries_per_layer[0] for a in names]
    assert list(cost.tile_entries_per_layer) == [pure[a].tile_entries_per_layer[0]
                                                 for a in names]
    # the pure layers themselves, from the masks written out
    for arch, c in pure.items():
        sizes = dict(num_segments=c.num_segments, window=c.window, block_len=c.block_len,
                     group_len=c.group_len)
        assert c.entries_per_layer[0] == mask_count(arch, 24, sizes, 2), arch
    assert cost.entries == sum(pure[a].entries_per_layer[0] for a in names)
    assert cost.flops == 4 * 16 * cost.entries
    assert cost.ratio_to_full == cost.entries / (5 * 24 * 24)


def test_hybrid_sizes_are_every_layer_kinds_own() -> None:
    costs = compare(dict(BASE, window=5, block_len=8, group_len=6), ["ecp"], PATTERNS)
    sizes = {c.label: (c.num_segments, c.window, c.block_len, c.group_len) for c in costs}
    assert sizes == {
        "ecp": (4, None, None, None),
        "hybrid(sliding_window*2,transformer)": (None, 5, None, None),
        "hybrid(ecp,block_local*2)": (4, None, 8, None),
        "hybrid(s2*3,transformer)": (None, None, None, 6),
        "hybrid(transformer,ecp,sliding_window,block_local,s2)": (4, 5, 8, 6)}
    # the set window is sliding_window's: 5 keys per query in both of its layers here
    window = next(c for c in costs if c.label == "hybrid(sliding_window*2,transformer)")
    assert window.entries_per_layer[0] == sum(min(q + 1, 5) for q in range(24))


def test_a_cut_pattern_drops_the_sizes_of_the_layers_it_cuts() -> None:
    # two layers of ecp*2,block_local: no block_local layer, so its block_len is dropped
    (cost,) = compare(dict(BASE, n_layers=2, block_len=8), [], ["ecp*2,block_local"])
    assert cost.layer_archs == ["ecp", "ecp"] and cost.block_len is None


def test_table_and_json_name_the_pattern() -> None:
    patterns = ["sliding_window*5,transformer", "block_local*3,transformer",
                "ecp*3,transformer"]
    costs = compare(ModelConfig.from_preset("paper"), ["transformer"], patterns)
    body = format_table(costs).split("\n\n")[0].splitlines()[3:]  # title, header, rule
    rows = {line.split()[0]: line.split()[1] for line in body}
    assert rows == {"transformer": "-", "hybrid(sliding_window*5,transformer)": "w=389",
                    "hybrid(block_local*3,transformer)": "b=512",
                    "hybrid(ecp*3,transformer)": "S=8"}
    data = costs[3].to_dict()
    assert data["arch"] == "hybrid" and data["layer_pattern"] == "ecp*3,transformer"
    assert data["layer_archs"] == ["ecp"] * 3 + ["transformer"] + ["ecp"] * 3 \
        + ["transformer"] + ["ecp"] * 3 + ["transformer"]
    assert costs[0].to_dict()["layer_pattern"] is None
    # the 12-layer Gemma-style model: 10 windows of w = 389 and 2 full causal layers
    n, w = 2048, 389
    window = w * (w + 1) // 2 + (n - w) * w
    assert costs[1].entries == 10 * window + 2 * n * (n + 1) // 2


def test_the_pattern_of_a_hybrid_config_is_replaced() -> None:
    cfg = ModelConfig(arch="hybrid", layer_pattern="ecp,transformer", global_rope="none",
                      **BASE)
    pure, hybrid = compare(cfg, ["ecp"], ["block_local,transformer"])
    assert pure.layer_pattern is None and pure.entries == attention_cost(
        ModelConfig(arch="ecp", **BASE)).entries
    assert hybrid.layer_archs == ["block_local", "transformer"] * 2 + ["block_local"]


def test_cli_adds_one_hybrid_row_per_pattern(capsys) -> None:
    assert main(["complexity", "--preset", "tiny", "--archs", "transformer", "--pattern",
                 "ecp,transformer", "--pattern", "sliding_window*2,transformer",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["arch"], r["layer_pattern"]) for r in rows] == [
        ("transformer", None), ("hybrid", "ecp,transformer"),
        ("hybrid", "sliding_window*2,transformer")]
    full = rows[0]["entries_per_layer"][0]
    assert rows[1]["entries_per_layer"] == [1312, full]  # tiny: N = 64, m = 16 (S·136 + 3·256)
    assert main(["complexity", "--preset", "tiny", "--archs", "", "--pattern",
                 "ecp*3,transformer"]) == 0
    table = capsys.readouterr().out
    assert "hybrid(ecp*3,transformer)" in table and "\ntransformer " not in table


@pytest.mark.parametrize("argv, fragment", [
    (["--pattern", "ecp*0,transformer"], "'ecp*0' repeats its layer by '0'"),
    (["--pattern", "perceiver_ar,transformer"], "'perceiver_ar' cannot be a layer"),
    (["--pattern", "ecp,,transformer"], "has an empty entry"),
    (["--pattern", "windowed*3,transformer"], "names 'windowed'"),
    (["--pattern", "ecp,transformer", "--num-segments", "5"], "hybrid(ecp,transformer): "),
    ([], "--archs names no architecture"),
])
def test_cli_bad_patterns_are_one_line_errors(capsys, argv, fragment) -> None:
    assert main(["complexity", "--preset", "paper", "--archs", "", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ecp: error:"), captured.err
    assert fragment in lines[0] and captured.out == ""
