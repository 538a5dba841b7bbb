"""Multi-query associative recall (``studies.mqar``): its sequences are what they claim (checked
position by position), the loss is taken at the queries only, every query's loss and
correctness are the ones the overall numbers average, full attention learns the task,
block_local cannot carry a pair across blocks and ECP carries it exactly within its layers'
reach; Evidence IV's recall tasks put every pair beyond one ECP layer and within its deepest."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecp_lm import ModelConfig, build_model
from ecp_lm.studies import specs
from ecp_lm.studies.recall import task_specs
from ecp_lm.studies.spec import Recall
from ecp_lm.training.mqar import (
    IGNORE,
    MQARSpec,
    TrainSpec,
    accuracy_by_offset,
    evaluate,
    mqar_batch,
    mqar_loss,
    segment_offset,
    train_mqar,
    unpack_queries,
)
from helpers import sharpen

SPEC = MQARSpec(seq_len=64, num_pairs=5, num_queries=3, d_min=17, d_max=32, num_keys=8,
                num_values=8, num_filler=16)
M = 8  # segment length of the models below (seq_len 64, 8 segments)


def model_for(spec: MQARSpec, arch: str, n_layers: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=spec.vocab_size, d_model=32, n_layers=n_layers,
                      n_heads=2, seq_len=spec.seq_len, num_segments=spec.seq_len // M,
                      **overrides)
    return build_model(cfg).eval()


@pytest.fixture(autouse=True)
def one_thread():
    """These small models run several times faster on one thread than on two that share a busy
    machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The data ---------------------------------------------------------------------------------------

def test_every_query_has_its_key_once_before_it_at_a_distance_in_range():
    batch = mqar_batch(SPEC, 300, torch.Generator().manual_seed(1))
    keys = range(SPEC.num_keys)
    values = range(SPEC.num_keys, SPEC.num_keys + SPEC.num_values)
    distances = []
    for b in range(300):
        row, targets = batch.tokens[b].tolist(), batch.targets[b].tolist()
        scored = [t for t, y in enumerate(targets) if y != IGNORE]
        assert len(scored) == SPEC.num_queries
        # Key tokens: every planted key once, and again at each of its queries.
        key_at = [t for t, tok in enumerate(row) if tok in keys]
        assert len(key_at) == SPEC.num_pairs + SPEC.num_queries
        for q in scored:
            key = row[q]
            assert key in keys
            before = [t for t in range(q) if row[t] == key]
            assert len(before) == 1, (b, q, before)
            k = before[0]
            assert SPEC.d_min <= q - k <= SPEC.d_max
            assert row[k + 1] in values
            assert targets[q] == row[k + 1]  # the target is that key's value...
            assert q + 1 < SPEC.seq_len and row[q + 1] == targets[q]  # ...which follows it
            distances.append(q - k)
        # Every key token that is not a query is followed by a value (a planted pair).
        for t in key_at:
            if t not in scored:
                assert row[t + 1] in values
        # Outside pairs and queries: filler only.
        planted = set(key_at) | {t + 1 for t in key_at}
        for t, tok in enumerate(row):
            if t not in planted:
                assert SPEC.filler_start <= tok < SPEC.vocab_size
        # The distinct keys of one sequence.
        assert len({row[t] for t in key_at}) == SPEC.num_pairs
    assert min(distances) == SPEC.d_min and max(distances) == SPEC.d_max  # the whole range


def test_batch_fields_agree_with_the_tokens_and_the_mask():
    batch = mqar_batch(SPEC, 64, torch.Generator().manual_seed(2))
    rows = torch.arange(64)[:, None]
    expected = torch.zeros_like(batch.mask)
    expected[rows, batch.query_pos] = True
    assert torch.equal(batch.mask, expected)
    assert torch.equal(batch.tokens[rows, batch.query_pos], batch.keys)
    assert torch.equal(batch.tokens[rows, batch.key_pos], batch.keys)
    assert torch.equal(batch.tokens[rows, batch.key_pos + 1], batch.values)
    assert torch.equal(batch.targets[rows, batch.query_pos], batch.values)
    assert torch.equal(batch.distance, batch.query_pos - batch.key_pos)


def test_vocabulary_ranges_are_disjoint_and_cover_the_vocabulary():
    ranges = [set(range(0, SPEC.num_keys)),
              set(range(SPEC.values_start, SPEC.filler_start)),
              set(range(SPEC.filler_start, SPEC.vocab_size))]
    assert sum(len(r) for r in ranges) == SPEC.vocab_size == len(set().union(*ranges))
    assert (len(ranges[0]), len(ranges[1]), len(ranges[2])) == (8, 8, 16)
    assert SPEC.chance == 1 / 8


