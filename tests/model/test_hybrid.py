"""Hybrid layer patterns (SPEC §3c): the pattern tiled over the layers; each layer the pure
architecture's, by weights (a one-name pattern is the pure model), by receptive field (by
perturbation, against first-visible positions written out here), by kernel (against the
materialised predicate); causality; RoPE per layer kind; exact decoding from per-layer caches
(local layers only: well past 3N; with a global layer: past N as the transformer); checkpoints
and YAML. That nothing outside the architecture files branches on a name, ``hybrid`` included,
is test_architectures.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.config import tile_pattern
from ecp_lm.generation import generate
from ecp_lm.model import attention as skeleton
from ecp_lm.model.cache import decode_span
from ecp_lm.model.kernels import choose_kernel
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train
from helpers import (
    TINY,
    decode_three_ways,
    random_tokens,
    sharp_model,
    tiny_config,
    tiny_run_config,
)

N, VOCAB = TINY["seq_len"], TINY["vocab_size"]  # m = 8, w = 13, b = 16, G = 8
README = ("sliding_window*5,transformer", "block_local*3,transformer", "ecp*3,transformer",
          "block_local*5,transformer", "ecp*5,transformer")
LOCAL = ("ecp,sliding_window", "sliding_window,ecp,s2,block_local", "s2*2,ecp")
PATTERNS = README + LOCAL + ("transformer,ecp", "ecp,block_local*2,transformer,s2")


def hybrid(pattern: str, n_layers: int = 6, **overrides):
    return sharp_model("hybrid", layer_pattern=pattern, n_layers=n_layers, **overrides)


# The pattern ------------------------------------------------------------------------------------

def test_the_unit_is_tiled_over_the_layers_and_cut_at_the_end():
    assert tile_pattern("sliding_window*5,transformer", 12) == \
        (["sliding_window"] * 5 + ["transformer"]) * 2
    assert tile_pattern("ecp*2, s2", 5) == ["ecp", "ecp", "s2", "ecp", "ecp"]
    assert tile_pattern("block_local*3,transformer", 2) == ["block_local"] * 2
    model = hybrid("ecp*2,transformer", n_layers=4)
    assert [block.attn.arch.cfg.arch for block in model.blocks] == \
        ["ecp", "ecp", "transformer", "ecp"]


@pytest.mark.parametrize(("fields", "message"), [
    (dict(layer_pattern="perceiver_ar,ecp"), r"'perceiver_ar' cannot be a layer of a hybrid; a "
                                             r"hybrid's layers keep every row and predict every"),
    (dict(layer_pattern="ecp*3,double"), r"'double' cannot be a layer .*perceiver family"),
    (dict(layer_pattern="ecp,gpt"), r"names 'gpt', which is not an architecture"),
    (dict(layer_pattern="ecp*0,transformer"), r"'ecp\*0' repeats its layer by '0'"),
    (dict(layer_pattern="ecp*x"), r"repeats its layer by 'x', which is not a positive integer"),
    (dict(layer_pattern="ecp,,s2"), r"has an empty entry"),
    (dict(layer_pattern=None), r"arch='hybrid' needs a layer_pattern"),
    (dict(layer_pattern="ecp", window=5), r"window=5 is set, but arch='hybrid' has no window"),
    (dict(layer_pattern="ecp,s2", global_rope="none"),
     r"global_rope='none' is set, but layer_pattern='ecp,s2' has no global \(transformer\)"),
    (dict(layer_pattern="ecp,transformer", global_rope="first"),
     r"global_rope='first' is not one of all, none"),
    (dict(layer_pattern="ecp,transformer", rope_base_global=1.0),
     r"rope_base_global=1.0 must be a number greater than 1"),
    (dict(layer_pattern="ecp,transformer", num_segments=5),
     r"layer_pattern='ecp,transformer', its ecp layers: seq_len=32 is not divisible by "
     r"num_segments=5"),
    (dict(layer_pattern="ecp,transformer", attn_impl="mask"),
     r"its transformer layers: arch='transformer' has no attn_impl='mask' kernel"),
])
def test_bad_patterns_are_refused_with_the_reason(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("hybrid", **fields)


def test_a_pattern_needs_arch_hybrid_and_global_fields_a_hybrid():
    with pytest.raises(ValueError, match=r"layer_pattern='ecp\*3,transformer' is set, but "
                                         r"arch='ecp': .* is arch='hybrid'"):
        tiny_config("ecp", layer_pattern="ecp*3,transformer")
    with pytest.raises(ValueError, match=r"global_rope='none' is for the global layers of a "
                                         r"hybrid"):
        tiny_config("transformer", global_rope="none")


def test_each_layer_kind_keeps_the_pure_architectures_sizes():
    cfg = tiny_config("hybrid", layer_pattern="sliding_window,block_local,s2,ecp",
                      n_layers=4).resolved()
    for arch, size in (("sliding_window", "window"), ("block_local", "block_len"),
                       ("s2", "group_len")):
        assert getattr(cfg, size) == getattr(tiny_config(arch).resolved(), size), size
    set_sizes = tiny_config("hybrid", layer_pattern="sliding_window,block_local", window=5,
                            block_len=4).resolved()
    assert (set_sizes.window, set_sizes.block_len, set_sizes.group_len) == (5, 4, None)
    model = build_model(set_sizes)
    assert [b.attn.arch.cache_capacity for b in model.blocks] == [5, 4]


# Each layer is the pure architecture's ------------------------------------------------------------

@pytest.mark.parametrize("arch", ["transformer", "ecp", "sliding_window", "block_local", "s2"])
def test_a_one_name_pattern_is_the_pure_architecture(arch):
    pure = sharp_model(arch, n_layers=3)
    model = build_model(tiny_config("hybrid", layer_pattern=arch, n_layers=3)).eval()
    model.load_state_dict(pure.state_dict())  # the same parameters, by the same names
    tokens = random_tokens(2, N)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), pure(tokens), atol=0, rtol=0)


def first_visible(arch: str, cfg: ModelConfig, q: int) -> int:
    """SPEC §3, §3b: the first position query q sees in one layer of ``arch``."""
    m = cfg.seq_len // cfg.num_segments
    if arch == "transformer":
        return 0
    if arch == "ecp":
        return max(0, (q // m - 1) * m)
    if arch == "sliding_window":
        return max(0, q - cfg.window + 1)
    if arch == "block_local":
        return q // cfg.block_len * cfg.block_len
    g = cfg.group_len  # s2: the earlier of its group and its shifted group
    return min(q // g * g, max(0, (q + g // 2) // g * g - g // 2))


def reach(cfg: ModelConfig, q: int) -> int:
    """The first input position output q depends on: each layer's reach, from the top down."""
    for arch in reversed(cfg.layer_archs):
        q = first_visible(arch, cfg, q)
    return q


