"""``ecp train --dry-run`` and the research's recipes in ``configs/``: every recipe loads, and its
dry run exits 0 without writing anything, printing the parameters of the model its YAML
describes, the tokens per step of its train section, FLOPs per token as the model counts them,
GPU-hours as FLOPs over MFU × peak, and a peak memory whose scaling from a small measured pass
agrees with a direct measurement."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from ecp_lm.bench.memory import LiveBytes
from ecp_lm.config import ModelConfig
from ecp_lm.model import build_model
from ecp_lm.run.config import RunConfig
from ecp_lm.run.dry_run import DEFAULT_MFU, DEFAULT_PEAK_TFLOPS, dry_run
from helpers import run_cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))
EXPECTED = {  # recipe: (arch, source, data path, tokenizer, vocab_size)
    "wikitext103-ecp": ("ecp", "wikitext103", "hf:Salesforce/wikitext", "hf:bert-base-cased",
                        28996),
    "wikitext103-ecp-gpt2": ("ecp", "wikitext103", "hf:Salesforce/wikitext", "hf:gpt2", 50257),
    "wikitext103-perceiver-ar": ("perceiver_ar", "wikitext103", "hf:Salesforce/wikitext",
                                 "hf:bert-base-cased", 28996),
    "wikitext103-transformer": ("transformer", "wikitext103", "hf:Salesforce/wikitext",
                                "hf:bert-base-cased", 28996),
    "wikitext103-sliding-window": ("sliding_window", "wikitext103", "hf:Salesforce/wikitext",
                                   "hf:bert-base-cased", 28996),
    "pg19-ecp": ("ecp", "pg19", "hf:deepmind/pg19", "hf:bert-base-cased", 28996),
    "scifar10-ecp": ("ecp", "scifar10", "hf:uoft-cs/cifar10", "bytes", 256),
}
TINY = dict(vocab_size=300, d_model=48, n_layers=2, n_heads=2, seq_len=64)


def value(out: str, label: str) -> str:
    """The value column of the table row ``label`` (its first token after the label)."""
    match = re.search(rf"^{re.escape(label)}\s{{2,}}(\S+)", out, flags=re.MULTILINE)
    assert match, f"no row {label!r} in:\n{out}"
    return match.group(1)


def number(out: str, label: str) -> float:
    return float(value(out, label).replace(",", ""))


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_the_recipes_are_the_researchs_experiments():
    assert sorted(p.stem for p in RECIPES) == sorted(EXPECTED)
    for path in RECIPES:
        cfg = RunConfig.load(str(path))
        arch, source, data_path, tokenizer, vocab = EXPECTED[path.stem]
        assert (cfg.model.arch, cfg.data.source, cfg.data.path, cfg.data.tokenizer,
                cfg.model.vocab_size) == (arch, source, data_path, tokenizer, vocab)
        assert cfg.model.n_layers == 12 and cfg.model.d_model == 768 and cfg.model.n_heads == 6
        if source == "scifar10":  # pixels as tokens: 32 × 32 grey levels, 10 classes
            assert (cfg.model.seq_len, cfg.model.num_classes) == (1024, 10)
        else:  # the research's size: the paper preset
            assert (cfg.model.seq_len, cfg.model.num_segments, cfg.model.num_classes) == \
                (2048, 8, None)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_dry_runs_without_writing(recipe, tmp_path, monkeypatch, capsys):
    cache, out_dir = tmp_path / "cache", tmp_path / "out"
    cache.mkdir()
    monkeypatch.setenv("ECP_LM_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    before, configs_before = tree(tmp_path), tree(CONFIGS)
    code, out, err = run_cli(capsys, "train", "--config", recipe, "--dry-run", "--out",
                             out_dir, "--measure-len", 16, "--mfu", 0.5, "--peak-tflops", 100)
    assert code == 0, err
    assert not out_dir.exists() and tree(tmp_path) == before and tree(CONFIGS) == configs_before

    data = yaml.safe_load(recipe.read_text())
    with torch.device("meta"):
        model = build_model(ModelConfig.from_dict(data["model"]))
    params = sum(p.numel() for p in model.parameters())
    assert number(out, "parameters") == params
    assert number(out, "  without embeddings") == params - model.embed.weight.numel()
    train = data["train"]
    tokens = train["batch_size"] * data["model"]["seq_len"] * train.get("grad_accum", 1)
    assert number(out, "tokens per step") == tokens
    assert number(out, "tokens") == tokens * train["steps"]
    per_token = number(out, "training FLOPs per token")
    assert per_token == pytest.approx(3 * number(out, "forward FLOPs per token"), abs=0.5)
    flops = per_token * tokens * train["steps"]
    assert number(out, "training FLOPs") == pytest.approx(flops, rel=1e-3)
    assert number(out, "GPU-hours") == pytest.approx(flops / (0.5 * 100e12) / 3600, rel=5e-3)
    assert "16 tokens (N / " in " ".join(out.split())
    assert number(out, "peak memory per device") > 0
    assert "kernel native" not in out  # the CPU's own kernel is left out, as on a GPU


def ecp_entries(n: int, m: int) -> int:
    """ECP's unmasked (query, key) pairs per layer: causal within each segment of m, plus the
    whole previous segment for every segment but the first."""
    segments = n // m
    return segments * m * (m + 1) // 2 + (segments - 1) * m * m


@pytest.mark.parametrize("arch, entries", [
    ("transformer", TINY["seq_len"] * (TINY["seq_len"] + 1) // 2),
    ("ecp", ecp_entries(TINY["seq_len"], 16)),
])
def test_flops_per_token_are_the_hand_formula(arch, entries, capsys, tmp_path):
    """Per token and layer, 2 FLOPs per weight of q, k, v, out (d × d each) and of the
    feed-forward (d × 4d, 4d × d); the head's d × V; attention 4 · d per score entry."""
    cfg = RunConfig.from_dict({"model": {**TINY, "arch": arch, "num_segments": 4}})
    d, layers, n = TINY["d_model"], TINY["n_layers"], TINY["seq_len"]
    linear = 2 * (layers * 12 * d * d + d * TINY["vocab_size"])
    attention = 4 * d * layers * entries / n
    run = dry_run("tiny", cfg)
    assert run.attention_flops / n == attention
    # the rotary embedding's angle table (positions × frequencies) is the rest
    assert linear <= run.linear_flops / n <= 1.002 * linear
    assert run.training_flops_per_token == 3 * run.forward_flops_per_token
    path = tmp_path / "tiny.yaml"
    cfg.to_yaml(path)
    code, out, _ = run_cli(capsys, "train", "--config", path, "--dry-run")
    assert code == 0
    assert number(out, "  attention") == pytest.approx(attention, abs=0.5)
    assert number(out, "forward FLOPs per token") == pytest.approx(linear + attention,
                                                                   rel=2e-3)


