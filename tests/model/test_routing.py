"""The Routing Transformer (``routing``): a layer equals routing attention written out here from
the paper (shared query/key projection, nearest-centroid routing, the last w keys of the
query's cluster; local heads on a window), the centroids move by the paper's moving average in
training and stay in evaluation, the chunked kernel equals the token-by-token reference forward
and backward, and decoding from the bounded rings equals the full forward."""

from __future__ import annotations

import math

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.model.archs.routing import CENTROID_DECAY
from ecp_lm.model.rows import Rows
from helpers import assert_cached_generation_is_uncached, assert_kernel_is_reference, random_tokens


def config(**overrides) -> ModelConfig:
    fields = dict(arch="routing", vocab_size=50, d_model=16, n_heads=2, n_layers=2,
                  seq_len=16, num_segments=4, num_clusters=3, window=4, rope="none")
    return ModelConfig(**{**fields, **overrides})


def paper_layer(mixer, u: torch.Tensor, w: int) -> torch.Tensor:
    """Roy et al. §4, causal: head 0 local (the last w positions), head 1 routed: k_t = W_k u_t
    is both query and key, routed to argmax_c (k_t/|k_t|)·μ_c; q attends to the last w
    positions p <= q routed to its cluster. float64, position by position."""
    k_dim = mixer.head_dim
    wq, wk, wv, wo = (p.weight for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj,
                                         mixer.out_proj))
    local_q = u @ wq.T  # (T, K)
    keys, values = u @ wk.T, u @ wv.T  # (T, 2K)
    routed = keys[:, k_dim:]
    cluster = [int(torch.argmax(mixer.centroids[0] @ (k / k.norm()))) for k in routed]
    outs = []
    for q in range(u.size(0)):
        local = list(range(max(0, q - w + 1), q + 1))
        mine = [p for p in range(q + 1) if cluster[p] == cluster[q]][-w:]
        heads = []
        for h, (query, seen) in enumerate([(local_q[q], local), (routed[q], mine)]):
            part = slice(h * k_dim, (h + 1) * k_dim)
            scores = torch.stack([query @ keys[p, part] for p in seen]) / math.sqrt(k_dim)
            weights = torch.softmax(scores, 0)
            heads.append(sum(a * values[p, part] for a, p in zip(weights, seen, strict=True)))
        outs.append(wo @ torch.cat(heads))
    return torch.stack(outs)


@pytest.mark.parametrize("kernel", ["chunked", "reference"])
def test_a_layer_is_routing_attention(kernel):
    model = build_model(config(n_layers=1, attn_impl=kernel)).double().eval()
    u = torch.randn(29, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mixer = model.blocks[0].attn
    got = mixer(u[None], Rows.span(0, 29), 29)[0]
    torch.testing.assert_close(got, paper_layer(mixer, u, 4), atol=1e-12, rtol=0)
    clusters = mixer.route(u[None] @ mixer.k_proj.weight[8:].T[None, None])  # (1, 1, T)
    assert len(set(clusters.flatten().tolist())) > 1  # more than one cluster is exercised


def test_the_centroids_move_in_training_only():
    model = build_model(config(n_layers=1)).double()
    mixer = model.blocks[0].attn
    tokens = random_tokens(2, 17, vocab=50)
    before = mixer.centroids.clone()
    with torch.no_grad():
        model.eval()
        model(tokens)
    model.at_step(1)
    assert torch.equal(mixer.centroids, before)  # evaluation records nothing
    model.train()
    model.loss(tokens)
    assert torch.equal(mixer.centroids, before)  # applied before the next step
    u = model.blocks[0].attn_norm(model.embed(tokens[:, :-1]))
    keys = (u @ mixer.k_proj.weight[8:].T).reshape(-1, 8)
    unit = keys / keys.norm(dim=-1, keepdim=True)
    nearest = (unit @ before[0].T).argmax(-1)
    model.at_step(1)
    for c in range(3):
        chosen = unit[nearest == c]
        want = before[0, c]
        if len(chosen):
            want = CENTROID_DECAY * want + (1 - CENTROID_DECAY) * chosen.mean(0)
            want = want / want.norm()
        torch.testing.assert_close(mixer.centroids[0, c], want, atol=1e-12, rtol=0)
    assert "blocks.0.attn.pending_count" in model.state_dict()  # a resume keeps the record


CASES = {"two heads": dict(), "with rope": dict(rope="all"),
         "one routed head": dict(n_heads=1, d_model=8), "wide": dict(num_clusters=2, window=7)}


@pytest.mark.parametrize("sizes", CASES.values(), ids=CASES.keys())
def test_the_kernel_is_the_reference_and_decoding_is_one_forward(sizes):
    tokens = random_tokens(2, 53, vocab=50)
    fast = assert_kernel_is_reference(config(attn_impl="chunked", **sizes),
                                      config(attn_impl="reference", **sizes), tokens)
    fast.eval()
    prompt = tokens[:, :5]
    assert_cached_generation_is_uncached(fast, prompt, 60)


@pytest.mark.parametrize("pattern", ["routing,ecp", "transformer,routing"])
def test_a_hybrid_layer_decodes_as_its_forward(pattern):
    model = build_model(config(arch="hybrid", layer_pattern=pattern, seq_len=32,
                               rope="all")).double().eval()
    prompt = random_tokens(1, 6, vocab=50)
    steps = 20 if "transformer" in pattern else 60
    assert_cached_generation_is_uncached(model, prompt, steps)


def test_sizes_are_checked():
    cfg = ModelConfig(arch="routing", seq_len=2048).resolved()
    assert (cfg.num_clusters, cfg.window) == (46, 45)  # ⌈√N⌉ centroids, ⌈N/k⌉ keys
    with pytest.raises(ValueError, match="num_clusters=4 is set, but arch='ecp'"):
        ModelConfig(arch="ecp", num_clusters=4)
    with pytest.raises(ValueError, match="a width per layer is longformer's"):
        config(window="3,4")
    with pytest.raises(ValueError, match="start_pos=4: arch='routing' keeps its keys"):
        build_model(config()).arch.check_start_pos(4)
