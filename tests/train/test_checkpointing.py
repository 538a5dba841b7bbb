"""Activation checkpointing (``train.activation_checkpointing``): every block is recomputed in the
backward pass, only when training with autograd on, and the losses, gradients and dropout masks
are those without it: in the model (ecp, the transformer, the perceiver family), compiled,
through ``ecp train``, and on two gloo ranks with DDP, FSDP and context parallelism."""

import json
import os

import pytest
import torch

from ecp_lm import build_model
from ecp_lm.cli import main
from ecp_lm.model import model as lm
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train
from helpers import TINY, random_tokens, spawn_ranks, tiny_config, tiny_run_config

LAYERS, DROPOUT = 3, 0.2
TOL = dict(atol=1e-6, rtol=0)


def dropout_model(arch: str, checkpointing: bool, **overrides):
    torch.manual_seed(0)
    model = build_model(tiny_config(arch, n_layers=LAYERS, dropout=DROPOUT, **overrides))
    model.activation_checkpointing = checkpointing
    return model.train()


def loss_and_grads(model, loss=None, seed: int = 1):
    """One backward pass at dropout seed ``seed``: the loss, the gradients and the next draw of
    the RNG after the step (checkpointing must leave the RNG where the step without it does)."""
    torch.manual_seed(seed)
    value = (loss or model.loss)(random_tokens(2, 33))
    value.backward()
    return value.detach(), {k: p.grad for k, p in model.named_parameters()}, torch.rand(4)


def block_runs(model, work) -> int:
    """How many times the blocks ran their forward during ``work()``."""
    runs = []
    hooks = [block.register_forward_pre_hook(lambda *_: runs.append(1)) for block in model.blocks]
    work()
    for hook in hooks:
        hook.remove()
    return len(runs)


@pytest.mark.parametrize("arch", ["ecp", "transformer", "perceiver_ar", "compressed_double"])
def test_gradients_equal_without_checkpointing(arch):
    loss, grads, after = loss_and_grads(dropout_model(arch, checkpointing=False))
    model = dropout_model(arch, checkpointing=True)
    recomputed = []
    assert block_runs(model, lambda: recomputed.append(loss_and_grads(model))) == 2 * LAYERS
    loss_ck, grads_ck, after_ck = recomputed[0]
    torch.testing.assert_close(loss_ck, loss, **TOL)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_ck[key], grad, **TOL, msg=key)
    assert torch.equal(after_ck, after)
    # dropout is on: another seed draws other masks, and the gradients differ
    other = loss_and_grads(dropout_model(arch, checkpointing=True), seed=2)[1]
    assert any(not torch.allclose(other[k], g) for k, g in grads.items())


def test_blocks_recomputed_only_when_training_with_grad():
    model = dropout_model("ecp", checkpointing=True)
    tokens = random_tokens(2, 33)
    assert block_runs(model, lambda: model.loss(tokens).backward()) == 2 * LAYERS
    with torch.no_grad():
        assert block_runs(model, lambda: model.loss(tokens)) == LAYERS
    model.eval()
    assert block_runs(model, lambda: model.loss(tokens).backward()) == LAYERS
    model.train()
    model.activation_checkpointing = False
    assert block_runs(model, lambda: model.loss(tokens).backward()) == LAYERS


def test_each_block_keeps_only_its_input():
    """The tensors autograd saves for the backward pass: with checkpointing, each block adds
    only its input (B, T, d) to those of the embedding, the final norm and the head."""
    def saved_bytes(checkpointing: bool, n_layers: int) -> int:
        torch.manual_seed(0)
        model = build_model(tiny_config("transformer", n_layers=n_layers, dropout=DROPOUT))
        model.activation_checkpointing = checkpointing
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss(random_tokens(2, 33))
        return sum(total)

    block_input = 2 * 32 * TINY["d_model"] * 4  # float32
    assert saved_bytes(True, 4) - saved_bytes(True, 1) == 3 * block_input
    assert saved_bytes(False, 4) - saved_bytes(False, 1) > 3 * 10 * block_input


def test_compiled_loss_with_checkpointing_equals_compiled_without():
    """``train.compile`` compiles the loss into one graph (fullgraph) with checkpointing too;
    with the same seed it draws the same dropout masks as without checkpointing."""
    from torch._inductor.compile_fx import compile_fx

    results, graphs = [], []

    def inductor(gm, example_inputs):  # inductor, keeping the graph Dynamo traced
        graphs.append(gm.code)
        return compile_fx(gm, example_inputs)

    for checkpointing in (False, True):
        torch._dynamo.reset()
        model = dropout_model("ecp", checkpointing)
        results.append(loss_and_grads(model, torch.compile(model.loss, backend=inductor,
                                                           fullgraph=True)))
    (loss, grads, after), (loss_ck, grads_ck, after_ck) = results
    # one graph each; the second recomputes each block (a checkpointed region per block)
    assert len(graphs) == 2 and "tag_activation_checkpoint" not in graphs[0]
    assert graphs[1].count("tag_activation_checkpoint(") == LAYERS
    torch.testing.assert_close(loss_ck, loss, **TOL)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_ck[key], grad, **TOL, msg=key)
    assert torch.equal(after_ck, after)


