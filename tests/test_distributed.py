"""Data parallelism on PyTorch's engine: two gloo processes train one tiny model."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from ecp_lm.train import train
from helpers import tiny_run_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, tmp_path, fsdp: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = tiny_run_config(tmp_path, "ecp", [f"train.fsdp={str(fsdp).lower()}",
                                           "train.device=cpu"], steps=3)
    result = train(cfg, tmp_path / "run", progress=False)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in result.model.state_dict().items()}
    torch.save(state, tmp_path / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_end_with_identical_weights(tmp_path, fsdp):
    tiny_run_config(tmp_path)  # writes the corpus once, before the workers start
    mp.spawn(worker, args=(2, free_port(), tmp_path, fsdp), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # Only rank 0 wrote; what it wrote is what both hold.
    from ecp_lm.checkpoint import read_checkpoint

    saved = read_checkpoint(tmp_path / "run" / "latest").load_model().state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, a[name]), name
    assert read_checkpoint(tmp_path / "run" / "latest").meta["step"] == 3


def test_ranks_see_different_data(tmp_path):
    """Each rank trains on its own shard: the two ranks' first batches differ."""
    from ecp_lm.data.batches import TrainWindows

    tokens = torch.arange(2000).numpy()
    first = [TrainWindows(tokens, 32, 2, seed=0, rank=r, world_size=2).batch(0)
             for r in (0, 1)]
    assert not torch.equal(first[0], first[1])
