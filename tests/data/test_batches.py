"""Training windows (seeded, resumable, sharded) and the SPEC §6 evaluation stream."""

import numpy as np
import pytest

from ecp_lm.data.batches import TrainWindows, eval_batches, eval_windows

TOKENS = np.arange(1000, dtype=np.uint16)


def test_windows_are_contiguous_next_token_pairs():
    batch = TrainWindows(TOKENS, seq_len=16, batch_size=4, seed=0).batch(0)
    assert batch.shape == (4, 17)
    assert (batch[:, 1:] - batch[:, :-1] == 1).all()  # consecutive stream tokens


def test_deterministic_for_a_seed():
    a = TrainWindows(TOKENS, 16, 4, seed=3)
    b = TrainWindows(TOKENS, 16, 4, seed=3)
    c = TrainWindows(TOKENS, 16, 4, seed=4)
    assert all((a.batch(s) == b.batch(s)).all() for s in range(20))
    assert any((a.batch(s) != c.batch(s)).any() for s in range(20))


def test_resume_from_a_step_gives_the_same_batch():
    run = TrainWindows(TOKENS, 16, 4, seed=1)
    seen = [run.batch(s) for s in range(30)]
    resumed = TrainWindows(TOKENS, 16, 4, seed=1)  # a fresh process after step 17
    for s in range(17, 30):
        assert (resumed.batch(s) == seen[s]).all()


def test_ranks_take_disjoint_windows():
    world = 3
    ranks = [TrainWindows(TOKENS, 16, 4, seed=0, rank=r, world_size=world) for r in range(world)]
    for step in range(5):  # within an epoch (62 windows, 12 per step)
        starts = [set(r.starts(step).tolist()) for r in ranks]
        assert sum(len(s) for s in starts) == 12 == len(set.union(*starts))


def test_an_epoch_visits_every_window_once():
    run = TrainWindows(TOKENS, 10, 9, seed=0)  # 99 windows, 11 steps
    starts = np.concatenate([run.starts(s) for s in range(11)])
    offset = starts.min()
    assert sorted(starts.tolist()) == [offset + 10 * i for i in range(99)]


def test_too_few_tokens():
    with pytest.raises(ValueError, match="16 tokens are fewer than one training window of "
                                         "seq_len\\+1=17"):
        TrainWindows(np.arange(16), 16, 2)
    with pytest.raises(ValueError, match="rank=2"):
        TrainWindows(TOKENS, 16, 2, rank=2, world_size=2)


@pytest.mark.parametrize("num_tokens, seq_len, stride", [
    (17, 16, 8), (18, 16, 8), (100, 16, 8), (101, 16, 5), (64, 16, 16), (50, 16, 1)])
def test_eval_scores_each_target_once(num_tokens, seq_len, stride):
    scored = []
    for w in eval_windows(num_tokens, seq_len, stride):
        last = w.start + seq_len  # targets of this window: start+1 .. start+N
        targets = range(last - w.num_scored + 1, last + 1)
        assert all(t - w.start - 1 >= seq_len - stride for t in targets)  # context >= N - k
        assert 1 <= w.num_scored <= stride and last <= num_tokens - 1
        scored.extend(targets)
    assert scored == list(range(seq_len - stride + 1, num_tokens))


def test_eval_same_targets_for_any_batch_size():
    tokens = np.arange(200)
    a = [(b.tolist(), n) for b, n in eval_batches(tokens, 16, 8, batch_size=3)]
    b = [(b.tolist(), n) for b, n in eval_batches(tokens, 16, 8, batch_size=7)]
    flat = lambda xs: [(row, k) for rows, ns in xs for row, k in zip(rows, ns, strict=True)]  # noqa: E731
    assert flat(a) == flat(b)


def test_eval_errors():
    with pytest.raises(ValueError, match="stride=0"):
        eval_windows(100, 16, 0)
    with pytest.raises(ValueError, match="16 tokens are fewer than one evaluation window"):
        eval_windows(16, 16, 8)
