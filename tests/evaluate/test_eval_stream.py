"""``ecp eval --stream``: a split scored as one stream through the KV caches, chunk by chunk,
gives the nll of one forward over the whole split, reads the split a chunk at a time, and is
refused (one line) where it cannot run."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ecp_lm.data.cache import open_run_cache
from ecp_lm.evaluate.scoring import score_stream_cached
from ecp_lm.run.checkpoint import read_checkpoint
from helpers import (
    TINY,
    UNBOUNDED,
    random_tokens,
    run_cli,
    sharp_model,
    trained_runs,
)

N = TINY["seq_len"]  # 32: ECP m = 8, sliding_window w = 13, block_local b = 16, s2 G = 8
SPLIT_LEN = 10 * N
CHUNK_LENS = (1, 7, N, 3 * N + 5)  # 7 and 3N + 5 do not divide the 10N - 1 inputs either


def full_forward_nll(model, tokens: np.ndarray) -> float:
    """The reference: one plain forward over the whole stream, every target tokens[1:]."""
    stream = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
    with torch.no_grad():
        logits = model(stream[:, :-1])
    return F.cross_entropy(logits[0], stream[0, 1:], reduction="sum").item()


@pytest.mark.parametrize("arch", UNBOUNDED)
def test_stream_nll_is_one_forward_over_the_split(arch):
    model = sharp_model(arch)
    tokens = random_tokens(1, SPLIT_LEN, seed=4)[0].numpy()
    expected = full_forward_nll(model, tokens)
    for chunk_len in CHUNK_LENS:
        nll, count = score_stream_cached(model, tokens, chunk_len)
        assert count == SPLIT_LEN - 1
        assert nll == pytest.approx(expected, rel=1e-5), (arch, chunk_len)


class Recorded:
    """A token array that records every slice read from it."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.reads = tokens, []

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: slice) -> np.ndarray:
        self.reads.append((index.start, index.stop))
        return self.tokens[index]


def test_the_split_is_read_a_chunk_at_a_time():
    """Each forward call reads its chunk and the one target after it, and each input once."""
    model = sharp_model("ecp")
    tokens = Recorded(random_tokens(1, SPLIT_LEN, seed=1)[0].numpy())
    score_stream_cached(model, tokens, 24)
    assert tokens.reads == [(a, min(a + 24, SPLIT_LEN - 1) + 1) for a in range(0, SPLIT_LEN - 1,
                                                                                24)]


def test_bad_streams_are_refused():
    model = sharp_model("ecp")
    tokens = random_tokens(1, 40)[0].numpy()
    for chunk_len in (0, -3, 2.5):
        with pytest.raises(ValueError, match="chunk_len"):
            score_stream_cached(model, tokens, chunk_len)
    with pytest.raises(ValueError, match="no target"):
        score_stream_cached(model, tokens[:1], 4)
    for arch in ("transformer", "perceiver_ar"):
        with pytest.raises(ValueError, match=rf"arch='{arch}' cannot score a stream: .* at most "
                                             rf"{N} tokens"):
            score_stream_cached(sharp_model(arch), tokens, 4)


# Through checkpoints and the command line ---------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny trained runs (N = 32, byte tokens): ecp, sliding_window and transformer."""
    return trained_runs(tmp_path_factory.mktemp("eval_stream"),
                        ("ecp", "sliding_window", "transformer"), steps=1)


def model_and_split(run, split="valid"):
    ckpt = read_checkpoint(run)
    cfg = ckpt.config
    tokens = open_run_cache(cfg.data, cfg.model.vocab_size, progress=False).tokens(split)
    return ckpt.load_model("cpu").eval(), np.asarray(tokens[:SPLIT_LEN])


@pytest.mark.parametrize("arch", ["ecp", "sliding_window"])
def test_cli_stream_equals_one_forward(runs, capsys, arch):
    model, tokens = model_and_split(runs[arch])
    expected = full_forward_nll(model, tokens)
    for chunk_len in (1, 7, N):
        code, stdout, _ = run_cli(capsys, "eval", "--ckpt", runs[arch], "--stream",
                                  "--chunk-len", chunk_len, "--max-tokens", SPLIT_LEN,
                                  "--precision", "fp32", "--json", "--quiet")
        assert code == 0
        report = json.loads(stdout)
        assert report["mode"] == "stream" and report["chunk_len"] == chunk_len
        assert report["arch"] == arch and report["split"] == "valid"
        assert report["tokens_scored"] == SPLIT_LEN - 1
        assert report["nll_sum"] == pytest.approx(expected, rel=1e-5), chunk_len
        assert report["loss"] == pytest.approx(expected / (SPLIT_LEN - 1), rel=1e-5)
        # byte tokens: the scored text is the bytes of targets 1 .. 10N - 1
        assert report["bits_per_byte"] == pytest.approx(
            expected / math.log(2) / (SPLIT_LEN - 1), rel=1e-5)
        assert report["ppl_word"] > 1.0


def test_cli_stream_table_defaults_to_chunks_of_n(runs, capsys):
    code, stdout, _ = run_cli(capsys, "eval", "--ckpt", runs["ecp"], "--stream",
                              "--max-tokens", SPLIT_LEN, "--quiet")
    assert code == 0
    assert f"one stream in chunks of {N}" in stdout
    for field in ("tokens_scored", "nll_sum", "loss", "ppl_token", "bits_per_byte",
                  "ppl_word"):
        assert field in stdout
    assert f"{SPLIT_LEN - 1:,}" in stdout


@pytest.mark.parametrize("extra, message", [
    (("--stream", "--stride", 4), "--stream does not combine with --stride"),
    (("--stream", "--seq-len", 64), "--stream does not combine with --seq-len"),
    (("--stream", "--per-position"), "--stream does not combine with --per-position"),
    (("--chunk-len", 8), "--chunk-len applies only to --stream"),
    (("--stream", "--chunk-len", 0), "chunk_len=0 must be an integer >= 1"),
])
def test_cli_bad_stream_options_exit_2(runs, capsys, extra, message):
    code, stdout, err = run_cli(capsys, "eval", "--ckpt", runs["ecp"], "--quiet", *extra)
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("ecp: error: ") and message in err


def test_cli_stream_refuses_the_transformer(runs, capsys):
    code, stdout, err = run_cli(capsys, "eval", "--ckpt", runs["transformer"], "--stream",
                                "--quiet")
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1
    assert "arch='transformer' cannot score a stream" in err and "at most 32 tokens" in err
