"""Attention sinks of sliding_window (``sink_tokens`` = k, SPEC §3b): query q sees kv <= q with
q - w < kv or kv < k.

Every check compares against a dense mask written out here from that definition (loops over
positions), never against the code under test: the predicate, each kernel's outputs and
gradients (also on the rows a chunk continuing a cache gives: the sinks as a history run before
a later band), decoding from the cache of w + k slots far past N (cached, uncached and one
forward), the cost's entries, and the configuration checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from ecp_lm import ModelConfig
from ecp_lm.bench.complexity import attention_cost
from ecp_lm.model.archs.sliding_window import SlidingWindow, SlidingWindowMask
from ecp_lm.model.kernels import flex, native
from ecp_lm.model.kernels.masks import materialize
from ecp_lm.model.rows import Rows
from helpers import TINY, decode_three_ways, random_tokens, sharp_model

N = TINY["seq_len"]  # 32


def allowed(q: int, kv: int, w: int, k: int) -> bool:
    """The definition: itself and w - 1 earlier positions, and the sinks 0 .. k - 1."""
    return kv <= q and (q - kv < w or kv < k)


def dense_mask(q_pos: list[int], kv_pos: list[int], w: int, k: int) -> torch.Tensor:
    return torch.tensor([[allowed(q, kv, w, k) for kv in kv_pos] for q in q_pos])


def dense_attention(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize(("w", "k"), [(1, 0), (4, 0), (4, 1), (5, 3), (7, 6)])
def test_the_predicate_is_the_definition(w, k):
    pos = torch.arange(20)
    grid = materialize(SlidingWindowMask(w, k), pos, pos)
    assert torch.equal(grid, dense_mask(list(range(20)), list(range(20)), w, k))


def test_no_sinks_is_the_plain_window():
    assert SlidingWindowMask(5) == SlidingWindowMask(5, 0)
    pos = torch.arange(-1, 30)  # -1: an empty cache slot, which the mask does not see alone
    assert torch.equal(materialize(SlidingWindowMask(5), pos, pos),
                       (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - 5))


# Kernels ----------------------------------------------------------------------------------------

def arch_with(w: int, k: int, impl: str = "auto") -> SlidingWindow:
    return SlidingWindow(ModelConfig(arch="sliding_window", seq_len=N, window=w, sink_tokens=k,
                                     attn_impl=impl))


LAYOUTS = {
    "from 0": Rows.span(0, 45),
    "chunk, sinks apart": Rows(range(0, 3), range(20, 45)),  # history 0..2, band from 20
    "chunk, sinks adjoining": Rows(range(0, 2), range(2, 30)),  # history 0..1, main from 2
}


def kernels() -> list[str]:
    found = ["reference", "mask"]
    if native.load():
        found.append("native")
    if flex.compiles_on_cpu():
        found.append("flex")
    return found


def kernel_cases() -> list[tuple[str, int, int, str]]:
    """(kernel, w, k, layout): a chunk's history holds at most the k sinks, and flex runs one
    size (each mask compiles a kernel of its own)."""
    return [(kernel, w, k, layout) for kernel in kernels()
            for w, k in [(5, 3), (8, 1), (6, 5)] for layout in LAYOUTS
            if (layout == "from 0" or len(LAYOUTS[layout].history) <= k)
            and (kernel != "flex" or (w, k) == (5, 3))]


@pytest.mark.parametrize(("kernel", "w", "k", "layout"), kernel_cases())
def test_every_kernel_equals_the_dense_definition(kernel, w, k, layout):
    """Outputs and the gradients of q, k and v (float64); flex: the forward (its backward
    runs on CUDA only). The rows whose outputs ``Attention`` keeps are compared: every row,
    or where the rows start with a history run of sinks (a chunk), the main run's."""
    rows = LAYOUTS[layout]
    arch = arch_with(w, k)
    positions = rows.positions().tolist()
    mask = dense_mask(positions, positions, w, k)
    gen = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(2, 3, len(rows), 8, generator=gen, dtype=torch.float64,
                            requires_grad=kernel != "flex") for _ in range(3))
    keep = slice(len(rows.history), None)
    want = dense_attention(q, kk, v, mask)[:, :, keep]
    if kernel == "reference":
        from ecp_lm.model.kernels.sdpa import reference_attention

        pos = rows.positions()
        got = reference_attention(q, kk, v, arch.mask, pos, pos)[:, :, keep]
    elif kernel == "flex":
        from ecp_lm.model.kernels.flex import flex_attention_from_mask

        with torch.no_grad():
            got = flex_attention_from_mask(q.float(), kk.float(), v.float(), arch.mask, rows,
                                           arch.flex_bands(3))[:, :, keep].double()
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
        return
    else:
        got = arch.attend(q, kk, v, rows, 0.0, kernel)[:, :, keep]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(want, (q, kk, v), grad)
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, kk, v), grad), expected,
                          strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.skipif(not native.load(), reason="the native kernel could not be built")
