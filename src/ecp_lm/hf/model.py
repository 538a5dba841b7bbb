"""``EcpLmForCausalLM``: a transformers causal LM around ``LanguageModel``.

The ecp-lm model is held as ``self.model`` (state-dict keys ``model.<ecp-lm keys>``) and runs
its own code: the wrapper adds only what transformers expects of a causal LM. ``forward``
returns a ``CausalLMOutputWithPast`` with logits for every position (the perceiver family's
earlier positions from shorter windows: ``every_position``); ``labels`` give
``LanguageModel.loss``'s loss; inside ``generate()`` the cache is an ``EcpLmCache``
(cache.py), so greedy generation equals ``ecp_lm.generate(..., temperature=0.0)`` token for
token for every architecture.

Batches: prompts of one length. Padding (an ``attention_mask`` with zeros) is refused with a
``ValueError``: ecp-lm positions are absolute (ECP's segments are aligned to position 0), so a
left-padded row would be a different computation. lm-evaluation-harness, at a batch size above
1, right-pads a batch's rows with token 0 and asks for every position's logits, with no mask:
harmless where every position is predicted causally (a real position's logits never read later
tokens), but a perceiver-family row is right-aligned in its window, so its positions depend on
where the row ends. Such a call, a perceiver-family batch in which a row ends in token 0 (which
may be that padding), is refused (``check_harness_padding``); an all-ones mask, or
``logits_to_keep`` (what ``generate`` passes: the rows' last positions), says the rows are whole.

Weights ``from_pretrained`` cannot read (a truncated or damaged ``model.safetensors``) are one
``ValueError`` naming the file, instead of safetensors' error deep inside transformers.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ecp_lm.generation import context_start
from ecp_lm.hf.cache import EcpLmCache
from ecp_lm.hf.config import EcpLmConfig
from ecp_lm.model import LanguageModel
from ecp_lm.model.archs.base import PerceiverFamily
from ecp_lm.model.loss import next_token_loss
from ecp_lm.model.rope import RotaryEmbedding

# The name of the cache in outputs and model inputs: ``past_key_values``, until a transformers
# 5.x release renamed it ``cache``.
CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
                else "past_key_values")
# The token lm-evaluation-harness right-pads a batch's rows with (its pad_and_concat).
HARNESS_PAD_ID = 0


class EcpLmForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = EcpLmConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # Tied when the config says so (tie_word_embeddings, which mirrors tie_embeddings).
    _tied_weights_keys: ClassVar[dict[str, str]] = {"model.head.weight": "model.embed.weight"}

    def __init__(self, config: EcpLmConfig):
        super().__init__(config)
        cfg = config.to_model_config()
        if cfg.num_classes is not None:
            raise ValueError(f"num_classes={cfg.num_classes}: a classification model is not a "
                             f"causal language model")
        self.model = LanguageModel(cfg)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike | None,
                        *args: Any, **kwargs: Any) -> EcpLmForCausalLM:
        """transformers' ``from_pretrained`` (also under ``trust_remote_code``, whose module
        names this class); weights it cannot read are a ``ValueError`` naming the file."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as err:
            name = os.fspath(pretrained_model_name_or_path or "")
            weights = (os.path.join(name, "model.safetensors") if os.path.isdir(name)
                       else f"the model.safetensors of {name}")
            raise ValueError(f"{weights} is unreadable ({err}): the export is truncated or "
                             f"damaged; write it again with ecp export") from None

    @classmethod
    def from_language_model(cls, model: LanguageModel) -> EcpLmForCausalLM:
        """A wrapper holding a copy of ``model``'s weights, built on the CPU in the default
        dtype (move it with ``.to``), in eval mode."""
        wrapper = cls(EcpLmConfig.from_model_config(model.cfg))
        wrapper.model.load_state_dict(model.state_dict())
        return wrapper.eval()

    # What transformers expects of a model ---------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes its own EcpLmCache

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """ecp-lm's own initialisation (transformers calls this per module, on a new model and
        for whatever loading left unset), and the rotary angle table, a buffer that is not
        saved."""
        if isinstance(module, LanguageModel):
            module._init_weights()  # transformers guards it: loaded weights are kept
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, RotaryEmbedding):
            module.reset_table()

    # Forward ------------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: EcpLmCache | None = None, labels: Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0,
                return_dict: bool | None = None, past_key_values: EcpLmCache | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, T) -> logits (B, T, V): every position's next-token logits, as a
        causal LM's (``every_position``), or the last ``logits_to_keep`` of them. With a cache,
        the positions ``EcpLmCache.step`` predicts.

        ``labels`` (B, T): the mean next-token loss of ``LanguageModel.loss(labels)`` (targets
        ``labels[:, 1:]``, -100 ignored). ``cache``, or ``use_cache=True`` in eval mode without
        labels, which makes one: ``input_ids`` continue the positions the cache has seen (see
        ``EcpLmCache.step``) and the output carries the cache.

        ``attention_mask``: all ones, or none; without one, and without ``logits_to_keep``, a
        perceiver-family batch whose rows may be lm-evaluation-harness's padding is refused
        (``check_harness_padding``).
        """
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("EcpLmForCausalLM takes input_ids (inputs_embeds is not supported)")
        check_no_padding(attention_mask)
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache and labels is None and not self.training:
            cache = EcpLmCache(self.model, input_ids.size(0), input_ids.device)
        if cache is None:
            if attention_mask is None and logits_to_keep == 0:
                check_harness_padding(self.model, input_ids)
            logits = every_position(self.model, input_ids, logits_to_keep)
        elif isinstance(cache, EcpLmCache):
            logits = cache.step(self.model, input_ids)
        else:
            raise ValueError(f"EcpLmForCausalLM decodes with an EcpLmCache, not a "
                             f"{type(cache).__name__} (pass none: forward makes one)")
        loss = None if labels is None else self._loss(input_ids, labels, logits, cache)
        if logits_to_keep and cache is not None:
            logits = logits[:, -logits_to_keep:]
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
        use_dict = return_dict if return_dict is not None else self.config.return_dict
        return out if use_dict else out.to_tuple()

    def _loss(self, input_ids: Tensor, labels: Tensor, logits: Tensor,
              cache: EcpLmCache | None) -> Tensor:
        """``LanguageModel.loss`` of ``labels``: the predictions from ``input_ids[:, :-1]``.
        Where every position is predicted those are the first T - 1 of ``logits``; otherwise
        the model runs on ``input_ids[:, :-1]`` with the labels as targets (its chunked head:
        no second set of logits)."""
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        t = input_ids.size(1)
        if cache is None and logits.size(1) == t and self.model.arch.num_predicted(t - 1) == t - 1:
            return next_token_loss(logits[:, :-1], labels.to(logits.device))
        labels = labels.to(input_ids.device)
        return self.model(input_ids[:, :-1], targets=labels[:, 1:])

    def prepare_inputs_for_generation(self, input_ids: Tensor, **kwargs: Any) -> dict[str, Any]:
        """transformers' preparation; without a cache (``use_cache=False``) only the context
        the architecture needs (``context_start``), so that generation runs past the window."""
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        if inputs.get(CACHE_FIELD) is None and not kwargs.get("use_cache", True):
            ids = inputs["input_ids"]
            inputs["input_ids"] = ids[:, context_start(self.model, ids.size(1)):]
            inputs.pop("attention_mask", None)
        return inputs


def every_position(model: LanguageModel, input_ids: Tensor, keep: int = 0) -> Tensor:
    """The next-token logits (B, K, V) of the last K = ``keep`` positions of ``input_ids``
    (B, T) (all T when ``keep`` is 0). An architecture that predicts every position runs once.
    The perceiver family predicts the last P = min(l, t) positions of a window x[:t]; the
    positions before the last l of x come from the windows x[:T - l], x[:T - 2l], ..., each
    predicting its own last l, so that every position is predicted with all the context
    before it, as its window's latents: ceil(K / l) passes."""
    t = input_ids.size(1)
    keep = t if keep <= 0 else min(keep, t)
    parts, stop = [], t
    while stop > t - keep:
        logits = model(input_ids[:, :stop])  # (B, P, V): positions stop - P .. stop - 1
        parts.append(logits)
        stop -= logits.size(1)
    logits = parts[0] if len(parts) == 1 else torch.cat(parts[::-1], dim=1)
    return logits[:, logits.size(1) - keep:]


