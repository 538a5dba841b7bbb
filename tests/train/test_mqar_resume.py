"""An MQAR training run with a checkpoint file (``studies.mqar.train_mqar``), SIGKILLed at random
instants and started again each time, ends with the weights, the curve and the per-query
results of a run never stopped; its state file is the run's own (another run's is refused) and
is gone once training ends."""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ecp_lm.config import ModelConfig
from ecp_lm.training.mqar import MQARSpec, TrainSpec, train_mqar
from helpers import run_child

# The task and model of the old MQAR experiment's tiny budget: N = 64 in 8 segments of 8.
SPEC = MQARSpec(seq_len=64, num_pairs=4, num_queries=4, d_min=17, d_max=32, num_keys=8,
                num_values=8, num_filler=16)
NUM_SEGMENTS, SEGMENT_LEN, MODEL = 8, 8, dict(d_model=16, n_heads=2)
TRAIN = TrainSpec(steps=40, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=20,
                  eval_size=64)
STEPS, EVAL_EVERY = 240, 10

CHILD = """
import json, sys
sys.path[:0] = [{here!r}, {tests!r}]  # this module and the helpers it imports
from dataclasses import replace
from pathlib import Path
import torch
from safetensors.torch import save_file
from ecp_lm.config import ModelConfig
from ecp_lm.training.mqar import train_mqar
from test_mqar_resume import MODEL, NUM_SEGMENTS, SEGMENT_LEN, SPEC, TRAIN
torch.set_num_threads(1)
cfg = ModelConfig(arch="ecp", vocab_size=SPEC.vocab_size, n_layers=2, seq_len=SPEC.seq_len,
                  num_segments=NUM_SEGMENTS, **MODEL)
train = replace(TRAIN, steps={steps}, eval_every={every}, warmup_steps=20)
out = Path({out!r})
model, result = train_mqar(cfg, SPEC, train, SEGMENT_LEN,
                           checkpoint=out / "train-state.pt" if {resume} else None)
save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, out / "model.safetensors")
curve = [{{k: v for k, v in point.items() if k != "elapsed_s"}} for point in result["curve"]]
(out / "result.json").write_text(json.dumps({{"curve": curve, "accuracy": result["accuracy"],
                                            "per_query": result["per_query"]}}))
print("done")
"""


def child(out: Path, resume: bool) -> str:
    out.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    return CHILD.format(here=str(here), tests=str(here.parent), steps=STEPS, every=EVAL_EVERY,
                        out=str(out), resume=resume)


def test_killed_and_resumed_equals_never_stopped(tmp_path):
    assert not run_child(child(tmp_path / "clean", resume=False))
    start = time.perf_counter()  # how long a warm uninterrupted child takes here, now
    assert not run_child(child(tmp_path / "timed", resume=False))
    whole = time.perf_counter() - start
    killed = tmp_path / "killed"
    state = killed / "train-state.pt"
    rng = random.Random(0)
    resumed_from = []
    for _ in range(16):  # random instants, until three kills have left a state behind
        was_killed = run_child(child(killed, resume=True),
                               kill_after=rng.uniform(0.3, 0.95) * whole)
        if (killed / "result.json").exists():  # done (a kill may land during the exit)
            if resumed_from:
                break
            shutil.rmtree(killed)  # done before any kill left a state: start again
            continue
        if was_killed and state.exists():
            resumed_from.append(torch.load(state, weights_only=True)["step"])
        if len(resumed_from) == 3:
            break
    assert resumed_from and max(resumed_from) > 0, "no kill landed after a checkpoint"
    assert all(step % EVAL_EVERY == 0 and 0 < step < STEPS for step in resumed_from)
    if not (killed / "result.json").exists():
        assert not run_child(child(killed, resume=True))
    assert not state.exists()
    a, b = (load_file(d / "model.safetensors") for d in (tmp_path / "clean", killed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    clean, resumed = (json.loads((d / "result.json").read_text())
                      for d in (tmp_path / "clean", killed))
    assert resumed == clean
    assert [p["step"] for p in clean["curve"]] == list(range(0, STEPS + 1, EVAL_EVERY))


def stopped_at_first_save(monkeypatch, cfg, train, state) -> None:
    """``cfg`` trained with ``state`` as its checkpoint, stopped right after its first save."""
    import ecp_lm.training.mqar as module

    real = module._save_state

    class StopError(Exception):
        pass

    def save_and_stop(*args):
        real(*args)
        raise StopError

    with monkeypatch.context() as patch:
        patch.setattr(module, "_save_state", save_and_stop)
        with pytest.raises(StopError):
            train_mqar(cfg, SPEC, train, SEGMENT_LEN, checkpoint=state)


def test_another_runs_state_is_refused(tmp_path, monkeypatch):
    cfg = ModelConfig(arch="ecp", vocab_size=SPEC.vocab_size, n_layers=2,
                      seq_len=SPEC.seq_len, num_segments=NUM_SEGMENTS, **MODEL)
    train = replace(TRAIN, steps=20, eval_every=10)
    state = tmp_path / "train-state.pt"
    stopped_at_first_save(monkeypatch, cfg, train, state)
    assert torch.load(state, weights_only=True)["step"] == 10
    with pytest.raises(ValueError, match="state of another run"):
        train_mqar(cfg, SPEC, replace(train, lr=train.lr / 2), SEGMENT_LEN,
                   checkpoint=state)
    _, result = train_mqar(cfg, SPEC, train, SEGMENT_LEN, checkpoint=state)
    assert [p["step"] for p in result["curve"]] == [0, 10, 20] and not state.exists()


def test_a_field_added_at_its_default_keeps_the_state(tmp_path, monkeypatch):
    """A later release's config has one more field, at its default: a state saved before it
    is still this run's own."""
    import dataclasses

    @dataclasses.dataclass
    class LaterConfig(ModelConfig):
        later_field: int = 0

    common = dict(arch="ecp", vocab_size=SPEC.vocab_size, n_layers=2, seq_len=SPEC.seq_len,
                  num_segments=NUM_SEGMENTS, **MODEL)
    train = replace(TRAIN, steps=20, eval_every=10)
    state = tmp_path / "train-state.pt"
    stopped_at_first_save(monkeypatch, ModelConfig(**common), train, state)
    _, result = train_mqar(LaterConfig(**common), SPEC, train, SEGMENT_LEN, checkpoint=state)
    assert [p["step"] for p in result["curve"]] == [0, 10, 20] and not state.exists()
    stopped_at_first_save(monkeypatch, ModelConfig(**common), train, state)
    with pytest.raises(ValueError, match="state of another run"):
        train_mqar(LaterConfig(**common, later_field=1), SPEC, train, SEGMENT_LEN,
                   checkpoint=state)