def test_native_with_sinks_and_dropout_has_the_gradient_of_its_forward():
    """With dropout, the native kernel's sink merge is differentiated against its own forward
    (the masks repeat under one seed): finite differences agree with the backward."""
    arch = arch_with(4, 2)
    rows = Rows.span(0, 11)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 1, 11, 4, generator=gen, dtype=torch.float64, requires_grad=True)
              for _ in range(3)]

    def run(q, k, v):
        torch.manual_seed(0)  # the same dropout masks at every call
        return arch.attend(q, k, v, rows, 0.3, "native")

    assert torch.autograd.gradcheck(run, inputs, atol=1e-6)
    torch.manual_seed(0)
    dropped = run(*inputs)
    assert not torch.allclose(dropped, arch.attend(*inputs, rows, 0.0, "native"))


def test_the_native_path_holds_no_t_by_t_tensor():
    """O(T·(w + k)) memory: no tensor of T² elements is created on the native path."""
    if not native.load():
        pytest.skip("the native kernel could not be built")
    from ecp_lm.bench.core import CreatedBytes

    t, arch = 2048, arch_with(16, 4)
    q, k, v = (torch.randn(1, 1, t, 8, requires_grad=True) for _ in range(3))
    with CreatedBytes() as created:
        arch.attend(q, k, v, Rows.span(0, t), 0.0, "native").sum().backward()
    assert created.largest < t * t // 8, created.largest


# Models: forward, decoding, chunks ---------------------------------------------------------

@pytest.mark.parametrize("impl", ["reference", "mask", "native"])
def test_a_model_with_sinks_equals_its_reference_kernel(impl):
    if impl == "native" and not native.load():
        pytest.skip("the native kernel could not be built")
    tokens = random_tokens(2, 2 * N + 5)
    ref = sharp_model("sliding_window", window=6, sink_tokens=2, attn_impl="reference")
    model = sharp_model("sliding_window", window=6, sink_tokens=2, attn_impl=impl)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens), atol=1e-4, rtol=0)


def test_sinks_change_what_a_late_position_sees():
    tokens = random_tokens(1, 2 * N)
    with torch.no_grad():
        plain = sharp_model("sliding_window", window=6)(tokens)
        sinks = sharp_model("sliding_window", window=6, sink_tokens=2)(tokens)
    assert torch.equal(plain[:, :6], sinks[:, :6])  # within the first window: the same keys
    assert (plain[:, 8:] - sinks[:, 8:]).abs().amax() > 1e-3


@pytest.mark.parametrize(("arch", "sizes"), [
    ("sliding_window", dict(window=5, sink_tokens=2)),
    ("hybrid", dict(layer_pattern="sliding_window,ecp,sliding_window", n_layers=3, window=5,
                    sink_tokens=3))])
def test_cached_generation_past_three_windows_in_constant_memory(arch, sizes):
    """A cache of w + k slots per window layer, the sinks never evicted; greedy cached,
    uncached and one forward agree far past N."""
    model = sharp_model(arch, **sizes)
    out, logits, plain, plain_logits, full, caches = decode_three_ways(
        model, random_tokens(2, 5), 3 * N + 7)
    assert torch.equal(out, plain)
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(plain_logits, full, atol=1e-4, rtol=0)
    w, k, last = sizes["window"], sizes["sink_tokens"], out.size(1) - 2
    windows = [c for c in caches if c.sinks]
    assert len(windows) == model.cfg.layer_archs.count("sliding_window") == 2
    for cache in windows:
        assert cache.capacity == cache.k.size(2) == w + k and cache.sinks == k
        for row in cache.pos.tolist():
            assert sorted(row) == [*range(k), *range(last - w + 1, last + 1)]


@pytest.mark.parametrize("impl", ["auto", "reference", "mask", "native"])
def test_causal_with_sinks(impl):
    """Changing token t changes no output before t, and changes output t."""
    if impl == "native" and not native.load():
        pytest.skip("the native kernel could not be built")
    model = sharp_model("sliding_window", window=4, sink_tokens=2, attn_impl=impl)
    tokens = random_tokens(1, N + 5)
    with torch.no_grad():
        base = model(tokens)[0]
        for t in (0, 1, 2, 9, N + 4):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % TINY["vocab_size"]
            diff = (model(changed)[0] - base).abs().amax(-1)
            assert torch.all(diff[:t] == 0.0) and diff[t] > 1e-4, (impl, t)


