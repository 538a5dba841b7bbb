"""The closed-form attention costs equal a brute-force count of masks written out from SPEC §3."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ecp_lm.bench.complexity import attention_cost, compare, format_table
from ecp_lm.config import ARCHS, ModelConfig
from helpers import NO_ATTENTION


def spec_layers(cfg: ModelConfig) -> list[tuple[range, range, Callable[[int, int], bool]]]:
    """Each layer's (query rows, key rows, mask on row indices), written out from SPEC §3.
    Rows are window positions 0 .. N-1, except compressed_double after layer 0: the p compressed
    rows, then the l latents. The last layer queries only the predicted rows (nothing reads the
    others); PerceiverAR queries only its latents in every layer."""
    cfg = cfg.resolved()
    n, num_layers, s = cfg.seq_len, cfg.n_layers, cfg.num_segments
    l = cfg.latent_len  # noqa: E741 (the paper's l)
    h = n - l
    last = num_layers - 1

    def double(c: int, segment: int | None = None) -> Callable[[int, int], bool]:
        def mask(q: int, kv: int) -> bool:
            if q < c:
                return kv < c and (segment is None or q // segment == kv // segment)
            return kv <= q
        return mask

    def causal(q: int, kv: int) -> bool:
        return kv <= q

    if cfg.arch == "transformer":
        return [(range(n), range(n), causal)] * num_layers
    if cfg.arch == "ecp":
        m = n // s

        def pairs(q: int, kv: int) -> bool:
            return kv <= q and q // m - kv // m <= 1
        return [(range(n), range(n), pairs)] * num_layers
    if cfg.arch == "perceiver_ar":
        return [(range(h, n), range(n), causal)] + [(range(h, n), range(h, n), causal)] * last
    if cfg.arch in ("double", "ssplit"):
        mask = double(h, h // s if cfg.arch == "ssplit" else None)
        return [(range(h, n) if i == last else range(n), range(n), mask)
                for i in range(num_layers)]
    if cfg.arch == "compressed_double":
        r = cfg.compressed_len + l  # rows after layer 0
        later = [(range(r - l, r) if i == last else range(r), range(r),
                  double(cfg.compressed_len)) for i in range(1, num_layers)]
        return [(range(n), range(n), double(h)), *later]
    if cfg.arch in NO_ATTENTION:  # SPEC §3d: no attention, no entries
        return [(range(0), range(0), causal)] * num_layers
    # SPEC §3b: every layer queries every position.
    if cfg.arch == "sliding_window":
        w = cfg.window

        def window(q: int, kv: int) -> bool:
            return q - w < kv <= q
        return [(range(n), range(n), window)] * num_layers
    if cfg.arch == "block_local":
        b = cfg.block_len

        def blocks(q: int, kv: int) -> bool:
            return kv <= q and q // b == kv // b
        return [(range(n), range(n), blocks)] * num_layers
    if cfg.arch == "sparse_transformer" and cfg.sparse_pattern == "fixed":
        stride, c = cfg.stride, cfg.summary_len

        def fixed(q: int, kv: int) -> bool:  # Child et al.: A(1) its block, A(2) summaries
            return kv <= q and (q // stride == kv // stride or kv % stride >= stride - c)
        return [(range(n), range(n), fixed)] * num_layers
    raise AssertionError(f"no SPEC reference for arch={cfg.arch!r}: add its mask here")


def strided_mask(stride: int, n_heads: int) -> Callable[[int, int, int], bool]:
    """Child et al.'s strided pattern: half the heads the last ℓ positions, half every ℓ-th."""
    def mask(q: int, kv: int, head: int) -> bool:
        if head < n_heads // 2:
            return q - stride < kv <= q
        return kv <= q and (q - kv) % stride == 0
    return mask


def longformer_mask(w: int, d: int, g: int, n_heads: int) -> Callable[[int, int, int], bool]:
    """Beltagy et al. §3.1: w positions with gaps of d (heads H/2.. of a dilated layer; 1 apart
    on the others) ending at q, and the g global tokens."""
    def mask(q: int, kv: int, head: int) -> bool:
        step = d if head >= n_heads // 2 else 1
        return kv in {q - j * step for j in range(w)} or (kv < g and kv <= q)
    return mask


