"""The work the recurrent mixers do, beside what they compute (test_recurrent.py):

- each recurrent kind in a hybrid keeps its own settings, whatever the pattern's order, and an
  explicit ``chunk_size`` is every kind's;
- a short input never pays for a whole chunk, in any of the three chunked kernels (the largest
  tensor a call creates, not its time);
- the chunked kernel runs a layer in groups (``recurrent.GROUP_TOKENS``): across group
  boundaries it is the token-by-token recurrence, forward and backward, and what a layer keeps
  for backward is its rows and one state per group, not the kernel's intermediates.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ecp_lm.bench.core import CreatedBytes
from ecp_lm.bench.memory import LiveBytes
from ecp_lm.config import ModelConfig
from ecp_lm.model.archs import architecture, recurrent
from ecp_lm.model.kernels import delta_rule, dplr, ssd
from ecp_lm.model.rows import Rows
from helpers import RECURRENT, random_tokens, sharp_model, tiny_config

# Each kind's settings in a hybrid ----------------------------------------------------------

SETTINGS = ("chunk_size", "mixer_width", "state_size", "conv_size")


def chunks(size: int, arch: str) -> dict[str, int]:
    """chunk_size=size where ``arch`` has chunks (sLSTM's cell has none)."""
    return {"chunk_size": size} if "chunk_size" in architecture(arch).size_fields else {}


DEFAULT_CHUNK = {"mamba2": 64, "gated_deltanet": 64, "rwkv7": 32, "rwkv4": 8, "mamba": 16,
                 "mlstm": 16, "slstm": None, "performer": 32}


def _settings(arch) -> dict[str, object]:
    return {name: getattr(arch.cfg, name) for name in SETTINGS}


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(RECURRENT, 2)))
def test_each_kind_keeps_its_own_settings_in_either_order(a, b):
    """``a,b`` and ``b,a``: every layer has the settings of the pure model of its kind (rwkv7
    chunks of 32, rwkv4 8 and mamba 16 beside the others' 64), read from the layers the model
    built."""
    pure = {kind: _settings(architecture(kind)(tiny_config(kind, seq_len=128)))
            for kind in (a, b)}
    assert {pure[kind]["chunk_size"] for kind in (a, b)} == {DEFAULT_CHUNK[a], DEFAULT_CHUNK[b]}
    for pattern in (f"{a},{b}", f"{b},{a}"):
        model = sharp_model("hybrid", layer_pattern=pattern, seq_len=128)
        for block, kind in zip(model.blocks, model.cfg.layer_archs, strict=True):
            assert _settings(block.attn.arch) == pure[kind], (pattern, kind)
            assert block.attn.chunk == pure[kind]["chunk_size"], (pattern, kind)


def test_an_explicit_chunk_size_is_every_kinds():
    model = sharp_model("hybrid", layer_pattern="rwkv7,mamba2,gated_deltanet", n_layers=3,
                        chunk_size=16)
    assert [block.attn.chunk for block in model.blocks] == [16, 16, 16]


# A short input pays for itself only ---------------------------------------------------------

def _ssd(t: int, chunk: int):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(1, 2, t, 8, generator=g)
    dt = torch.rand(1, 2, t, generator=g)
    b, c = (torch.randn(1, 1, t, 4, generator=g) for _ in range(2))
    return ssd.ssd_chunked(x, dt, -torch.ones(2), b, c, torch.ones(2), chunk,
                           torch.randn(1, 2, 8, 4, generator=g))


def _delta(t: int, chunk: int):
    g = torch.Generator().manual_seed(t)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 2, t, 8, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(1, 2, t, 8, generator=g)
    return delta_rule.gated_delta_rule_chunked(
        q, k, v, -torch.rand(1, 2, t, generator=g), torch.rand(1, 2, t, generator=g), chunk,
        initial_state=torch.randn(1, 2, 8, 8, generator=g))


