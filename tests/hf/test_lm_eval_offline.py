"""The offline lm-evaluation-harness commands (``docs/lm_eval_offline.sh``, quoted on the evaluation
page, docs/concepts/evaluation.md, as they stand) run as written, with no Hub: in a folder
holding a checkpoint at ``runs/demo/ecp`` and a WikiText raw test file at
``wikitext-103-raw/wiki.test.raw``, they export the checkpoint, write its articles as a local
task scored by the harness's own ``wikitext`` rules, and run ``lm_eval`` on it. Its word
perplexity and bits per byte are those of ``ecp eval --stream`` on each detokenised article after
a line end (the harness's BOS token), with the words and bytes counted on the original article,
as the harness's ``wikitext`` counts them."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

import torch
from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

from ecp_lm import build_model
from ecp_lm.data.tokenizers import ByteTokenizer
from ecp_lm.run.checkpoint import save_checkpoint
from ecp_lm.run.config import RunConfig
from helpers import TINY, run_cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "lm_eval_offline.sh"
SEQ_LEN = 256  # every article below fits in one window: scored with all of itself before it

# wiki.test.raw's layout: " = Title = " starts an article, " = = Section = = " does not, lines
# start with a space, and a line of one space separates paragraphs.
ARTICLES = [
    " = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles is a "
    "tactical role @-@ playing video game developed by Sega . \n \n = = Gameplay = = \n \n "
    "It was released in 2011 . \n ",
    " = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre "
    "actor . \n ",
    " = Tower Building of the Little Rock Arsenal = \n \n The building is a two @-@ story "
    "structure ( built in 1840 ) . \n ",
]
TEST_TEXT = " \n" + "\n".join(ARTICLES)


def write_wikitext(folder: Path, test: str) -> Path:
    folder.mkdir(parents=True)
    for split, text in (("train", TEST_TEXT * 3), ("valid", ARTICLES[0]), ("test", test)):
        (folder / f"wiki.{split}.raw").write_text(text, encoding="utf-8")
    return folder


def test_the_evaluation_page_quotes_the_commands():
    """The evaluation page's block is the script, character for character."""
    page = ROOT / "docs" / "concepts" / "evaluation.md"
    assert f"```bash\n{SCRIPT.read_text()}```\n" in page.read_text()


def test_offline_commands_run_as_written(tmp_path, capsys):
    cfg = RunConfig.from_dict({
        "model": {**TINY, "vocab_size": 256, "seq_len": SEQ_LEN, "arch": "ecp"},
        "data": {"source": "wikitext103",
                 "path": str(write_wikitext(tmp_path / "wikitext-103-raw", TEST_TEXT)),
                 "cache_dir": str(tmp_path / "cache")}})
    torch.manual_seed(0)
    checkpoint = tmp_path / "runs" / "demo" / "ecp"
    save_checkpoint(checkpoint, build_model(cfg.model).state_dict(), cfg, ByteTokenizer(), None,
                    {"step": 0})

    bin_dir = os.path.dirname(sys.executable)  # ecp, python and lm_eval of this environment
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(["bash", "-e", str(SCRIPT)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    pages = [json.loads(line)["page"]
             for line in (tmp_path / "tasks" / "wiki.test.jsonl").read_text().splitlines()]
    assert pages == ARTICLES  # the articles, each whole
    [path] = (tmp_path / "results").rglob("results_*.json")
    metrics = json.loads(path.read_text())["results"]["wikitext_local"]

    nll = words = num_bytes = 0
    for i, page in enumerate(pages):
        text = wikitext_detokenizer({"page": page})
        assert len(text.encode()) < SEQ_LEN
        folder = write_wikitext(tmp_path / f"doc{i}", "\n" + text)
        code, out, err = run_cli(capsys, "eval", "--ckpt", checkpoint, "--split", "test",
                                 "--stream", "--data-path", folder, "--json", "--quiet")
        assert code == 0, err
        nll += json.loads(out)["nll_sum"]
        words += len(re.split(r"\s+", page))  # the harness's count, on the original page
        num_bytes += len(page.encode())
    assert metrics["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-4)
    assert metrics["bits_per_byte,none"] == pytest.approx(nll / math.log(2) / num_bytes,
                                                          rel=1e-4)
