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


@pytest.mark.parametrize("arch", ["ecp", "sliding_window", "transformer", "perceiver_ar", "mamba2",
                                  "gated_deltanet", "rwkv7"])
def test_training_loss_is_one_graph(arch):
    """What train.compile compiles (the task's loss: forward and cross-entropy) is one graph."""
    from ecp_lm.model.loss import next_token_loss

    model = sharp_model(arch).train()
    tokens = random_tokens(2, N + 1)
    found = explain(lambda t: next_token_loss(model(t[:, :-1]), t, reduction="sum"), tokens)
    assert (found.graph_count, found.graph_break_count) == (1, 0)


def test_compiled_training_equals_eager(tmp_path):
    """train.compile (inductor, fullgraph: a graph break would fail the run) logs the losses of
    the eager run, step for step."""
    from ecp_lm.plot import read_metrics
    from ecp_lm.training.loop import train
    from helpers import tiny_run_config

    losses = []
    for compiled in (False, True):
        torch._dynamo.reset()
        out = tmp_path / f"compiled{compiled}"
        train(tiny_run_config(tmp_path, steps=3, eval_every=100, compile=compiled), out,
              progress=False)
        losses.append([r["loss"] for r in read_metrics(out)["train"]])
    torch._dynamo.reset()
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["ecp", "transformer"])
def test_bf16_autocast_training_step_is_close_to_fp32(arch):
    """CPU bf16 autocast (the native kernel widening to float32 for ECP): the loss within bf16's
    rounding of fp32's, and every gradient pointing the same way."""
    model = sharp_model(arch).train()
    tokens = random_tokens(2, N + 1)
    results = []
    for dtype in (None, torch.bfloat16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            loss = model.loss(tokens)
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (loss32, grads32), (loss16, grads16) = results
    assert abs(loss16 - loss32) < 2e-2 * abs(loss32)
    for g32, g16 in zip(grads32, grads16, strict=True):
        cosine = torch.nn.functional.cosine_similarity(g32.flatten(), g16.flatten(), dim=0)
        assert cosine > 0.98, cosine


@pytest.mark.parametrize("arch", ["ecp", "double"])  # a band block mask, a predicate one
def test_fullgraph_compiled_forward_runs_flex_on_the_cpu(arch):
    """A model compiled whole (fullgraph) lowers FlexAttention inside its graph on the CPU: the
    capability check is not traced, and the block mask's offsets are constants there."""
    model = sharp_model(arch, attn_impl="flex")
    ref = sharp_model(arch, attn_impl="reference")
    ref.load_state_dict(model.state_dict())
    tokens = random_tokens(2, N - 3)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out = torch.compile(model, fullgraph=True)(tokens)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, ref(tokens), atol=1e-5, rtol=1e-5)


def test_a_compiled_step_that_cannot_train_is_refused_before_tracing(tmp_path):
    """train.compile with a kernel that has no CPU backward: the kernel's own one-line reason,
    before torch.compile traces anything (its error would name a graph break instead)."""
    from torch._dynamo.utils import counters

    from ecp_lm.training.loop import train
    from helpers import tiny_run_config

    cfg = tiny_run_config(tmp_path, steps=2, compile=True, overrides=["model.attn_impl=flex"])
    torch._dynamo.reset()
    frames = counters["frames"]["total"]
    with pytest.raises(ValueError, match="attn_impl='flex' cannot run this call: FlexAttention "
                                         "has no backward on cpu"):
        train(cfg, tmp_path / "run", progress=False)
    assert counters["frames"]["total"] == frames