def test_same_seed_same_batch():
    a = mqar_batch(SPEC, 16, torch.Generator().manual_seed(3))
    b = mqar_batch(SPEC, 16, torch.Generator().manual_seed(3))
    c = mqar_batch(SPEC, 16, torch.Generator().manual_seed(4))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.tokens, c.tokens)


def test_bad_specs():
    with pytest.raises(ValueError, match="d_min=40 <= d_max=30"):
        MQARSpec(d_min=40, d_max=30)
    with pytest.raises(ValueError, match="num_queries=5 <= num_pairs=4"):
        MQARSpec(num_pairs=4, num_queries=5)
    with pytest.raises(ValueError, match="more than half"):
        MQARSpec(seq_len=64, num_pairs=16, num_queries=16)
    with pytest.raises(ValueError, match="schedule='linear'"):
        TrainSpec(schedule="linear")


def recall_stages():
    study = specs.load("evidence4")
    return [(budget, s) for budget in study.budgets for s in study.stages(budget).values()
            if isinstance(s.task, Recall)]


@pytest.mark.parametrize(("budget", "stage"), recall_stages(),
                         ids=[budget for budget, _ in recall_stages()])
def test_evidence4_pairs_lie_beyond_one_ecp_layer_and_within_its_deepest(budget, stage):
    """Every query of the study's recall task is 2 to max(depths) segments after its value: one
    ECP layer never sees the pair, the deepest model always can; no key is within 2m of its
    query."""
    spec = task_specs(stage)[0]
    m = ModelConfig(arch="ecp", seq_len=spec.seq_len,
                    num_segments=stage.task.num_segments).segment_len
    assert m == spec.seq_len // stage.task.num_segments
    assert 2 * m < spec.d_min <= spec.d_max <= max(stage.task.depths) * m
    offsets = segment_offset(mqar_batch(spec, 512, torch.Generator().manual_seed(0)), m)
    assert offsets.min() >= 2 and offsets.max() <= max(stage.task.depths)
    assert stage.task.select_depth in stage.task.depths


# Training ---------------------------------------------------------------------------------------

LEARNED = MQARSpec(seq_len=32, num_pairs=2, num_queries=2, d_min=9, d_max=16, num_keys=8,
                   num_values=8, num_filler=8)


@pytest.fixture(scope="module")
def learned():
    """A transformer trained on ``LEARNED`` (segments of 8), and its record."""
    from ecp_lm.runtime import torch_threads

    cfg = ModelConfig(arch="transformer", vocab_size=LEARNED.vocab_size, d_model=32,
                      n_layers=2, n_heads=2, seq_len=32, num_segments=4)
    train = TrainSpec(steps=300, batch_size=32, lr=3e-3, warmup_steps=20, eval_every=150,
                      eval_size=256)
    with torch_threads(1):
        return train_mqar(cfg, LEARNED, train, segment_len=8)


def test_a_transformer_learns_the_task_well_above_chance(learned):
    model, result = learned
    assert [p["step"] for p in result["curve"]] == [0, 150, 300]
    assert result["curve"][0]["accuracy"] < 0.3
    assert result["accuracy"] > 0.7, result["curve"]  # chance 1/8
    # Every held-out query's correctness and loss, whose means are the reported numbers.
    correct, loss = unpack_queries(result["per_query"])
    per_query = {"correct": correct, "loss": loss}
    assert len(per_query["correct"]) == len(per_query["loss"]) == 256 * LEARNED.num_queries
    assert set(per_query["correct"]) == {0, 1}
    assert sum(per_query["correct"]) / len(per_query["correct"]) == pytest.approx(
        result["accuracy"], abs=1e-6)
    assert sum(per_query["loss"]) / len(per_query["loss"]) == pytest.approx(
        result["loss"], abs=1e-4)  # each loss kept to 5 significant digits
    assert result["chance"] == 1 / 8 and result["params"] == model.num_params()
    # The held-out set is seed 0's (0 + 1_000_003), its queries listed sequence by sequence.
    held_out = mqar_batch(LEARNED, 256, torch.Generator().manual_seed(1_000_003))
    final = evaluate(model, held_out)
    assert per_query["correct"] == final["correct"].flatten().int().tolist()
    offset = segment_offset(held_out, 8)
    weighted = sum(acc * (offset == o).sum().item()
                   for o, acc in result["accuracy_by_offset"].items())
    assert weighted / offset.numel() == pytest.approx(result["accuracy"])


def test_the_loss_is_taken_only_at_the_queries():
    model = model_for(SPEC, "transformer", 1)
    batch = mqar_batch(SPEC, 4, torch.Generator().manual_seed(6))
    logits = model(batch.tokens)
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(),
                               ignore_index=IGNORE)
    assert torch.allclose(mqar_loss(model, batch), expected)


