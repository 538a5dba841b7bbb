"""The end-to-end demo: ECP against a same-size PerceiverAR on a real offline corpus.

Prepares enwiki-mini (bytes), trains both with the ``demo`` preset (identical sizes, data order,
optimiser and schedule), evaluates both on the test split with the SPEC §6 protocol, prints a
side-by-side table, samples from the ECP model and writes the learning curves. Interrupted, it
resumes where it stopped: finished runs are kept, an unfinished one continues from its
checkpoint.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.generation import generate
from ecp_lm.outputs import output_folder
from ecp_lm.plot import plot_runs, read_metrics
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.run.config import RunConfig
from ecp_lm.run.folder import holds_runs
from ecp_lm.training.loop import train_or_resume

ARCHS = ("ecp", "perceiver_ar")


def _sample(run: Path, prompt: str, new_tokens: int) -> str:
    ckpt = read_checkpoint(run)
    model, tokenizer = ckpt.load_model(), ckpt.tokenizer()
    ids = torch.as_tensor(tokenizer.encode(prompt), dtype=torch.long)[None]
    out = generate(model, ids, new_tokens, temperature=0.8, top_k=40, seed=0)
    return tokenizer.decode(out[0, ids.size(1):])


def run_demo(out_dir: str | Path = "runs/demo", steps: int | None = None,
             progress: bool = True, max_eval_tokens: int | None = None) -> dict[str, Any]:
    """Train, score and sample both models into ``out_dir``. ``steps`` shortens the training;
    ``max_eval_tokens`` scores only the first tokens of the validation and test splits (a quick
    check: the table's numbers are then not the test split's)."""
    if steps is not None and steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    out_dir = output_folder(out_dir, "demo", legacy=holds_runs)
    start = time.perf_counter()
    rows = []
    for arch in ARCHS:
        overrides = [f"model.arch={arch}"] + ([f"train.steps={steps}"] if steps is not None else [])
        if max_eval_tokens is not None:
            overrides.append(f"train.eval_max_tokens={max_eval_tokens}")
        cfg = RunConfig.load("demo", overrides)
        run = out_dir / arch
        if progress:
            print(f"== training {arch} ({cfg.train.steps} steps) -> {run}", flush=True)
        seconds = train_or_resume(cfg, run, progress)
        report = evaluate_checkpoint(run / "best", "test", progress=progress,
                                     max_tokens=max_eval_tokens)
        speeds = [r["tokens_per_s"] for r in read_metrics(run)["train"]]
        rows.append({"arch": arch, "params": report["params"], "steps": cfg.train.steps,
                     "train_tokens_per_s": statistics.median(speeds),
                     "train_seconds": seconds, **{k: report[k] for k in (
                         "tokens_scored", "loss", "bits_per_byte", "ppl_token")}})
    prompt = "The history of the "
    sample = _sample(out_dir / "ecp" / "best", prompt, 240)
    png = plot_runs([out_dir / a for a in ARCHS], out_dir / "learning_curves.png",
                    title="enwiki-mini (bytes): ECP vs PerceiverAR")
    result = {"rows": rows, "prompt": prompt, "sample": sample, "plot": str(png),
              "seconds": time.perf_counter() - start}
    write_bytes_atomic(out_dir / "results.json", (json.dumps(result, indent=2) + "\n").encode())
    return result


def format_result(result: dict[str, Any]) -> str:
    lines = ["test split of enwiki-mini, SPEC §6 protocol (N=256, stride 128):",
             f"{'arch':<14}{'params':>10}{'train tok/s':>13}{'test loss':>11}"
             f"{'test bits/byte':>16}{'tokens scored':>15}"]
    for r in result["rows"]:
        lines.append(f"{r['arch']:<14}{r['params']:>10,}{r['train_tokens_per_s']:>13,.0f}"
                     f"{r['loss']:>11.4f}{r['bits_per_byte']:>16.4f}{r['tokens_scored']:>15,}")
    lines += ["", "sample from ECP (temperature 0.8, top-k 40, seed 0):", "-" * 72,
              result["prompt"] + result["sample"], "-" * 72, "",
              f"learning curves: {result['plot']}",
              f"demo time: {result['seconds'] / 60:.1f} min"]
    return "\n".join(lines)
