"""Run configuration: model, data and training in one typed config (YAML, dotted overrides).

``RunConfig`` nests ``ModelConfig`` (config.py), ``DataConfig`` and ``TrainConfig``. It is
loaded from a named preset or a YAML file, then command-line overrides such as
``model.d_model=128 train.lr=3e-4`` are applied; each value is parsed as YAML and checked against
the field's type, and an unknown key or a wrong type raises ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ecp_lm.config import PRESETS, ModelConfig, read_yaml_mapping, saved_fields, yaml_problem
from ecp_lm.runtime import parse_device

SCHEDULES = ("cosine", "halving", "wsd")
PATHLESS_SOURCES = ("enwiki-mini", "sympy-code", "digits")  # fetched with pip, or bundled
PRECISIONS = ("auto", "fp32", "bf16")  # fp16 training would need loss scaling
LOGGERS = ("tensorboard", "wandb")  # train.logger: besides these, auto or none
MAX_SEED = 2**32 - 1  # numpy's seeds are >= 0; resuming derives larger torch seeds from it


@dataclass
class DataConfig:
    """Where the tokens come from (see ``ecp data prepare``)."""

    source: str = "enwiki-mini"
    """A text source (wikitext103, pg19, enwik8, text, enwiki-mini, sympy-code) or a pixel dataset
    (scifar10, scifar10-rgb, mnist-5k, digits) for sequence classification."""
    path: str | None = None
    """The source's folder or file, or ``hf:OWNER/NAME[@REVISION]``: a Hugging Face Hub dataset
    in the local hub cache (wikitext103, pg19, scifar10, scifar10-rgb)."""
    tokenizer: str = "bytes"
    """bytes, bpe, the path of a tokenizer.json / .tiktoken file, or ``hf:REPO``: the
    tokenizer.json of a Hub model repository (text sources)."""
    bpe_vocab_size: int = 4096
    """Vocabulary of the BPE trained on the train split (tokenizer=bpe)."""
    cache_dir: str | None = None
    """Token cache folder (default: the user cache)."""

    def __post_init__(self) -> None:
        if self.source in PATHLESS_SOURCES and self.path is not None:
            raise ValueError(f"data.source={self.source} takes no data.path (got "
                             f"{self.path!r}): it is fetched or bundled")
        from ecp_lm.data.tokenizers import check_bpe_vocab_size

        check_bpe_vocab_size(self.bpe_vocab_size, "data.bpe_vocab_size")


@dataclass
class TrainConfig:
    """Optimiser, schedule, batching, validation and checkpointing."""

    steps: int = 1000
    """Optimiser steps."""
    batch_size: int = 16
    """Sequences per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimiser step (the loss is weighted by predicted tokens)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """cosine and wsd: final learning rate as a fraction of ``lr``."""
    warmup_steps: int = 100
    """Linear warm-up steps."""
    schedule: str = "cosine"
    """``cosine`` (warm-up then cosine decay), ``halving`` (warm-up, then constant, halved
    every ``halve_every`` steps: the research's schedule) or ``wsd`` (warm-up, stable at
    ``lr``, then a linear decay to ``lr * min_lr_ratio`` over the last ``decay_steps``: a run
    stopped anywhere before its decay is the same run as a longer one, so an annealed model
    at any budget branches off one stable run)."""
    halve_every: int = 0
    """halving: steps between halvings (0: never)."""
    decay_steps: int = 0
    """wsd: steps of the final decay (0: a fifth of ``steps``)."""
    weight_decay: float = 0.1
    """AdamW decay, applied to matrix weights only."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    eval_every: int = 200
    """Validate every this many steps (and at the end)."""
    eval_max_tokens: int | None = None
    """Validate on the first this many tokens of the validation split (None: all of it)."""
    eval_batch_size: int = 16
    """Windows per evaluation batch."""
    eval_train_tokens: int = 0
    """Also score the first this many tokens of the train split at each validation, in eval
    mode and by the same protocol (``train_loss``, ``train_bits_per_byte`` in the valid record):
    the gap between train and validation as training goes (0: off)."""
    checkpoint_every: int = 200
    """Write the latest checkpoint every this many steps (and at the end)."""
    keep_every: int = 0
    """Also keep the checkpoint of every this many steps as DIR/step-NNNNNN/ (weights, config,
    tokenizer), which later saves leave alone (0: off)."""
    log_every: int = 10
    """Append training metrics every this many steps (a line each when output is redirected)."""
    logger: str = "auto"
    """Where the metrics also go: tensorboard (DIR/tensorboard/), wandb (Weights & Biases), both
    (tensorboard,wandb), none, or auto (tensorboard when it is installed)."""
    wandb_project: str | None = None
    """logger=wandb: the W&B project (null: $WANDB_PROJECT, else ecp-lm)."""
    wandb_name: str | None = None
    """logger=wandb: the W&B run's name (null: the run folder's name)."""
    seed: int = 0
    """Seeds initialisation, data order and dropout."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    precision: str = "auto"
    """auto (bf16 autocast on CUDA, fp32 on CPU), fp32, or bf16."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    fsdp: bool = False
    """Shard parameters with FSDP (fully_shard) instead of replicating them with DDP."""
    activation_checkpointing: bool = False
    """Keep only each block's input from the forward pass and recompute the block in the
    backward pass (torch.utils.checkpoint): the activations of one block at a time instead of
    every block's, for about one more forward pass per step; the same losses and gradients,
    dropout masks included."""
    context_parallel: int = 1
    """Ranks that share one window, each computing K contiguous shards of it and exchanging a
    halo of keys and values with its neighbours (model/context_parallel.py): under torchrun,
    K divides the world size, and the world size / K groups are data-parallel. ecp,
    sliding_window, block_local and s2 only; seq_len a multiple of K times their period."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "checkpoint_every",
                     "log_every", "eval_batch_size", "context_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.eval_max_tokens is not None and self.eval_max_tokens < 1:
            raise ValueError(f"train.eval_max_tokens={self.eval_max_tokens} must be >= 1 or "
                             f"null (all of the validation split)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"train.schedule={self.schedule!r} is not one of "
                             f"{', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} is not one of "
                             f"{', '.join(PRECISIONS)}")
        try:
            parse_device(self.device)
        except ValueError as err:
            raise ValueError(f"train.device: {err}") from None
        for name in ("warmup_steps", "halve_every", "keep_every", "decay_steps",
                     "eval_train_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"train.seed={self.seed} must be from 0 to {MAX_SEED} (2**32 - 1)")
        if self.schedule == "wsd" and self.decay_steps > self.steps:
            raise ValueError(f"train.decay_steps={self.decay_steps} exceeds train.steps="
                             f"{self.steps}")
        names = self.logger.split(",")
        if names not in (["auto"], ["none"]) and (len(set(names)) < len(names)
                                                  or not set(names) <= set(LOGGERS)):
            raise ValueError(f"train.logger={self.logger!r} is not auto, none, or one or more "
                             f"of {', '.join(LOGGERS)} joined by commas")
        self._check_optimiser()

    def _check_optimiser(self) -> None:
        """Finite values in the ranges AdamW and clipping are defined on."""
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"train.{name}={getattr(self, name)} must be a finite number")
        if self.lr <= 0:
            raise ValueError(f"train.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio} is outside [0, 1]")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay={self.weight_decay} must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} is outside [0, 1)")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip={self.grad_clip} must be >= 0 (0: no clipping)")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
        """Build from nested fields with ``section.key=value`` overrides applied first."""
        for name, section in (data or {}).items():
            if section is not None and not isinstance(section, dict):
                raise ValueError(f"config section {name} must be a mapping of keys, got "
                                 f"{section!r}")
        data = {k: dict(v or {}) for k, v in data.items()} if data else {}
        for item in overrides:
            key, value = parse_override(item)
            section, name = key
            data.setdefault(section, {})[name] = value
        unknown = sorted(set(data) - set(SECTION_TYPES))
        if unknown:
            raise ValueError(f"unknown config section(s) {', '.join(unknown)}; "
                             f"sections: {', '.join(SECTION_TYPES)}")
        return cls(**{name: _build_section(name, section, data.get(name, {}))
                      for name, section in SECTION_TYPES.items()})

    @classmethod
    def load(cls, preset_or_path: str, overrides: list[str] = (),
             saved: bool = False) -> RunConfig:
        """A preset name (see ``RUN_PRESETS``) or a YAML file, with overrides. ``saved``: the
        file is one a run wrote (a run folder's or a checkpoint's ``config.yaml``, maybe of an
        earlier release), whose model section is read with the names sizes had then
        (``config.saved_fields``); a file a user wrote is read as written now."""
        if preset_or_path in RUN_PRESETS:
            return cls.from_dict(RUN_PRESETS[preset_or_path], overrides)
        data = read_yaml(preset_or_path, None if saved else "--config")
        if saved and isinstance(data.get("model"), dict):
            data = {**data, "model": saved_fields(data["model"])}
        if overrides:
            return cls.from_dict(data, overrides)
        try:
            return cls.from_dict(data)
        except ValueError as err:  # the file's own content (e.g. a checkpoint's config.yaml)
            raise ValueError(f"{preset_or_path}: {err}") from None


SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


def read_yaml(preset_or_path: str, setting: str | None = "--config") -> dict[str, Any]:
    """The sections of a run config file, checked to be mappings; every error names the file,
    after ``setting`` (the option that gave it; None for a file a run wrote)."""
    path = Path(preset_or_path)
    if not path.is_file():
        raise ValueError(f"--config {preset_or_path!r} is neither a preset "
                         f"({', '.join(RUN_PRESETS)}) nor a YAML file")
    return read_yaml_mapping(path, setting, "a mapping with model/data/train sections")


def is_override(item: str) -> bool:
    """Whether ``item`` has the form of a ``section.key=value`` override."""
    key, sep, _ = item.partition("=")
    parts = key.strip().split(".")
    return bool(sep) and len(parts) == 2 and all(parts)


def parse_override(item: str) -> tuple[tuple[str, str], Any]:
    if not is_override(item):
        raise ValueError(f"override {item!r} is not of the form section.key=value "
                         f"(e.g. model.d_model=128)")
    key, _, text = item.partition("=")
    section, name = key.strip().split(".")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as err:
        raise ValueError(f"override {item!r}: its value is not YAML "
                         f"({yaml_problem(err)})") from None
    return (section, name), value


def _build_section(name: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"unknown config key {name}.{key}")
        values[key] = _check_type(f"{name}.{key}", value, hints[key])
    try:
        return cls(**values)
    except TypeError as err:  # pragma: no cover - guarded by the checks above
        raise ValueError(f"{name}: {err}") from err
    except ValueError as err:
        text = str(err)
        if text.startswith(f"{name}."):  # DataConfig and TrainConfig name their keys
            raise
        # ModelConfig names its fields bare: "block_len=8 ..." is the key model.block_len here
        field_name = text.partition("=")[0]
        raise ValueError(f"{name}.{text}" if field_name in known else f"{name}: {text}") \
            from None


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """``value`` if it fits ``hint`` (int, float, bool, str, or X | None), else ValueError."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is float and isinstance(value, str):  # YAML reads 3e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        if option is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(o, "__name__", str(o)).replace("NoneType", "null")
                        for o in options)
    raise ValueError(f"config key {key} expects {names}, got {value!r}")


# Presets: model sizes from config.PRESETS plus data and schedule.
RUN_PRESETS: dict[str, dict[str, Any]] = {
    # Seconds: for tests and smoke runs.
    "tiny": {
        "model": {**PRESETS["tiny"], "arch": "ecp"},
        "data": {"source": "enwiki-mini", "tokenizer": "bytes"},
        "train": {"steps": 20, "batch_size": 4, "lr": 1e-3, "warmup_steps": 2,
                  "eval_every": 10, "checkpoint_every": 10, "log_every": 5,
                  "eval_max_tokens": 4096},
    },
    # The demo (`ecp demo`): a byte-level model that trains for a few minutes on a 2-core CPU.
    "demo": {
        "model": {**PRESETS["small"], "arch": "ecp"},
        "data": {"source": "enwiki-mini", "tokenizer": "bytes"},
        "train": {"steps": 1500, "batch_size": 16, "lr": 2e-3, "warmup_steps": 50,
                  "eval_every": 250, "checkpoint_every": 250, "log_every": 10,
                  "eval_max_tokens": 65536},
    },
    # The research's scale on Wikitext-103 with a 50k BPE vocabulary (needs a GPU).
    "paper": {
        "model": {**PRESETS["paper"], "arch": "ecp", "vocab_size": 50257},
        "data": {"source": "wikitext103", "tokenizer": "bpe", "bpe_vocab_size": 50257},
        "train": {"steps": 100000, "batch_size": 8, "grad_accum": 4, "lr": 3e-4,
                  "warmup_steps": 2000, "eval_every": 2000, "checkpoint_every": 1000,
                  "eval_max_tokens": 1 << 20},
    },
}
