"""The order of communication in a context-parallel training step, on four gloo ranks (two
data-parallel groups of two context-parallel ranks): every rank issues the same sequence of
operations, and the gradient all-reduces come after every halo exchange of the step, never in
between, so that two communicators (the context group's and the world's) are used in one order
everywhere, as NCCL needs."""

import os
from itertools import pairwise

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ecp_lm import build_model
from ecp_lm.training import loop as train_module
from helpers import free_port, tiny_run_config

WORLD, STEPS = 4, 2


def worker(rank: int, port: int, tmp_path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    log: list[tuple] = []
    recording = [False]
    batch_isend_irecv, all_reduce = dist.batch_isend_irecv, dist.all_reduce

    def halo(ops):
        if recording[0]:
            log.append(("halo", len(dist.get_process_group_ranks(ops[0].group))))
        return batch_isend_irecv(ops)

    def reduce(tensor, *args, group=None, **kwargs):
        if recording[0]:
            log.append(("all_reduce", dist.get_world_size(group)))
        return all_reduce(tensor, *args, group=group, **kwargs)

    step = train_module._Loop.step

    def recorded_step(self, index):
        recording[0] = True
        log.append(("step",))
        try:
            return step(self, index)
        finally:
            recording[0] = False

    dist.batch_isend_irecv, dist.all_reduce = halo, reduce
    train_module._Loop.step = recorded_step
    cfg = tiny_run_config(tmp_path, "ecp", ["train.device=cpu", "train.context_parallel=2"],
                          steps=STEPS, batch_size=2, grad_accum=2, eval_every=100,
                          checkpoint_every=100, eval_max_tokens=600)
    train_module.train(cfg, tmp_path / "run", progress=False)
    torch.save(log, tmp_path / f"log{rank}.pt")
    dist.destroy_process_group()


def test_halo_exchanges_and_gradient_reductions_in_one_order(tmp_path):
    tiny_run_config(tmp_path)  # the corpus, written once before the workers start
    mp.spawn(worker, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    logs = [torch.load(tmp_path / f"log{r}.pt") for r in range(WORLD)]
    assert all(log == logs[0] for log in logs)  # one sequence on every rank
    steps = [i for i, op in enumerate(logs[0]) if op == ("step",)] + [len(logs[0])]
    assert len(steps) == STEPS + 1
    n_params = len(list(build_model(tiny_run_config(tmp_path).model).parameters()))
    for a, b in pairwise(steps):
        ops = logs[0][a + 1:b]
        halos = [i for i, op in enumerate(ops) if op[0] == "halo"]
        reduces = [i for i, op in enumerate(ops) if op[0] == "all_reduce"]
        # two micro-batches x two layers, forward and backward: 8 exchanges in the context group
        assert len(halos) == 8 and all(ops[i] == ("halo", 2) for i in halos)
        # gradients (one all-reduce per parameter, over the world) and the loss, after them all
        assert len(reduces) == n_params + 1 and min(reduces) > max(halos)
        assert all(ops[i] == ("all_reduce", WORLD) for i in reduces)
