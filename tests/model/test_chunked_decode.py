"""Chunked decoding into filled ring caches: after a prefill, the rest of a sequence fed to
``hidden_states`` in chunks of any length gives the logits of one plain forward over the whole
sequence (the rings wrap, and a chunk may be longer than the ring), for every architecture that
decodes from caches and for hybrids of them. The chunks run on the architectures' kernels with
the keys they need read from the ring, not densely over the whole ring (``cached_attention``),
so a chunk creates no (C, capacity + C) tensor; the dense path stays where rows differ."""

import pytest
import torch

from ecp_lm.bench.core import CreatedBytes
from ecp_lm.model import attention as skeleton
from ecp_lm.model.cache import KVCache
from ecp_lm.model.kernels import LIBRARIES
from helpers import NO_ATTENTION, UNBOUNDED, random_tokens, sharp_model

# N = 16, S = 4: ECP m = 4 (a ring of 2m = 8), sliding_window w = 7, block_local b = 8, s2
# groups of 4: every ring wraps many times over a sequence of 12m = 3N.
SMALL = dict(seq_len=16, num_segments=4)
M = 4
LENGTH = 12 * M
FILLS = (1, M - 1, M, M + 1, 2 * M + 1, 3 * M)
MIXED = (3, 1, 2 * M + 1, 2, M, 5, M - 1, 2 * M)
# Models with a transformer layer read at most N tokens: N = 3·16 holds the whole sequence, and
# their local layers keep m = 4.
BOUNDED = dict(seq_len=LENGTH, num_segments=LENGTH // M)
RING_CACHED = {
    **{arch: (arch, SMALL) for arch in UNBOUNDED},
    "transformer": ("transformer", BOUNDED),
    "hybrid(ecp,transformer)": ("hybrid", dict(layer_pattern="ecp,transformer", **BOUNDED)),
    "hybrid(sliding_window,block_local,s2,ecp)": (
        "hybrid", dict(layer_pattern="sliding_window,block_local,s2,ecp", n_layers=4, **SMALL)),
    # attention sinks: a ring of w = 7 and 3 sink slots, the sinks read from their own slots
    "sliding_window+sinks": ("sliding_window", dict(sink_tokens=3, **SMALL)),
    "hybrid(sliding_window,ecp)+sinks": (
        "hybrid", dict(layer_pattern="sliding_window,ecp", sink_tokens=2, **SMALL)),
    # Longformer: a window per layer, half the heads dilated in one, global tokens in slots of
    # their own
    "longformer+dilation+globals": ("longformer", dict(window="3,5", dilation="2,1",
                                                       global_tokens=2, **SMALL)),
    "hybrid(longformer,ecp)+dilation": ("hybrid", dict(layer_pattern="longformer,ecp",
                                                       window=3, dilation=3, **SMALL)),
    # recurrent layers: their states beside the other layers' rings (Samba's pattern, ECP's)
    "hybrid(mamba2,sliding_window)": (
        "hybrid", dict(layer_pattern="mamba2,sliding_window", **SMALL)),
    "hybrid(gated_deltanet,rwkv7,ecp)": (
        "hybrid", dict(layer_pattern="gated_deltanet,rwkv7,ecp", n_layers=3, **SMALL)),
    "hybrid(mamba2*2,transformer)": (
        "hybrid", dict(layer_pattern="mamba2*2,transformer", n_layers=3, **BOUNDED)),
    # the research's named rivals beside ECP and a global layer: RWKV-4's channel mix keeps
    # its own state; an mLSTM block has no feed-forward
    "hybrid(rwkv4,mamba,ecp)": ("hybrid", dict(layer_pattern="rwkv4,mamba,ecp", n_layers=3,
                                               **SMALL)),
    "hybrid(mlstm,slstm,performer,transformer)": (
        "hybrid", dict(layer_pattern="mlstm,slstm,performer,transformer", n_layers=4,
                       **BOUNDED)),
}
"""Every architecture that decodes from per-layer caches, and hybrids: (arch, overrides)."""
LOCAL = [name for name, (_, overrides) in RING_CACHED.items()
         if overrides is SMALL and name not in (*NO_ATTENTION, "compressive", "routing")]
"""The local attention ones without sinks: they also run a window at any offset (sinks start at
0, and so do the compressive transformer's segments and the routing transformer's rings)."""


def ring_model(name: str, **overrides):
    """The model, in float64 where a recurrent mixer runs: its chunked and token-by-token forms
    sum in different orders, which at the unit-gain weights of ``sharp_model`` moves float32
    logits by about 1e-5; in float64 they agree to 1e-12."""
    arch, sizes = RING_CACHED[name]
    model = sharp_model(arch, **sizes, **overrides)
    recurrent = any(block.attn.arch.recurrent for block in model.blocks)
    return model.double() if recurrent else model


def no_dense_chunks(monkeypatch) -> None:
    """Makes the dense path over the whole ring (``cached_attention``) fail if a chunk takes it."""
    def dense(*args, **kwargs):
        raise AssertionError("a chunk attended over the whole ring (cached_attention)")

    monkeypatch.setattr(skeleton, "cached_attention", dense)


def chunked_logits(model, tokens, fill: int, chunk_lens) -> torch.Tensor:
    """Logits of every position: a prefill of ``fill`` tokens, then chunks of the given lengths
    (cycled) up to the end of ``tokens``."""
    caches = model.make_caches(tokens.size(0))
    outs = [model.prefill(tokens[:, :fill], caches)]
    start, lengths = fill, iter(chunk_lens)
    while start < tokens.size(1):
        stop = min(tokens.size(1), start + next(lengths))
        outs.append(model.head(model.hidden_states(tokens[:, start:stop], caches, start)))
        start = stop
    return torch.cat(outs, dim=1)


def cycle(*lengths: int):
    while True:
        yield from lengths


def assert_chunks_exact(model, tokens, fill: int, chunk_lens, label) -> None:
    with torch.no_grad():
        full = model(tokens)
        chunked = chunked_logits(model, tokens, fill, chunk_lens)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("name", RING_CACHED)
def test_every_chunk_length_equals_one_forward(name, fill, monkeypatch):
    """Chunks of 1 … 3N, and of mixed lengths, after prefills of several lengths: exact on the
    architectures' kernels, never densely over the whole ring."""
    no_dense_chunks(monkeypatch)
    model = ring_model(name)
    tokens = random_tokens(2, LENGTH, seed=fill)
    for chunk_len in range(1, LENGTH + 1):
        assert_chunks_exact(model, tokens, fill, cycle(chunk_len),
                            f"{name} fill={fill} chunk_len={chunk_len}")
    assert_chunks_exact(model, tokens, fill, cycle(*MIXED), f"{name} fill={fill} mixed")


@pytest.mark.parametrize("name", RING_CACHED)
def test_the_dense_path_is_exact_too(name):
    """``dense_cached_chunks``, the comparison the stream benchmark runs, is the same function."""
    model = ring_model(name)
    tokens = random_tokens(2, LENGTH, seed=7)
    with skeleton.dense_cached_chunks():
        for chunk_len in (1, M + 1, 3 * M):
            assert_chunks_exact(model, tokens, M + 1, cycle(chunk_len), f"{name} {chunk_len}")


@pytest.mark.parametrize("arch", ["ecp", "s2"])
@pytest.mark.parametrize("variant", [dict(tied_kv=True), dict(rope="first"),
                                     dict(tied_kv=True, rope="first")])
def test_chunks_exact_with_tied_kv_and_rope_in_layer_0(arch, variant):
    model = sharp_model(arch, seed=3, n_layers=3, **SMALL, **variant)
    tokens = random_tokens(3, LENGTH, seed=5)
    for chunk_len in (2, M + 1, 2 * M + 1):
        assert_chunks_exact(model, tokens, M + 1, cycle(chunk_len), f"{variant} {chunk_len}")


def test_the_transformer_window_in_chunks():
    """The transformer's cache holds its whole window: chunks within it are exact too."""
    model = sharp_model("transformer", **SMALL)
    tokens = random_tokens(2, SMALL["seq_len"], seed=2)
    for chunk_len in (1, 3, 5):
        assert_chunks_exact(model, tokens, 3, cycle(chunk_len), f"chunk_len={chunk_len}")


def test_a_chunk_must_continue_the_caches():
    model = sharp_model("ecp", **SMALL)
    tokens = random_tokens(2, 3 * M)
    caches = model.make_caches(2)
    with torch.no_grad():
        model.prefill(tokens[:, :M + 1], caches)
        for wrong in (M, M + 2, 0):
            with pytest.raises(ValueError, match=rf"start_pos={wrong}, but the caches continue "
                                                 rf"at position {M + 1}$"):
                model.hidden_states(tokens[:, M + 1:M + 4], caches, wrong)
        model.hidden_states(tokens[:, M + 1:M + 4], caches, M + 1)
        assert caches[0].next_pos == [M + 4, M + 4]


def test_rows_at_different_positions_refuse_a_chunk():
    """Stacked caches whose rows stand at different positions take single decode steps only
    (``decode_one_token``); a chunk names one position for every row."""
    model = sharp_model("ecp", **SMALL)
    rows = []
    with torch.no_grad():
        for n in (3, 5):
            caches = model.make_caches(1)
            model.prefill(random_tokens(1, n, seed=n), caches)
            rows.append(caches)
        stacked = [KVCache.stack(pair) for pair in zip(*rows, strict=True)]
        with pytest.raises(ValueError, match=r"continue at position \[3, 5\]"):
            model.hidden_states(random_tokens(2, 2), stacked, 3)


def test_rows_of_different_origins_take_the_dense_path_exactly(monkeypatch):
    """Stacked rows that continue at one position but whose streams start at different ones
    (row 0 at 0, row 1 at m): where the chunk's first query reaches before m, the rows would
    need different keys, so the chunk attends densely over the ring (exact); once it reaches
    no further back than m, the rows agree and it runs on the kernel."""
    model = sharp_model("ecp", **SMALL)
    tokens = random_tokens(2, LENGTH, seed=4)
    dense = []
    real = skeleton.cached_attention
    monkeypatch.setattr(skeleton, "cached_attention",
                        lambda *a, **k: dense.append(a[0].size(2)) or real(*a, **k))
    first = M + 2  # position 6: its query sees the segment from 0 on
    with torch.no_grad():
        rows = [model.make_caches(1), model.make_caches(1)]
        model.prefill(tokens[:1, :first], rows[0])
        model.prefill(tokens[1:, M:first], rows[1], start_pos=M)
        caches = [KVCache.stack(pair) for pair in zip(*rows, strict=True)]
        assert caches[0].origin == [0, M]
        chunked, start = [], first
        for chunk_len in (3, 1, 2 * M + 1, 5, LENGTH):
            stop = min(LENGTH, start + chunk_len)
            chunked.append(model.head(model.hidden_states(tokens[:, start:stop], caches, start)))
            start = stop
        chunked = torch.cat(chunked, dim=1)
        full = [model(tokens[:1])[:, first:], model(tokens[1:, M:], start_pos=M)[:, first - M:]]
    torch.testing.assert_close(chunked, torch.cat(full), atol=1e-5, rtol=0)
    # The first chunk (positions 6 .. 8) reaches back to 0: densely, in each of the 2 layers;
    # from the second on (position 9, which reaches back to 4) on the kernel.
    assert dense == [3, 3]


def largest_created(model, tokens, caches, start_pos: int) -> int:
    """The most elements of one tensor the call creates (views excluded)."""
    with torch.no_grad(), CreatedBytes() as mode:
        model.hidden_states(tokens, caches, start_pos)
    return mode.largest


@pytest.mark.parametrize("name", LOCAL)
def test_a_long_chunk_into_filled_caches_allocates_what_a_fresh_forward_does(name):
    """A chunk of C = 64N into rings filled past their capacity creates no tensor larger than
    a forward over the same C tokens without caches does (its (C, 4d) feed-forward): nothing of
    C × (capacity + C). Densely over the ring it would (C² masks and more)."""
    model = ring_model(name)
    n = SMALL["seq_len"]
    chunk_len, fill = 64 * n, 3 * n  # the fill a multiple of every period
    tokens = random_tokens(1, fill + chunk_len, seed=1)
    chunk = tokens[:, fill:]
    fresh = largest_created(model, chunk, None, fill)
    assert fresh == chunk_len * 4 * model.cfg.d_model

    def filled() -> list[KVCache]:
        caches = model.make_caches(1)
        with torch.no_grad():
            model.prefill(tokens[:, :fill], caches)
        return caches

    assert largest_created(model, chunk, filled(), fill) == fresh
    with skeleton.dense_cached_chunks():  # the property could fail
        assert largest_created(model, chunk, filled(), fill) >= chunk_len ** 2


@pytest.mark.parametrize("name", ["compressive", "routing"])
def test_a_long_chunk_into_a_filled_state_stays_linear(name):
    """The compressive and routing transformers, whose streams start at 0: a chunk of C = 64N
    into a filled state creates nothing larger than the chunk's (C, 4d) feed-forward."""
    model = ring_model(name)
    n = SMALL["seq_len"]
    chunk_len, fill = 64 * n, 3 * n + 1
    tokens = random_tokens(1, fill + chunk_len, seed=1)
    caches = model.make_caches(1)
    with torch.no_grad():
        model.prefill(tokens[:, :fill], caches)
    largest = largest_created(model, tokens[:, fill:], caches, fill)
    assert largest == chunk_len * 4 * model.cfg.d_model


def test_prepend_reads_the_ring_in_position_order():
    """``KVCache.prepend``: the positions start .. stop - 1 from their slots (the ring wrapped),
    zeros for those older than the ring, then the new keys; None where a slot does not hold the
    position it should."""
    cache = KVCache(2, 1, 4, 1)
    cache.start_at(0)
    values = torch.arange(1.0, 11.0).view(1, 1, 10, 1).expand(2, 1, 10, 1)  # position p: p + 1
    cache.update(torch.arange(10), values, -values)  # slots hold positions 8, 9, 6, 7
    new = torch.full((2, 1, 2, 1), 100.0)
    k, v = cache.prepend(4, 10, new, -new)
    assert k[0, 0, :, 0].tolist() == [0, 0, 7, 8, 9, 10, 100, 100]
    torch.testing.assert_close(v, -k)
    assert cache.prepend(10, 10, new, new)[0].shape == (2, 1, 2, 1)
    assert cache.prepend(4, 11, new, new) is None  # position 10 is not written
    cache.pos[1, 2] = 2  # row 1's slot of position 6 holds another
    assert cache.prepend(6, 10, new, new) is None
    assert cache.prepend(7, 10, new, new) is not None


@pytest.mark.parametrize("name", RING_CACHED)
def test_chunks_exact_on_every_kernel(name, monkeypatch):
    """A chunk's queries take the last rows of their keys on every kernel an architecture has,
    padded in front with zero queries where the kernel needs a query at every row."""
    no_dense_chunks(monkeypatch)
    arch, _ = RING_CACHED[name]
    own = [] if arch == "hybrid" else list(ring_model(name).arch.kernels)
    kernels = ["reference"] + [k for k in own if k not in LIBRARIES]  # CUDA only
    tokens = random_tokens(2, LENGTH, seed=8)
    for kernel in kernels:
        model = ring_model(name, attn_impl=kernel)
        for chunk_len in (1, M + 1, 3 * M + 2):
            assert_chunks_exact(model, tokens, M + 1, cycle(chunk_len),
                                f"{name} {kernel} {chunk_len}")
