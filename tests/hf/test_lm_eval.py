"""lm-evaluation-harness runs an ``ecp export`` folder as ``--model hf`` with
``trust_remote_code`` (config.json's ``auto_map``), without importing ecp_lm itself:

- for every architecture and two hybrids, its ``loglikelihood`` and ``loglikelihood_rolling``
  equal sums of log-probabilities computed here from ``LanguageModel`` by the harness's
  documented windows (the context cut to the last N + 1 tokens; documents in disjoint windows
  of N, the first after the BOS token, the last with a full window of context);
- at the harness's batch size 4, which right-pads a batch's rows with token 0 and passes no
  attention mask, a perceiver-family batch whose rows could be padded is refused with one line
  (its positions depend on where a row ends), and one whose rows are not padded is scored as
  above;
- ``lm_eval`` on the command line, with a local WikiText-style task of this test's own making,
  reports the word perplexity and bits per byte that ``ecp eval --stream`` gives on the same
  documents, within 1e-4 relative.

Offline: the task reads a local JSON Lines file; nothing reaches a hub."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from ecp_lm import build_model
from ecp_lm.config import ARCHS
from ecp_lm.data.tokenizers import ByteTokenizer
from ecp_lm.generation import generate
from ecp_lm.hf import EcpLmForCausalLM
from ecp_lm.hf.export import export_checkpoint
from ecp_lm.run.checkpoint import save_checkpoint
from ecp_lm.run.config import RunConfig
from helpers import PERCEIVER_FAMILY, TINY, run_cli, sharp_model

N = TINY["seq_len"]
LINE_END = 10  # the byte tokenizer's "\n": the BOS stand-in the exported tokenizer reports
CASES = {**{arch: dict(arch=arch) for arch in ARCHS},
         "sliding_window*2,transformer": dict(arch="hybrid", n_layers=3,
                                              layer_pattern="sliding_window*2,transformer"),
         "ecp,block_local": dict(arch="hybrid", layer_pattern="ecp,block_local", block_len=8)}
REQUESTS = [("The model reads", " a long context"),
            ("", "segments"),  # an empty context: the continuation follows the BOS token
            ("and predicts what comes next while segments pass information upward",
             " through the layers")]  # cut to the last N + 1 tokens
# The long document is not one repeated byte: two of its rolling windows would then hold the
# same tokens with continuations of different lengths, and the harness's logits cache (HFLM's
# logits_cache, on by default) scores the second from the first's logits at the wrong positions,
# which only a model whose output moves along a constant input (a recurrent one) shows.
DOCUMENTS = ["= Alpha =\nThe model reads a long context and predicts what comes next.",
             "short", ("windows of a long document " * 4)[:2 * N + 5]]


def export(tmp_path, model) -> str:
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), RunConfig(model=model.cfg),
                    ByteTokenizer(), None, {"step": 0})
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    return str(tmp_path / "hf")


@torch.no_grad()
def row(model, ids: list[int], p: int) -> torch.Tensor:
    """The log-probabilities (V,) of the token after ids[p], the input being ``ids``: the
    model's own prediction where it predicts p within ``ids``; a perceiver-family model
    predicts only the last l positions of its input, and p is then predicted as one of the
    last l of the input cut after the block of l that holds it, counted from the end."""
    x = torch.tensor(ids)[None]
    t = len(ids)
    predicted = model.arch.num_predicted(t)
    while p < t - predicted:  # p is not among the last `predicted`: drop the last block
        t -= predicted
        predicted = model.arch.num_predicted(t)
    logits = model(x[:, :t])[0].float()  # (predicted, V): positions t - predicted .. t - 1
    return logits[p - (t - predicted)].log_softmax(-1)


def loglikelihood(model, context: str, continuation: str) -> tuple[float, bool]:
    ctx = list(context.encode()) or [LINE_END]
    cont = list(continuation.encode())
    full = (ctx + cont)[-(N + 1):]
    inputs = full[:-1]
    first = len(inputs) - len(cont)  # the position that predicts cont[0]
    rows = [row(model, inputs, first + i) for i in range(len(cont))]
    ll = sum(r[c].item() for r, c in zip(rows, cont, strict=True))
    return ll, all(int(r.argmax()) == c for r, c in zip(rows, cont, strict=True))


def rolling(model, text: str) -> float:
    """The harness's rolling windows: tokens predicted in disjoint runs of N, the first after
    the BOS token, each run's input the N tokens before its targets (fewer at the start)."""
    ids = list(text.encode())
    stream = [LINE_END, *ids]  # stream[j] comes before ids[j]
    total = 0.0
    for start in range(0, len(ids), N):
        stop = min(start + N, len(ids))
        inputs = stream[max(0, stop - N):stop]
        offset = max(0, stop - N)
        total += sum(row(model, inputs, j - offset)[ids[j]].item() for j in range(start, stop))
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_harness_scores_equal_ours(case, tmp_path):
    model = sharp_model(**{**CASES[case], "vocab_size": 256})
    # A perceiver-family model refuses a padded batch (test below): one request per batch.
    batch_size = 1 if case in PERCEIVER_FAMILY else 4
    lm = HFLM(pretrained=export(tmp_path, model), trust_remote_code=True, device="cpu",
              batch_size=batch_size)
    assert lm.max_length == N and lm.prefix_token_id == LINE_END
    results = lm.loglikelihood([Instance("loglikelihood", {}, request, i)
                                for i, request in enumerate(REQUESTS)], disable_tqdm=True)
    for (ll, greedy), request in zip(results, REQUESTS, strict=True):
        expected, expected_greedy = loglikelihood(model, *request)
        assert ll == pytest.approx(expected, rel=1e-5, abs=1e-4), request
        assert greedy == expected_greedy
    scores = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), i)
                                       for i, doc in enumerate(DOCUMENTS)], disable_tqdm=True)
    for score, doc in zip(scores, DOCUMENTS, strict=True):
        assert score == pytest.approx(rolling(model, doc), rel=1e-5, abs=1e-4), doc[:20]


