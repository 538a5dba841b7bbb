"""The MQAR experiment: its sequences are what they claim (checked position by position), full
attention learns it, block_local cannot carry a pair across blocks, the linear probe reads what
is there, and the runner writes its reports and resumes without training again."""

from __future__ import annotations

import json

import pytest
import torch

from ecp_lm import ModelConfig, build_model
from ecp_lm.experiments import mqar
from ecp_lm.experiments.mqar.budgets import BUDGETS
from ecp_lm.experiments.mqar.linear_probe import (
    layer_states,
    probe_accuracy,
    query_probe,
    segment_probe,
)
from ecp_lm.experiments.mqar.task import IGNORE, MQARSpec, mqar_batch, single_pair_batch
from ecp_lm.experiments.mqar.train import TrainSpec, mqar_loss, segment_offset, train_mqar
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
        planted = {t for t in key_at} | {t + 1 for t in key_at}
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


def test_vocabulary_ranges_are_disjoint_and_cover_the_vocabulary():
    ranges = [set(range(0, SPEC.num_keys)),
              set(range(SPEC.values_start, SPEC.filler_start)),
              set(range(SPEC.filler_start, SPEC.vocab_size))]
    assert sum(len(r) for r in ranges) == SPEC.vocab_size == len(set().union(*ranges))
    assert (len(ranges[0]), len(ranges[1]), len(ranges[2])) == (8, 8, 16)


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


@pytest.mark.parametrize("name", list(BUDGETS))
def test_budget_distances_lie_beyond_one_ecp_layer_and_within_its_reach(name):
    budget = BUDGETS[name]
    m = budget.segment_len
    assert m == ModelConfig(arch="ecp", seq_len=budget.spec.seq_len,
                            num_segments=budget.num_segments).segment_len
    assert 2 * m < budget.spec.d_min <= budget.spec.d_max <= budget.reach_depth * m
    assert budget.reach_depth in budget.depths
    # block_local's blocks (2m) never hold a pair and its query together.
    assert budget.spec.d_min > 2 * m


