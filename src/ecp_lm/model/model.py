"""The shared skeleton: token embedding -> L pre-norm blocks -> final norm -> head (SPEC §2, §5).

One ``LanguageModel`` serves every architecture. The ``Architecture`` object (``archs/``, one
file per pattern) decides which positions each layer's rows hold and which rows query, which keys
each query sees (its mask predicate) and runs its exact fast kernels; everything else is here
(embedding, block, head, prefill and decode) and in ``attention`` (projections, RoPE, kernels).
A recurrent architecture gives each block its own mixer in place of ``Attention``
(``Architecture.mixer``, with the same interface and a state for a cache). Shapes: B batch,
T tokens, R rows a layer holds, Rq rows that query, H heads, D head size, d = H·D, V vocabulary.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ecp_lm.model.archs import architecture
from ecp_lm.model.archs.base import Architecture
from ecp_lm.model.attention import Attention
from ecp_lm.model.cache import Cache, decode_span
from ecp_lm.model.context_parallel import ContextGroup
from ecp_lm.model.kernels import check_kernel
from ecp_lm.model.kernels.native import decode_linear, dropout
from ecp_lm.model.loss import linear_cross_entropy
from ecp_lm.model.rope import RotaryEmbedding, Rotation, Rotations
from ecp_lm.model.rows import Rows

if TYPE_CHECKING:
    from ecp_lm.config import ModelConfig


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose training masks on CPU come from the native kernel's hash
    (``native.dropout``; elsewhere, or compiled, ``F.dropout``)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p) if self.training and self.p > 0.0 else x


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The skeleton's norm: LayerNorm (its bias where ``cfg.bias``) or RMSNorm."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=1e-6)
    return nn.LayerNorm(cfg.d_model, bias=cfg.bias)


class FeedForward(nn.Module):
    """``down(gelu(up x))``, or with ``mlp: swiglu`` ``down(silu(gate x) ⊙ up x)``; hidden
    width ``cfg.ff_width``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        width = cfg.ff_width
        self.gate = nn.Linear(cfg.d_model, width, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.up = nn.Linear(cfg.d_model, width, bias=cfg.bias)
        self.act = nn.GELU()
        self.down = nn.Linear(width, cfg.d_model, bias=cfg.bias)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, linear=nn.Linear.__call__) -> Tensor:
        up = linear(self.up, x)
        hidden = self.act(up) if self.gate is None else F.silu(linear(self.gate, x)) * up
        return self.dropout(linear(self.down, hidden))