def s2_mask(g: int, n_heads: int) -> Callable[[int, int, int], bool]:
    """SPEC §3b s2: groups of G; the second half of the heads' groups shifted by G/2."""
    def mask(q: int, kv: int, head: int) -> bool:
        shift = g // 2 if head >= n_heads // 2 else 0
        return kv <= q and (q + shift) // g == (kv + shift) // g
    return mask


def brute_force_entries(cfg: ModelConfig) -> list[float]:
    """Allowed (query, key) pairs of each layer, counted one by one (the mean over heads)."""
    resolved = cfg.resolved()
    per_head = {"s2": lambda: s2_mask(resolved.group_len, cfg.n_heads),
                "sparse_transformer": lambda: strided_mask(resolved.stride, cfg.n_heads)}
    if cfg.arch == "routing":  # at most the last w keys, of its window or of its cluster
        w = resolved.window
        return [sum(q - w < kv <= q for q in range(cfg.seq_len) for kv in range(cfg.seq_len))
                ] * cfg.n_layers
    if cfg.arch == "compressive":  # Rae et al.: compressed slots, memory, the segment to q
        m, n_m, c = resolved.segment_len, resolved.memory_len, resolved.compression_rate
        memory: list[int] = []
        slots = 0
        count = 0
        for a in range(0, cfg.seq_len, m):
            segment = list(range(a, min(a + m, cfg.seq_len)))
            count += sum(slots + len(memory) + i + 1 for i in range(len(segment)))
            memory += segment
            evicted, memory = memory[:max(0, len(memory) - n_m)], memory[-n_m:]
            slots = min(n_m, slots + len(evicted) // c)
        return [count] * cfg.n_layers
    if cfg.arch == "longformer":
        n, h = cfg.seq_len, cfg.n_heads

        def each_layer(value: int | str) -> list[int]:
            items = [int(x) for x in str(value).split(",")]
            return items * cfg.n_layers if len(items) == 1 else items
        masks = [longformer_mask(w, d, resolved.global_tokens, h) for w, d in
                 zip(each_layer(resolved.window), each_layer(resolved.dilation), strict=True)]
        return [sum(mask(q, kv, head) for head in range(h) for q in range(n) for kv in range(n))
                / h for mask in masks]
    if cfg.arch in per_head and resolved.sparse_pattern != "fixed":
        mask, n = per_head[cfg.arch](), cfg.seq_len
        per_layer = sum(mask(q, kv, h) for h in range(cfg.n_heads) for q in range(n)
                        for kv in range(n)) / cfg.n_heads
        return [per_layer] * cfg.n_layers
    return [sum(mask(q, kv) for q in queries for kv in keys)
            for queries, keys, mask in spec_layers(cfg)]


SIZES = [
    dict(seq_len=16, latent_len=8, num_segments=4, compressed_len=3, n_layers=2),
    dict(seq_len=16, latent_len=4, num_segments=2, compressed_len=5, n_layers=3),
    dict(seq_len=24, latent_len=12, num_segments=3, compressed_len=1, n_layers=3),
    dict(seq_len=24, latent_len=18, num_segments=6, compressed_len=5, n_layers=2),
    dict(seq_len=24, latent_len=21, num_segments=1, compressed_len=2, n_layers=1),
]


def valid(arch: str, sizes: dict) -> bool:
    try:
        ModelConfig(arch=arch, d_model=16, n_heads=2, **sizes)
    except ValueError:
        return False
    return True


CASES = [pytest.param(arch, sizes, id=f"{arch}-" + "-".join(map(str, sizes.values())))
         for arch in ARCHS for sizes in SIZES if valid(arch, sizes)]
CASES += [pytest.param(arch, dict(seq_len=n, num_segments=1, n_layers=2, **{size: w}),
                       id=f"{arch}-N{n}-{size}{w}")
          for arch, size in (("sliding_window", "window"), ("block_local", "block_len"))
          for n, w in [(16, 1), (16, 5), (17, 4), (24, 24), (10, 40)]]
CASES += [pytest.param("s2", dict(seq_len=n, num_segments=s, n_layers=1), id=f"s2-N{n}-S{s}")
          for n, s in [(12, 2), (20, 5), (24, 12)]]
CASES += [pytest.param("s2", dict(seq_len=n, num_segments=3, group_len=g, n_layers=1),
                       id=f"s2-N{n}-G{g}") for n, g in [(17, 4), (16, 6), (10, 40)]]
CASES += [pytest.param("sparse_transformer", dict(seq_len=n, num_segments=1, n_layers=1,
                                                  stride=st, **extra),
                       id=f"sparse-N{n}-l{st}-{extra.get('sparse_pattern', 'strided')}")
          for n, st in [(16, 4), (17, 5), (24, 1), (10, 10)]
          for extra in ({}, dict(sparse_pattern="fixed", summary_len=min(2, st)))]
CASES += [pytest.param("longformer", dict(seq_len=n, num_segments=1, n_layers=2, **extra),
                       id=f"longformer-N{n}-" + "-".join(f"{k}{v}" for k, v in extra.items()))
          for n in (16, 19)
          for extra in (dict(window=5), dict(window="3,6", dilation=2),
                        dict(window=4, dilation="1,3", global_tokens=2),
                        dict(window="1,20", dilation="4,2", global_tokens=7))]


@pytest.mark.parametrize(("arch", "sizes"), CASES)
def test_entries_match_brute_force_count_of_spec_masks(arch: str, sizes: dict) -> None:
    cfg = ModelConfig(arch=arch, d_model=16, n_heads=2, **sizes)
    cost = attention_cost(cfg)
    assert list(cost.entries_per_layer) == brute_force_entries(cfg)
    assert len(cost.tile_entries_per_layer) == cfg.n_layers
    for entries, tiles in zip(cost.entries_per_layer, cost.tile_entries_per_layer, strict=True):
        assert entries <= tiles <= cfg.seq_len ** 2


def test_tile_entries_small_cases() -> None:
    # N = 16, l = 8 (h = 8), S = 4, p = 3, L = 3.
    base = dict(seq_len=16, latent_len=8, num_segments=4, compressed_len=3, n_layers=3)
    expected = {
        "transformer": [256, 256, 256],
        "ecp": [7 * 16] * 3,  # (2S - 1) m², m = 4
        "perceiver_ar": [8 * 16, 64, 64],
        "double": [64 + 8 * 16, 64 + 8 * 16, 8 * 16],
        "ssplit": [16 + 8 * 16, 16 + 8 * 16, 8 * 16],  # S blocks of (h/S)² = 4 · 2²
        "compressed_double": [64 + 8 * 16, 9 + 8 * 11, 8 * 11],
        # w = 7 (16·7 - 21 = 91 entries, nearest ECP's 88): blocks of 7, 7 and 2 queries
        # against their previous block and themselves.
        "sliding_window": [7 * 7 + 7 * 14 + 2 * 9] * 3,
        "block_local": [2 * 8 * 8] * 3,  # b = 2m = 8
        "s2": [(4 * 16 + (4 + 3 * 16 + 4)) // 2] * 3,  # G = 4: squares of 4,4,4,4 | 2,4,4,4,2
        # ℓ = 4, 2 heads: blocks of 4 against 8 keys but the first (112) | 4 classes of 4² (64)
        "sparse_transformer": [(112 + 64) // 2] * 3,
        "longformer": [7 * 7 + 7 * 14 + 2 * 9] * 3,  # one window of 7, as sliding_window's
        # m = n_m = 4, c = 4: segments of 4 rows against themselves, then the memory, then 1
        # and 2 compressed slots
        "compressive": [4 * 4 + 4 * 8 + 4 * 9 + 4 * 10] * 3,
        # k = 4 centroids, w = 4: blocks of 4 rows against their previous block and themselves
        "routing": [4 * 4 + 3 * 4 * 8] * 3,
        **{arch: [0] * 3 for arch in NO_ATTENTION},  # no attention
    }
    for cost in compare(base, ARCHS):
        assert list(cost.tile_entries_per_layer) == expected[cost.arch], cost.arch


@pytest.mark.parametrize("segments", [4, 8, 16])
def test_ecp_tile_ratio_is_paper_formula(segments: int) -> None:
    cost = attention_cost(ModelConfig.from_preset("paper", arch="ecp", num_segments=segments))
    assert cost.tile_ratio_to_full == pytest.approx((2 * segments - 1) / segments ** 2, abs=1e-15)


def test_ecp_at_sixteen_segments_is_about_twelve_percent() -> None:
    cost = attention_cost(ModelConfig.from_preset("paper", arch="ecp", num_segments=16))
    assert round(cost.tile_ratio_to_full, 3) == 0.121


def test_transformer_is_the_causal_reference() -> None:
    cost = attention_cost(ModelConfig.from_preset("paper", arch="transformer"))
    assert cost.ratio_to_causal == 1.0
    assert cost.tile_ratio_to_full == 1.0
    n = cost.seq_len
    assert cost.ratio_to_full == pytest.approx((n + 1) / (2 * n))


def test_ratio_ordering_and_flops() -> None:
    costs = {c.arch: c for c in compare(ModelConfig.from_preset("paper", num_segments=16), ARCHS)}
    ecp, full = costs["ecp"], costs["transformer"]
    assert ecp.entries < full.entries and ecp.tile_ratio_to_full < full.tile_ratio_to_full
    # PerceiverAR queries only its latents; double adds a bidirectional h² history per layer.
    assert costs["perceiver_ar"].entries < costs["ssplit"].entries < costs["double"].entries
    assert costs["compressed_double"].entries < costs["double"].entries
    assert ecp.flops == 4 * ecp.d_model * ecp.entries
    assert sum(ecp.flops_per_layer) == ecp.flops


def test_to_dict_fields() -> None:
    data = attention_cost(ModelConfig(arch="ssplit", seq_len=16, num_segments=2)).to_dict()
    assert data["arch"] == "ssplit" and data["num_segments"] == 2
    assert data["compressed_len"] is None
    assert data["entries"] == sum(data["entries_per_layer"])
    assert data["tile_flops"] == sum(data["tile_flops_per_layer"])
    assert data["ratio_to_full"] == data["entries"] / data["full_entries"]
    assert data["ratio_to_causal"] == data["entries"] / data["causal_entries"]


def test_compare_names_the_architecture_whose_constraints_fail() -> None:
    base = ModelConfig.from_preset("paper", arch="double", num_segments=7)  # fine for double
    with pytest.raises(ValueError, match=r"^ssplit: .*not divisible by num_segments=7"):
        compare(base, ["transformer", "ssplit"])


def test_format_table_lists_every_arch() -> None:
    table = format_table(compare(ModelConfig.from_preset("tiny"), ARCHS))
    lines = table.splitlines()
    for arch in ARCHS:
        assert any(line.startswith(arch + " ") for line in lines), arch
    assert "100.0%" in table  # the transformer's ratio to causal


def test_each_pattern_reports_its_own_size_under_its_own_name() -> None:
    costs = {c.arch: c for c in compare(ModelConfig.from_preset("paper", num_segments=16),
                                        ARCHS)}
    sizes = {arch: (c.num_segments, c.window, c.block_len, c.group_len)
             for arch, c in costs.items() if arch in ("ecp", "sliding_window", "block_local",
                                                      "s2")}
    assert sizes == {"ecp": (16, None, None, None), "sliding_window": (None, 194, None, None),
                     "block_local": (None, None, 256, None), "s2": (None, None, None, 128)}
    data = costs["block_local"].to_dict()
    assert data["block_len"] == 256 and data["window"] is None and data["group_len"] is None
    rows = {line.split()[0]: line.split()[1] for line in format_table(list(costs.values()))
            .splitlines()[3:] if line.strip() and line.split()[0] in costs}
    assert (rows["sliding_window"], rows["block_local"], rows["s2"]) == \
        ("w=194", "b=256", "G=128")


def test_compare_sizes_only_the_pattern_a_size_belongs_to() -> None:
    base = dict(seq_len=64, num_segments=4, window=5, block_len=8, group_len=4)
    costs = {c.arch: c for c in compare(base, ARCHS)}
    assert (costs["sliding_window"].window, costs["block_local"].block_len,
            costs["s2"].group_len) == (5, 8, 4)
    assert costs["ecp"].window is None and costs["transformer"].block_len is None
