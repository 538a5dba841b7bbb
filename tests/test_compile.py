"""torch.compile captures every architecture's forward as one graph with no graph breaks: no host
syncs and nothing untraceable on the hot path. ``explain`` only traces, so this stays fast."""

import pytest
import torch
import torch._dynamo

from ecp_lm.config import ARCHS
from helpers import TINY, random_tokens, sharp_model

N, M = TINY["seq_len"], TINY["seq_len"] // TINY["num_segments"]


def explain(model, *args, **kwargs):
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(model)(*args, **kwargs)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("length", [N - 5, N])  # N - 5: a short window, a partial segment
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_is_one_graph(arch, length):
    model = sharp_model(arch)  # attn_impl="auto": on CPU the native ECP kernel, a torch op
    found = explain(model, random_tokens(2, length))
    assert found.graph_break_count == 0, [b.reason for b in found.break_reasons]
    assert found.graph_count == 1


def test_ecp_forward_at_an_offset_is_one_graph():
    found = explain(sharp_model("ecp"), random_tokens(2, N + 3), start_pos=10**7 + M)
    assert (found.graph_count, found.graph_break_count) == (1, 0)
