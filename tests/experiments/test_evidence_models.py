"""Evidence III's models and their costs: the tile-matched window is w = m, the kernel tiles of
a block-sparse kernel are counted by hand for small cases, and the coverage of a split's
documents by its first bytes."""

from __future__ import annotations

import pytest

from ecp_lm.config import ModelConfig
from ecp_lm.experiments.evidence.models import (
    costs,
    coverage,
    kernel_tiles,
    model_config,
    variant,
)

SIZE = dict(d_model=32, n_layers=2, n_heads=2, seq_len=512, num_segments=4)  # m = 128


def config(name: str) -> ModelConfig:
    return ModelConfig(**model_config(name, SIZE))


def test_the_two_windows():
    assert variant("sliding_window_tiles", 128) == {"arch": "sliding_window", "window": 128}
    entries, tiles = config("sliding_window").resolved(), config("sliding_window_tiles")
    assert tiles.window == 128 and entries.window > 128
    # entry-matched: ECP's unmasked entries; tile-matched: ECP's research tiles
    assert costs(config("sliding_window"))["entries"] == pytest.approx(
        costs(config("ecp"))["entries"], rel=0.01)
    assert costs(tiles)["research_tiles"] == costs(config("ecp"))["research_tiles"]
    with pytest.raises(ValueError, match="unknown model"):
        variant("sliding", 8)


def test_kernel_tiles_by_hand():
    # 4 x 4 blocks of 128: causal attention visits the 10 on or below the diagonal.
    assert kernel_tiles(config("transformer")) == 10 / 16
    # w = 128: query block i sees keys i*128 - 127 .. : blocks i - 1 and i (block 0: itself).
    assert kernel_tiles(config("sliding_window_tiles")) == 7 / 16
    # ECP, m = 128: a segment sees the previous one and itself causally: the same 7 blocks.
    assert kernel_tiles(config("ecp")) == 7 / 16
    # block_local, blocks of 2m = 256: each query block sees its own block of 256 causally,
    # 1 + 2 blocks per block of 256, twice.
    assert kernel_tiles(config("block_local")) == 6 / 16
    assert kernel_tiles(ModelConfig(arch="perceiver_ar", **SIZE)) is None  # latents only
    assert kernel_tiles(ModelConfig(arch="ecp", **{**SIZE, "seq_len": 384,
                                                   "num_segments": 3}), block=256) is None


def test_coverage():
    sizes = [100, 50, 200, 10]
    assert coverage(sizes, None) == {"documents": 4, "of": 4, "bytes": 360, "share": 1.0}
    assert coverage(sizes, 150) == {"documents": 2, "of": 4, "bytes": 150, "share": 150 / 360}
    assert coverage(sizes, 151)["documents"] == 3
    assert coverage(sizes, 10_000)["bytes"] == 360


def test_orderings_only_where_ranges_separate():
    from ecp_lm.experiments.evidence.stats import orderings, spread

    ranges = {"a": spread([1.0, 1.2]), "b": spread([1.3, 1.5]), "c": spread([1.1, 1.4])}
    assert orderings(ranges) == ["a < b"]  # c overlaps both
    assert orderings(ranges, higher_is_better=True) == ["b > a"]
    assert spread([1.0, 2.0, 4.0]) == {"mean": 7 / 3, "min": 1.0, "max": 4.0,
                                       "half_range": 1.5, "n": 3}


def test_equal_time_calls_only_where_a_faster_point_lies_below():
    from ecp_lm.experiments.evidence.stats import equal_time_calls, spread

    # a: 1 s a step; b: 2 s. a's 200 steps (200 s) against b's 100 (200 s): a below, a call.
    # b never gets a point of no more time below one of a's.
    curves = {"a": {100: spread([1.0, 1.1]), 200: spread([0.8, 0.85])},
              "b": {100: spread([0.9, 0.95]), 200: spread([0.7, 0.75])}}
    assert equal_time_calls(curves, {"a": 1.0, "b": 2.0}) == [
        "a < b (a at 200 steps, 200 s; b at 100, 200 s)"]
    # At equal step times the same curves call b first: b's 100 steps lie below a's 100.
    assert equal_time_calls(curves, {"a": 1.0, "b": 1.0}) == [
        "b < a (b at 100 steps, 100 s; a at 100, 100 s)"]
    # Overlapping ranges call nothing.
    close = {"a": {100: spread([1.0, 1.2])}, "b": {100: spread([1.1, 1.3])}}
    assert equal_time_calls(close, {"a": 1.0, "b": 9.0}) == []