def test_tokens_gpu_hours_and_world_size_by_hand(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = RunConfig.from_dict({"model": {**TINY, "num_segments": 4},
                               "train": {"steps": 300, "batch_size": 3, "grad_accum": 5,
                                         "context_parallel": 2}})
    run = dry_run("tiny", cfg)
    assert run.world_size == 4 and run.data_parallel == 2
    assert run.tokens_per_step == 3 * 64 * 5 * 2
    assert run.total_tokens == 300 * run.tokens_per_step
    assert run.total_flops == pytest.approx(run.training_flops_per_token * 300 * 3 * 64 * 5 * 2)
    assert run.gpu_hours == pytest.approx(
        run.total_flops / (DEFAULT_MFU * DEFAULT_PEAK_TFLOPS * 1e12) / 3600)
    # context parallelism: each of the 2 ranks of a window holds half its tokens
    assert run.memory.scale == pytest.approx(3 * 64 / 2 / run.memory.seq_len)
    again = dry_run("tiny", cfg, mfu=0.25, peak_tflops=312, world_size=8)
    assert again.tokens_per_step == 2 * run.tokens_per_step
    assert again.gpu_hours == pytest.approx(again.total_flops / (0.25 * 312e12) / 3600)


def test_memory_adds_up_and_its_scaling_matches_a_direct_measurement():
    """The peak scaled from batch 1 agrees with the pass measured at the config's batch of 8,
    and from a window of N/4 with one of N; weights 4 B and AdamW 8 B per parameter."""
    cfg = RunConfig.from_dict({"model": {**TINY, "num_segments": 4},
                               "train": {"batch_size": 8, "grad_accum": 2}})
    small = dry_run("tiny", cfg, measure_batch=1)
    direct = dry_run("tiny", cfg, measure_batch=8)
    short = dry_run("tiny", cfg, measure_batch=8, measure_len=16)
    assert (small.memory.scale, direct.memory.scale, short.memory.scale) == (8, 1, 4)
    assert direct.memory.peak == direct.memory.measured_peak
    assert small.memory.peak == pytest.approx(direct.memory.peak, rel=0.05)
    assert short.memory.peak == pytest.approx(direct.memory.peak, rel=0.05)
    assert small.weights == 4 * small.params and small.optimizer_state == 8 * small.params
    # grad_accum 2: the first micro-batch's gradients are held through the second's pass
    assert small.backward_memory == small.memory.peak + small.weights
    assert small.peak_memory == small.weights + max(
        small.optimizer_state + small.backward_memory, 16 * small.params)


def test_live_bytes_follow_what_is_alive():
    x = torch.randn(250, 1000, requires_grad=True)  # made outside: not counted
    mib = 250 * 1000 * 4
    with LiveBytes(lambda shape: 0, 1) as live:
        y = (x * 2).exp()  # x * 2 is freed at once; exp keeps its output for backward
        view = y[:10]  # a view: no new storage
        del y
        assert live.live == [mib]
        y = view.sum()
        y.backward()  # x.grad is new
        del view, y
        assert live.live == [mib]  # x.grad only
    # in backward: exp's output, the slice's gradient (y's shape) and exp's, and two scalars
    assert live.peak((1.0,)) == 3 * mib + 8
    assert math.isclose(live.peak((0.5,)), 1.5 * mib + 4)


@pytest.mark.parametrize("argv, fragment", [
    (["--dry-run", "--mfu", "0"], "--mfu 0.0 must lie in (0, 1]"),
    (["--dry-run", "--peak-tflops", "-1"], "--peak-tflops -1.0 must be a positive number"),
    (["--dry-run", "--measure-len", "128"], "--measure-len 128 exceeds model.seq_len=64"),
    (["--dry-run", "--measure-len", "15"], "--measure-len 15:"),
    (["--dry-run", "--measure-batch", "0"], "--measure-batch 0 must be >= 1"),
    (["--dry-run", "--measure-len", "32", "--measure-batch", "2"],
     "tensors of 64 rows, the size of a parameter dimension"),  # tiny's d_model 64
    (["--dry-run", "--world-size", "0"], "--world-size 0 must be a positive multiple"),
])
def test_bad_dry_run_options_are_one_line_errors(argv, fragment, capsys):
    code, out, err = run_cli(capsys, "train", "--config", "tiny", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ecp: error: ") and fragment in err, err


def test_dry_run_options_need_dry_run(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", "--config", "tiny", "--out", tmp_path / "r",
                           "--mfu", "0.5")
    assert code == 2 and "--mfu sets up --dry-run" in err.splitlines()[-1]
    assert not (tmp_path / "r").exists()


def test_dry_run_of_a_device_this_machine_lacks(capsys):
    """A config for a GPU is estimated on a machine without one: train.device is not checked."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, err = run_cli(capsys, "train", "--config", "tiny", "--dry-run",
                             "train.device=cuda")
    assert code == 0, err
    assert "nothing trained, read or written" in out


def test_perceiver_ar_runs_under_a_dispatch_mode_as_without():
    """Lower-right causal attention (PerceiverAR's layer 0) builds a tensor subclass that no
    dispatch mode can construct; under one it runs on the same mask made dense."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="perceiver_ar", **TINY))
    tokens = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"]))
    plain = model(tokens)
    with LiveBytes(lambda shape: 0, 1) as live:
        counted = model(tokens)
    assert live.peak((1.0,)) > 0
    torch.testing.assert_close(counted, plain)


def test_the_loss_chunk_is_scaled_up_to_one_chunk_of_the_predicted_rows():
    """PerceiverAR predicts its l latents only: its loss has batch × l rows, and at full scale a
    chunk of logits holds at most ``chunk_rows(V)`` of them."""
    from ecp_lm.bench.memory import measure_backward
    from ecp_lm.model.loss import chunk_rows

    vocab = 200_000  # chunks of 167 rows
    cfg = ModelConfig(arch="perceiver_ar", **{**TINY, "vocab_size": vocab})  # l = 32
    memory = measure_backward(cfg, 1, scale=16.0)
    assert memory.chunk_scale == chunk_rows(vocab) / 32 < memory.scale
    assert measure_backward(cfg, 1, scale=2.0).chunk_scale == 2.0  # 64 rows: one chunk
