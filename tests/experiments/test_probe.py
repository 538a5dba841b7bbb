"""The long-range recall probe: its sequences are well formed, full attention can solve it, and
an ECP whose receptive field ends before the pair cannot."""

import pytest
import torch

from ecp_lm.config import ModelConfig
from ecp_lm.experiments.probe import RecallSpec, recall_batch, train_probe

SPEC = RecallSpec(seq_len=32, min_gap=10, max_gap=14, num_keys=8, num_values=8, num_filler=16)


def test_sequences_plant_the_pair_at_the_right_distance():
    tokens, value = recall_batch(SPEC, 256, torch.Generator().manual_seed(0))
    keys, marker = tokens[:, -1], SPEC.num_keys + SPEC.num_values + SPEC.num_filler
    assert (tokens[:, -2] == marker).all() and (keys < SPEC.num_keys).all()
    for row, key, val in zip(tokens, keys, value, strict=True):
        where = (row[:-1] == key).nonzero().flatten()
        assert len(where) == 1  # the key appears once before the query
        assert row[where + 1] == val and SPEC.min_gap <= 31 - (where + 1) <= SPEC.max_gap
    assert ((tokens >= SPEC.num_keys) | (tokens == keys[:, None])).all()


def test_bad_gaps():
    with pytest.raises(ValueError, match="min_gap=20 <= max_gap=10"):
        RecallSpec(seq_len=32, min_gap=20, max_gap=10)


def model(arch: str, n_layers: int, num_segments: int = 8) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=SPEC.vocab_size, d_model=32, n_layers=n_layers,
                       n_heads=2, seq_len=SPEC.seq_len, num_segments=num_segments)


def test_full_attention_solves_it():
    result = train_probe(model("transformer", 2), SPEC, steps=250, eval_size=256)
    assert result["accuracy"] > 0.9


def test_ecp_cannot_reach_past_its_receptive_field():
    # m = 4, L = 1: the query sees at most 7 positions back, the value is 10 to 14 back.
    result = train_probe(model("ecp", 1), SPEC, steps=150, eval_size=512)
    assert result["accuracy"] < 0.25  # chance is 1/8
