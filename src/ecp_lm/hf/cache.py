"""``EcpLmCache``: a transformers ``Cache`` that holds ecp-lm's own decoding state.

Inside ``generate()`` transformers passes a model only the tokens its cache has not seen
(``get_seq_length()`` says how many it has). What the cache holds is what ``ecp_lm.generate``
keeps (generation.py):

- architectures with a ``cache_capacity`` (ecp, transformer, the local baselines, hybrids):
  one ``KVCache`` per layer, of that layer's own capacity (``LanguageModel.make_caches``: a
  hybrid's local layers keep their rings, its global layers N); the first call prefills them
  (``LanguageModel.prefill``), every later token is one decode step (``decode_one_token``).
  ECP's ring holds 2m positions, so its memory stays constant however long the generation runs,
  as does a hybrid's with local layers only;
- architectures with a window of N (the perceiver family; the transformer, and a hybrid with a
  global layer, once the sequence reaches N): the tokens from the architecture's
  ``context_start`` on, at most N per row, and each call recomputes the prediction from them,
  as uncached generation does.

All rows stand at the same position: a batch of prompts of one length (no padding).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ecp_lm.generation import context_start
from ecp_lm.model import LanguageModel
from ecp_lm.model.cache import KVCache


class EcpLmCache(Cache):
    """Decoding state of a batch of ``batch_size`` rows for ``model``."""

    def __init__(self, model: LanguageModel, batch_size: int,
                 device: torch.device | str | None = None):
        super().__init__(layers=[])
        self._batch_size = batch_size
        self.kv: list[KVCache] | None = model.make_caches(batch_size, device)
        """Per-layer KV caches while they are in use; None once decoding recomputes."""
        self.window = model.arch.max_len
        """Longest input the architecture accepts (None: unbounded, no tokens are kept)."""
        device = device if device is not None else model.embed.weight.device
        self.tokens = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        """The tokens recomputation needs, from absolute position ``offset`` on."""
        self.offset = 0
        self.seen = 0
        """Positions seen so far (the same in every row)."""

    # What transformers asks a cache -------------------------------------------------------------
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # no limit: past a window of N decoding recomputes

    @property
    def is_linear(self) -> list[bool]:
        return [False]  # attention state: transformers passes only the unseen tokens

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("EcpLmCache cannot be rolled back (crop): a ring of KV slots forgets "
                         "the positions it overwrote")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = torch.arange(self._batch_size, device=self.tokens.device)
        self._select_rows(rows.repeat_interleave(repeats))

    def reset(self) -> None:
        raise ValueError("EcpLmCache cannot be reset; start generation with a new one")

    def nbytes(self) -> int:
        """Bytes held: the KV buffers and the kept tokens."""
        kv = sum(cache.nbytes() for cache in self.kv) if self.kv is not None else 0
        return kv + self.tokens.numel() * self.tokens.element_size()

    # Decoding -------------------------------------------------------------------------------------
    def step(self, model: LanguageModel, new: Tensor) -> Tensor:
        """Logits (B, P, V) after the new tokens ``new`` (B, T), which continue the positions
        seen: P = T while the KV caches are in use, else the positions the architecture predicts
        from its context (the last one is always the next token's)."""
        if new.size(0) != self._batch_size:
            raise ValueError(f"the cache holds {self._batch_size} rows, the input has "
                             f"{new.size(0)}")
        start, total = self.seen, self.seen + new.size(1)
        if self.kv is not None and (self.window is None or total < self.window):
            logits = self._decode(model, new, start)
        else:
            self.kv = None  # past the window (or never cached): recompute from now on
            tokens = torch.cat([self.tokens, new], dim=1)
            logits = model(tokens[:, context_start(model, total) - self.offset:])
        self._keep_tokens(model, new, total)
        self.seen = total
        return logits

    def _decode(self, model: LanguageModel, new: Tensor, start: int) -> Tensor:
        if start == 0:
            return model.prefill(new, self.kv)
        steps = [model.decode_one_token(new[:, i:i + 1], start + i, self.kv)
                 for i in range(new.size(1))]
        return torch.stack(steps, dim=1)  # (B, T, V)

    def _keep_tokens(self, model: LanguageModel, new: Tensor, total: int) -> None:
        """Keep the tokens a later recomputation needs: none for an unbounded architecture
        decoding from its caches, else those from ``context_start`` on (at most N)."""
        if self.window is None:
            return
        keep_from = context_start(model, total)
        tokens = torch.cat([self.tokens, new], dim=1)
        self.tokens = tokens[:, keep_from - self.offset:]
        self.offset = keep_from

    def _select_rows(self, index: Tensor) -> None:
        """Keep the rows ``index`` (B',) of every buffer, in that order (beam search)."""
        self.tokens = self.tokens[index.to(self.tokens.device)]
        for cache in self.kv or ():
            cache.select_rows(index)
        self._batch_size = index.numel()
