"""The shared skeleton: token embedding -> L blocks -> final norm -> head (SPEC §2, §5).

One ``LanguageModel`` class serves every architecture; the ``Architecture`` object decides
which rows each layer keeps and queries, which keys each query sees, and what is predicted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ecp_lm.config import ModelConfig
from ecp_lm.model.archs import architecture
from ecp_lm.model.cache import KVCache
from ecp_lm.model.context_parallel import ContextGroup
from ecp_lm.model.kernels.native import decode_linear
from ecp_lm.model.loss import linear_cross_entropy
from ecp_lm.model.rope import RotaryEmbedding, Rotations


class LanguageModel(nn.Module):
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them
    (``torch.utils.checkpoint``; ``train.activation_checkpointing``): honoured when training with
    autograd on, and never with KV caches."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg = cfg.resolved()  # the sizes this model has, every one concrete
        self.arch = architecture(cfg.arch)(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        rope = None if cfg.rope == "none" else RotaryEmbedding(cfg.head_dim)
        self.blocks = nn.ModuleList(
            self.arch.make_block(i, rope if cfg.rope == "all" or i == 0 else None)
            for i in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        if cfg.num_classes is None:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        else:
            self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        self._init_weights()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not name.endswith("compress"):
                is_residual = name.endswith(("out_proj", "ff.down"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else 0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def hidden_states(self, tokens: Tensor, caches: list[KVCache] | None = None,
                      start_pos: int = 0, context: ContextGroup | None = None) -> Tensor:
        """tokens (B, T) int64 at positions ``start_pos`` .. -> final-normed hidden states of the
        predicted positions, (B, P, d) (P as in ``forward``). With ``caches`` (architectures
        with a cache) their keys/values go into the caches (see ``prefill``). Into filled caches,
        tokens continue them at their next position, ``start_pos`` (a ValueError otherwise), in
        chunks of any length, exactly: the hidden states are those of one forward over the whole
        stream, as far as the architecture sees. A window starts only where
        ``check_start_pos`` allows. With a ``context`` group, tokens are this rank's shard of a
        window split across the group's ranks (``ContextGroup.shard``; every rank of the group
        calls together)."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a (B, T) int64 tensor, got shape "
                             f"{tuple(tokens.shape)} dtype {tokens.dtype}")
        t = tokens.size(1)
        if context is not None:
            self.check_context(t, context, start_pos, caches)
        if caches is not None and caches[0].filled:
            expected = caches[0].next_pos
            if any(p != start_pos for p in expected):
                raise ValueError(f"hidden_states at start_pos={start_pos}, but the caches "
                                 f"continue at position {_positions(expected)}")
        else:
            self.arch.check_start_pos(start_pos)
        self.arch.check_length(start_pos + t)
        self._check_token_ids(tokens)
        rows, n_predicted = self.arch.input_rows(t, start_pos), self.arch.num_predicted(t)
        x = self.dropout(self.embed(tokens))  # (B, T, d)
        rope, dtype = self.blocks[0].attn.rope, self.compute_dtype(tokens.device.type)
        # rope: the one RotaryEmbedding, which layer 0 holds whenever any layer rotates
        rotations = None if rope is None else Rotations(rope, tokens.device)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            # Looked up here, outside any recomputed block (a checkpointed region that
            # torch.compile traces may not write to the memo): once per row layout.
            rotation = None if block.attn.rope is None else rotations(rows, dtype)
            args = (x, rows, self.arch.num_queries(i, rows, n_predicted), cache, context,
                    rotation)
            if recompute and cache is None:
                # The block's activations are dropped and recomputed in backward, under the
                # forward's RNG state (the same dropout masks). A context group's halo exchange
                # is recomputed too: every rank recomputes its layers in the same order, so the
                # repeated messages pair up, and they carry the same keys and values.
                x, rows = checkpoint(block, *args, use_reentrant=False, preserve_rng_state=True)
            else:
                x, rows = block(*args)
        return self.norm(x[:, x.size(1) - n_predicted:])

    def check_context(self, shard_len: int, context: ContextGroup, start_pos: int,
                      caches: list[KVCache] | None = None) -> None:
        """Refuses a context-parallel call this architecture cannot compute exactly
        (ValueError): the window of K shards of ``shard_len`` must suit its halo."""
        if caches is not None:
            raise ValueError("context parallelism is for whole windows, not cached decoding")
        self.arch.check_context(shard_len * context.size, context.size)
        if start_pos != context.index * shard_len:
            raise ValueError(f"shard {context.index} of {context.size} starts at position "
                             f"{context.index * shard_len}, not start_pos={start_pos}")

    def _check_token_ids(self, tokens: Tensor) -> None:
        """Out-of-range ids as a ValueError, in eager mode on CPU only. Reading the ids back is a
        host sync that would stall an accelerator and break a compiled graph; ids are validated
        where they enter instead (data layer, ``generate``, CLI), and elsewhere an out-of-range
        id fails inside the embedding."""
        if tokens.device.type != "cpu" or torch.compiler.is_compiling():
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.cfg.vocab_size - 1}, "
                             f"got min {lo} max {hi}")

    def forward(self, tokens: Tensor, start_pos: int = 0, context: ContextGroup | None = None,
                targets: Tensor | None = None, reduction: str = "mean") -> Tensor:
        """tokens (B, T) -> logits (B, P, vocab) of the last P positions, P = min(latent_len, T)
        for the perceiver family and T for every other architecture; or (B, num_classes) with a
        classification head (over the mean hidden state of the predicted positions).

        ``start_pos``: the absolute position of the first token, where the architecture allows
        one other than 0 (ecp: any multiple of m, computing the same function as at 0); a
        ValueError otherwise. ``context``: tokens are one shard of a window split across ranks
        (``hidden_states``); the logits are those of the shard's positions.

        ``targets`` (B, T), the token after each input (``tokens[:, 1:]`` and one more): instead
        of logits, the cross-entropy of the predicted positions (``head_loss``: ``reduction``
        mean, sum, or none (B, P)), computed without the (B, P, vocab) logits. The loss is
        reached through ``forward`` so that DDP's and FSDP's hooks see it."""
        hidden = self.hidden_states(tokens, start_pos=start_pos, context=context)
        if self.cfg.num_classes is not None:
            if targets is not None:
                raise ValueError("targets: a classifier's loss is the cross-entropy of its "
                                 "(B, num_classes) output; call it without targets")
            return self.head(hidden.mean(dim=1))
        if targets is None:
            return self.head(hidden)
        if targets.shape != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, "
                             f"got {tuple(targets.shape)}")
        return self.head_loss(hidden, targets[:, targets.size(1) - hidden.size(1):], reduction)

    def head_loss(self, hidden: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        """Cross-entropy of ``head(hidden)`` for hidden (B, P, d) against targets (B, P) (-100:
        not counted), in float32, over chunks of rows (``models.loss``): the same loss and
        gradients as the logits' ``F.cross_entropy`` without holding them. ``reduction``: mean,
        sum, or none: (B, P), for scoring without a gradient."""
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.size(-1)), self.head.weight,
                                    self.head.bias, targets.reshape(-1), reduction)
        return loss.view(targets.shape) if reduction == "none" else loss

    # Incremental decoding (architectures with a cache_capacity) --------------------------------
    def compute_dtype(self, device_type: str) -> torch.dtype:
        """The dtype activations come out in: autocast's where it is on, else the parameters'
        (also on devices without autocast, such as ``meta``)."""
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.embed.weight.dtype

    def make_caches(self, batch_size: int, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> list[KVCache] | None:
        """One empty KV cache per layer, or None if this architecture decodes by recomputing.
        By default on the model's device, in ``compute_dtype`` (call it under the same autocast
        as the decoding)."""
        capacity = self.arch.cache_capacity
        if capacity is None or self.cfg.num_classes is not None:
            return None
        device = torch.device(device) if device is not None else self.embed.weight.device
        dtype = dtype or self.compute_dtype(device.type)
        return [KVCache(batch_size, self.cfg.n_heads, capacity, self.cfg.head_dim, dtype, device)
                for _ in self.blocks]

    def prefill(self, tokens: Tensor, caches: list[KVCache], start_pos: int = 0) -> Tensor:
        """Logits (B, T, V) of a prompt at positions ``start_pos`` .. (as in ``forward``),
        filling empty caches."""
        if any(cache.filled for cache in caches):
            raise ValueError("prefill needs empty caches (make_caches)")
        for cache in caches:
            cache.start_at(start_pos)
        return self.head(self.hidden_states(tokens, caches, start_pos))

    def decode_one_token(self, token: Tensor, pos: int | Tensor, caches: list[KVCache]
                         ) -> Tensor:
        """Logits (B, V) after ``token`` (B, 1) at absolute position ``pos``, the position after
        the last one in the caches: an int, or a (B,) tensor where rows stand at different
        positions (``KVCache.stack``). Checks the call, then runs ``decode_step``."""
        if token.dim() != 2 or token.size(1) != 1 or not caches[0].filled:
            raise ValueError("decode_one_token takes one (B, 1) token after a prefill")
        expected = caches[0].next_pos
        if isinstance(pos, int):
            if any(p != pos for p in expected):
                raise ValueError(f"decode_one_token at pos={pos}, but the caches continue at "
                                 f"position {_positions(expected)}")
            positions = torch.full((token.size(0),), pos, dtype=torch.long,
                                   device=token.device)
        else:
            positions = pos
            if positions.tolist() != expected:  # the eager API checks; decode_step does not
                raise ValueError(f"decode_one_token at pos={positions.tolist()}, but the caches "
                                 f"continue at positions {expected}")
        logits = self.decode_step(token, positions, caches, caches[0].slots_in_use(ahead=1))
        for cache in caches:
            cache.advance()
        return logits

    def decode_step(self, token: Tensor, pos: Tensor, caches: list[KVCache],
                    span: int | None = None) -> Tensor:
        """The decode step itself: token (B, 1) at positions ``pos`` (B,) int64 -> logits
        (B, V). Tensor operations of fixed shape only, no host sync and no branch on the caches'
        state, so ``torch.compile(model.decode_step, fullgraph=True)`` is one graph for every
        step (``generate(..., compile=True)``). Eager callers may pass ``span``, the leading
        cache slots in use after this step (``KVCache.slots_in_use``), to attend over only
        those. It checks nothing: callers that take user input go through
        ``decode_one_token``."""
        x = self.embed(token)
        rope, rotation = self.blocks[0].attn.rope, None
        if rope is not None:  # one (cos, sin) at ``pos`` for every layer's queries and keys
            rotation = rope.rotation(pos[:, None], caches[0].k.dtype, x.device)
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block.decode(x, pos, cache, span, rotation)
        return decode_linear(self.head, self.norm(x))[:, -1]

    def loss(self, tokens: Tensor, context: ContextGroup | None = None) -> Tensor:
        """Mean next-token cross-entropy over the predicted positions of ``tokens[:, :-1]``;
        ``tokens`` is (B, T + 1): the inputs followed by one more target token. With a
        ``context`` group, the mean over this rank's shard of the window (the window's mean is
        the mean over the group's ranks: context_parallel.py)."""
        if context is None:
            return self(tokens[:, :-1], targets=tokens[:, 1:])
        shard, start_pos = context.shard(tokens)
        return self(shard[:, :-1], start_pos, context, targets=shard[:, 1:])

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer groups: weight decay on matrix weights (linear maps, embeddings) only, not
        on norms or biases."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]


def _positions(positions: list[int]) -> str:
    return str(positions[0]) if len(set(positions)) == 1 else str(positions)


def next_token_loss(logits: Tensor, tokens: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits (B, P, V) for the last P inputs of ``tokens`` (B, T + 1), whose
    targets are the last P tokens; computed in float32. For logits already at hand: training
    and scoring reach the loss through ``LanguageModel.forward(..., targets=...)``, which never
    holds them."""
    targets = tokens[:, tokens.size(1) - logits.size(1):]  # (B, P)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           reduction=reduction)


def build_model(cfg: ModelConfig) -> LanguageModel:
    """The model for ``cfg`` (every architecture shares ``LanguageModel``)."""
    return LanguageModel(cfg)