@pytest.mark.parametrize("pattern", PATTERNS)
def test_receptive_field_by_perturbation(pattern):
    """Output p depends on input t exactly when reach(p) <= t <= p: a global layer reaches
    everything before it, local layers as in their pure architectures. In float64: through six
    layers, the edge of the field moves an output by as little as 5e-9, below float32's
    resolution (rounding then decides whether it shows), far above float64's; an output the
    input cannot reach is computed from the same bits and does not move at all."""
    model = hybrid(pattern).double()
    cfg = model.cfg
    t_len = N if model.arch.max_len is not None else 3 * N
    tokens = random_tokens(1, t_len)
    with torch.no_grad():
        base = model(tokens)[0]
        for t in range(0, t_len, 3):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % VOCAB
            diff = (model(changed)[0] - base).abs().amax(dim=-1)
            for p in range(t_len):
                depends = reach(cfg, p) <= t <= p
                assert (diff[p] > 1e-12) == depends, (pattern, t, p, float(diff[p]))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_causal(pattern):
    model = hybrid(pattern)
    tokens = random_tokens(2, N)
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 7, 19, N - 1):
            changed = tokens.clone()
            changed[:, t:] = (changed[:, t:] + 3) % VOCAB
            torch.testing.assert_close(model(changed)[:, :t], base[:, :t], atol=0, rtol=0)