def _dplr(t: int, chunk: int):
    g = torch.Generator().manual_seed(t)
    r, k, v, a, b = (torch.randn(1, 2, t, 8, generator=g) for _ in range(5))
    log_w = -torch.rand(1, 2, t, 8, generator=g) * 0.6
    return dplr.dplr_chunked(r, log_w, k, v, a, b, chunk, torch.randn(1, 2, 8, 8, generator=g),
                             decay_bound=0.61)


@pytest.mark.parametrize("kernel", [_ssd, _delta, _dplr], ids=["ssd", "delta_rule", "dplr"])
@pytest.mark.parametrize("t", [1, 3])
def test_a_short_input_never_pays_for_a_whole_chunk(kernel, t):
    """T tokens in chunks of 64 create no larger tensor than T tokens in chunks of T: the work
    of a T-token chunk, not a padded 64-token one (one token into a filled state costs one)."""
    def largest(chunk: int) -> int:
        with torch.no_grad(), CreatedBytes() as mode:
            kernel(t, chunk)
        return mode.largest

    assert largest(64) == largest(t)


# Groups of the chunked kernel ---------------------------------------------------------------

@pytest.mark.parametrize("arch", RECURRENT)
def test_groups_compute_the_recurrence_forward_and_backward(arch, monkeypatch):
    """Groups of two chunks of 4 over 37 tokens (five groups, the last one partial): the chunked
    layer's output and every gradient equal the token-by-token recurrence's, in float64."""
    monkeypatch.setattr(recurrent, "GROUP_TOKENS", 8)
    grouped = sharp_model(arch, attn_impl="chunked", **chunks(4, arch)).double().train()
    reference = sharp_model(arch, attn_impl="reference", **chunks(4, arch)).double().train()
    reference.load_state_dict(grouped.state_dict())
    tokens = random_tokens(2, 38, seed=2)
    losses = [model.loss(tokens) for model in (grouped, reference)]
    torch.testing.assert_close(losses[0], losses[1], atol=1e-12, rtol=1e-12)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(grouped.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-11, rtol=1e-9, msg=name)


@pytest.mark.parametrize("arch", RECURRENT)
def test_backward_recomputes_each_group_exactly_under_its_autocast(arch, monkeypatch):
    """A bf16 autocast training step in groups: each group's recomputation in backward gives
    bit for bit the output (and dtype) the group gave in the forward, so its gradients are
    those of the forward that ran; every parameter gets one."""
    monkeypatch.setattr(recurrent, "GROUP_TOKENS", 8)
    model = sharp_model(arch, attn_impl="chunked", **chunks(4, arch)).train()
    mixer_class = type(model.blocks[0].attn)
    real, seen = mixer_class.mix, {}

    def recording(self, rows, state, kernel):
        y, new = real(self, rows, state, kernel)
        key = (id(self), rows.untyped_storage().data_ptr(), rows.storage_offset(), rows.shape)
        seen.setdefault(key, []).append(y.detach().clone())
        return y, new

    monkeypatch.setattr(mixer_class, "mix", recording)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(random_tokens(2, 30, seed=4))
    loss.backward()
    assert len(seen) == 2 * 4  # two layers of four groups, each run twice
    for forward, again in seen.values():
        assert again.dtype == forward.dtype and torch.equal(again, forward)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_small_call_runs_each_mixer_once(arch, monkeypatch):
    """A training step on a small call (one group of 30 tokens, its rows under
    ``KEEP_ELEMENTS``): each layer's mixer runs once, in the forward (backward differentiates
    what ran, no recomputation), and every gradient equals the token-by-token recurrence's, in
    float64. With the same rows over ``KEEP_ELEMENTS``, backward recomputes each layer."""
    model = sharp_model(arch, attn_impl="chunked", **chunks(4, arch)).double().train()
    reference = sharp_model(arch, attn_impl="reference", **chunks(4, arch)).double().train()
    reference.load_state_dict(model.state_dict())
    mixer_class = type(model.blocks[0].attn)
    real, calls = mixer_class.mix, []

    def counting(self, rows, state, kernel):
        calls.append(kernel)
        return real(self, rows, state, kernel)

    monkeypatch.setattr(mixer_class, "mix", counting)
    tokens = random_tokens(2, 31, seed=5)
    model.loss(tokens).backward()
    assert calls == ["chunked"] * len(model.blocks)
    calls.clear()
    monkeypatch.setattr(recurrent, "KEEP_ELEMENTS", 2 * 30 * model.cfg.d_model - 1)
    model.zero_grad()
    model.loss(tokens).backward()
    assert calls == ["chunked"] * 2 * len(model.blocks)
    reference.loss(tokens).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-11, rtol=1e-9, msg=name)


