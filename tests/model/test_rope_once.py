"""The rotary angles are computed once per forward and row layout, not per layer: the float64
angle computation runs once for each distinct layout of rows the layers hold (PerceiverAR and
compressed_double: two; every other architecture: one), and the hidden states equal those of a
forward that rotates every layer's queries and keys by angles computed for that layer alone."""

import math

import pytest
import torch

from ecp_lm.config import ARCHS
from ecp_lm.model.attention import Attention
from ecp_lm.model.rope import RotaryEmbedding, frequencies, rotate
from helpers import NO_ATTENTION, random_tokens, sharp_model

LAYERS = 4
TWO_LAYOUTS = ("perceiver_ar", "compressed_double")  # the latents / the compressed history


@pytest.fixture
def angle_calls(monkeypatch):
    """The number of ``RotaryEmbedding.angles`` calls, the only float64 work of the rotation."""
    calls = []
    real = RotaryEmbedding.angles

    def counting(self, positions):
        calls.append(positions.numel())
        return real(self, positions)

    monkeypatch.setattr(RotaryEmbedding, "angles", counting)
    return calls


def layouts_of_rotating_layers(model, tokens, **kwargs) -> set:
    """The distinct rows held by the layers that rotate, recorded from the attention calls."""
    seen = set()
    hooks = [block.attn.register_forward_pre_hook(lambda m, args: seen.add(args[1]))
             for block in model.blocks if block.attn.rope is not None]
    with torch.no_grad():
        model.hidden_states(tokens, **kwargs)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_angles_once_per_row_layout(arch, angle_calls):
    model = sharp_model(arch, n_layers=LAYERS)
    tokens = random_tokens(2, 32)
    layouts = layouts_of_rotating_layers(model, tokens)
    angle_calls.clear()
    with torch.no_grad():
        model.hidden_states(tokens)
    # a recurrent mixer has no positions to rotate: no angles at all
    expected = 0 if arch in NO_ATTENTION else 2 if arch in TWO_LAYOUTS else 1
    assert len(angle_calls) == len(layouts) == expected
    assert len(angle_calls) < 2 * LAYERS  # each layer's queries and keys once, before


@pytest.mark.parametrize("arch", ["ecp", "perceiver_ar", "compressed_double"])
@pytest.mark.parametrize("rope, expected", [("first", 1), ("none", 0)])
def test_rope_first_rotates_layer_zero_only_and_none_never(arch, rope, expected, angle_calls):
    model = sharp_model(arch, n_layers=LAYERS, rope=rope)
    with torch.no_grad():
        model.hidden_states(random_tokens(2, 32))
    assert len(angle_calls) == expected


def test_training_step_computes_angles_once(angle_calls):
    model = sharp_model("ecp", n_layers=LAYERS).train()
    model.loss(random_tokens(2, 33)).backward()
    assert len(angle_calls) == 1


def test_cached_prefill_and_chunks_compute_angles_once_each(angle_calls):
    model = sharp_model("ecp", n_layers=LAYERS)
    tokens = random_tokens(2, 40)
    caches = model.make_caches(2)
    with torch.no_grad():
        model.prefill(tokens[:, :24], caches)
        assert len(angle_calls) == 1
        model.hidden_states(tokens[:, 24:], caches, start_pos=24)  # a chunk into filled caches
    assert len(angle_calls) == 2


# The reference: every layer rotates by angles of its own, computed here ------------------------

def own_rotation(positions: torch.Tensor, head_dim: int, dtype: torch.dtype):
    """(cos, sin) of θ_i(p) = p·ω_i, reduced modulo 2π in float64: exact enough at the positions
    used here (error about p·10⁻¹⁶ rad, far below float32's rounding)."""
    freqs = torch.tensor(frequencies(head_dim), dtype=torch.float64)
    angles = torch.remainder(positions.double()[:, None] * freqs, 2 * math.pi)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def per_layer_forward(self, x, rows, n_query, cache=None, context=None, rotation=None):
    """``Attention.forward`` without a cache or context group, rotating this layer's queries
    and keys by angles computed for this layer alone (the rotation passed in is ignored)."""
    assert cache is None and context is None
    kv_pos = rows.positions(x.device)
    q, k, v = self._project(x, n_query)
    if self.rope is not None:
        q = rotate(q, own_rotation(kv_pos[len(rows) - n_query:], self.head_dim, q.dtype))
        k = rotate(k, own_rotation(kv_pos, self.head_dim, k.dtype))
    out = self._attend(q, k, v, rows)  # (B, H, Rq, D)
    b, _, rq, _ = out.shape
    return self.out_proj(out.transpose(1, 2).reshape(b, rq, -1))


@pytest.mark.parametrize("rope", ["all", "first"])
@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_equal_per_layer_rotation(arch, rope, monkeypatch):
    model = sharp_model(arch, n_layers=LAYERS, rope=rope)
    tokens = random_tokens(2, 32)
    with torch.no_grad():
        shared = model.hidden_states(tokens)
        monkeypatch.setattr(Attention, "forward", per_layer_forward)
        reference = model.hidden_states(tokens)
    torch.testing.assert_close(shared, reference, atol=1e-6, rtol=0)


def exact_per_layer_forward(self, x, rows, n_query, cache=None, context=None, rotation=None):
    """``Attention.forward`` as before the rotation was shared: each layer takes the exactly
    reduced angles (``RotaryEmbedding.angles``) of its queries and of its keys, separately."""
    assert cache is None and context is None
    kv_pos = rows.positions(x.device)
    q, k, v = self._project(x, n_query)

    def rotation_at(positions):
        angles = self.rope.angles(positions)
        return angles.cos().to(q.dtype), angles.sin().to(q.dtype)

    q = rotate(q, rotation_at(kv_pos[len(rows) - n_query:]))
    k = rotate(k, rotation_at(kv_pos))
    out = self._attend(q, k, v, rows)
    b, _, rq, _ = out.shape
    return self.out_proj(out.transpose(1, 2).reshape(b, rq, -1))


@pytest.mark.parametrize("start_pos", [8, 10**7, 2**62])
def test_ecp_far_from_zero_equals_per_layer_rotation_bitwise(start_pos, monkeypatch):
    """Far from 0 only the exact reduction is exact enough; shared, its angles are the same."""
    model = sharp_model("ecp", n_layers=LAYERS)
    tokens = random_tokens(2, 40)
    with torch.no_grad():
        shared = model.hidden_states(tokens, start_pos=start_pos)
        monkeypatch.setattr(Attention, "forward", exact_per_layer_forward)
        reference = model.hidden_states(tokens, start_pos=start_pos)
    assert torch.equal(shared, reference)