def test_each_querys_loss_and_correctness_are_what_the_overall_numbers_average(learned):
    """``evaluate``'s (B, Q) losses and hits are each query's own cross-entropy and argmax hit
    (read off the full forward here), whatever the chunk; their means are the loss and the
    accuracy; the accuracies per segment offset average back to the overall one."""
    model = learned[0]
    batch = mqar_batch(LEARNED, 40, torch.Generator().manual_seed(12))
    q = LEARNED.num_queries
    result = evaluate(model, batch)
    assert result["per_query_loss"].shape == result["correct"].shape == (40, q)
    with torch.no_grad():
        logits = model(batch.tokens)
    for b in range(40):
        for j in range(q):
            at = logits[b, batch.query_pos[b, j]]
            value = batch.values[b, j]
            assert result["per_query_loss"][b, j].item() == pytest.approx(
                F.cross_entropy(at[None], value[None]).item(), rel=1e-5, abs=1e-6)
            assert result["correct"][b, j].item() == (at.argmax().item() == value.item())
    assert result["loss"] == pytest.approx(result["per_query_loss"].mean().item())
    assert result["accuracy"] == pytest.approx(result["correct"].float().mean().item())
    assert 0 < result["accuracy"] < 1  # both kinds of query present: the check could fail
    chunked = evaluate(model, batch, chunk=7)
    assert torch.equal(chunked["correct"], result["correct"])
    assert torch.allclose(chunked["per_query_loss"], result["per_query_loss"], atol=1e-5)
    offset = segment_offset(batch, 8)
    by_offset = accuracy_by_offset(result["correct"], batch, 8)
    assert set(by_offset) == set(offset.unique().tolist())
    weighted = sum(acc * (offset == o).sum().item() for o, acc in by_offset.items())
    assert weighted / offset.numel() == pytest.approx(result["accuracy"])


# What each architecture can see ----------------------------------------------------------------

def perturbed_value_changes(model, batch) -> list[bool]:
    """For each (sequence, query): does replacing the planted value change the query's
    logits at all?"""
    base = model(batch.tokens)
    changed = []
    for b in range(batch.tokens.size(0)):
        for j in range(batch.query_pos.size(1)):
            tokens = batch.tokens[b:b + 1].clone()
            k, q = batch.key_pos[b, j].item(), batch.query_pos[b, j].item()
            old = tokens[0, k + 1].item()
            tokens[0, k + 1] = SPEC.values_start + (old - SPEC.values_start + 1) % \
                SPEC.num_values
            changed.append(not torch.equal(model(tokens)[0, q], base[b, q]))
    return changed


@torch.no_grad()
def test_block_local_never_sees_a_pair_in_an_earlier_block():
    # Blocks of 2m = 16; every key is 17..32 positions before its query, so always in an
    # earlier block: the query's logits do not depend on the value at all, at any depth.
    model = sharpen(model_for(SPEC, "block_local", 3)).eval()
    assert model.cfg.block_len == 2 * M < SPEC.d_min
    batch = mqar_batch(SPEC, 6, torch.Generator().manual_seed(7))
    assert not any(perturbed_value_changes(model, batch))
    # The same perturbation reaches the query in a transformer.
    full = sharpen(model_for(SPEC, "transformer", 3)).eval()
    assert all(perturbed_value_changes(full, batch))


@torch.no_grad()
def test_block_local_does_see_a_pair_in_the_same_block():
    spec = MQARSpec(seq_len=64, num_pairs=1, num_queries=1, d_min=2, d_max=3, num_keys=8,
                    num_values=8, num_filler=16)
    model = sharpen(model_for(spec, "block_local", 2)).eval()
    batch = mqar_batch(spec, 40, torch.Generator().manual_seed(8))
    same = (batch.query_pos // 16 == (batch.key_pos + 1) // 16).flatten().tolist()
    changed = perturbed_value_changes(model, batch)
    assert any(same) and not all(same)
    assert changed == same


@torch.no_grad()
def test_ecp_sees_a_pair_exactly_within_its_layers_reach():
    # Values 2..4 segments before their queries: L = 1 sees none, L = 2 only offset 2, L = 4
    # all of them.
    batch = mqar_batch(SPEC, 8, torch.Generator().manual_seed(9))
    offset = segment_offset(batch, M).flatten()
    assert set(offset.tolist()) == {2, 3, 4}
    for layers in (1, 2, 4):
        model = sharpen(model_for(SPEC, "ecp", layers)).eval()
        changed = torch.tensor(perturbed_value_changes(model, batch))
        assert torch.equal(changed, offset <= layers), layers
