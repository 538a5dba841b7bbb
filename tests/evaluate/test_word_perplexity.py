"""Word-level perplexity on a constructed WikiText-style corpus whose word count and loss are
known: a model with uniform predictions over the 256 bytes loses exactly ln 256 nats per
target, so ``ecp eval``'s ``ppl_word`` must be exp(targets * ln 256 / W) with W the
whitespace-separated words of the scored text, counted here by hand (and ``ppl_word_eos`` with
one more per line)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ecp_lm import build_model
from ecp_lm.data.tokenizers import ByteTokenizer
from ecp_lm.run.checkpoint import save_checkpoint
from ecp_lm.run.config import RunConfig
from helpers import TINY, run_cli

# Leading spaces, runs of spaces, tabs, blank lines and a heading, as in wiki.*.raw.
ARTICLE = (" = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles "
           "( Japanese : 戦場のヴァルキュリア3 ) is a tactical role @-@ playing video game .\n"
           " \n = = Gameplay = = \n \n\tAs with previous games ,  the  player\t\tcontrols units "
           "1 @,@ 000 strong .  \n")


def known_words(text: bytes) -> tuple[int, int]:
    """Words (maximal runs of bytes that are not ASCII whitespace) and lines, by hand."""
    words, inside = 0, False
    for byte in text:
        blank = byte in b" \t\n\r\x0b\x0c"
        words += not blank and not inside
        inside = not blank
    return words, text.count(b"\n") + (bool(text) and not text.endswith(b"\n"))


def uniform_checkpoint(tmp_path, folder, seq_len: int):
    """An ECP checkpoint whose head is zero: every prediction is uniform over the bytes."""
    cfg = RunConfig.from_dict({
        "model": {**TINY, "vocab_size": 256, "seq_len": seq_len, "arch": "ecp",
                  "tie_embeddings": False},
        "data": {"source": "wikitext103", "path": str(folder),
                 "tokenizer": "bytes", "cache_dir": str(tmp_path / "cache")}})
    model = build_model(cfg.model)
    with torch.no_grad():
        model.head.weight.zero_()
        if model.head.bias is not None:
            model.head.bias.zero_()
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), cfg, ByteTokenizer(), None,
                    {"step": 0})
    return tmp_path / "ckpt"


@pytest.mark.parametrize("mode", ["windows", "stream"])
def test_word_perplexity_on_a_constructed_stream(tmp_path, capsys, mode):
    folder = tmp_path / "wikitext"
    folder.mkdir()
    test = (ARTICLE * 3).encode()
    for split, data in (("train", ARTICLE.encode() * 4), ("valid", ARTICLE.encode()),
                        ("test", test)):
        (folder / f"wiki.{split}.raw").write_bytes(data)
    seq_len, stride = 32, 16  # the windows score targets from index 32 - 16 + 1 = 17 on
    ckpt = uniform_checkpoint(tmp_path, folder, seq_len)
    args = ["--stream"] if mode == "stream" else ["--stride", str(stride)]
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(ckpt), "--split", "test", "--json",
                           "--quiet", *args)
    assert code == 0, err
    report = json.loads(out)
    first = 1 if mode == "stream" else seq_len - stride + 1
    scored = test[first:]
    words, lines = known_words(scored)
    assert words == len(scored.decode().split())  # no Unicode space outside ASCII here
    assert report["tokens_scored"] == len(scored)  # bytes: one token per byte
    assert (report["bytes_scored"], report["words_scored"], report["lines_scored"]) == (
        len(scored), words, lines)
    nll = len(scored) * math.log(256)
    assert report["nll_sum"] == pytest.approx(nll, rel=1e-6)
    assert report["ppl_word"] == pytest.approx(math.exp(nll / words), rel=1e-5)
    assert report["ppl_word_eos"] == pytest.approx(math.exp(nll / (words + lines)), rel=1e-5)
    assert report["bits_per_byte"] == pytest.approx(8.0, rel=1e-6)
