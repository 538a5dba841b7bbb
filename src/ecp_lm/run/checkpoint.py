"""Checkpoints: a folder per checkpoint, written atomically.

``model.safetensors`` (weights; tied tensors stored once), ``config.yaml`` (the RunConfig),
``tokenizer.json``, ``trainer.pt`` (optimizer state, RNG states, step, tokens seen, best
validation loss, data cursor) and ``meta.json`` (step, validation, the architecture and a
digest of the parameter shapes: a ``config.yaml`` edited to describe another model is refused
on load instead of evaluating the weights as something they are not). The folder is built
beside its destination and put in place atomically (``fsutil.atomic_directory``), so a kill at
any moment leaves the previous checkpoint intact and loadable, and so does a write that fails (a
full disk: ``fsutil.WriteError``, one line naming the folder and the system's reason).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ecp_lm import __version__
from ecp_lm.data.tokenizers import Tokenizer, load_saved
from ecp_lm.fsutil import atomic_directory, current_version, file_mode, writing
from ecp_lm.model import LanguageModel, build_model
from ecp_lm.outputs import CHECKPOINT
from ecp_lm.run.config import RunConfig

FORMAT = CHECKPOINT.value
WEIGHTS, CONFIG, TRAINER, META = "model.safetensors", "config.yaml", "trainer.pt", "meta.json"


@dataclass
class Checkpoint:
    directory: Path
    """The real folder of the version read (every file comes from it)."""
    config: RunConfig
    meta: dict[str, Any]
    path: Path | None = None
    """The folder as a user names it (``run/best``); messages and reports show this one."""

    def __post_init__(self) -> None:
        if self.path is None:
            self.path = self.directory

    def load_model(self, device: torch.device | str = "cpu") -> LanguageModel:
        """The model with its weights, in eval mode; its config.yaml must describe the model
        the weights were saved from (architecture and parameter shapes, when recorded)."""
        model = build_model(self.config.model)
        self.check_model(model)
        load_weights(model, self.directory / WEIGHTS)
        return model.to(device).eval()

    def check_model(self, model: LanguageModel) -> None:
        arch, shapes = self.meta.get("arch"), self.meta.get("param_shapes_sha256")
        if arch is not None and arch != self.config.model.arch:
            raise ValueError(f"checkpoint {self.path}: its {CONFIG} says "
                             f"arch={self.config.model.arch!r}, but the weights were saved "
                             f"from arch={arch!r}")
        if shapes is not None and shapes != param_shapes_digest(model.state_dict()):
            raise ValueError(f"checkpoint {self.path}: its {CONFIG} describes other "
                             f"parameter shapes than the weights were saved with (was "
                             f"{CONFIG} edited?)")

    def tokenizer(self) -> Tokenizer:
        if not (self.directory / "tokenizer.json").is_file():
            raise ValueError(f"checkpoint {self.path} has no tokenizer.json")
        return load_saved(self.directory)

    def trainer_state(self) -> dict[str, Any]:
        path = self.directory / TRAINER
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated or corrupt: torch raises many kinds
            raise ValueError(f"{path} is unreadable ({type(err).__name__}); the checkpoint "
                             f"is truncated or corrupt") from err


def locate(path: str | Path) -> tuple[Path, Path]:
    """(the folder as named, the real folder of its current version) of a checkpoint folder, or
    of a run folder's ``best``, else ``latest``, checkpoint."""
    path = Path(path)
    for candidate in (path, path / "best", path / "latest"):
        directory = current_version(candidate)
        if (directory / META).is_file():
            return candidate, directory
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{path} is a link to {os.readlink(path)}, which is not there: a "
                         f"checkpoint copied without what its link names (copy with cp -rL)")
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    raise ValueError(f"{path} is not an ecp-lm checkpoint or run folder (no {META})")


def resolve(path: str | Path) -> Path:
    """The real folder of the current version of a checkpoint (see ``locate``): every file of
    one checkpoint is read from it."""
    return locate(path)[1]


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Open and check a checkpoint (or a run folder's best/latest one)."""
    shown, directory = locate(path)
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{shown / META} is unreadable: {err}") from err
    if meta.get("format") != FORMAT:
        raise ValueError(f"{shown} has checkpoint format {meta.get('format')!r}; this "
                         f"ecp-lm {__version__} reads {FORMAT!r}")
    for name in (WEIGHTS, CONFIG):
        if not (directory / name).is_file():
            raise ValueError(f"checkpoint {shown} is incomplete: {name} is missing")
    config = RunConfig.load(str(directory / CONFIG), saved=True)
    return Checkpoint(directory, config, meta, shown)


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint's ``meta.json`` (a folder an earlier release wrote in
    place, which a new save may replace)."""
    return CHECKPOINT.holds(path)


def save_checkpoint(out: Path, model_state: dict[str, torch.Tensor], config: RunConfig,
                    tokenizer: Tokenizer | None, trainer_state: dict[str, Any] | None,
                    meta: dict[str, Any]) -> None:
    """Write a complete checkpoint folder at ``out``, atomically."""
    weights = _dedupe(model_state)
    meta = {"arch": config.model.arch, "param_shapes_sha256": param_shapes_digest(model_state),
            **meta}
    with writing(out), atomic_directory(out, is_checkpoint_folder) as tmp:
        save_file(weights, tmp / WEIGHTS)
        os.chmod(tmp / WEIGHTS, file_mode())  # safetensors writes 0600 whatever the umask
        config.to_yaml(tmp / CONFIG)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if trainer_state is not None:
            # through a Python file: a failed write is then the OSError behind torch's error
            with open(tmp / TRAINER, "wb") as f:
                torch.save(trainer_state, f)
        meta = {"format": FORMAT, "ecp_lm_version": __version__, **meta}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")


def copy_checkpoint(src: Path, out: Path, **meta: Any) -> None:
    """Write the checkpoint ``src`` again as ``out`` (atomically), its weights, config and
    tokenizer as they are (hard links where the file system allows) and its ``meta.json``
    updated with ``meta``; the trainer state is left out (``best/`` holds weights only)."""
    ckpt = read_checkpoint(src)
    with writing(out), atomic_directory(out, is_checkpoint_folder) as tmp:
        for name in (WEIGHTS, CONFIG, "tokenizer.json"):
            if (ckpt.directory / name).is_file():
                try:
                    os.link(ckpt.directory / name, tmp / name)
                except OSError:
                    shutil.copyfile(ckpt.directory / name, tmp / name)
        (tmp / META).write_text(json.dumps({**ckpt.meta, **meta}, indent=2) + "\n")


def param_shapes_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of the sorted (name, shape) pairs of a state dict (tied names included)."""
    pairs = sorted((name, list(t.shape)) for name, t in state.items())
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


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
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and expected[name].shape != tensor.shape:
            raise ValueError(f"{path} does not fit the configured model: {name} has shape "
                             f"{tuple(tensor.shape)}, the config gives "
                             f"{tuple(expected[name].shape)}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - set(
        dict(model.named_parameters()))
    if unexpected or set(missing) - tied:
        raise ValueError(f"{path} does not fit the configured model: missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