def check_no_padding(attention_mask: Tensor | None) -> None:
    """ValueError for a mask with zeros (padding), which ecp-lm's absolute positions cannot
    express."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("attention_mask has zeros (padding): EcpLmForCausalLM takes batches "
                         "of prompts of one length, without padding; generate prompts of "
                         "different lengths one at a time")


def check_harness_padding(model: LanguageModel, input_ids: Tensor) -> None:
    """ValueError for a perceiver-family batch of rows, some ending in ``HARNESS_PAD_ID``, given
    without an attention mask: lm-evaluation-harness's right padding, for all the model can
    tell, and a padded row's window would end later than the row, scoring its tokens at other
    positions. One row is never padded, nor is a row ending in another token."""
    if not isinstance(model.arch, PerceiverFamily) or input_ids.size(0) < 2:
        return
    ends = (input_ids[:, -1] == HARNESS_PAD_ID).nonzero().flatten().tolist()
    if ends:
        raise ValueError(
            f"rows {ends} of a batch of {input_ids.size(0)} end in token {HARNESS_PAD_ID}, "
            f"which is how lm-evaluation-harness right-pads a batch (it passes no attention "
            f"mask), and a perceiver-family model ({model.cfg.arch}) scores a row's tokens by "
            f"where the row ends, so a padded row would be scored at other positions: run the "
            f"harness with batch_size=1 (or, if no row is padded, pass an all-ones "
            f"attention_mask)")
