"""The chunked loss (model/loss.py) is the plain ``F.cross_entropy(head(hidden).float(), ...)``:
the same loss and gradients for every parameter (the tied head included), in float32 and under
bf16 autocast, with rows that are not a multiple of the chunk; no tensor of all the rows by V
is ever made, in training or in scoring; and the compiled training loss stays one graph."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ecp_lm.evaluate.positions import per_position_loss
from ecp_lm.evaluate.scoring import score_stream, score_stream_cached
from ecp_lm.model import loss as chunked
from ecp_lm.model.loss import chunk_rows, linear_cross_entropy
from helpers import TINY, random_tokens, sharp_model

N, V = TINY["seq_len"], TINY["vocab_size"]
ROWS = 7  # rows per chunk here: 64 and 32 predicted rows are not multiples of it
ARCHS = ("ecp", "transformer", "perceiver_ar")


@pytest.fixture
def chunks_of_seven(monkeypatch):
    monkeypatch.setattr(chunked, "LOSS_CHUNK_BYTES", ROWS * 4 * V)
    assert chunk_rows(V) == ROWS


def plain_loss(model, tokens, reduction="mean"):
    """The reference: every row's logits at once, widened to float32."""
    hidden = model.hidden_states(tokens[:, :-1])  # (B, P, d)
    targets = tokens[:, tokens.size(1) - hidden.size(1):]  # (B, P)
    logits = model.head(hidden).float()  # (B, P, V)
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction=reduction)


