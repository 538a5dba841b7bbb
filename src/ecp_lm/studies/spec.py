"""What a study declares before anything runs: its models and how their sizes are matched, its
stages (task, data, budget points, seeds, rate grid, selection and report data) and its
comparisons, each primary or secondary.

A study is one ``Study`` in one module of ``studies/specs``. The runner (``runner``) trains what
it declares, the report (``report``) analyses it with ``stats`` and writes ``verdicts.json``.

Models. A model is a name and its ``ModelConfig`` fields beside the stage's shared size.
``"m"`` stands for the segment length N/S; ``mixer_width`` or ``ff_hidden`` ``"matched"`` asks
for the width whose parameter count is the nearest to the reference model's
(``model.match_parameters``).

Seeds. Every model of a stage runs the same seeds (``Stage.seeds``): nothing adds seeds where a
margin is small. Seed s of every model trains on the same batches in the same order.

Comparisons. ``Contrast`` names a weighted sum of cells, a cell being a model at a point (and,
on recall, a depth): ECP against a rival, or an interaction such as ECP's gain from L = 2 to
L = 4 against a rival's. The primary family (at most ``stats.MAX_PRIMARY``) is declared in the
spec; every other contrast the report shows is secondary.

Cost claims. ``CostClaim`` states a claim about attention's cost as a fraction of full
attention; the report checks it analytically (``ecp complexity``) at the named sizes, in both
cost conventions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ecp_lm.config import ModelConfig


@dataclass(frozen=True)
class Grid:
    """Learning rates each model tries first (ascending), extended past an edge by ``factor``
    up to ``extensions`` times on each side (``rates``)."""

    rates: tuple[float, ...]
    factor: float
    extensions: int = 2

    def __post_init__(self):
        if list(self.rates) != sorted(self.rates) or len(set(self.rates)) != len(self.rates):
            raise ValueError(f"a grid's rates must ascend, got {self.rates}")
        if self.factor <= 1:
            raise ValueError(f"a grid's factor must exceed 1, got {self.factor}")


@dataclass(frozen=True)
class Language:
    """Byte-level language modelling on ``source``: rates chosen on the validation split,
    every reported number from the test split."""

    source: str
    size: dict[str, Any]
    train: dict[str, Any]
    points: tuple[int, ...]
    """Budget points (optimiser steps), each an annealed model of one stable run."""
    select_steps: int
    decay_fraction: float = 0.2
    select_tokens: int | None = None
    """Validation bytes each rate trial is scored on (None: the whole split)."""
    report_tokens: int | None = None
    """Test bytes each point is scored on (None: the whole split)."""
    context_models: tuple[str, ...] = ()
    """Models whose context gain (windows of N against 2m on the same targets) is measured."""
    equal_time: tuple[str, ...] = ()
    """Models also trained for the time the reference's last point took: steps = last ×
    (the reference's step time ÷ theirs), from step times measured side by side."""
    metric: str = "bits_per_byte"
    """``bits_per_byte``, or ``accuracy`` for a pixel source (its size sets ``num_classes``)."""
    lower_is_better: bool = True
    path: str | None = None
    """Where the source's files are, for a source that needs them (``data.path``)."""


@dataclass(frozen=True)
class Recall:
    """Multi-query associative recall (``training.mqar``): rates chosen on one set of held-out
    sequences, every reported accuracy from another."""

    task: dict[str, Any]
    """``training.mqar.MQARSpec`` fields."""
    num_segments: int
    model: dict[str, Any]
    """Width fields shared by every model (d_model, n_heads)."""
    train: dict[str, Any]
    """``training.mqar.TrainSpec`` fields beside steps, lr and seed."""
    depths: tuple[int, ...]
    steps: int
    select_steps: int
    select_depth: int
    select_sequences: int = 3_000_017
    """The seed of the selection sequences (every rate trial is scored on them)."""
    report_sequences: int = 4_000_037
    """The seed of the report sequences (every reported accuracy, nothing that chooses)."""
    chance_margin: float = 0.02
    """A run is at chance where its accuracy is within this of 1 / the number of values."""
    threads: int | None = 1
    metric: str = "accuracy"
    lower_is_better: bool = False
    depths_of: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Models run at fewer depths than ``depths`` (each a subset holding ``select_depth``): the
    rest run at every depth."""


@dataclass(frozen=True)
class Stage:
    name: str
    task: Language | Recall
    models: dict[str, dict[str, Any]]
    seeds: tuple[int, ...]
    grid: Grid
    select_seeds: tuple[int, ...] = (0, 1)
    """Seeds each rate trial runs (the mean score chooses): at least two, or selection data
    of at least 1M bytes."""
    reference: str = "ecp"
    """The model the others' sizes are matched to and that the secondary contrasts compare."""

    def __post_init__(self):
        if len(self.seeds) < 2:
            raise ValueError(f"stage {self.name}: {len(self.seeds)} seed(s); the pooled "
                             f"analysis needs at least two per model")
        if self.reference not in self.models:
            raise ValueError(f"stage {self.name}: reference {self.reference!r} is not one of "
                             f"its models {list(self.models)}")
        if isinstance(self.task, Recall):
            for m, depths in self.task.depths_of.items():
                if m not in self.models or not (
                        self.task.select_depth in depths and set(depths) <= set(self.task.depths)):
                    raise ValueError(f"stage {self.name}: depths_of {m!r}: {depths} must be a "
                                     f"model's depths among {self.task.depths} holding the "
                                     f"selection depth {self.task.select_depth}")
        big = isinstance(self.task, Language) and self.task.select_tokens is None
        if len(self.select_seeds) < 2 and not big:
            raise ValueError(f"stage {self.name}: rates are chosen on at least two seeds "
                             f"or on the whole validation split")

    def cells(self) -> list[str]:
        """The stage's cells: a model, or on recall a model at a depth (``ecp@L4``)."""
        if isinstance(self.task, Recall):
            return [cell(m, d) for m in self.models for d in self.depths(m)]
        return list(self.models)

    def depths(self, model: str) -> tuple[int, ...]:
        """The depths a recall model runs at (``Recall.depths_of``, else every depth)."""
        return self.task.depths_of.get(model, self.task.depths)

    def points(self) -> list[str]:
        """Budget points; on language with ``equal_time`` models, ``time<last>`` too: the
        reference at its last point against them at its time; on recall with ``distances``,
        ``d<distance>`` too: the accuracy on the queries at that distance."""
        if isinstance(self.task, Recall):
            distances = self.task.task.get("distances", ())
            return [str(self.task.steps), *(f"d{d}" for d in distances)]
        time = [f"time{max(self.task.points)}"] if self.task.equal_time else []
        return [str(p) for p in self.task.points] + time


def cell(model: str, depth: int | None = None) -> str:
    return model if depth is None else f"{model}@L{depth}"


@dataclass(frozen=True)
class Contrast:
    """Σ weight × mean(cell) at one (stage, point); ``point`` ``"final"`` is the stage's last.
    ``name`` is what tables show; for a plain pair it is ``"a − b"``."""

    stage: str
    point: str
    weights: tuple[tuple[str, float], ...]
    name: str = ""

    @classmethod
    def pair(cls, stage: str, a: str, b: str, point: str = "final") -> Contrast:
        return cls(stage, point, ((a, 1.0), (b, -1.0)), f"{a} − {b}")

    @classmethod
    def interaction(cls, stage: str, a: str, b: str, low: str, high: str,
                    point: str = "final") -> Contrast:
        """(a at high − a at low) − (b at high − b at low): how much more ``a`` gains."""
        w = ((cell_at(a, high), 1.0), (cell_at(a, low), -1.0), (cell_at(b, high), -1.0),
             (cell_at(b, low), 1.0))
        return cls(stage, point, w, f"({a}: {high} − {low}) − ({b}: {high} − {low})")

    @property
    def a(self) -> str:
        return self.weights[0][0]

    @property
    def b(self) -> str:
        return self.weights[1][0] if len(self.weights) == 2 else "interaction"


def cell_at(model: str, depth: str) -> str:
    return f"{model}@{depth}"


@dataclass(frozen=True)
class CostClaim:
    """"``arch`` needs ``fraction`` of full attention's compute" at a preset's sizes
    (``config.PRESETS``): checked against the score entries the mask allows and against the
    whole tiles a block kernel scores, each over L·N² (``bench.complexity``)."""
    claim: str
    arch: str
    fraction: float
    preset: str = "paper"


@dataclass(frozen=True)
class Study:
    name: str
    question: str
    budgets: dict[str, tuple[Stage, ...]]
    primary: tuple[Contrast, ...]
    """Declared before the runs; Holm runs over these alone (those whose models learned)."""
    cost_claims: tuple[CostClaim, ...] = ()

    def stages(self, budget: str) -> dict[str, Stage]:
        if budget not in self.budgets:
            raise ValueError(f"study {self.name} has no budget {budget!r}; budgets: "
                             f"{', '.join(self.budgets)}")
        return {s.name: s for s in self.budgets[budget]}


def model_config(stage: Stage, name: str, depth: int | None = None) -> ModelConfig:
    """Model ``name`` of ``stage`` at its size (and, on recall, ``depth`` layers)."""
    from ecp_lm.model.matching import match_parameters

    if name not in stage.models:
        raise ValueError(f"unknown model {name!r}; stage {stage.name}'s models: "
                         f"{', '.join(stage.models)}")
    task = stage.task
    if isinstance(task, Recall):
        from ecp_lm.training.mqar import MQARSpec

        spec = MQARSpec(**task.task)
        size = dict(n_layers=depth, seq_len=spec.seq_len, num_segments=task.num_segments,
                    **task.model)
        vocab = spec.vocab_size
    else:
        size, vocab = task.size, 256
    m = size["seq_len"] // size["num_segments"]
    declared = stage.models[name]
    fields = {k: (m if v == "m" else v) for k, v in declared.items() if v != "matched"}
    cfg = ModelConfig(vocab_size=vocab, **size, **fields)
    for name in (k for k, v in declared.items() if v == "matched"):
        cfg = match_parameters(cfg, model_config(stage, stage.reference, depth), name)
    return cfg