def test_single_pair_sequences_leave_room_for_every_offset():
    tokens, value_pos, values = single_pair_batch(SPEC, M, 5, 200,
                                                  torch.Generator().manual_seed(5))
    rows = torch.arange(200)
    assert ((value_pos // M + 5) * M + M - 1 < SPEC.seq_len).all()
    assert torch.equal(tokens[rows, value_pos], values)
    assert (tokens[rows, value_pos - 1] < SPEC.num_keys).all()
    assert ((tokens < SPEC.values_start).sum(1) == 1).all()  # one key, no query


# Training ---------------------------------------------------------------------------------------

def test_a_transformer_learns_the_task_well_above_chance():
    spec = MQARSpec(seq_len=32, num_pairs=2, num_queries=2, d_min=9, d_max=16, num_keys=8,
                    num_values=8, num_filler=8)
    cfg = ModelConfig(arch="transformer", vocab_size=spec.vocab_size, d_model=32, n_layers=2,
                      n_heads=2, seq_len=32, num_segments=4)
    train = TrainSpec(steps=300, batch_size=32, lr=3e-3, warmup_steps=20, eval_every=150,
                      eval_size=256)
    _, result = train_mqar(cfg, spec, train, segment_len=8)
    assert [p["step"] for p in result["curve"]] == [0, 150, 300]
    assert result["curve"][0]["accuracy"] < 0.3
    assert result["accuracy"] > 0.7, result["curve"]  # chance 1/8


def test_the_loss_is_taken_only_at_the_queries():
    model = model_for(SPEC, "transformer", 1)
    batch = mqar_batch(SPEC, 4, torch.Generator().manual_seed(6))
    logits = model(batch.tokens)
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)
    assert torch.allclose(mqar_loss(model, batch), expected)


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


# Probes ----------------------------------------------------------------------------------------

def test_layer_states_are_the_residual_stream():
    model = model_for(SPEC, "ecp", 2)
    tokens = mqar_batch(SPEC, 3, torch.Generator().manual_seed(10)).tokens
    positions = torch.tensor([[0, 5, 63]] * 3)
    states = layer_states(model, tokens, positions)
    assert states.shape == (3, 3, 3, 32)
    assert torch.allclose(states[0], model.embed(tokens)[torch.arange(3)[:, None], positions])
    final = model.norm(states[-1])
    assert torch.allclose(final, model.hidden_states(tokens)[torch.arange(3)[:, None],
                                                              positions], atol=1e-5)


def test_linear_probe_reads_a_planted_label_and_not_noise():
    gen = torch.Generator().manual_seed(11)
    labels = torch.randint(0, 8, (600,), generator=gen)
    codes = torch.randn(8, 16, generator=gen)
    x = codes[labels] + 0.1 * torch.randn(600, 16, generator=gen)
    assert probe_accuracy(x[:400], labels[:400], x[400:], labels[400:], 8) > 0.98
    noise = torch.randn(600, 16, generator=gen)
    assert probe_accuracy(noise[:400], labels[:400], noise[400:], labels[400:], 8) < 0.3


def test_segment_probe_grid_shape_and_the_trivial_read_out():
    model = model_for(SPEC, "ecp", 2)
    grid = segment_probe(model, SPEC, M, max_offset=3, n_train=256, n_test=128, anchor="value")
    acc = grid["accuracy"]
    assert (len(acc), len(acc[0])) == (3, 4) and grid["offsets"] == [0, 1, 2, 3]
    # The embedding at the value's own position is the value's embedding: read exactly.
    assert acc[0][0] > 0.99
    # The embedding one or more segments later is a filler token's: nothing to read.
    assert max(acc[0][1:]) < 0.35
    ends = segment_probe(model, SPEC, M, max_offset=2, n_train=64, n_test=32)
    assert (len(ends["accuracy"]), len(ends["accuracy"][0])) == (3, 3)


def test_query_probe_grid_shape():
    model = model_for(SPEC, "transformer", 3)
    grid = query_probe(model, SPEC, M, n_train=64, n_test=32)
    assert len(grid["accuracy"]) == 4 == len(grid["overall"])
    assert grid["offsets"] == [2, 3, 4]
    assert all(len(row) == 3 for row in grid["accuracy"])


# The runner -----------------------------------------------------------------------------------

def test_runner_writes_reports_and_resumes_without_training(tmp_path, monkeypatch):
    out = tmp_path / "mqar"
    assert mqar.main(["--budget", "tiny", "--out", str(out), "--quiet", "--threads", "1"]) == 0
    budget = BUDGETS["tiny"]
    summary = json.loads((out / "results.json").read_text())
    runs = summary["runs"]
    assert len(runs) == len(budget.archs) * len(budget.depths)
    for run in runs:
        assert run["curve"][-1]["step"] == budget.train.steps
        assert (out / run["arch"] / f"L{run['n_layers']}" / "result.json").is_file()
        assert len(run["segment_probe"]["accuracy"]) == run["n_layers"] + 1
    text = (out / "results.md").read_text()
    assert "## Held-out accuracy against training steps" in text and "Segment probe" in text
    for png in ("accuracy_vs_steps", "accuracy_vs_depth", "segment_probe", "query_probe"):
        assert (out / f"{png}.png").read_bytes().startswith(b"\x89PNG")

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(mqar, "train_mqar", no_training)
    (out / "results.md").unlink()
    assert mqar.main(["--budget", "tiny", "--out", str(out), "--quiet", "--threads", "1"]) == 0
    assert (out / "results.md").read_text() == text
    # Another step count does not mix with the folder's runs.
    with pytest.raises(ValueError, match="use another --out"):
        mqar.run_experiment("tiny", out, steps=3, progress=False)
    assert mqar.main(["--budget", "tiny", "--out", str(out), "--quiet", "--threads", "1",
                      "--steps", "3"]) == 2  # the same, as one line