class Block(nn.Module):
    """``x = x + Attn(Norm(x)); x = x + FF(Norm(x))``. Where only the last ``n_query`` rows
    query (PerceiverAR's layer 0, or the last layer, whose other rows nobody reads), the residual
    is those rows and the block returns only them. An architecture may map the rows to fewer
    between the two (``Architecture.compression``: compressed_double's history), or put a
    recurrent mixer in attention's place (``Architecture.mixer``), and a feed-forward of its own
    in the skeleton's (``Architecture.feed_forward``: RWKV-4's channel mix, whose token shift
    keeps its last input in the layer's cache, so every row of the block runs)."""

    def __init__(self, cfg: ModelConfig, arch: Architecture, rope: RotaryEmbedding | None,
                 layer: int):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        mixer = arch.mixer(cfg, layer)
        self.attn = Attention(cfg, arch, rope) if mixer is None else mixer
        """The token mixer: attention, or the architecture's recurrent mixer."""
        ff = arch.feed_forward(cfg, layer) if arch.has_feed_forward else None
        self.ff_norm = make_norm(cfg) if arch.has_feed_forward else None
        self.ff = None if self.ff_norm is None else FeedForward(cfg) if ff is None else ff
        self.ff_state = ff is not None and hasattr(ff, "cache_shapes")
        """Whether the feed-forward reads the row before each (and the cache's last row)."""
        self.dropout = Dropout(cfg.dropout)
        self.compress = arch.compression(layer)

    def forward(self, x: Tensor, rows: Rows, n_query: int, cache: Cache | None = None,
                context: ContextGroup | None = None, rotation: Rotation | None = None
                ) -> tuple[Tensor, Rows]:
        keep = x.size(1) if self.ff_state else n_query
        update = self.attn(self.attn_norm(x), rows, keep, cache, context, rotation)
        x, rows = x[:, x.size(1) - keep:] + self.dropout(update), rows.tail(keep)
        if self.compress is not None:
            x, rows = self.compress(x, rows)
        if self.ff is None:
            return x, rows
        if self.ff_state:
            x = x + self.dropout(self.ff(self.ff_norm(x), cache))
            return x[:, x.size(1) - n_query:], rows.tail(n_query)
        return x + self.dropout(self.ff(self.ff_norm(x))), rows

    def decode(self, x: Tensor, pos: Tensor, cache: Cache, span: int | None = None,
               rotation: Rotation | None = None) -> Tensor:
        """One token per batch row at positions ``pos`` (B,): (B, 1, d) -> (B, 1, d)."""
        x = x + self.dropout(self.attn.decode(self.attn_norm(x), pos, cache, span, rotation))
        if self.ff is None:
            return x
        if self.ff_state:
            return x + self.dropout(self.ff(self.ff_norm(x), cache, decode_linear))
        return x + self.dropout(self.ff(self.ff_norm(x), decode_linear))

    def make_cache(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> Cache:
        """The layer's decoding cache: its mixer's, with the feed-forward's state beside."""
        if self.ff_state:
            return self.attn.make_cache(batch_size, dtype, device, self.ff.cache_shapes())
        return self.attn.make_cache(batch_size, dtype, device)


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
        self.dropout = Dropout(cfg.dropout)
        # Layer i attends with arch.layer(i) (a hybrid's layers differ) and rotates with the
        # base arch.rope_base(i) (None: no RoPE); one RotaryEmbedding per base, shared.
        bases = [self.arch.rope_base(i) for i in range(cfg.n_layers)]
        ropes = {base: RotaryEmbedding(cfg.head_dim, base)
                 for base in dict.fromkeys(bases) if base is not None}
        self.blocks = nn.ModuleList(
            Block(cfg, self.arch.layer(i), ropes.get(base), i) for i, base in enumerate(bases))
        self.norm = make_norm(cfg)
        out = cfg.vocab_size if cfg.num_classes is None else cfg.num_classes
        self.head = nn.Linear(cfg.d_model, out, bias=cfg.num_classes is not None)
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

    def forward(self, tokens: Tensor, start_pos: int = 0, context: ContextGroup | None = None,
                targets: Tensor | None = None, reduction: str = "mean") -> Tensor:
        """tokens (B, T) -> logits (B, P, V) of the last P positions, P = min(latent_len, T)
        for the perceiver family and T for every other architecture; or (B, num_classes) with a
        classification head (over the mean hidden state of the predicted positions).

        ``start_pos``: the absolute position of the first token, where the architecture allows
        one other than 0 (ecp: any multiple of m, computing the same function as at 0).
        ``context``: tokens are one shard of a window split across ranks (``hidden_states``).
        ``targets`` (B, T), the token after each input: instead of logits, the cross-entropy of
        the predicted positions (``head_loss``: ``reduction`` mean, sum, or none (B, P)),
        without the (B, P, V) logits. The loss goes through ``forward`` so that DDP's and FSDP's
        hooks see it."""
        hidden = self.hidden_states(tokens, start_pos=start_pos, context=context)  # (B, P, d)
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

    def hidden_states(self, tokens: Tensor, caches: list[Cache] | None = None,
                      start_pos: int = 0, context: ContextGroup | None = None) -> Tensor:
        """tokens (B, T) int64 at positions ``start_pos`` .. -> final-normed hidden states of the
        predicted positions, (B, P, d). With ``caches``, their keys and values go into the
        caches (``prefill``); into filled caches, tokens continue them at their next position
        (a ValueError otherwise), in chunks of any length, exactly as one forward over the whole
        stream. With a ``context`` group, tokens are this rank's shard of a window
        (``ContextGroup.shard``; every rank of the group calls together)."""
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
        # The positions the rows hold (T rows from start_pos, or the perceiver family's
        # right-aligned window) and how many trailing positions are predicted (T, or l).
        rows, n_predicted = self.arch.input_rows(t, start_pos), self.arch.num_predicted(t)
        x = self.dropout(self.embed(tokens))  # (B, T, d)
        dtype, rotations = self.compute_dtype(tokens.device.type), Rotations(tokens.device)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            # Looked up here, outside any recomputed block (a checkpointed region that
            # torch.compile traces may not write to the memo): once per row layout.
            rope = block.attn.rope
            rotation = None if rope is None else rotations(rope, rows, dtype)
            # Rows that query: all of them, but in the last layer only the predicted ones.
            args = (x, rows, self.arch.num_queries(i, rows, n_predicted), cache, context,
                    rotation)
            if recompute and cache is None:
                # Dropped and recomputed in backward under the forward's RNG state (the same
                # dropout masks); a context group's halo exchange is recomputed too, in the same
                # order on every rank, so the repeated messages pair up.
                x, rows = checkpoint(block, *args, use_reentrant=False, preserve_rng_state=True)
            else:
                x, rows = block(*args)  # (B, R, d) -> (B, R', d)
        return self.norm(x[:, x.size(1) - n_predicted:])  # (B, P, d)

    def head_loss(self, hidden: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        """Cross-entropy of ``head(hidden)`` for hidden (B, P, d) against targets (B, P) (-100:
        not counted), in float32 over chunks of rows (loss.py): the loss and gradients of the
        logits' ``F.cross_entropy`` without holding them. ``reduction``: mean, sum, or none."""
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.size(-1)), self.head.weight,
                                    self.head.bias, targets.reshape(-1), reduction)
        return loss.view(targets.shape) if reduction == "none" else loss

    def loss(self, tokens: Tensor, context: ContextGroup | None = None) -> Tensor:
        """Mean next-token cross-entropy of the predicted positions of ``tokens[:, :-1]``, for
        ``tokens`` (B, T + 1). With a ``context`` group, the mean over this rank's shard (the
        window's mean is the mean over the group's ranks: context_parallel.py)."""
        if context is None:
            return self(tokens[:, :-1], targets=tokens[:, 1:])
        shard, start_pos = context.shard(tokens)
        return self(shard[:, :-1], start_pos, context, targets=shard[:, 1:])

    # Incremental decoding (architectures with a cache_capacity) --------------------------------
    def make_caches(self, batch_size: int, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> list[Cache] | None:
        """One empty cache per layer (keys and values, or a recurrent mixer's state), or None if
        this architecture decodes by recomputing.
        By default on the model's device, in ``compute_dtype`` (call it under the same autocast
        as the decoding)."""
        if self.arch.cache_capacity is None or self.cfg.num_classes is not None:
            return None
        device = torch.device(device) if device is not None else self.embed.weight.device
        dtype = dtype or self.compute_dtype(device.type)
        # Each layer's own (a hybrid's local layers keep their rings, its global the N, its
        # recurrent layers their states)
        return [block.make_cache(batch_size, dtype, device) for block in self.blocks]

    def prefill(self, tokens: Tensor, caches: list[Cache], start_pos: int = 0) -> Tensor:
        """Logits (B, T, V) of a prompt at positions ``start_pos`` .., filling empty caches."""
        if any(cache.filled for cache in caches):
            raise ValueError("prefill needs empty caches (make_caches)")
        for cache in caches:
            cache.start_at(start_pos)
        return self.head(self.hidden_states(tokens, caches, start_pos))

    def decode_one_token(self, token: Tensor, pos: int | Tensor, caches: list[Cache]
                         ) -> Tensor:
        """Logits (B, V) after ``token`` (B, 1) at absolute position ``pos``, the position after
        the last one in the caches: an int, or a (B,) tensor where rows stand at different
        positions (``stack_caches``). Checks the call, then runs ``decode_step``."""
        if token.dim() != 2 or token.size(1) != 1 or not caches[0].filled:
            raise ValueError("decode_one_token takes one (B, 1) token after a prefill")
        expected = caches[0].next_pos
        if isinstance(pos, int):
            if any(p != pos for p in expected):
                raise ValueError(f"decode_one_token at pos={pos}, but the caches continue at "
                                 f"position {_positions(expected)}")
            pos = torch.full((token.size(0),), pos, dtype=torch.long, device=token.device)
        elif pos.tolist() != expected:  # the eager API checks; decode_step does not
            raise ValueError(f"decode_one_token at pos={pos.tolist()}, but the caches "
                             f"continue at positions {expected}")
        logits = self.decode_step(token, pos, caches, decode_span(caches))
        for cache in caches:
            cache.advance()
        return logits

    def decode_step(self, token: Tensor, pos: Tensor, caches: list[Cache],
                    span: int | None = None) -> Tensor:
        """The decode step: token (B, 1) at positions ``pos`` (B,) int64 -> logits (B, V).
        Tensor operations of fixed shape only, no host sync and no branch on the caches' state,
        so ``torch.compile(model.decode_step, fullgraph=True)`` is one graph for every step
        (``generate(..., compile=True)``). Eager callers may pass ``span``, the leading cache
        slots in use after this step (``KVCache.slots_in_use``). It checks nothing: callers
        that take user input go through ``decode_one_token``."""
        x = self.embed(token)  # (B, 1, d)
        rotations: dict[float, Rotation] = {}  # one (cos, sin) at ``pos`` per RoPE base
        for block, cache in zip(self.blocks, caches, strict=True):
            rope, rotation = block.attn.rope, None
            if rope is not None:
                if rope.base not in rotations:
                    rotations[rope.base] = rope.rotation(pos[:, None], cache.k.dtype, x.device)
                rotation = rotations[rope.base]
            x = block.decode(x, pos, cache, span, rotation)
        return decode_linear(self.head, self.norm(x))[:, -1]  # (B, V)

    # Checks and bookkeeping ---------------------------------------------------------------------
    def compute_dtype(self, device_type: str) -> torch.dtype:
        """The dtype activations come out in: autocast's where it is on, else the parameters'
        (also on devices without autocast, such as ``meta``)."""
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.embed.weight.dtype

    def check_kernels(self, device: torch.device | str, training: bool) -> None:
        """Refuses (ValueError) an explicit ``attn_impl`` that cannot run this model's layers on
        ``device`` in ``compute_dtype`` (call it under the autocast the model will run in), with
        their dropout and a backward where ``training``: called before compiling a step, so that
        the reason comes first rather than inside torch.compile's error."""
        device = torch.device(device)
        dtype, dropout = self.compute_dtype(device.type), self.cfg.dropout if training else 0.0
        for block in self.blocks:
            check_kernel(block.attn.arch, self.cfg.attn_impl, device, dtype, dropout, training)

    def check_context(self, shard_len: int, context: ContextGroup, start_pos: int,
                      caches: list[Cache] | None = None) -> None:
        """Refuses a context-parallel call this architecture cannot compute exactly
        (ValueError): the window of K shards of ``shard_len`` must suit its halo."""
        if caches is not None:
            raise ValueError("context parallelism is for whole windows, not cached decoding")
        self.arch.check_context(shard_len * context.size, context.size)
        if start_pos != context.index * shard_len:
            raise ValueError(f"shard {context.index} of {context.size} starts at position "
                             f"{context.index * shard_len}, not start_pos={start_pos}")

    def _check_token_ids(self, tokens: Tensor) -> None:
        """Out-of-range ids as a ValueError, in eager mode on CPU only: reading the ids back is a
        host sync that would stall an accelerator and break a compiled graph, so elsewhere ids
        are validated where they enter (data layer, ``generate``, CLI)."""
        if tokens.device.type != "cpu" or torch.compiler.is_compiling():
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.cfg.vocab_size - 1}, "
                             f"got min {lo} max {hi}")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def at_step(self, step: int) -> None:
        """Before training step ``step``: each layer's schedule (the Performer's draws of its
        random features)."""
        for module in self.modules():
            if module is not self and hasattr(module, "at_step"):
                module.at_step(step)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer groups: weight decay on matrix weights (linear maps, embeddings) only."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]


def _positions(positions: list[int]) -> str:
    return str(positions[0]) if len(set(positions)) == 1 else str(positions)


def build_model(cfg: ModelConfig) -> LanguageModel:
    """The model for ``cfg`` (every architecture shares ``LanguageModel``)."""
    return LanguageModel(cfg)
