"""Each document's loss (``evaluate_checkpoint(documents=True)``): the targets of a document are
those whose bytes it holds, and their losses are those the protocol scored them with."""

import itertools
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ecp_lm.data.batches import eval_windows
from ecp_lm.data.cache import open_cache
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.run.config import RunConfig
from ecp_lm.training.loop import train
from helpers import TINY

SIZES = [24_000, 700, 1_000, 350, 820, 500, 300, 400, 450, 380]
"""Bytes of the corpus's files in order: the test split (its last 5%) begins inside the
seventh and holds the rest of it and three whole files."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("documents")
    rng = random.Random(0)
    words = "every document ends where its file does and begins the next one".split()
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i, size in enumerate(SIZES):
        text = " ".join(rng.choice(words) for _ in range(size))[:size - 1] + "\n"
        (corpus / f"{i:02}.txt").write_text(text)
    cfg = RunConfig.from_dict({
        "model": {**TINY, "vocab_size": 256, "arch": "ecp"},
        "data": {"source": "text", "path": str(corpus), "tokenizer": "bytes",
                 "cache_dir": str(tmp / "cache")},
        "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "eval_every": 3,
                  "checkpoint_every": 3, "eval_max_tokens": 300, "eval_batch_size": 4}})
    train(cfg, tmp / "run", progress=False)
    return tmp


def reference_nll(folder, split: str) -> tuple[np.ndarray, int]:
    """Each target's nll (NaN where not scored), from the model's logits on each window of the
    protocol, and the first scored target."""
    ckpt = read_checkpoint(folder / "run" / "latest")
    model = ckpt.load_model("cpu").eval()
    tokens = np.asarray(open_cache(folder / "cache").tokens(split), dtype=np.int64)
    n, stride = TINY["seq_len"], evaluate_checkpoint(folder / "run", split, progress=False)[
        "stride"]
    nll = np.full(len(tokens), np.nan)
    with torch.no_grad():
        for w in eval_windows(len(tokens), n, stride):
            window = torch.from_numpy(tokens[w.start:w.start + n + 1])[None]
            logits = model(window[:, :-1])[0]  # (P, V): the last P inputs' next tokens
            p = logits.size(0)
            targets = window[0, n + 1 - p:]
            losses = F.cross_entropy(logits.double(), targets, reduction="none").numpy()
            scored = range(w.start + n + 1 - w.num_scored, w.start + n + 1)
            nll[list(scored)] = losses[p - w.num_scored:]
    return nll, n - stride + 1


def test_each_documents_loss_sums_its_own_targets(run):
    report = evaluate_checkpoint(run / "run", "test", progress=False, documents=True)
    docs = report["documents"]
    total = sum(SIZES)
    start = round(total * 0.95)
    ends = np.cumsum(SIZES)
    bounds = [0, *(int(e) - start for e in ends if e > start)]  # the files, in test bytes
    nll, first = reference_nll(run, "test")
    assert not np.isnan(nll[first:]).any() and np.isnan(nll[:first]).all()
    expected = [(nll[max(a, first):b].sum(), b - max(a, first))
                for a, b in itertools.pairwise(bounds) if b > first]
    assert len(expected) == 4 == len(docs["nll"])
    assert docs["bytes"] == docs["tokens"] == [size for _, size in expected]
    assert docs["nll"] == pytest.approx([v for v, _ in expected], rel=1e-4)
    assert sum(docs["nll"]) == pytest.approx(report["nll_sum"], rel=1e-9)
    bits = sum(docs["nll"]) / math.log(2) / sum(docs["bytes"])
    assert bits == pytest.approx(report["bits_per_byte"], rel=1e-9)


def test_a_cache_whose_chunks_miss_the_ranges_is_refused(run):
    cache = open_cache(run / "cache")
    whole = cache.stats("test")["bytes"]
    assert list(cache.range_starts("test", [whole])) == [0, whole]
    with pytest.raises(ValueError, match="do not begin where its 2 ranges do"):
        cache.range_starts("test", [7, whole - 7])
