"""Checkpoints: a folder per checkpoint, written atomically.

``model.safetensors`` (weights; tied tensors stored once), ``config.yaml`` (the RunConfig),
``tokenizer.json``, ``trainer.pt`` (optimizer state, RNG states, step, tokens seen, best
validation loss, data cursor) and ``meta.json``. The folder is built beside its destination and
renamed into place (``fsutil.atomic_directory``), so a kill at any moment leaves the previous
checkpoint intact and loadable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ecp_lm import __version__
from ecp_lm.data.tokenizers import Tokenizer, load_saved
from ecp_lm.fsutil import atomic_directory
from ecp_lm.models import LanguageModel, build_model
from ecp_lm.runconfig import RunConfig

FORMAT = "ecp-lm-checkpoint/1"
WEIGHTS, CONFIG, TRAINER, META = "model.safetensors", "config.yaml", "trainer.pt", "meta.json"


@dataclass
class Checkpoint:
    directory: Path
    config: RunConfig
    meta: dict[str, Any]

    def load_model(self, device: torch.device | str = "cpu") -> LanguageModel:
        """The model with its weights, in eval mode."""
        model = build_model(self.config.model)
        load_weights(model, self.directory / WEIGHTS)
        return model.to(device).eval()

    def tokenizer(self) -> Tokenizer:
        if not (self.directory / "tokenizer.json").is_file():
            raise ValueError(f"checkpoint {self.directory} has no tokenizer.json")
        return load_saved(self.directory)

    def trainer_state(self) -> dict[str, Any]:
        path = self.directory / TRAINER
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated or corrupt: torch raises many kinds
            raise ValueError(f"{path} is unreadable ({type(err).__name__}); the checkpoint "
                             f"is truncated or corrupt") from err


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (its ``best``, else ``latest``, checkpoint)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    for name in ("best", "latest"):
        if (path / name / META).is_file():
            return path / name
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    raise ValueError(f"{path} is not an ecp-lm checkpoint or run folder (no {META})")


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Open and check a checkpoint (or a run folder's best/latest one)."""
    directory = resolve(path)
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{directory / META} is unreadable: {err}") from err
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory} has checkpoint format {meta.get('format')!r}; this "
                         f"ecp-lm {__version__} reads {FORMAT!r}")
    for name in (WEIGHTS, CONFIG):
        if not (directory / name).is_file():
            raise ValueError(f"checkpoint {directory} is incomplete: {name} is missing")
    config = RunConfig.load(str(directory / CONFIG))
    return Checkpoint(directory, config, meta)


def save_checkpoint(out: Path, model_state: dict[str, torch.Tensor], config: RunConfig,
                    tokenizer: Tokenizer | None, trainer_state: dict[str, Any] | None,
                    meta: dict[str, Any]) -> None:
    """Write a complete checkpoint folder at ``out``, atomically."""
    with atomic_directory(out) as tmp:
        save_file(_dedupe(model_state), tmp / WEIGHTS)
        config.to_yaml(tmp / CONFIG)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER)
        meta = {"format": FORMAT, "ecp_lm_version": __version__, **meta}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")


def _dedupe(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each storage once (tied embeddings share one)."""
    seen, out = set(), {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.shape)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().cpu().contiguous()
    return out


def load_weights(model: torch.nn.Module, path: Path) -> None:
    try:
        state = load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is unreadable ({err}); the checkpoint is truncated or "
                         f"corrupt") from err
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - set(
        dict(model.named_parameters()))
    if unexpected or set(missing) - tied:
        raise ValueError(f"{path} does not fit the configured model: missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