@pytest.mark.parametrize("pattern", README + LOCAL)
def test_every_layer_runs_its_own_kernels_and_equals_the_reference(pattern, native_kernel,
                                                                    monkeypatch):
    model = hybrid(pattern)
    reference = hybrid(pattern, attn_impl="reference")
    ran = []

    def choose(arch, *args):
        ran.append((arch.cfg.arch, kernel := choose_kernel(arch, *args)))
        return kernel

    tokens = random_tokens(2, N)
    with torch.no_grad():
        expected = reference(tokens)
        monkeypatch.setattr(skeleton, "choose_kernel", choose)
        torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=1e-4)
    # auto on CPU: the native band kernel in local layers, flash (causal SDPA) in global ones
    assert ran == [(kind, "flash" if kind == "transformer" else "native")
                   for kind in model.cfg.layer_archs]


# RoPE per layer kind ------------------------------------------------------------------------------

def test_global_rope_and_its_base_apply_to_the_global_layers_only():
    def bases(**fields):
        model = hybrid("ecp*2,transformer", **fields)
        return [None if b.attn.rope is None else b.attn.rope.base for b in model.blocks]

    assert bases() == [10000.0] * 6
    assert bases(global_rope="none") == [10000.0, 10000.0, None] * 2
    assert bases(rope_base_global=1e6) == [10000.0, 10000.0, 1e6] * 2
    assert bases(rope="none", global_rope="all", rope_base_global=5e5) == [None, None, 5e5] * 2
    assert bases(rope="first") == [10000.0] + [None] * 5
    assert bases(rope_base=500.0) == [500.0] * 6
    tokens = random_tokens(1, N)
    with torch.no_grad():
        default = hybrid("ecp*2,transformer")(tokens)
        for fields in (dict(global_rope="none"), dict(rope_base_global=1e6)):
            assert (hybrid("ecp*2,transformer", **fields)(tokens) - default).abs().max() > 1e-3


# Decoding -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", LOCAL)
def test_local_hybrids_decode_past_three_windows_from_their_rings(pattern):
    """Each layer's ring has its own capacity; cached, uncached and one forward agree 3N + 7
    tokens past the prompt, and every ring holds its last ``capacity`` positions."""
    model = hybrid(pattern, n_layers=4)
    out, logits, plain, plain_logits, full, caches = decode_three_ways(
        model, random_tokens(2, 5), 3 * N + 7)
    assert torch.equal(out, plain)
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(plain_logits, full, atol=1e-4, rtol=0)
    expected = [{"ecp": 16, "sliding_window": 13, "block_local": 16, "s2": 8}[arch]
                for arch in model.cfg.layer_archs]
    assert [cache.capacity for cache in caches] == expected
    last = out.size(1) - 2
    for cache in caches:
        for row in cache.pos.tolist():
            assert sorted(row) == list(range(last - cache.capacity + 1, last + 1))