def test_off_by_default_and_never_with_caches():
    model = build_model(tiny_config("ecp", n_layers=LAYERS))
    assert model.activation_checkpointing is False
    model.activation_checkpointing = True
    model.train()
    caches = model.make_caches(1)
    prefill = lambda: model.prefill(random_tokens(1, 12), caches).sum().backward()  # noqa: E731
    assert block_runs(model, prefill) == LAYERS  # each cache filled once, not again in backward
    assert all(cache.next_pos == [12] for cache in caches)


def test_train_help_lists_the_key(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["train", "--help"]) == 0
    assert "train.activation_checkpointing=false" in capsys.readouterr().out


def losses(run) -> list[float]:
    lines = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return [(r["kind"], r["loss"]) for r in lines]


def run_config(tmp_path, checkpointing: bool, overrides=()):
    return tiny_run_config(tmp_path, "ecp", ["train.device=cpu", f"model.dropout={DROPOUT}",
                                             f"train.activation_checkpointing={checkpointing}",
                                             *overrides], steps=4)


def counting_checkpoints(monkeypatch) -> list[int]:
    """Counts the blocks ``hidden_states`` runs under ``torch.utils.checkpoint``."""
    calls = []
    real = lm.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lm, "checkpoint", counting)
    return calls


def test_training_run_equals_one_without_checkpointing(tmp_path, monkeypatch):
    calls = counting_checkpoints(monkeypatch)
    for checkpointing in (False, True):
        calls.clear()
        train(run_config(tmp_path, checkpointing, ["train.grad_accum=2"]),
              tmp_path / f"ck{checkpointing}", progress=False)
        # 4 steps of 2 micro-batches, each block once per micro-batch; never in validation
        assert len(calls) == (4 * 2 * 2 if checkpointing else 0)
    plain, ck = tmp_path / "ckFalse", tmp_path / "ckTrue"
    assert losses(ck) == losses(plain) and len(losses(plain)) >= 4
    weights = read_checkpoint(plain / "latest").load_model().state_dict()
    for key, value in read_checkpoint(ck / "latest").load_model().state_dict().items():
        torch.testing.assert_close(value, weights[key], **TOL, msg=key)


# Two gloo ranks -----------------------------------------------------------------------------

RANKED = {"ddp": [], "fsdp": ["train.fsdp=true"], "context-parallel": ["train.context_parallel=2"]}


def worker(rank: int, world: int, port: int, tmp_path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    calls, real = [], lm.checkpoint
    lm.checkpoint = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    counts = {}
    for name, overrides in RANKED.items():
        for checkpointing in (False, True):
            calls.clear()
            train(run_config(tmp_path, checkpointing, ["train.steps=3", *overrides]),
                  tmp_path / f"{name}-{checkpointing}", progress=False)
            counts[f"{name}-{checkpointing}"] = len(calls)
    (tmp_path / f"counts{rank}.json").write_text(json.dumps(counts))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_ranks(worker, 2, tmp_path_factory.mktemp("checkpointing"))


@pytest.mark.parametrize("name", RANKED)
def test_two_ranks_equal_without_checkpointing(two_ranks, name):
    """DDP and FSDP recompute each block under their hooks; with context parallelism the
    recomputed layers repeat their halo exchange, which pairs up on every rank."""
    plain, ck = two_ranks / f"{name}-False", two_ranks / f"{name}-True"
    for rank in (0, 1):  # 3 steps, each block checkpointed once per step, on every rank
        counts = json.loads((two_ranks / f"counts{rank}.json").read_text())
        assert (counts[f"{name}-False"], counts[f"{name}-True"]) == (0, 3 * 2)
    assert losses(ck) == losses(plain)
    weights = read_checkpoint(plain / "latest").load_model().state_dict()
    for key, value in read_checkpoint(ck / "latest").load_model().state_dict().items():
        torch.testing.assert_close(value, weights[key], **TOL, msg=key)


def test_bench_checkpointing_reports_both_modes(tmp_path, capsys):
    """``ecp bench --checkpointing``: each case without and then with checkpointing, in its own
    process, with the peak memory and step time of both and their ratios."""
    out = tmp_path / "ck.json"
    assert main(["bench", "--checkpointing", "--archs", "transformer", "--seq-lens", "256",
                 "--d-model", "64", "--segment-len", "64", "--repeats", "1", "--warmup", "0",
                 "--json", str(out)]) == 0
    without, with_ = json.loads(out.read_text())["train"]
    assert (without["checkpointing"], with_["checkpointing"]) == (False, True)
    for r in (without, with_):
        assert r["step_s"] > 0 and r["peak_mib"] >= 0 and r["attention_share"] is None
    assert without["time_ratio"] == 1.0 and with_["time_ratio"] == with_["step_s"] / without[
        "step_s"]
    if without["peak_mib"]:  # a resident set that did not grow at this size has no ratio
        assert without["memory_ratio"] == 1.0
        assert with_["memory_ratio"] == with_["peak_mib"] / without["peak_mib"]
    table = capsys.readouterr().out
    assert "checkpointing" in table and "peak ÷ off" in table
    for conflict in (["--train-modes"], ["--decode-only"], ["--loss-memory"]):
        assert main(["bench", "--checkpointing", *conflict]) == 2