@pytest.mark.parametrize("arch", PERCEIVER_FAMILY)
def test_harness_batches_of_4_are_refused_where_padded_else_exact(arch, tmp_path):
    """The requests' rows differ in length, so the harness right-pads them with token 0: refused
    with one line that names the fix. A document's rolling windows of N tokens each (none
    padded) are scored in one batch as at batch size 1. (Not DOCUMENTS' "xx...": in one batch,
    its last two windows have the same tokens, and the harness scores the shorter continuation
    with the first positions of the other's logits, where ours are the last.)"""
    model = sharp_model(arch, vocab_size=256)
    lm = HFLM(pretrained=export(tmp_path, model), trust_remote_code=True, device="cpu",
              batch_size=4)
    with pytest.raises(ValueError, match="batch_size=1") as err:
        lm.loglikelihood([Instance("loglikelihood", {}, request, i)
                          for i, request in enumerate(REQUESTS)], disable_tqdm=True)
    assert "\n" not in str(err.value) and "token 0" in str(err.value)
    doc = "The model reads a long context and predicts what comes next, segment by segment."
    assert len(doc) > 2 * N  # three windows of N tokens (the last with a full context)
    [score] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0)],
                                       disable_tqdm=True)
    assert score == pytest.approx(rolling(model, doc), rel=1e-5, abs=1e-4)


