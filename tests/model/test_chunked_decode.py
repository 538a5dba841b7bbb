"""Chunked decoding into filled ring caches: after a prefill, the rest of a sequence fed to
``hidden_states`` in chunks of any length gives the logits of one plain forward over the whole
sequence (the rings wrap, and a chunk may be longer than the ring)."""

import pytest
import torch

from ecp_lm.model.cache import KVCache
from helpers import UNBOUNDED, random_tokens, sharp_model

# N = 16, S = 4: ECP m = 4 (a ring of 2m = 8), sliding_window w = 7, block_local b = 8, s2
# groups of 4: every ring wraps many times over a sequence of 12m.
SMALL = dict(seq_len=16, num_segments=4)
M = 4
LENGTH = 12 * M
FILLS = (1, M - 1, M, M + 1, 2 * M + 1, 3 * M)
MIXED = (3, 1, 2 * M + 1, 2, M, 5, M - 1, 2 * M)


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
@pytest.mark.parametrize("arch", UNBOUNDED)
def test_every_chunk_length_equals_one_forward(arch, fill):
    model = sharp_model(arch, **SMALL)
    tokens = random_tokens(2, LENGTH, seed=fill)
    for chunk_len in range(1, 2 * M + 2):
        assert_chunks_exact(model, tokens, fill, cycle(chunk_len),
                            f"{arch} fill={fill} chunk_len={chunk_len}")
    assert_chunks_exact(model, tokens, fill, cycle(*MIXED), f"{arch} fill={fill} mixed")


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
