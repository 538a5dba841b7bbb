"""A language stage's measures (``studies.language``): the context gain scores the same targets
with windows of N and of 2m (on a constructed stream, both score exactly the targets from
N - k + 1 to the end, their count and bytes counted here by hand, and the score with windows of
2m is the one of the same windows read from N - k - m on), and a scoring of other targets is
refused; a rate trial's score is the mean over its seeds."""

from __future__ import annotations

import pytest
import torch

from ecp_lm import build_model
from ecp_lm.data.tokenizers import ByteTokenizer
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.run.checkpoint import save_checkpoint
from ecp_lm.run.config import RunConfig
from ecp_lm.studies.language import context_gain, trial_means
from helpers import TINY, sharpen, write_corpus


@pytest.mark.parametrize("max_tokens", [None, 1000])
def test_both_windows_score_the_same_targets(tmp_path, max_tokens):
    corpus = write_corpus(tmp_path / "corpus.txt")
    cfg = RunConfig.from_dict({
        "model": {**TINY, "vocab_size": 256, "arch": "ecp"},
        "data": {"source": "text", "path": str(corpus), "cache_dir": str(tmp_path / "cache")}})
    torch.manual_seed(0)
    model = sharpen(build_model(cfg.model))
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), cfg, ByteTokenizer(), None,
                    {"step": 0})
    n, m = TINY["seq_len"], TINY["seq_len"] // TINY["num_segments"]  # 32 and 8
    full = evaluate_checkpoint(tmp_path / "ckpt", "valid", max_tokens=max_tokens,
                               progress=False)
    gain = context_gain(tmp_path / "ckpt", "valid", cfg.model.to_dict(), max_tokens, full)

    k = full["stride"]  # min(N/2, l) = 16: windows of N score from target 17 on
    valid = corpus.read_bytes()
    valid = valid[int(len(valid) * 0.9):int(len(valid) * 0.95)]  # the 90/5/5 byte split
    stream = valid[:max_tokens] if max_tokens else valid
    targets = stream[n - k + 1:]
    assert full["tokens_scored"] == full["bytes_scored"] == len(targets)

    # Windows of 2m at stride m score from their target m + 1 on: read from N - k - m.
    cut = evaluate_checkpoint(tmp_path / "ckpt", "valid", seq_len=2 * m, stride=m,
                              max_tokens=max_tokens, progress=False, start=n - k - m)
    assert (cut["tokens_scored"], cut["bytes_scored"]) == (len(targets), len(targets))
    assert gain == cut["bits_per_byte"] - full["bits_per_byte"]
    assert gain != 0  # the two windows do differ: the check could fail
    # From the start of the split they would score m + 1 .. the end: N - k - m more targets.
    whole = evaluate_checkpoint(tmp_path / "ckpt", "valid", seq_len=2 * m, stride=m,
                                max_tokens=max_tokens, progress=False)
    assert whole["tokens_scored"] == len(targets) + n - k - m
    # A score at N of other targets than the windows of 2m score is refused.
    for key in ("tokens_scored", "bytes_scored"):
        with pytest.raises(RuntimeError, match="context gain: windows of 16 scored"):
            context_gain(tmp_path / "ckpt", "valid", cfg.model.to_dict(), max_tokens,
                         {**full, key: full[key] - 1})


def test_a_trials_score_is_the_mean_over_its_seeds():
    results = [{"model": "a", "lr": 1e-3, "seed": 0, "bits_per_byte": 2.0},
               {"model": "a", "lr": 1e-3, "seed": 1, "bits_per_byte": 3.0},
               {"model": "a", "lr": 2e-3, "seed": 0, "bits_per_byte": 4.0},
               {"model": "b", "lr": 1e-3, "seed": 1, "bits_per_byte": 1.0}]
    assert trial_means(results, "bits_per_byte") == {"a": {1e-3: 2.5, 2e-3: 4.0},
                                                     "b": {1e-3: 1.0}}
