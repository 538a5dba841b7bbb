"""The experiment's budgets: the task, the depths, the model size, the training and the probes'
sizes, and the model each (architecture, depth) trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ecp_lm.config import ModelConfig
from ecp_lm.experiments.mqar.task import MQARSpec
from ecp_lm.experiments.mqar.train import TrainSpec

MQAR_ARCHS = ("ecp", "sliding_window", "block_local", "transformer")
"""Compared at matched sizes (the attention patterns add no parameters)."""


@dataclass(frozen=True)
class Budget:
    spec: MQARSpec
    num_segments: int
    """S: m = N/S for ECP's segments, block_local's blocks (2m) and sliding_window's window
    (ECP's cost); also the segments the probes and offsets are counted in."""
    depths: tuple[int, ...]
    model: dict[str, Any]
    train: TrainSpec
    probe_offsets: int
    """The segment probe reads offsets 0 .. this."""
    probe_train: int
    probe_test: int
    reach_depth: int = 4
    """The depth whose ECP receptive field (reach_depth·m) the distances are chosen to fit."""
    threads: int | None = None
    """torch CPU threads when ``--threads`` is not given (None: the machine's default)."""
    archs: tuple[str, ...] = MQAR_ARCHS

    @property
    def segment_len(self) -> int:
        return self.spec.seq_len // self.num_segments


# Both budgets: N = 64, S = 8, m = 8, d in [17, 32] = (2m, 4m]. A query is 2 to 4 segments
# after its key: one ECP layer (its own and the previous segment) never sees the pair, L = 4
# layers always reach it, L = 2 only at offset 2; block_local's blocks of 2m = 16 never hold a
# pair and its query together.
BUDGETS: dict[str, Budget] = {
    "tiny": Budget(
        spec=MQARSpec(seq_len=64, num_pairs=4, num_queries=4, d_min=17, d_max=32, num_keys=8,
                      num_values=8, num_filler=16),
        num_segments=8, depths=(2, 4),
        model=dict(d_model=16, n_heads=2),
        train=TrainSpec(steps=40, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=20,
                        eval_size=64),
        probe_offsets=4, probe_train=96, probe_test=64,
        threads=1),  # models this small run slower on two threads than on one
    "small": Budget(
        spec=MQARSpec(),
        num_segments=8, depths=(2, 4, 6),
        model=dict(d_model=64, n_heads=4),
        train=TrainSpec(),
        probe_offsets=6, probe_train=2048, probe_test=512),
}


def model_config(budget: Budget, arch: str, depth: int) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=budget.spec.vocab_size, n_layers=depth,
                       seq_len=budget.spec.seq_len, num_segments=budget.num_segments,
                       **budget.model)
