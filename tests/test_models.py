"""Model-level properties: causality, ECP's receptive field, gradients, lengths, heads."""

import pytest
import torch

from ecp_lm import build_model
from helpers import TINY, random_tokens, sharp_model

N, L, M = TINY["seq_len"], TINY["n_layers"], TINY["seq_len"] // TINY["num_segments"]


def peak(x: torch.Tensor) -> float:
    return x.max().item() if x.numel() else 0.0


def predicted_positions(model, t: int) -> torch.Tensor:
    n = model.arch.num_predicted(t)
    return torch.arange(t - n, t)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_causality_by_perturbation(arch, impl):
    model = sharp_model(arch, attn_impl=impl)
    t_len = 2 * N + 3 if arch == "ecp" else N
    tokens = random_tokens(1, t_len)
    positions = predicted_positions(model, t_len)
    with torch.no_grad():
        base = model(tokens)[0]
        for t in range(t_len):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % TINY["vocab_size"]
            diff = (model(changed)[0] - base).abs().amax(dim=-1)  # (P,)
            assert peak(diff[positions < t]) <= 1e-6, (arch, t)
            if (positions >= t).any():
                assert peak(diff[positions >= t]) > 1e-4, (arch, t)


def test_causality_by_gradient(arch):
    """d logits[i] / d embedding[j] == 0 for every j after the predicted position i."""
    model = sharp_model(arch)
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["emb"] = output

    model.embed.register_forward_hook(keep)
    t_len = N
    logits = model(random_tokens(1, t_len))[0]
    for i, pos in enumerate(predicted_positions(model, t_len).tolist()):
        model.zero_grad()
        captured["emb"].grad = None
        logits[i].sum().backward(retain_graph=True)
        grad = captured["emb"].grad[0].abs().amax(dim=-1)  # (T,)
        assert peak(grad[pos + 1:]) == 0.0, (arch, pos)
        assert grad[: pos + 1].max() > 0.0


@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_ecp_receptive_field(n_layers):
    """An output in segment s depends on input segments max(0, s-L) .. s and no earlier one."""
    model = sharp_model("ecp", n_layers=n_layers)
    t_len = 2 * N  # 8 segments of m = 8
    tokens = random_tokens(1, t_len)
    segment = torch.arange(t_len) // M
    with torch.no_grad():
        base = model(tokens)[0]
        for t in range(0, t_len, 3):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % TINY["vocab_size"]
            diff = (model(changed)[0] - base).abs().amax(dim=-1)
            s_t = t // M
            assert peak(diff[segment > s_t + n_layers]) <= 1e-6, t
            assert peak(diff[:t]) <= 1e-6, t
            reach = (torch.arange(t_len) >= t) & (segment <= s_t + n_layers)
            assert diff[reach].min() > 1e-6, t  # every position it may reach, it does


@pytest.mark.parametrize("overrides", [{}, dict(tied_kv=True), dict(tie_embeddings=True),
                                       dict(rope="first"), dict(num_classes=3)])
def test_every_parameter_gets_a_gradient(arch, overrides):
    model = build_model(sharp_model(arch, **overrides).cfg).train()
    tokens = random_tokens(2, N + 1)
    if model.cfg.num_classes is None:
        loss = model.loss(tokens)
    else:
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :N]), torch.tensor([0, 2]))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_output_shapes_and_lengths(arch):
    model = sharp_model(arch)
    latent = model.cfg.latent_len
    for t in (1, 5, N):
        expected = t if arch in ("ecp", "transformer") else min(latent, t)
        assert model(random_tokens(3, t)).shape == (3, expected, TINY["vocab_size"])
    if arch == "ecp":
        assert model(random_tokens(1, 3 * N + 5)).shape[1] == 3 * N + 5
    else:
        with pytest.raises(ValueError, match=rf"input length {N + 1} is outside 1..{N}"):
            model(random_tokens(1, N + 1))
    with pytest.raises(ValueError, match="input length 0"):
        model(torch.zeros(1, 0, dtype=torch.long))


def test_bad_tokens():
    model = sharp_model("ecp")
    with pytest.raises(ValueError, match=r"token ids must lie in 0\.\.49"):
        model(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(1, 4))


def test_classification_head(arch):
    model = sharp_model(arch, num_classes=10)
    logits = model(random_tokens(4, N))
    assert logits.shape == (4, 10)
    hidden = model.hidden_states(random_tokens(4, N))
    torch.testing.assert_close(model(random_tokens(4, N)), model.head(hidden.mean(dim=1)))


def test_tie_embeddings_shares_storage():
    model = build_model(sharp_model("ecp", tie_embeddings=True).cfg)
    assert model.head.weight is model.embed.weight
    untied = build_model(sharp_model("ecp").cfg)
    assert model.num_params() == untied.num_params() - TINY["vocab_size"] * TINY["d_model"]


def test_tied_kv_has_one_projection():
    model = build_model(sharp_model("double", tied_kv=True).cfg)
    assert all(block.attn.v_proj is None for block in model.blocks)


def test_rope_first_only_in_layer_zero():
    model = build_model(sharp_model("ecp", rope="first", n_layers=3).cfg)
    assert [block.attn.rope is not None for block in model.blocks] == [True, False, False]


def test_param_groups_decay_only_matrices():
    model = build_model(sharp_model("ecp").cfg)
    decay, no_decay = model.param_groups(0.1)
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