def _kept_for_backward(arch: str, t: int) -> int:
    """Bytes a mixer layer at d_model 32 keeps between its forward and its backward on T
    tokens: what is alive after the forward that was not alive before it, the output aside."""
    cfg = ModelConfig(arch=arch, d_model=32, n_heads=2, n_layers=1, seq_len=t)
    kind = architecture(arch)(cfg)
    torch.manual_seed(0)
    mixer = kind.mixer(kind.cfg, 0)
    x = torch.randn(1, t, 32, requires_grad=True)
    with LiveBytes(lambda shape: 0, 1) as live:
        out = mixer(x, Rows.span(0, t), t)
        kept = live.live[0] - out.numel() * out.element_size()
    out.sum().backward()
    return kept


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_layer_keeps_less_than_a_number_per_token_and_channel_for_backward(arch):
    """At 4 and 16 groups, what a layer creates in its forward and keeps for its backward (its
    rows are the caller's) is one state per group: under a number per token and channel,
    where the kernel's intermediates held for backward are about sixty."""
    group = recurrent.GROUP_TOKENS
    for n in (4, 16):
        kept = _kept_for_backward(arch, n * group)
        assert kept <= (n * group) * 32 * 4, kept / (n * group * 32 * 4)


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_layer_of_several_groups_compiles_to_one_graph(arch, monkeypatch):
    """Under torch.compile the groups' recomputation is traced (torch.utils.checkpoint): the
    training loss over four groups is one graph without breaks."""
    import torch._dynamo

    from ecp_lm.model.loss import next_token_loss

    monkeypatch.setattr(recurrent, "GROUP_TOKENS", 8)
    model = sharp_model(arch, **chunks(4, arch)).train()
    tokens = random_tokens(2, 31)
    torch._dynamo.reset()
    try:
        found = torch._dynamo.explain(
            lambda t: next_token_loss(model(t[:, :-1]), t, reduction="sum"))(tokens)
    finally:
        torch._dynamo.reset()
    assert (found.graph_count, found.graph_break_count) == (1, 0), found.break_reasons


@pytest.mark.parametrize("arch", ["slstm", "mlstm", "rwkv4", "mamba"])
def test_a_layers_backward_creates_bytes_linear_in_its_length(arch):
    """Backward of one layer at 512 tokens creates twice what it creates at 256 (within 10%):
    no step of the sLSTM cell's loop, nor chunk of the others', costs a gradient of the whole
    input (indexing one inside the loop did, and made it grow with the square of the length)."""
    def created(t: int) -> int:
        cfg = ModelConfig(arch=arch, d_model=32, n_heads=2, n_layers=1, seq_len=t)
        kind = architecture(arch)(cfg)
        torch.manual_seed(0)
        mixer = kind.mixer(kind.cfg, 0)
        out = mixer(torch.randn(1, t, 32, requires_grad=True), Rows.span(0, t), t).sum()
        with CreatedBytes() as mode:
            out.backward()
        return mode.bytes

    assert created(512) <= 2.2 * created(256)