def test_a_hybrid_receptive_field_adds_the_sinks():
    """sliding_window, ecp, sliding_window with 2 sinks (float64, by perturbation): output p
    depends on input t <= p exactly when t is within the layers' composed band (from the top
    layer down: p - (w - 1), then ECP's previous segment, then p - (w - 1)) or t is a sink."""
    w, k, m = 5, 2, N // TINY["num_segments"]
    model = sharp_model("hybrid", layer_pattern="sliding_window,ecp,sliding_window",
                        n_layers=3, window=w, sink_tokens=k).double()
    t_len = 3 * N
    tokens = random_tokens(1, t_len)

    def reach(p: int) -> int:
        p = max(0, p - w + 1)
        p = max(0, (p // m - 1) * m)
        return max(0, p - w + 1)

    with torch.no_grad():
        base = model(tokens)[0]
        for t in [*range(0, t_len, 4), 1]:
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % TINY["vocab_size"]
            diff = (model(changed)[0] - base).abs().amax(-1)
            for p in range(t_len):
                depends = t <= p and (reach(p) <= t or t < k)
                assert (diff[p] > 1e-12) == depends, (t, p, float(diff[p]))


@pytest.mark.parametrize("impl", ["auto", "mask"])
def test_the_training_loss_with_sinks_is_one_graph(impl):
    """What train.compile compiles (forward and cross-entropy) traces without a graph break."""
    from ecp_lm.model.loss import next_token_loss

    model = sharp_model("sliding_window", window=6, sink_tokens=2, attn_impl=impl).train()
    torch._dynamo.reset()
    found = torch._dynamo.explain(
        lambda t: next_token_loss(model(t[:, :-1]), t, reduction="sum"))(random_tokens(2, 40))
    assert (found.graph_count, found.graph_break_count) == (1, 0)


# Configuration --------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "message"), [
    (dict(arch="sliding_window", window=4, sink_tokens=-1),
     r"sink_tokens=-1 must be a non-negative integer"),
    (dict(arch="sliding_window", window=4, sink_tokens=1.5),
     r"sink_tokens=1.5 must be a non-negative integer"),
    (dict(arch="sliding_window", window=4, sink_tokens=4),
     r"sink_tokens=4 is not below window=4"),
    (dict(arch="ecp", sink_tokens=2), r"sink_tokens=2 is set, but arch='ecp' has no layer "
                                      r"with a window"),
    (dict(arch="hybrid", layer_pattern="ecp,transformer", sink_tokens=2),
     r"sink_tokens=2 is set, but layer_pattern='ecp,transformer' with n_layers=2 has no "
     r"layer with a window"),
    (dict(arch="hybrid", layer_pattern="ecp,transformer,sliding_window", n_layers=2,
          sink_tokens=2), r"has no layer with a window"),  # its window layer is cut off
    (dict(arch="hybrid", layer_pattern="sliding_window,transformer", window=3, sink_tokens=3),
     r"its sliding_window layers: sink_tokens=3 is not below window=3"),
])
def test_bad_sinks_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_sinks_apply_to_the_window_layers_only():
    cfg = ModelConfig(arch="hybrid", layer_pattern="sliding_window,transformer", window=4,
                      sink_tokens=2)
    assert cfg.layer_config("sliding_window").sink_tokens == 2
    assert cfg.layer_config("transformer").sink_tokens == 0
    assert ModelConfig.from_dict(ModelConfig(arch="sliding_window", sink_tokens=3).to_dict()) \
        .sink_tokens == 3


def test_offsets_and_shards_are_refused_with_sinks():
    model = sharp_model("sliding_window", window=5, sink_tokens=2)
    tokens = random_tokens(1, 8)
    with pytest.raises(ValueError, match=r"start_pos=5: with sink_tokens=2 every query sees "
                                         r"positions 0\.\.1"):
        model(tokens, start_pos=5)
    with pytest.raises(ValueError, match=r"only the first of K=2 context-parallel shards"):
        model.arch.check_context(16, 2)
    assert model.arch.context_start(1000) == 0  # uncached generation reads everything


# Cost ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "w", "k"), [(32, 5, 2), (32, 13, 12), (40, 40, 3), (64, 7, 0),
                                            (9, 4, 3)])
def test_entries_count_the_sinks(n, w, k):
    cfg = ModelConfig(arch="sliding_window", seq_len=n, window=w, sink_tokens=k, n_layers=2)
    cost = attention_cost(cfg)
    entries = sum(allowed(q, kv, w, k) for q in range(n) for kv in range(n))
    assert cost.entries_per_layer == (entries, entries)
    # tiles: blocks of w queries against their previous block and themselves, and every block
    # after the first against k sink columns
    blocks = [(s, min(w, n - s)) for s in range(0, n, w)]
    tiles = sum(r * r + (r * (w + k) if s else 0) for s, r in blocks)
    assert cost.tile_entries_per_layer == (tiles, tiles)
    assert cost.sink_tokens == k


def test_a_long_chunk_into_filled_caches_allocates_what_a_forward_does():
    """A chunk of C = 64N into caches filled past w + k creates no tensor larger than a forward
    over C tokens does (its (C, 4d) feed-forward): nothing of C × (capacity + C)."""
    from ecp_lm.bench.core import CreatedBytes

    model = sharp_model("sliding_window", window=6, sink_tokens=2)
    fill, chunk_len = 3 * N, 64 * N
    tokens = random_tokens(1, fill + chunk_len, seed=1)

    def largest(tokens, caches, start_pos) -> int:
        with torch.no_grad(), CreatedBytes() as mode:
            model.hidden_states(tokens, caches, start_pos)
        return mode.largest

    assert largest(tokens[:, :chunk_len], None, 0) == chunk_len * 4 * model.cfg.d_model
    caches = model.make_caches(1)
    with torch.no_grad():
        model.prefill(tokens[:, :fill], caches)
    assert largest(tokens[:, fill:], caches, fill) == chunk_len * 4 * model.cfg.d_model