def loss_and_grads(model, loss_fn, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_chunk_rows_keep_a_chunk_within_the_budget():
    assert chunk_rows(50257) == 667  # 128 MiB of float32 logits at the paper's vocabulary
    assert chunk_rows(50257) * 50257 * 4 <= chunked.LOSS_CHUNK_BYTES
    assert chunk_rows(10**9) == 1  # at least one row


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_is_the_plain_loss(reduction):
    """With a bias, ignored targets (-100) and 40 rows in chunks of 7."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=gen, requires_grad=True)
    weight = torch.randn(V, 16, generator=gen, requires_grad=True)
    bias = torch.randn(V, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (40,), generator=gen)
    targets[[3, 17, 39]] = -100
    expected = F.cross_entropy(F.linear(hidden, weight, bias).float(), targets,
                               reduction=reduction)
    if reduction == "none":
        with torch.no_grad():
            got = linear_cross_entropy(hidden, weight, bias, targets, reduction, rows=ROWS)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        return
    got = linear_cross_entropy(hidden, weight, bias, targets, reduction, rows=ROWS)
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)
    want = torch.autograd.grad(expected, (hidden, weight, bias))
    for g, w in zip(torch.autograd.grad(got, (hidden, weight, bias)), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert g.abs().max() > 0


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_model_loss_and_every_gradient_equal_the_plain_loss(arch, tie, chunks_of_seven):
    model = sharp_model(arch, tie_embeddings=tie).train()
    assert (model.head.weight is model.embed.weight) == tie
    tokens = random_tokens(2, N + 1)
    ref_loss, ref_grads = loss_and_grads(model, lambda: plain_loss(model, tokens))
    loss, grads = loss_and_grads(model, lambda: model.loss(tokens))
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=0, msg=name)
    # the training task's form: the summed loss through forward
    summed, _ = loss_and_grads(model, lambda: model(tokens[:, :-1], targets=tokens[:, 1:],
                                                    reduction="sum"))
    torch.testing.assert_close(summed, plain_loss(model, tokens, "sum").detach(), atol=0,
                               rtol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_autocast_matches_the_plain_loss(arch, tie, chunks_of_seven):
    """Both in bf16 matrix products with float32 log-softmax: the loss within bf16's rounding,
    every gradient within 2% of its largest entry."""
    model = sharp_model(arch, tie_embeddings=tie).train()
    tokens = random_tokens(2, N + 1)
    ref_loss, ref_grads = loss_and_grads(model, lambda: plain_loss(model, tokens), True)
    loss, grads = loss_and_grads(model, lambda: model.loss(tokens), True)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=1e-3)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], atol=2e-2 * scale, rtol=0, msg=name)


class _RowsOfLogits(TorchDispatchMode):
    """Records the most rows of any tensor of V columns an operation makes, other than views
    of the model's parameters (the head's weight, transposed)."""

    def __init__(self, model):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.size(-1) == V
                    and t.untyped_storage().data_ptr() not in self.params):
                self.rows = max(self.rows, t.numel() // V)
        return out


@pytest.mark.parametrize("arch", ARCHS)
def test_no_tensor_holds_every_row_of_logits(arch, chunks_of_seven):
    """Forward and backward of the training loss, and the scorers of ``ecp eval``, make tensors
    of at most one chunk's rows by V (the plain loss makes (B·P, V) ones). The attention is the
    dense reference: torch's causal-bias tensor subclass cannot be made under a dispatch mode."""
    model = sharp_model(arch, attn_impl="reference").train()
    tokens = random_tokens(2, N + 1)
    with _RowsOfLogits(model) as seen:
        model.loss(tokens).backward()
    assert seen.rows == ROWS
    with _RowsOfLogits(model) as plain:
        plain_loss(model, tokens).backward()
    assert plain.rows == 2 * model.arch.num_predicted(N)  # what the check would catch
    stream = random_tokens(1, 4 * N + 1)[0].numpy()
    with _RowsOfLogits(model) as seen:
        score_stream(model, stream, N, N // 2, batch_size=4)
        per_position_loss(model, stream, N, batch_size=4)
        if model.arch.max_len is None:
            score_stream_cached(model, stream, chunk_len=N)
    assert seen.rows == ROWS


@pytest.mark.parametrize("arch", ARCHS)
def test_scorers_equal_the_plain_cross_entropy(arch, chunks_of_seven):
    """``score_stream`` and ``per_position_loss`` give the nll of the logits' cross-entropy."""
    model = sharp_model(arch)
    stream = random_tokens(1, 3 * N + 1)[0].numpy()
    windows = torch.from_numpy(np.stack([stream[i * N:(i + 1) * N + 1] for i in range(3)]))
    with torch.no_grad():
        expected = plain_loss(model, windows, "none").reshape(3, -1)  # (windows, P)
    result = per_position_loss(model, stream, N, batch_size=2)
    p = expected.size(1)
    np.testing.assert_allclose(result.nll_sum[N - p:], expected.double().sum(0).numpy(),
                               rtol=1e-6)
    nll, count = score_stream(model, stream[:N + 1], N, N // 2)  # one window: its last stride
    assert count == N // 2
    np.testing.assert_allclose(nll, expected[0, p - N // 2:].double().sum().item(), rtol=1e-6)


def test_reduction_none_has_no_gradient_and_unknown_reductions_are_refused():
    model = sharp_model("ecp").train()
    tokens = random_tokens(2, N + 1)
    with pytest.raises(ValueError, match="reduction='none' is for scoring"):
        model(tokens[:, :-1], targets=tokens[:, 1:], reduction="none")
    with pytest.raises(ValueError, match="reduction='max'"):
        model(tokens[:, :-1], targets=tokens[:, 1:], reduction="max")
    with pytest.raises(ValueError, match="targets must have the shape of tokens"):
        model(tokens[:, :-1], targets=tokens)


def test_classifier_keeps_its_head_and_refuses_targets():
    model = sharp_model("perceiver_ar", num_classes=10)
    tokens = random_tokens(2, N)
    assert model(tokens).shape == (2, 10)
    with pytest.raises(ValueError, match="classifier"):
        model(tokens, targets=tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_training_loss_is_one_graph_and_equals_eager(arch, chunks_of_seven):
    """What train.compile compiles (``LanguageModelling.loss_sum``: forward with targets), over
    several chunks: one graph without breaks, and through AOTAutograd the eager loss and
    gradients."""
    model = sharp_model(arch).train()
    tokens = random_tokens(2, N + 1)

    def loss_sum(t):
        return model(t[:, :-1], targets=t[:, 1:], reduction="sum")

    torch._dynamo.reset()
    try:
        found = torch._dynamo.explain(loss_sum)(tokens)
        assert (found.graph_count, found.graph_break_count) == (1, 0), found.break_reasons
        compiled = torch.compile(loss_sum, backend="aot_eager", fullgraph=True)
        loss, grads = loss_and_grads(model, lambda: compiled(tokens))
    finally:
        torch._dynamo.reset()
    ref_loss, ref_grads = loss_and_grads(model, lambda: loss_sum(tokens))
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=0, msg=name)


def test_hf_labels_with_ignored_positions_take_the_chunked_path(chunks_of_seven):
    """The perceiver family predicts fewer positions than it reads, so the wrapper's labels loss
    runs the model with targets: the plain loss with -100 positions left out."""
    from ecp_lm.hf import EcpLmForCausalLM

    model = sharp_model("perceiver_ar")
    wrapper = EcpLmForCausalLM.from_language_model(model)
    tokens = random_tokens(2, N)
    labels = tokens.clone()
    labels[0, -3:] = -100
    with torch.no_grad():
        loss = wrapper(tokens, labels=labels).loss
        logits = model(tokens[:, :-1])  # (B, P, V)
        expected = F.cross_entropy(logits.reshape(-1, V),
                                   labels[:, N - logits.size(1):].reshape(-1))
    torch.testing.assert_close(loss, expected, atol=0, rtol=1e-6)


def test_bench_loss_memory_reports_every_loss(tmp_path, capsys):
    """``ecp bench --loss-memory`` at a tiny size: the table and its JSON (the memory figures
    themselves are measured at the paper's vocabulary, README: Performance)."""
    from ecp_lm.cli import main as cli_main

    out = tmp_path / "loss.json"
    assert cli_main(["bench", "--loss-memory", "--loss-vocab", "256", "--loss-batch", "2",
                     "--loss-seq-len", "64", "--d-model", "16", "--n-layers", "1",
                     "--n-heads", "2", "--segment-len", "16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["vocab_size"] == 256 and report["meta"]["body"]["d_model"] == 16
    cases = report["loss_memory"]["cases"]
    assert [c["loss"] for c in cases] == ["hidden", "plain", "chunked"]
    assert report["loss_memory"]["rows"] == 128
    for c in cases:
        assert c["step_s"] > 0 and c["peak_mib"] >= 0 and c["share_mib"] >= 0
    assert "chunked" in capsys.readouterr().out
    assert cli_main(["bench", "--loss-batch", "2"]) == 2  # an option of --loss-memory only
    assert cli_main(["bench", "--loss-memory", "--decode"]) == 2
