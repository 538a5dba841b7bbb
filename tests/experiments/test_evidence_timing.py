"""Evidence III's step times (``timing.timed_steps``): kept times are read back only when they
cover every model asked for; otherwise every model is timed again, in this invocation."""

from __future__ import annotations

import json

from ecp_lm.bench import core
from ecp_lm.config import ModelConfig
from ecp_lm.experiments.evidence.timing import timed_steps


def test_times_are_kept_only_when_they_cover_every_model(tmp_path, monkeypatch):
    measured = []

    def fake_step_seconds(cfg, spec):
        measured.append((cfg.arch, spec.batch_size, spec.warmup, spec.repeats))
        return 0.1 * len(measured)

    monkeypatch.setattr(core, "step_seconds", fake_step_seconds)
    ecp = ModelConfig(arch="ecp", vocab_size=256, d_model=32, n_layers=2, n_heads=2,
                      seq_len=64, num_segments=4)
    models = {"ecp": (ecp, 4), "transformer": (ModelConfig(**{**ecp.to_dict(),
                                                              "arch": "transformer"}), 8)}
    path = tmp_path / "step_s.json"
    path.write_text(json.dumps({"ecp": 9.0}))
    times = timed_steps(models, path)  # the kept file lacks the transformer: both timed again
    assert measured == [("ecp", 4, 1, 3), ("transformer", 8, 1, 3)]
    assert times == {"ecp": 0.1, "transformer": 0.2} == json.loads(path.read_text())
    assert timed_steps({"ecp": models["ecp"]}, path) == times and len(measured) == 2
    assert timed_steps(models, path) == times and len(measured) == 2
