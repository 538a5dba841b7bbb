"""The same-cost baselines (SPEC §3b): sliding_window, block_local and s2.

Each is checked against facts written out here from docs/spec.md, not from the code: the mask grids,
how far back an output can depend on its input after L layers (by perturbation), exact decoding
from constant-size ring caches far past the window, windows at offsets, and the default sizes.
"""

from __future__ import annotations

import pytest
import torch

from ecp_lm import ModelConfig
from ecp_lm.model.archs.block_local import BlockLocalMask
from ecp_lm.model.archs.s2 import ShiftedGroupMask
from ecp_lm.model.archs.sliding_window import SlidingWindowMask
from ecp_lm.model.kernels.masks import materialize, show
from helpers import TINY, decode_three_ways, random_tokens, sharp_model

N, M = TINY["seq_len"], TINY["seq_len"] // TINY["num_segments"]  # 32, 8
VOCAB = TINY["vocab_size"]


def grid(mask, q, kv, n_heads=None) -> str:
    return show(materialize(mask, torch.as_tensor(q), torch.as_tensor(kv), n_heads))


def block(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


def test_sliding_window_mask():
    assert grid(SlidingWindowMask(3), range(6), range(6)) == block("""
        #.....
        ##....
        ###...
        .###..
        ..###.
        ...###""")


def test_block_local_mask():
    assert grid(BlockLocalMask(3), range(7), range(7)) == block("""
        #......
        ##.....
        ###....
        ...#...
        ...##..
        ...###.
        ......#""")


def test_shifted_group_mask_differs_between_head_halves():
    heads = materialize(ShiftedGroupMask(4, 2), torch.arange(8), torch.arange(8), n_heads=2)
    assert show(heads[0]) == block("""
        #.......
        ##......
        ###.....
        ####....
        ....#...
        ....##..
        ....###.
        ....####""")
    assert show(heads[1]) == block("""
        #.......
        ##......
        ..#.....
        ..##....
        ..###...
        ..####..
        ......#.
        ......##""")  # groups shifted by G/2: 0-1, 2-5, 6-9; nothing wraps around
    with pytest.raises(ValueError, match="differs between heads"):
        materialize(ShiftedGroupMask(4, 2), torch.arange(8), torch.arange(8))


# Receptive fields, by perturbation ---------------------------------------------------------------

def first_visible(arch: str, cfg: ModelConfig, q: int) -> int:
    """SPEC §3b: the first position query q sees in one layer (over every head)."""
    cfg = cfg.resolved()
    if arch == "sliding_window":
        return max(0, q - cfg.window + 1)
    if arch == "block_local":
        return q // cfg.block_len * cfg.block_len
    g = cfg.group_len  # s2: the earlier of its group and its shifted group
    return min(q // g * g, max(0, (q + g // 2) // g * g - g // 2))


def reach_after(arch: str, cfg: ModelConfig, q: int) -> int:
    for _ in range(cfg.n_layers):
        q = first_visible(arch, cfg, q)
    return q


@pytest.mark.parametrize(("arch", "sizes"), [
    ("sliding_window", dict(window=5)), ("sliding_window", dict(window=5, sink_tokens=2)),
    ("block_local", {}), ("block_local", dict(block_len=5)), ("s2", {}),
    ("s2", dict(group_len=6))])
@pytest.mark.parametrize("n_layers", [1, 3])
def test_receptive_field_by_perturbation(arch, sizes, n_layers):
    """Output p depends on input t exactly when reach_after(p) <= t <= p: sliding_window
    L·(w - 1) positions back, block_local its own block at any depth, s2 about G/2 per layer
    (sizes set, or their defaults from N and S); and, with k attention sinks, when t < k <= p
    too (the sinks see only positions below k)."""
    model = sharp_model(arch, n_layers=n_layers, **sizes)
    t_len = 3 * N
    tokens = random_tokens(1, t_len)
    with torch.no_grad():
        base = model(tokens)[0]
        for t in [*range(0, t_len, 5), 1]:
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % VOCAB
            diff = (model(changed)[0] - base).abs().amax(dim=-1)
            for p in range(t_len):
                sink = t < sizes.get("sink_tokens", 0) and t <= p
                depends = reach_after(arch, model.cfg, p) <= t <= p or sink
                assert (diff[p] > 1e-6) == depends, (arch, n_layers, t, p, float(diff[p]))


def test_block_local_never_crosses_a_block_at_any_depth():
    model = sharp_model("block_local", n_layers=4)
    b = model.cfg.block_len
    tokens = random_tokens(1, 4 * b)
    with torch.no_grad():
        base = model(tokens)[0]
        changed = tokens.clone()
        changed[0, :b] = (changed[0, :b] + 7) % VOCAB  # every token of block 0
        later = (model(changed)[0] - base)[b:]
    assert later.abs().max() == 0.0


def test_sliding_window_receptive_field_is_l_times_w_minus_one():
    model = sharp_model("sliding_window", n_layers=3, window=4)
    assert model.arch.context_start(100) == 99 - 3 * 3


# Decoding from ring caches --------------------------------------------------------------------

@pytest.mark.parametrize(("arch", "slots"), [("sliding_window", 13), ("block_local", 16),
                                             ("s2", 8)])
def test_cached_generation_past_three_windows_in_constant_memory(arch, slots):
    """Ring caches of w (sliding_window), b (block_local) and G (s2) slots; greedy cached,
    uncached and one full forward give the same logits well past 3N."""
    model = sharp_model(arch, n_layers=3)
    out, logits, plain, plain_logits, full, caches = decode_three_ways(
        model, random_tokens(2, 5), 3 * N + 7)
    assert torch.equal(out, plain)
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(plain_logits, full, atol=1e-4, rtol=0)
    assert len(caches) == 3
    for cache in caches:
        assert cache.capacity == cache.k.size(2) == slots and cache.filled == slots
        last = out.size(1) - 2
        for row in cache.pos.tolist():
            assert sorted(row) == list(range(last - slots + 1, last + 1))


@pytest.mark.parametrize(("arch", "period"), [("sliding_window", 1), ("block_local", 16),
                                              ("s2", 8)])
def test_a_window_at_an_offset_of_the_period_equals_the_window_at_zero(arch, period):
    model = sharp_model(arch)
    tokens = random_tokens(1, N + 3)
    with torch.no_grad():
        at_zero = model(tokens)
        for start in (period, 5 * period, 10**6 * period):
            torch.testing.assert_close(model(tokens, start_pos=start), at_zero, atol=1e-5,
                                       rtol=0)
    if period > 1:
        with pytest.raises(ValueError, match=rf"start_pos={period + 1} is not a non-negative "
                                             rf"multiple of \w+={period}"):
            model(tokens, start_pos=period + 1)


# Default sizes ----------------------------------------------------------------------------------

def ecp_entries(n: int, s: int) -> int:
    m = n // s  # segment 0 sees itself causally, segment s >= 1 also all of segment s - 1
    return sum(q + 1 - max(0, (q // m - 1) * m) for q in range(n))


def window_entries(n: int, w: int) -> int:
    return sum(min(q + 1, w) for q in range(n))


@pytest.mark.parametrize(("n", "s"), [(32, 4), (64, 4), (256, 8), (1024, 4), (2048, 16)])
def test_default_window_matches_ecp_entries(n, s):
    w = ModelConfig(arch="sliding_window", seq_len=n, num_segments=s).resolved().window
    target = ecp_entries(n, s)
    best = min(range(1, n + 1), key=lambda x: (abs(window_entries(n, x) - target), x))
    assert w == best
    if s >= 16:  # many segments: both ramps are short, and per query ECP sees about 3m/2
        assert abs(w - 1.5 * (n // s)) <= 0.05 * (n // s)


def test_default_block_is_ecp_one_layer_reach():
    assert ModelConfig(arch="block_local", seq_len=64, num_segments=4).resolved().block_len == 32
    assert ModelConfig(arch="block_local", seq_len=64, block_len=7).resolved().block_len == 7


def test_default_group_is_ecp_segment():
    cfg = ModelConfig(arch="s2", seq_len=64, num_segments=4)
    assert cfg.group_len is None and cfg.resolved().group_len == 16 == cfg.segment_len
    # Set, G needs no N divisible by S; segment_len is the pattern's period, G.
    cfg = ModelConfig(arch="s2", seq_len=60, num_segments=8, group_len=6)
    assert cfg.resolved().group_len == 6 == cfg.segment_len
    model = sharp_model("s2", seq_len=60, num_segments=8, group_len=6)
    assert model.arch.period == 6 and model.make_caches(1)[0].capacity == 6


@pytest.mark.parametrize(("fields", "message"), [
    (dict(arch="s2", n_heads=3, d_model=48), "n_heads=3 is odd"),
    (dict(arch="s2", seq_len=60, num_segments=4), "group_len=15 is odd"),
    (dict(arch="s2", group_len=9), "group_len=9 is odd"),
    (dict(arch="s2", seq_len=60, num_segments=8), "seq_len=60 is not divisible.*set group_len"),
    (dict(arch="sliding_window", seq_len=60, num_segments=8), "set window"),
    (dict(arch="block_local", seq_len=60, num_segments=8), "set block_len"),
    (dict(arch="block_local", block_len=0), "block_len=0 must be a positive integer"),
    (dict(arch="s2", group_len=-2), "group_len=-2 must be a positive integer"),
    (dict(arch="sliding_window", window=2.5), "window=2.5 must be an integer"),
])
def test_bad_sizes_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)
