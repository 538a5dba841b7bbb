"""``EcpLmConfig``: the Hugging Face configuration of an ecp-lm model.

It holds exactly the fields of ``ModelConfig`` under the same names (``config.json`` reads like
``config.yaml``'s ``model:`` section), validated by building the ``ModelConfig`` they describe,
so an invalid combination raises the same ``ValueError`` as ``ModelConfig`` itself. The fields
are read as a saved model section (``ModelConfig.from_saved``): the ``config.json`` of an export
by an earlier release, which named some sizes otherwise (block_local's ``block_len`` was
``window``), describes the same model, and so does one written before a field existed (a hybrid's
``layer_pattern``, the RoPE bases and ``global_rope``): a missing field takes its default, the
value every model had then. ``tie_word_embeddings``, the name transformers reads,
mirrors ``tie_embeddings``; ``max_position_embeddings`` reads ``seq_len``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

from transformers import PretrainedConfig

from ecp_lm.config import ModelConfig, saved_fields
from ecp_lm.outputs import EXPORT

MODEL_TYPE = EXPORT.value
FIELDS = tuple(f.name for f in fields(ModelConfig))
_DEFAULTS = ModelConfig().to_dict()  # every default is a plain value (no factories)


class EcpLmConfig(PretrainedConfig):
    """The fields of ``ModelConfig`` (documented in ``ecp_lm.config``), one to one."""

    model_type = MODEL_TYPE
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
        # The context a harness gives the model (lm-evaluation-harness reads this name).
        "max_position_embeddings": "seq_len"}

    def __init__(self, arch: str = _DEFAULTS["arch"], vocab_size: int = _DEFAULTS["vocab_size"],
                 d_model: int = _DEFAULTS["d_model"], n_layers: int = _DEFAULTS["n_layers"],
                 n_heads: int = _DEFAULTS["n_heads"], seq_len: int = _DEFAULTS["seq_len"],
                 latent_len: int | None = None, num_segments: int = _DEFAULTS["num_segments"],
                 compressed_len: int | None = None, window: int | str | None = None,
                 block_len: int | None = None, group_len: int | None = None,
                 sink_tokens: int = _DEFAULTS["sink_tokens"], mixer_width: int | None = None,
                 state_size: int | None = None, conv_size: int | None = None,
                 chunk_size: int | None = None, num_features: int | None = None,
                 feature_redraw: int | None = None, stride: int | None = None,
                 summary_len: int | None = None, sparse_pattern: str | None = None,
                 forget_gate: str | None = None, dilation: int | str | None = None,
                 global_tokens: int = _DEFAULTS["global_tokens"],
                 memory_len: int | None = None, compression_rate: int | None = None,
                 num_clusters: int | None = None, ff_mult: int | None = None,
                 ff_hidden: int | None = None,
                 norm: str = _DEFAULTS["norm"], mlp: str = _DEFAULTS["mlp"],
                 bias: bool = _DEFAULTS["bias"], dropout: float = _DEFAULTS["dropout"],
                 rope: str = _DEFAULTS["rope"], tied_kv: bool = _DEFAULTS["tied_kv"],
                 tie_embeddings: bool = _DEFAULTS["tie_embeddings"],
                 attn_impl: str = _DEFAULTS["attn_impl"], num_classes: int | None = None,
                 layer_pattern: str | None = None, rope_base: float = _DEFAULTS["rope_base"],
                 global_rope: str | None = None, rope_base_global: float | None = None,
                 **kwargs: Any):
        values = dict(arch=arch, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                      n_heads=n_heads, seq_len=seq_len, latent_len=latent_len,
                      num_segments=num_segments, compressed_len=compressed_len, window=window,
                      block_len=block_len, group_len=group_len, sink_tokens=sink_tokens,
                      mixer_width=mixer_width, state_size=state_size, conv_size=conv_size,
                      chunk_size=chunk_size, num_features=num_features,
                      feature_redraw=feature_redraw, stride=stride, summary_len=summary_len,
                      sparse_pattern=sparse_pattern, forget_gate=forget_gate, dilation=dilation,
                      global_tokens=global_tokens, memory_len=memory_len,
                      compression_rate=compression_rate, num_clusters=num_clusters,
                      ff_mult=ff_mult, ff_hidden=ff_hidden,
                      norm=norm, mlp=mlp,
                      bias=bias,
                      dropout=dropout, rope=rope, tied_kv=tied_kv,
                      tie_embeddings=tie_embeddings, attn_impl=attn_impl,
                      num_classes=num_classes, layer_pattern=layer_pattern,
                      rope_base=rope_base, global_rope=global_rope,
                      rope_base_global=rope_base_global)
        # Validated; sizes left unset stay unset, as in ModelConfig (derived where needed); the
        # old names of renamed sizes (an earlier release's config.json) read as the new ones.
        for name, value in ModelConfig(**saved_fields(values)).to_dict().items():
            setattr(self, name, value)
        kwargs["tie_word_embeddings"] = tie_embeddings
        super().__init__(**kwargs)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs: Any) -> EcpLmConfig:
        return cls(**cfg.to_dict(), **kwargs)

    def to_model_config(self) -> ModelConfig:
        """The ``ModelConfig`` these fields describe."""
        return ModelConfig(**{name: getattr(self, name) for name in FIELDS})
