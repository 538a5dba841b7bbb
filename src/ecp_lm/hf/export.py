"""``ecp export``: an ecp-lm checkpoint as a Hugging Face model folder.

The folder holds ``config.json`` (``EcpLmConfig``: the ``ModelConfig`` fields),
``model.safetensors`` (``save_pretrained``; tied embeddings stored once),
``generation_config.json`` and the tokenizer as a ``PreTrainedTokenizerFast``
(``tokenizer.json``, ``tokenizer_config.json``) giving exactly ecp-lm's ids, so that after
``import ecp_lm.hf`` both ``AutoModelForCausalLM.from_pretrained(folder)`` and
``pipeline("text-generation", model=folder)`` work offline. It is written atomically
(``fsutil.atomic_directory``): a kill leaves the previous export or none, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from ecp_lm.data.tokenizers import Tokenizer
from ecp_lm.fsutil import atomic_directory, check_replaceable, current_version, file_mode
from ecp_lm.hf.config import MODEL_TYPE
from ecp_lm.hf.model import EcpLmForCausalLM
from ecp_lm.run.checkpoint import read_checkpoint


def to_transformers_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """ecp-lm's tokenizer as a transformers fast tokenizer with the same ids (no special tokens
    are added)."""
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.core(),
                                   clean_up_tokenization_spaces=False)


def is_export_folder(path: Path) -> bool:
    """Whether ``path`` holds an ecp-lm model's ``config.json`` (an export an earlier release
    wrote in place, which a new export may replace)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def export_checkpoint(ckpt: str | Path, out: str | Path) -> list[str]:
    """Write the Hugging Face folder ``out`` for the checkpoint (or run folder) ``ckpt``;
    returns the names of the files written. ValueError for a classification model, and for an
    ``out`` that is not empty and not an earlier export (``fsutil.check_replaceable``)."""
    out = Path(out)
    check_replaceable(out, is_export_folder)  # before any work: never over a user's folder
    checkpoint = read_checkpoint(ckpt)
    cfg = checkpoint.config.model
    if cfg.num_classes is not None:
        raise ValueError(f"checkpoint {checkpoint.path} is a classification model "
                         f"(num_classes={cfg.num_classes}); ecp export writes language models")
    model = EcpLmForCausalLM.from_language_model(checkpoint.load_model("cpu"))
    has_tokenizer = (checkpoint.directory / "tokenizer.json").is_file()
    tokenizer = to_transformers_tokenizer(checkpoint.tokenizer()) if has_tokenizer else None
    with atomic_directory(out, is_export_folder) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for weights in tmp.glob("*.safetensors"):  # safetensors writes 0600 whatever the umask
            os.chmod(weights, file_mode())
    return sorted(p.name for p in current_version(out).iterdir())
