"""Hugging Face ``transformers`` integration (the optional extra ``ecp-lm[hf]``).

Importing this package registers the model type ``ecp_lm`` with ``AutoConfig`` and
``AutoModelForCausalLM``, so that ``AutoModelForCausalLM.from_pretrained(folder)`` and
``pipeline("text-generation", model=folder)`` load a folder written by ``ecp export``
(``export.py``) or by ``save_pretrained``; an export also loads without it under
``trust_remote_code=True`` (as lm-evaluation-harness loads models). ``import ecp_lm`` alone
never imports transformers.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("ecp_lm.hf needs Hugging Face transformers: "
                      "pip install 'ecp-lm[hf]'") from err

from transformers import AutoConfig, AutoModelForCausalLM

from ecp_lm.hf.cache import EcpLmCache
from ecp_lm.hf.config import MODEL_TYPE, EcpLmConfig
from ecp_lm.hf.model import CACHE_FIELD, EcpLmForCausalLM
from ecp_lm.hf.tokenizer import EcpLmTokenizer

__all__ = ["CACHE_FIELD", "MODEL_TYPE", "EcpLmCache", "EcpLmConfig", "EcpLmForCausalLM",
           "EcpLmTokenizer"]

AutoConfig.register(MODEL_TYPE, EcpLmConfig, exist_ok=True)
AutoModelForCausalLM.register(EcpLmConfig, EcpLmForCausalLM, exist_ok=True)
