"""``ecp export``: an ecp-lm checkpoint as a Hugging Face model folder.

The folder holds ``config.json`` (``EcpLmConfig``: the ``ModelConfig`` fields),
``model.safetensors`` (``save_pretrained``; tied embeddings stored once),
``generation_config.json``, the tokenizer (``tokenizer.json``, ``tokenizer_config.json``)
giving exactly ecp-lm's ids, and ``modeling_ecp_lm.py``, which names the installed package's
classes for transformers' remote code (``auto_map`` in both configs). So the folder loads
offline in two ways:

- after ``import ecp_lm.hf`` (which registers the model type), by
  ``AutoModelForCausalLM.from_pretrained(folder)`` and ``pipeline("text-generation",
  model=folder)``;
- with ``trust_remote_code=True`` and no import, as lm-evaluation-harness loads it
  (``lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True``); the
  tokenizer is then an ``EcpLmTokenizer``, whose BOS id is the line end's (tokenizer.py).

It is written atomically (``fsutil.atomic_directory``): a kill leaves the previous export or
none, never half of one, and so does a write that fails (a full disk: ``fsutil.WriteError``, one
line). Only an earlier export is replaced (``outputs.check_replace``): never a checkpoint, a run
folder, a token cache or a user's folder, and nothing inside a run folder or a checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ecp_lm.data.tokenizers import Tokenizer
from ecp_lm.fsutil import atomic_directory, current_version, file_mode, writing
from ecp_lm.hf.model import EcpLmForCausalLM
from ecp_lm.hf.tokenizer import EcpLmTokenizer
from ecp_lm.outputs import EXPORT, check_replace
from ecp_lm.run.checkpoint import read_checkpoint

REMOTE_MODULE = "modeling_ecp_lm"
REMOTE_CODE = '''"""ecp-lm's classes for transformers' trust_remote_code (the auto_map of
config.json and tokenizer_config.json). The code is the installed ecp_lm package's:
pip install 'ecp-lm[hf]'."""

from ecp_lm.hf import EcpLmConfig, EcpLmForCausalLM, EcpLmTokenizer

__all__ = ["EcpLmConfig", "EcpLmForCausalLM", "EcpLmTokenizer"]
'''
MODEL_AUTO_MAP = {"AutoConfig": f"{REMOTE_MODULE}.EcpLmConfig",
                  "AutoModelForCausalLM": f"{REMOTE_MODULE}.EcpLmForCausalLM"}


def to_transformers_tokenizer(tokenizer: Tokenizer) -> EcpLmTokenizer:
    """ecp-lm's tokenizer as a transformers fast tokenizer with the same ids (no special tokens
    are added)."""
    return EcpLmTokenizer.from_ecp_lm(tokenizer)


def save_tokenizer(tokenizer: EcpLmTokenizer, folder: Path) -> None:
    """``save_pretrained``, with a tokenizer_config.json that loads as transformers' own fast
    tokenizer by default and as ``EcpLmTokenizer`` under trust_remote_code."""
    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings.update(tokenizer_class="TokenizersBackend",
                    auto_map={"AutoTokenizer": [None, f"{REMOTE_MODULE}.EcpLmTokenizer"]})
    path.write_text(json.dumps(settings, indent=2) + "\n")


def is_export_folder(path: Path) -> bool:
    """Whether ``path`` holds an ecp-lm model's ``config.json`` (an export an earlier release
    wrote in place, which a new export may replace)."""
    return EXPORT.holds(path)


def export_checkpoint(ckpt: str | Path, out: str | Path) -> list[str]:
    """Write the Hugging Face folder ``out`` for the checkpoint (or run folder) ``ckpt``;
    returns the names of the files written. ValueError for a classification model, and for an
    ``out`` that is not empty and not an earlier export (``outputs.check_replace``)."""
    out = Path(out)
    check_replace(out, EXPORT)  # before any work: never over a user's folder or another output
    checkpoint = read_checkpoint(ckpt)
    cfg = checkpoint.config.model
    if cfg.num_classes is not None:
        raise ValueError(f"checkpoint {checkpoint.path} is a classification model "
                         f"(num_classes={cfg.num_classes}); ecp export writes language models")
    model = EcpLmForCausalLM.from_language_model(checkpoint.load_model("cpu"))
    has_tokenizer = (checkpoint.directory / "tokenizer.json").is_file()
    tokenizer = to_transformers_tokenizer(checkpoint.tokenizer()) if has_tokenizer else None
    model.config.auto_map = MODEL_AUTO_MAP
    with writing(out), atomic_directory(out, is_export_folder) as tmp:
        model.save_pretrained(tmp)
        (tmp / f"{REMOTE_MODULE}.py").write_text(REMOTE_CODE)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        for weights in tmp.glob("*.safetensors"):  # safetensors writes 0600 whatever the umask
            os.chmod(weights, file_mode())
    return sorted(p.name for p in current_version(out).iterdir())