@pytest.mark.parametrize("pattern", (*README, "transformer,ecp"))
def test_hybrids_with_a_global_layer_decode_past_the_window_as_the_transformer(pattern):
    """Within N: the per-layer caches (local rings, the global layer's N) equal one forward;
    past N the window slides, recomputed, and cached and uncached generation agree."""
    model = hybrid(pattern, rope_base_global=1e5)
    prompt = random_tokens(2, 5)
    with torch.no_grad():
        out, logits = generate(model, prompt, N - 5, return_logits=True)
        full = model(out[:, :-1])[:, prompt.size(1) - 1:]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
        longer, long_logits = generate(model, prompt, 2 * N, return_logits=True)
        plain, plain_logits = generate(model, prompt, 2 * N, use_cache=False,
                                       return_logits=True)
    assert torch.equal(longer, plain)
    torch.testing.assert_close(long_logits, plain_logits, atol=1e-4, rtol=0)
    capacities = [cache.capacity for cache in model.make_caches(1)]
    local = {"sliding_window": 13, "block_local": 16, "ecp": 16}
    assert capacities == [N if a == "transformer" else local[a] for a in model.cfg.layer_archs]


@pytest.mark.parametrize("pattern", ["ecp*3,transformer", "sliding_window,ecp,s2,block_local"])
def test_chunks_into_filled_caches_equal_one_forward(pattern):
    model = hybrid(pattern, n_layers=4)
    t_len = N if model.arch.max_len is not None else 3 * N
    tokens = random_tokens(2, t_len)
    with torch.no_grad():
        full = model.head(model.hidden_states(tokens))
        caches = model.make_caches(2)
        parts = [model.prefill(tokens[:, :7], caches)]
        for start, stop in ((7, 8), (8, 21), (21, t_len)):
            parts.append(model.head(model.hidden_states(tokens[:, start:stop], caches, start)))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=0)


def test_the_decode_span_covers_the_largest_ring():
    model = hybrid("sliding_window*5,transformer")
    caches = model.make_caches(1)
    with torch.no_grad():
        model.prefill(random_tokens(1, 20), caches)
    # The window's ring (13) wrapped, the global layer's (32) holds 20: the next step reads 21.
    assert [c.slots_in_use(ahead=1) for c in caches] == [13] * 5 + [21]
    assert decode_span(caches) == 21


def test_inputs_follow_the_layers():
    global_model, local_model = hybrid("ecp,transformer"), hybrid("ecp,sliding_window,block_local")
    with pytest.raises(ValueError, match=r"input length 33 is outside 1..32"):
        global_model(random_tokens(1, N + 1))
    with pytest.raises(ValueError, match=r"its transformer layers: start_pos=8"):
        global_model(random_tokens(1, 8), start_pos=8)
    assert local_model.arch.max_len is None and local_model.arch.period == 16  # lcm(8, 1, 16)
    tokens = random_tokens(1, N)
    with torch.no_grad():
        torch.testing.assert_close(local_model(tokens, start_pos=48), local_model(tokens),
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"its block_local layers: start_pos=8 is not"):
        local_model(tokens, start_pos=8)


# Saved and read back ------------------------------------------------------------------------------

def test_yaml_round_trip(tmp_path):
    cfg = tiny_config("hybrid", layer_pattern="sliding_window*5,transformer", n_layers=6,
                      window=7, global_rope="none", rope_base=500.0)
    path = tmp_path / "model.yaml"
    cfg.to_yaml(path)
    assert ModelConfig.from_yaml(path) == cfg
    assert dataclasses.replace(cfg, n_layers=8).layer_archs == \
        ["sliding_window"] * 5 + ["transformer"] + ["sliding_window"] * 2


def test_a_trained_hybrid_checkpoint_loads_to_the_same_model(tmp_path):
    cfg = tiny_run_config(tmp_path, "hybrid", ["model.layer_pattern=ecp*2,transformer",
                                               "model.n_layers=3", "model.rope_base_global=1e5"],
                          steps=2)
    result = train(cfg, tmp_path / "run", progress=False)
    ckpt = read_checkpoint(tmp_path / "run" / "latest")
    assert ckpt.config.model.layer_pattern == "ecp*2,transformer"
    assert ckpt.config.model.rope_base_global == 1e5
    loaded = ckpt.load_model().eval()
    tokens = random_tokens(1, loaded.cfg.seq_len, vocab=loaded.cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), result.model.eval()(tokens), atol=0, rtol=0)
