"""Bits per byte and words count the corpus, not the decoded tokens: a normalising tokenizer
decodes to other text than it read, and the token cache's per-chunk index keeps the corpus's own
counts (``TokenCache.text_size``, ``evaluate.scored_text``)."""

import math
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from ecp_lm.data.cache import prepare
from ecp_lm.data.sources import open_source
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.evaluate.scoring import scored_text
from ecp_lm.run.config import RunConfig
from ecp_lm.training.loop import train
from helpers import TINY

# U+FB01 and U+FB00 are 3 UTF-8 bytes each; NFKC turns them into "fi" and "ff". With one space or
# line end after each, every token stands for exactly 4 corpus bytes, and decodes to 2 (+ 1 space).
LIGATURES = ("\ufb01", "\ufb00")
BYTES_PER_TOKEN = 4


def ligature_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    lines, left = [], words
    while left:
        n = min(left, rng.randint(3, 12))
        lines.append(" ".join(rng.choice(LIGATURES) for _ in range(n)))
        left -= n
    return "\n".join(lines) + "\n"


def normalising_tokenizer(path):
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "fi": 1, "ff": 2}, unk_token="[UNK]"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


@pytest.fixture
def ligature_corpus(tmp_path):
    files = {}
    for split, words, seed in (("train", 2000, 0), ("valid", 700, 1), ("test", 300, 2)):
        files[split] = tmp_path / f"{split}.txt"
        files[split].write_text(ligature_text(words, seed), encoding="utf-8")
    return files, normalising_tokenizer(tmp_path / "tokenizer.json")


def test_text_size_counts_corpus_bytes_under_a_normaliser(ligature_corpus, tmp_path):
    files, tokenizer = ligature_corpus
    source = open_source("text", splits={k: str(v) for k, v in files.items()})
    cache = prepare(source, str(tokenizer), out=tmp_path / "cache", progress=False)
    tokens = cache.tokens("valid")
    corpus = files["valid"].read_bytes()
    assert len(tokens) == 700 and cache.stats("valid")["bytes"] == len(corpus)
    decoded = cache.tokenizer().decode(tokens).encode()
    assert len(decoded) < 0.8 * len(corpus)  # what the decoded-text measure used to count
    assert cache.text_size("valid", 0, len(tokens)) == (len(corpus), len(corpus.split()),
                                                        corpus.count(b"\n"))
    for start, stop in ((17, 700), (0, 350), (123, 456)):
        num_bytes = scored_text(cache, "valid", start, stop).num_bytes
        assert abs(num_bytes - BYTES_PER_TOKEN * (stop - start)) <= BYTES_PER_TOKEN


def test_text_size_is_exact_for_bytes_across_chunks(tmp_path):
    """A corpus of several encoding chunks (about 1 MB each): any range of a byte cache counts
    exactly its bytes, words and lines."""
    rng = random.Random(0)
    words = "long context models read every byte of the corpus once".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 15)))
             for _ in range(60_000)]
    text = ("\n".join(lines)).encode()  # no final line end: the last line still counts
    (tmp_path / "c.txt").write_bytes(text)
    source = open_source("text", paths=[str(tmp_path / "c.txt")], fractions=[0.1, 0.8, 0.1])
    cache = prepare(source, "bytes", out=tmp_path / "cache", progress=False)
    assert len(cache.chunk_index("valid")) >= 2
    valid = cache.tokens("valid").astype(np.uint8).tobytes()

    def expected(a, b):  # a final line without its line end counts, as in the manifest
        part = valid[a:b]
        open_line = b == len(valid) and not part.endswith(b"\n")
        return len(part), len(part.split()), part.count(b"\n") + open_line

    n = len(valid)
    for a, b in ((0, n), (1, n), (5000, n - 3), (n // 2 - 7, n // 2 + 9), (1 << 20, n)):
        assert cache.text_size("valid", a, b) == expected(a, b)


def test_eval_bits_per_byte_uses_corpus_bytes(tmp_path):
    # 4,000 words of 4 bytes: the 90/5/5 byte split falls between words.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(ligature_text(4000, seed=3), encoding="utf-8")
    tokenizer = normalising_tokenizer(tmp_path / "tokenizer.json")
    cfg = RunConfig.from_dict({
        "model": {**TINY, "vocab_size": 3, "arch": "ecp"},
        "data": {"source": "text", "path": str(corpus), "tokenizer": str(tokenizer),
                 "cache_dir": str(tmp_path / "cache")},
        "train": {"steps": 2, "batch_size": 2, "warmup_steps": 1, "eval_every": 2,
                  "checkpoint_every": 2, "eval_batch_size": 4}})
    train(cfg, tmp_path / "run", progress=False)
    report = evaluate_checkpoint(tmp_path / "run", "valid", progress=False)
    bits = report["nll_sum"] / math.log(2)
    assert report["tokens_scored"] == 200 - (32 - 16 + 1)
    corpus_bytes = BYTES_PER_TOKEN * report["tokens_scored"]
    assert report["bits_per_byte"] == pytest.approx(bits / corpus_bytes, rel=1e-2)
