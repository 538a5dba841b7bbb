"""The relay intervention: replacing nothing is the model itself, replacing everything is the
donor's forward, the masks cover exactly the segments between a value and its query (and as
many before the value), and with the path replaced an ECP query no longer depends on the value
while a transformer's still does."""

from __future__ import annotations

import torch

from ecp_lm.experiments.evidence.relay import intervene, patched_logits, segment_masks
from ecp_lm.experiments.mqar.task import IGNORE, MQARBatch
from helpers import random_tokens, sharp_model

N, M = 32, 8  # four segments of 8


def batch_of(tokens, key_pos, query_pos):
    b = tokens.size(0)
    keys = tokens[torch.arange(b), key_pos]
    values = tokens[torch.arange(b), key_pos + 1]
    targets = torch.full_like(tokens, IGNORE)
    return MQARBatch(tokens, targets, query_pos[:, None], key_pos[:, None], keys[:, None],
                     values[:, None])


def test_nothing_and_everything():
    tokens, donor = random_tokens(2, N, seed=1), random_tokens(2, N, seed=2)
    for arch in ("ecp", "sliding_window", "transformer"):
        model = sharp_model(arch)
        with torch.no_grad():
            none = patched_logits(model, tokens, donor, torch.zeros(2, N, dtype=torch.bool))
            torch.testing.assert_close(none, model(tokens))
            every = patched_logits(model, tokens, donor, torch.ones(2, N, dtype=torch.bool))
            torch.testing.assert_close(every, model(donor))


def test_masks_by_hand():
    tokens = random_tokens(2, N)
    # row 0: value at 9 (segment 1), query at 30 (segment 3): path = segment 2, control = 0;
    # row 1: value at 3 (segment 0), query at 29 (segment 3): path = 1, 2; no control.
    batch = batch_of(tokens, torch.tensor([8, 2]), torch.tensor([30, 29]))
    path, control = segment_masks(batch, M, 0)
    seg = torch.arange(N) // M
    assert path[0].equal(seg == 2) and control[0].equal(seg == 0)
    assert path[1].equal((seg == 1) | (seg == 2)) and not control[1].any()


def test_the_replaced_path_cuts_ecp_from_the_value_not_the_transformer():
    torch.manual_seed(0)
    tokens, donor = random_tokens(4, N, seed=3), random_tokens(4, N, seed=4)
    key_pos, query_pos = torch.full((4,), 8), torch.full((4,), 29)  # value 9 (segment 1)
    other = tokens.clone()
    other[:, 9] = (tokens[:, 9] + 1) % 50  # another value
    batch, changed = batch_of(tokens, key_pos, query_pos), batch_of(other, key_pos, query_pos)
    path, _ = segment_masks(batch, M, 0)  # segment 2
    for arch, depends in (("ecp", False), ("transformer", True)):
        model = sharp_model(arch)  # two ECP layers reach segment 1 from 3 only through 2
        with torch.no_grad():
            a = patched_logits(model, batch.tokens, donor, path)[:, 29]
            b = patched_logits(model, changed.tokens, donor, path)[:, 29]
            unpatched = model(batch.tokens)[:, 29], model(changed.tokens)[:, 29]
        assert not torch.allclose(*unpatched)  # the value matters to both, unpatched
        assert torch.allclose(a, b) != depends, arch
    report = intervene(sharp_model("ecp"), batch, batch_of(donor, key_pos, query_pos), M)
    assert set(report) == {"2"} and report["2"]["queries"] == 4
    assert report["2"]["control_queries"] == 4  # segment 0, before the value's


def test_binding_batch_and_probe():
    from ecp_lm.experiments.evidence.relay import binding_batch, binding_probe
    from ecp_lm.experiments.mqar.budgets import BUDGETS

    spec, m = BUDGETS["tiny"].spec, BUDGETS["tiny"].segment_len
    tokens, keys, values = binding_batch(spec, m, 3, 50, torch.Generator().manual_seed(0))
    for row in range(50):
        assert len(set(keys[row].tolist())) == 3  # distinct keys
        for j in range(3):  # pair j inside segment j: its key, then its value
            segment = tokens[row, j * m:(j + 1) * m].tolist()
            at = segment.index(keys[row, j].item())
            assert segment[at + 1] == values[row, j].item()
        planted = (tokens[row] < spec.values_start).sum().item()
        assert planted == 3  # no other key anywhere: filler elsewhere
    model = sharp_model("ecp", vocab_size=spec.vocab_size, seq_len=spec.seq_len,
                        num_segments=spec.seq_len // m, n_layers=2)
    report = binding_probe(model, spec, m, 3, 64, 32)
    assert report["segments"] == list(range(2, spec.seq_len // m))
    assert len(report["accuracy"]) == 3 and all(
        len(r) == len(report["segments"]) and all(0 <= v <= 1 for v in r)
        for r in report["accuracy"])
