"""The distributed set-up of a training run: this process's place among ``torchrun``'s ranks
(``Dist``), the process group and context-parallel mesh it joins, the DDP or FSDP wrapping of the
model, and each rank's random seed and RNG states.

A run is one process, or one of ``torchrun``'s: DDP with gloo on CPU or nccl on CUDA, or FSDP
``fully_shard``; with ``train.context_parallel`` K > 1 the ranks form groups of K that share each
window. Every rank has its own dropout masks; its RNG states are saved in every checkpoint and
restored on resume.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ecp_lm.model.archs import architecture
from ecp_lm.model.context_parallel import ContextGroup
from ecp_lm.run.config import RunConfig, TrainConfig
from ecp_lm.runtime import resolve_device


@dataclass
class Dist:
    """This process's place in a (possibly single-process) data-parallel run; with context
    parallelism, in a 2-D mesh of world_size / K data-parallel groups of K ranks that share one
    window (ranks r·K .. r·K + K - 1 form group r)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    context: ContextGroup | None = None
    """This rank's context-parallel group (None: every rank has its own windows)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def context_size(self) -> int:
        return 1 if self.context is None else self.context.size

    @property
    def data_rank(self) -> int:
        """Which data shard this rank trains on (shared by its context group)."""
        return self.rank // self.context_size

    @property
    def data_size(self) -> int:
        """Data-parallel groups: how many different batches one step takes."""
        return self.world_size // self.context_size

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def check_context_parallel(cfg: RunConfig) -> None:
    """What context parallelism cannot run, found before any process group is joined."""
    tc = cfg.train
    unsupported = [name for name in ("fsdp", "compile") if getattr(tc, name)]
    if unsupported:
        raise ValueError(f"train.context_parallel={tc.context_parallel} runs in eager mode with "
                         f"replicated weights; not with train.{' or train.'.join(unsupported)}")
    architecture(cfg.model.arch)(cfg.model).check_context(cfg.model.seq_len, tc.context_parallel)


def init_distributed(device: str, context_parallel: int = 1) -> Dist:
    """Join torchrun's process group when WORLD_SIZE > 1; pick this process's device. With
    ``context_parallel`` K > 1, lay the ranks out as a (world / K) x K mesh of data-parallel
    groups of K ranks that share each window."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % context_parallel:
        raise ValueError(f"train.context_parallel={context_parallel} does not divide the world "
                         f"size {world} (the ranks torchrun starts)")
    resolved = resolve_device(device, "train.device")
    if world > 1:
        if resolved.type == "cuda":
            # Each rank takes its GPU from LOCAL_RANK before the process group starts, so that
            # NCCL binds this rank's communicators to its own device (not all to cuda:0).
            if resolved.index is None:
                resolved = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
            torch.cuda.set_device(resolved)
        if not torch.distributed.is_initialized():
            if resolved.type == "cuda":
                torch.distributed.init_process_group("nccl", device_id=resolved)
            else:
                torch.distributed.init_process_group("gloo")
    context = None
    if context_parallel > 1:
        mesh = init_device_mesh(resolved.type, (world // context_parallel, context_parallel),
                                mesh_dim_names=("data", "context"))
        context = ContextGroup.of(mesh.get_group("context"))
    return Dist(int(os.environ.get("RANK", "0")), world, resolved, context)


def wrap_model(model: nn.Module, cfg: TrainConfig, dist: Dist) -> nn.Module:
    """DDP or FSDP across ranks; compiled across ranks with ``compile`` (on one process the
    whole loss is compiled instead: ``loop._Loop.loss_sum``).

    With context parallelism the model is not wrapped: its gradients are averaged over every
    rank after the backward pass (``loop._Loop.step``), not by DDP during it. The backward pass
    itself communicates: each layer's halo exchange returns gradients to the previous rank of
    the context group (send/recv on that group's communicator), in the order autograd runs the
    layers, which is the same on every rank (every rank runs the same graph). DDP would launch
    its bucket all-reduces (on the world's communicator) from autograd hooks whenever a bucket
    fills, in between those sends and receives; NCCL needs every rank to issue operations on
    different communicators in one order, and where a bucket boundary falls relative to a halo
    is an implementation detail of DDP's bucketing, not something the ranks agree on. After the
    backward, every halo exchange of the step has been issued on every rank, and the gradient
    all-reduces follow in parameter order: one order everywhere, by construction (tested with
    gloo: every rank issues the same sequence of operations, and no all-reduce comes between a
    step's first and last halo exchange)."""
    if dist.context is not None:
        return model
    if cfg.fsdp and dist.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif dist.world_size > 1:
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return torch.compile(model) if cfg.compile and dist.world_size > 1 else model


def rank_seed(seed: int, rank: int) -> int:
    """Rank 0 keeps the run's seed; every other rank draws its dropout masks from its own."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def _rng_state(dist: Dist) -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state(dist.device) if dist.device.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def rng_states(dist: Dist) -> list[dict[str, Any]]:
    """Every rank's RNG states in rank order, as a checkpoint saves them (gathered from the
    other ranks: a collective when there are several)."""
    if dist.world_size == 1:
        return [_rng_state(dist)]
    states: list[Any] = [None] * dist.world_size
    torch.distributed.all_gather_object(states, _rng_state(dist))
    return states


def restore_rng(trainer: dict[str, Any], dist: Dist, seed: int) -> None:
    """This rank's RNG states from the checkpoint (saved for every rank); a run resumed on
    another number of ranks reseeds each rank from (seed, rank, step) instead."""
    states = trainer.get("rng")
    if states is None and dist.world_size == 1:  # a checkpoint of ecp-lm 0.1.0
        states = [{"cpu": trainer["rng_cpu"], "cuda": None}]
    if states is None or len(states) != dist.world_size:
        torch.manual_seed(rank_seed(seed * 1_000_003 + trainer["step"], dist.rank))
        return
    torch.set_rng_state(states[dist.rank]["cpu"])
    if dist.device.type == "cuda" and states[dist.rank]["cuda"] is not None:
        torch.cuda.set_rng_state(states[dist.rank]["cuda"], dist.device)
