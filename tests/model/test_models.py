"""Model-level properties: causality, ECP's receptive field, gradients, lengths, heads."""

import dataclasses

import pytest
import torch

from ecp_lm import build_model
from helpers import (
    NO_ATTENTION,
    PERCEIVER_FAMILY,
    TINY,
    UNBOUNDED,
    random_tokens,
    sharp_model,
    tiny_config,
)

N, L, M = TINY["seq_len"], TINY["n_layers"], TINY["seq_len"] // TINY["num_segments"]


def peak(x: torch.Tensor) -> float:
    return x.max().item() if x.numel() else 0.0


def predicted_positions(model, t: int) -> torch.Tensor:
    n = model.arch.num_predicted(t)
    return torch.arange(t - n, t)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_causality_by_perturbation(arch, impl):
    model = sharp_model(arch, attn_impl=impl)
    t_len = 2 * N + 3 if arch in UNBOUNDED else N
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
    if arch in NO_ATTENTION and "tied_kv" in overrides:  # no attention, no keys to tie
        with pytest.raises(ValueError, match="tied_kv=True .* has no attention"):
            tiny_config(arch, **overrides)
        return
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
        expected = min(latent, t) if arch in PERCEIVER_FAMILY else t
        assert model(random_tokens(3, t)).shape == (3, expected, TINY["vocab_size"])
    if arch in UNBOUNDED:
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


def identity_head_twin(classifier):
    """A language model with ``classifier``'s body and an identity head (vocab_size = d_model):
    its logits are the final hidden states of the positions SPEC §5 says are predicted."""
    twin = build_model(dataclasses.replace(classifier.cfg, num_classes=None)).eval()
    body = {k: v for k, v in classifier.state_dict().items() if not k.startswith("head.")}
    missing, unexpected = twin.load_state_dict(body, strict=False)
    assert missing == ["head.weight"] and not unexpected
    with torch.no_grad():
        twin.head.weight.copy_(torch.eye(classifier.cfg.d_model))
    return twin


def test_classification_head_is_over_mean_of_predicted_rows(arch):
    """SPEC §5: (B, num_classes) = head(mean of the final hidden states of the predicted
    positions): all T positions for ecp and transformer, the last min(l, T) otherwise."""
    d = TINY["d_model"]
    model = sharp_model(arch, num_classes=10, vocab_size=d)
    twin = identity_head_twin(model)
    weight, bias = model.head.weight, model.head.bias
    for t in (5, N, 2 * N + 3) if arch in UNBOUNDED else (5, N):
        tokens = random_tokens(3, t, vocab=d, seed=t)
        with torch.no_grad():
            rows = twin(tokens)  # (B, P, d): the hidden states of the predicted positions
            expected_p = min(model.cfg.latent_len, t) if arch in PERCEIVER_FAMILY else t
            assert rows.shape == (3, expected_p, d), (arch, t)
            expected = rows.mean(dim=1) @ weight.T + bias  # (B, num_classes)
            torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5,
                                       msg=f"{arch} T={t}")


def test_classification_of_one_sequence_ignores_the_others(arch):
    """Each sequence's class logits depend on its own tokens (every one of them reaches a
    predicted position: ecp and transformer predict every position, the perceiver family's
    latents see the whole window) and on no other sequence of the batch."""
    model = sharp_model(arch, num_classes=10)
    tokens = random_tokens(2, N)
    with torch.no_grad():
        base = model(tokens)
        for row, t in ((0, 0), (0, N // 2), (0, N - 1), (1, 0), (1, N - 1)):
            changed = tokens.clone()
            changed[row, t] = (changed[row, t] + 1) % TINY["vocab_size"]
            diff = (model(changed) - base).abs().amax(dim=-1)  # (B,)
            assert diff[1 - row] <= 1e-6, (arch, row, t)
            assert diff[row] > 1e-4, (arch, row, t)


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
