"""Data parallelism on PyTorch's engine, checked against one process: two gloo ranks training
on half a batch each end with the weights one process reaches on the whole batch (DDP and FSDP,
with gradient accumulation); each rank draws its own dropout masks, and a resumed two-rank run
restores every rank's RNG."""

import os

import pytest
import torch

from ecp_lm.model.archs import recurrent
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train
from helpers import spawn_ranks, tiny_run_config

STEPS, BATCH = 3, 2  # per rank; one process takes 2 * BATCH
RUNS = {  # name: (overrides, stop_at then resume)
    "ddp": (["train.grad_accum=2"], False),
    "fsdp": (["train.fsdp=true", "train.grad_accum=2"], False),
    "dropout": (["model.dropout=0.2"], False),
    "dropout-resumed": (["model.dropout=0.2"], True),
    # recurrent mixers beside attention: their parameters (A_log, D, convolutions, low-rank
    # maps) sharded and reduced like any other, each layer run in four groups recomputed in
    # backward (GROUP_TOKENS)
    "fsdp-recurrent": (["train.fsdp=true", "model.arch=hybrid",
                        "model.layer_pattern=mamba2,rwkv7,gated_deltanet,ecp",
                        "model.n_layers=4", "model.chunk_size=4"], False),
    "ddp-recurrent": (["model.arch=hybrid", "model.layer_pattern=mamba2,rwkv7,gated_deltanet,ecp",
                       "model.n_layers=4", "model.chunk_size=4"], False),
}
GROUP_TOKENS = 8
"""The recurrent layers' groups here: two chunks of 4, four groups to a window of 32."""


def config(tmp_path, overrides, batch_size):
    return tiny_run_config(tmp_path, "ecp", ["train.device=cpu", *overrides], steps=STEPS,
                           batch_size=batch_size, eval_max_tokens=600)


def full_state(model):
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}


def worker(rank: int, world: int, port: int, tmp_path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    recurrent.GROUP_TOKENS = GROUP_TOKENS
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    reductions = []
    real = fsdp_group.foreach_reduce

    def counting(*args, **kwargs):  # one call per FSDP group whose gradients are reduced
        reductions.append(1)
        return real(*args, **kwargs)

    fsdp_group.foreach_reduce = counting
    report = {}
    for name, (overrides, resumed) in RUNS.items():
        cfg = config(tmp_path, overrides, BATCH)
        reductions.clear()
        if resumed:
            train(cfg, tmp_path / name, progress=False, stop_at=1)
        result = train(cfg, tmp_path / name, resume=resumed, progress=False)
        report[name] = {"state": full_state(result.model), "rng": torch.get_rng_state(),
                        "reductions": len(reductions)}
    torch.save(report, tmp_path / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp_path = spawn_ranks(worker, 2, tmp_path_factory.mktemp("ddp"))
    return tmp_path, [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("name", ["ddp", "fsdp", "ddp-recurrent", "fsdp-recurrent"])
def test_two_ranks_equal_one_process_on_the_combined_batch(two_ranks, name, monkeypatch):
    monkeypatch.setattr(recurrent, "GROUP_TOKENS", GROUP_TOKENS)
    tmp_path, ranks = two_ranks
    overrides = [o for o in RUNS[name][0] if not o.startswith("train.fsdp")]
    single = train(config(tmp_path, overrides, 2 * BATCH), tmp_path / f"single-{name}",
                   progress=False)
    for rank in ranks:
        for key, tensor in single.model.state_dict().items():
            torch.testing.assert_close(rank[name]["state"][key], tensor, atol=2e-6, rtol=1e-5,
                                       msg=key)
    saved = read_checkpoint(tmp_path / name / "latest")  # only rank 0 wrote: what both hold
    assert saved.meta["step"] == STEPS
    for key, tensor in saved.load_model().state_dict().items():
        assert torch.equal(tensor, ranks[0][name]["state"][key]), key


def test_fsdp_reduces_gradients_once_per_step(two_ranks):
    """With gradient accumulation, gradients are reduce-scattered after the last micro-batch of
    a step only: once per step for each FSDP group (every block, and the root)."""
    _, ranks = two_ranks
    groups = tiny_run_config(two_ranks[0]).model.n_layers + 1
    assert ranks[0]["fsdp"]["reductions"] == STEPS * groups


def test_each_rank_draws_its_own_dropout_masks(two_ranks):
    _, ranks = two_ranks
    assert not torch.equal(ranks[0]["dropout"]["rng"], ranks[1]["dropout"]["rng"])
    for key, tensor in ranks[0]["dropout"]["state"].items():  # the weights stay in step
        assert torch.equal(tensor, ranks[1]["dropout"]["state"][key]), key


def test_two_rank_resume_restores_every_ranks_rng(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        for key, tensor in rank["dropout"]["state"].items():
            assert torch.equal(tensor, rank["dropout-resumed"]["state"][key]), key
        assert torch.equal(rank["dropout"]["rng"], rank["dropout-resumed"]["rng"])


def test_ranks_see_different_data(tmp_path):
    """Each rank trains on its own shard: the two ranks' first batches differ."""
    from ecp_lm.data.batches import TrainWindows

    tokens = torch.arange(2000).numpy()
    first = [TrainWindows(tokens, 32, 2, seed=0, rank=r, world_size=2).batch(0)
             for r in (0, 1)]
    assert not torch.equal(first[0], first[1])
