"""Exact computation at any absolute position: rotary scores depend only on the offset between
query and key, an ECP window at offset P (a multiple of m) computes what it computes at 0, a
cached ECP stream far from position 0 equals the uncached forward, and offsets at which an
architecture's function is not defined are refused."""

import pytest
import torch

from ecp_lm.config import ARCHS
from ecp_lm.generation import context_start
from ecp_lm.model.rope import RotaryEmbedding
from helpers import TINY, UNBOUNDED, random_tokens, sharp_model

N, M = TINY["seq_len"], TINY["seq_len"] // TINY["num_segments"]
FAR = [10**6, 10**7, 2**31, 2**53, 2**62]  # all multiples of M = 8


def test_rope_scores_depend_only_on_the_offset():
    head_dim = 64
    rope = RotaryEmbedding(head_dim)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, head_dim, generator=gen).unbind(0)  # (1, 1, 1, D) each
    offsets = torch.arange(0, 100)

    def scores(start: int) -> torch.Tensor:
        """q at start + offset against k at start, for every offset."""
        pos = start + offsets
        k_rot = rope(k, torch.tensor([start]))  # (1, 1, 1, D)
        return (rope(q.expand(1, 1, len(offsets), head_dim), pos) * k_rot).sum(-1).flatten()

    near = scores(0)
    for start in [1, 12345, *FAR]:
        torch.testing.assert_close(scores(start), near, atol=1e-5, rtol=0, msg=f"at {start}")


def test_rope_table_survives_dtype_casts():
    """Casting a model (its floating-point buffers) must not round the rotation angles."""
    model = sharp_model("ecp")
    rope = model.blocks[0].attn.rope
    pos = torch.tensor([0, 7, 10**7, 2**31])
    before = rope.angles(pos)
    model.to(torch.bfloat16).to(torch.float32)
    assert torch.equal(rope.angles(pos), before) and before.dtype == torch.float64


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("start_pos", [M, *FAR])
def test_ecp_window_at_an_offset_equals_the_window_at_zero(impl, start_pos):
    model = sharp_model("ecp", attn_impl=impl)
    tokens = random_tokens(2, 2 * N + 3)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, start_pos=start_pos), model(tokens),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt_len", [3, 2 * M + 3])
def test_ecp_cached_stream_far_from_zero_equals_uncached(prompt_len):
    """Prefill near position 10^7 (an odd multiple of m, so the ring of 2m slots starts half-way
    round), decode past several segment boundaries; each step equals a forward over the context
    the prediction needs, itself started at a multiple of m."""
    model = sharp_model("ecp", n_layers=2)
    start = 10**7 + M
    steps = 3 * M
    tokens = random_tokens(1, prompt_len + steps, seed=prompt_len)
    caches = model.make_caches(1)
    with torch.no_grad():
        logits = [model.prefill(tokens[:, :prompt_len], caches, start_pos=start)[:, -1]]
        for i in range(prompt_len, tokens.size(1) - 1):
            logits.append(model.decode_one_token(tokens[:, i:i + 1], start + i, caches))
        firsts = set()
        for i, step in zip(range(prompt_len - 1, tokens.size(1) - 1), logits, strict=True):
            first = max(start, context_start(model, start + i + 1))  # the stream begins at start
            firsts.add(first)
            uncached = model(tokens[:, first - start:i + 1], start_pos=first)[:, -1]
            torch.testing.assert_close(step, uncached, atol=1e-5, rtol=0, msg=f"step at {i}")
        at_zero = model(tokens[:, :-1])[:, prompt_len - 1:]  # the same stream from position 0
    torch.testing.assert_close(torch.stack(logits, dim=1), at_zero, atol=1e-5, rtol=0)
    assert len(firsts) > 1  # the uncached context moved on by whole segments


def test_ecp_refuses_offsets_off_the_segment_grid():
    model = sharp_model("ecp")
    tokens = random_tokens(1, 8)
    for start_pos in (3, M + 1, -M):
        with pytest.raises(ValueError, match=rf"start_pos={start_pos} is not a non-negative "
                                             rf"multiple of segment_len={M}"):
            model(tokens, start_pos=start_pos)
    with pytest.raises(ValueError, match="start_pos=5"):
        model.prefill(tokens, model.make_caches(1), start_pos=5)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in UNBOUNDED])
def test_other_architectures_refuse_any_offset(arch):
    model = sharp_model(arch)
    tokens = random_tokens(1, 8)
    for start_pos in (M, 1):
        with pytest.raises(ValueError, match=rf"start_pos={start_pos}: arch='{arch}'"):
            model(tokens, start_pos=start_pos)
    caches = model.make_caches(1)
    if caches is not None:
        with pytest.raises(ValueError, match=rf"start_pos={M}: arch='{arch}'"):
            model.prefill(tokens, caches, start_pos=M)


def test_decode_must_continue_the_caches():
    model = sharp_model("ecp")
    caches = model.make_caches(1)
    with torch.no_grad():
        model.prefill(random_tokens(1, 5), caches, start_pos=2 * M)
        with pytest.raises(ValueError, match=rf"pos=5, but the caches continue at position "
                                             rf"{2 * M + 5}"):
            model.decode_one_token(random_tokens(1, 1), 5, caches)
