"""A long-range recall probe that isolates context propagation.

Each sequence of N tokens plants a key–value pair (two tokens) ``min_gap`` to ``max_gap``
positions before its end, fills the rest with random filler tokens, and ends with a query marker
followed by the key; the model must predict the value as the next token. Keys, values, the
marker and the filler use disjoint ranges of the vocabulary, so the only way to succeed is to
carry the pair across the gap. With ``min_gap`` > 2m no single ECP layer sees the pair: ECP
succeeds only if its L layers propagate it (L·m must cover the gap), the research's claim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ecp_lm.config import ModelConfig
from ecp_lm.model import LanguageModel, build_model


@dataclass(frozen=True)
class RecallSpec:
    seq_len: int = 128
    min_gap: int = 40
    """The pair's value lies at least this many positions before the query key..."""
    max_gap: int = 60
    """...and at most this many."""
    num_keys: int = 16
    num_values: int = 16
    num_filler: int = 32

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values + self.num_filler + 1

    def __post_init__(self) -> None:
        if not 4 <= self.min_gap <= self.max_gap <= self.seq_len - 4:
            raise ValueError(f"need 4 <= min_gap={self.min_gap} <= max_gap={self.max_gap} <= "
                             f"seq_len-4={self.seq_len - 4}")


def recall_batch(spec: RecallSpec, batch_size: int, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, N), values (B,)): the value must be predicted after the last token."""
    n, keys, values = spec.seq_len, spec.num_keys, spec.num_values
    filler0, marker = keys + values, keys + values + spec.num_filler
    tokens = torch.randint(filler0, marker, (batch_size, n), generator=generator)
    key = torch.randint(0, keys, (batch_size,), generator=generator)
    value = keys + torch.randint(0, values, (batch_size,), generator=generator)
    # The query key is at n - 1; the value at p + 1 = n - 1 - gap, min_gap <= gap <= max_gap.
    gap = torch.randint(spec.min_gap, spec.max_gap + 1, (batch_size,), generator=generator)
    start = n - 2 - gap
    rows = torch.arange(batch_size)
    tokens[rows, start] = key
    tokens[rows, start + 1] = value
    tokens[:, -2] = marker
    tokens[:, -1] = key
    return tokens, value


def train_probe(cfg: ModelConfig, spec: RecallSpec, steps: int, batch_size: int = 32,
                lr: float = 2e-3, eval_size: int = 512, seed: int = 0) -> dict[str, float]:
    """Train ``cfg`` on the probe (loss on the final prediction only); test accuracy on fresh
    sequences of a separate seed."""
    if cfg.vocab_size < spec.vocab_size or cfg.seq_len != spec.seq_len:
        raise ValueError(f"the probe needs vocab_size >= {spec.vocab_size} and seq_len="
                         f"{spec.seq_len}, got {cfg.vocab_size} and {cfg.seq_len}")
    torch.manual_seed(seed)
    model: LanguageModel = build_model(cfg)
    optimizer = torch.optim.AdamW(model.param_groups(0.01), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        tokens, value = recall_batch(spec, batch_size, gen)
        loss = F.cross_entropy(model(tokens)[:, -1], value)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    test_gen = torch.Generator().manual_seed(10_000 + seed)
    tokens, value = recall_batch(spec, eval_size, test_gen)
    with torch.no_grad():
        logits = torch.cat([model(t)[:, -1] for t in tokens.split(128)])
    return {"accuracy": (logits.argmax(-1) == value).float().mean().item(),
            "chance": 1.0 / spec.num_values, "final_train_loss": loss.item()}