def test_perceiver_rows_ending_in_token_0_need_an_attention_mask():
    """Without a mask, every position's logits asked for, such rows could be the harness's
    padding (refused); an all-ones mask says they are not, as do one row and logits_to_keep
    (uncached generation); a causal pattern's logits never read later tokens."""
    x = torch.randint(1, 50, (2, N // 2), generator=torch.Generator().manual_seed(0))
    x[1, -1] = 0
    model = sharp_model("perceiver_ar")
    wrapper = EcpLmForCausalLM.from_language_model(model)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"rows \[1\] of a batch of 2 end in token 0"):
            wrapper(x)
        logits = wrapper(x, attention_mask=torch.ones_like(x)).logits
        torch.testing.assert_close(logits, torch.cat([wrapper(x[:1]).logits,
                                                      wrapper(x[1:]).logits]))
        torch.testing.assert_close(wrapper(x, logits_to_keep=2).logits, logits[:, -2:])
        plain = wrapper.generate(x, do_sample=False, max_new_tokens=N, use_cache=False)
        assert torch.equal(plain, generate(model, x, N, temperature=0.0))
        causal = EcpLmForCausalLM.from_language_model(sharp_model("ecp"))
        torch.testing.assert_close(causal(x).logits[:, :-1], causal(x[:, :-1]).logits)


# A WikiText-style document set: headings, runs of spaces, tabs; each document fits in one
# window of N = 256 and neither starts nor ends with whitespace (where the harness's word
# count, re.split(r"\s+"), would count an empty word).
ARTICLES = [
    "= Valkyria Chronicles III =\n\nSenjō no Valkyria 3 : Unrecorded Chronicles is a tactical "
    "role @-@ playing video game developed by Sega .",
    "= Tower Building of the Little Rock Arsenal =\n\nThe  building\tis a two @-@ story "
    "structure ,\n\n= = Construction = =\n\nIt was built in 1840 .",
    "= Robert Boulter =\nRobert Boulter is an English film , television and theatre actor .",
]


def write_wikitext(folder, test: str):
    folder.mkdir(parents=True)
    for split, text in (("train", "\n".join(ARTICLES) * 3), ("valid", ARTICLES[0]),
                        ("test", test)):
        (folder / f"wiki.{split}.raw").write_text(text, encoding="utf-8")
    return folder


@pytest.mark.parametrize("arch", ["ecp", "sliding_window"])
def test_lm_eval_word_perplexity_equals_ecp_eval(arch, tmp_path, capsys):
    seq_len = 256
    cfg = RunConfig.from_dict({
        "model": {**TINY, "vocab_size": 256, "seq_len": seq_len, "arch": arch},
        "data": {"source": "wikitext103", "path": str(write_wikitext(tmp_path / "wiki", "x")),
                 "cache_dir": str(tmp_path / "cache")}})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), cfg, ByteTokenizer(), None,
                    {"step": 0})
    assert run_cli(capsys, "export", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf")[0] == 0

    # ecp eval: each document as the test split after a line end (the harness's BOS token),
    # read as one stream, so every byte of the document is scored with all of it before.
    nll = words = num_bytes = 0
    for i, article in enumerate(ARTICLES):
        assert len(article.encode()) < seq_len
        folder = write_wikitext(tmp_path / f"doc{i}", "\n" + article)
        code, out, err = run_cli(capsys, "eval", "--ckpt", tmp_path / "ckpt", "--split", "test",
                                 "--stream", "--data-path", folder, "--json", "--quiet")
        assert code == 0, err
        report = json.loads(out)
        assert report["words_scored"] == len(article.split())
        nll += report["nll_sum"]
        words += report["words_scored"]
        num_bytes += report["bytes_scored"]

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"page": a}) + "\n"
                                                 for a in ARTICLES))
    (tasks / "local_wiki.yaml").write_text(
        "task: local_wiki\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'docs.jsonl'}\noutput_type: loglikelihood_rolling\n"
        "test_split: test\ndoc_to_text: ''\ndoc_to_target: '{{page}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    lm_eval = [sys.executable, "-c", "from lm_eval.__main__ import cli_evaluate; cli_evaluate()"]
    done = subprocess.run(
        [*lm_eval, "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'hf'},trust_remote_code=True", "--tasks", "local_wiki",
         "--include_path", str(tasks), "--device", "cpu", "--output_path",
         str(tmp_path / "results")], env=env, capture_output=True, text=True, timeout=600,
        cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = (tmp_path / "results").rglob("results_*.json")
    metrics = json.loads(path.read_text())["results"]["local_wiki"]
    assert metrics["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-4)
    assert metrics["bits_per_byte,none"] == pytest.approx(nll / math.log(2) / num_bytes,
                                                          rel=1e-4)
