"""Evidence III, implicit dropout: does ECP generalise better, as if its restricted attention
were a dropout of its own?

An overfitting regime: the Study I model size (N = 256, d_model 128, 4 layers) on about 1 MB of
training text (the first megabyte of enwiki-mini's train split, cut at a line end; validation
and test from its own splits) for many epochs, ecp, the sliding window at both matches (in
entries and in tiles, ``models.MODELS``) and the transformer at dropout 0, 0.1 and 0.2, three
seeds each. Every epoch the run scores, in eval mode and by the
same SPEC §6 protocol, its validation slice and the first bytes of its training text
(``train.eval_train_tokens``): the gap between them as training goes, and the best validation
score of each model.

The claim predicts a smaller gap for ECP at dropout 0, and an advantage that shrinks once the
others get their best dropout. The report says what was found.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

from ecp_lm.config import ModelConfig
from ecp_lm.experiments.evidence.jobs import Job, run_jobs
from ecp_lm.experiments.evidence.models import costs, model_config
from ecp_lm.experiments.evidence.stats import separated, spread
from ecp_lm.experiments.evidence.timing import timed_steps
from ecp_lm.experiments.study import write_json
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.run.config import RunConfig
from ecp_lm.runtime import torch_threads

MODELS = ("ecp", "sliding_window", "sliding_window_tiles", "transformer")
"""The stage's models (``models.MODELS``): ECP, both sliding windows, full attention."""
DROPOUTS = (0.0, 0.1, 0.2)
FILES = {"train": "wiki.train.raw", "valid": "wiki.valid.raw", "test": "wiki.test.raw"}


@dataclass(frozen=True)
class DropoutBudget:
    size: dict[str, Any]
    train_bytes: int
    eval_bytes: int
    """Bytes of the validation and test splits kept, and of the training text scored."""
    epochs: int
    batch_size: int
    lr: float = 2e-3
    seeds: int = 3


DROPOUT_BUDGETS = {
    "tiny": DropoutBudget(size=dict(d_model=32, n_layers=2, n_heads=2, seq_len=64,
                                    num_segments=4),
                          train_bytes=16384, eval_bytes=4096, epochs=2, batch_size=32),
    # small: a quarter of the text, so that it overfits within its few epochs.
    "small": DropoutBudget(size=dict(d_model=128, n_layers=4, n_heads=4, seq_len=256,
                                     num_segments=8),
                           train_bytes=1 << 18, eval_bytes=65536, epochs=6, batch_size=16),
    # full: 10 epochs of 1 MB (cut from 24 to fit the 2-core CPU).
    "full": DropoutBudget(size=dict(d_model=128, n_layers=4, n_heads=4, seq_len=256,
                                    num_segments=8),
                          train_bytes=1 << 20, eval_bytes=131072, epochs=10, batch_size=16),
}


def steps_per_epoch(budget: DropoutBudget) -> int:
    return max(1, budget.train_bytes // (budget.batch_size * budget.size["seq_len"]))


def prefix(chunks, limit: int) -> bytes:
    """The first ``limit`` bytes of the chunks, cut after their last line end."""
    data = bytearray()
    for chunk in chunks:
        data += chunk
        if len(data) >= limit:
            break
    data = bytes(data[:limit])
    cut = data.rfind(b"\n")
    return data[:cut + 1] if cut >= 0 else data


def write_corpus(budget: DropoutBudget, folder: Path) -> Path:
    """The regime's corpus as a WikiText-style folder (one file per split), written once."""
    from ecp_lm.data.sources import open_source

    if all((folder / name).exists() for name in FILES.values()):
        return folder
    source = open_source("enwiki-mini")
    folder.mkdir(parents=True, exist_ok=True)
    for split, name in FILES.items():
        limit = budget.train_bytes if split == "train" else budget.eval_bytes
        write_bytes_atomic(folder / name, prefix(source.chunks(split), limit))
    return folder


def model(budget: DropoutBudget, name: str, dropout: float = 0.0) -> ModelConfig:
    """Model ``name`` at the stage's size and ``dropout``."""
    return ModelConfig(**model_config(name, budget.size), dropout=dropout)


def run_config(budget: DropoutBudget, name: str, dropout: float, seed: int,
               corpus: Path) -> RunConfig:
    epoch = steps_per_epoch(budget)
    return RunConfig.from_dict({
        "model": {**model_config(name, budget.size), "dropout": dropout},
        "data": {"source": "wikitext103", "path": str(corpus), "tokenizer": "bytes"},
        "train": {"steps": epoch * budget.epochs, "batch_size": budget.batch_size,
                  "lr": budget.lr, "warmup_steps": max(1, epoch // 4), "seed": seed,
                  "eval_every": epoch, "checkpoint_every": epoch,
                  "log_every": max(1, epoch // 4), "eval_max_tokens": budget.eval_bytes,
                  "eval_train_tokens": budget.eval_bytes}})


def dropout_job(budget_name: str, arch: str, dropout: float, seed: int, corpus: str,
                folder: str) -> dict[str, Any]:
    """Train one run; its validation records: valid and train scores at every epoch."""
    from ecp_lm.plot import read_metrics
    from ecp_lm.training.loop import train_or_resume

    budget = DROPOUT_BUDGETS[budget_name]
    run = Path(folder) / "run"
    train_or_resume(run_config(budget, arch, dropout, seed, Path(corpus)), run, progress=False)
    epoch = steps_per_epoch(budget)
    curve = [{"epoch": r["step"] / epoch, "step": r["step"],
              "valid_bits": r["bits_per_byte"], "train_bits": r["train_bits_per_byte"],
              "gap_bits": r["bits_per_byte"] - r["train_bits_per_byte"]}
             for r in read_metrics(run)["valid"]]
    best = min(curve, key=lambda c: c["valid_bits"])
    return {"arch": arch, "dropout": dropout, "seed": seed, "curve": curve,
            "best_valid_bits": best["valid_bits"], "best_epoch": best["epoch"],
            "gap_at_best": best["gap_bits"], "final_gap": curve[-1]["gap_bits"],
            "step_s": step_seconds(run, budget)}


def run_dropout(budget_name: str, out: Path, jobs: int = 1, threads: int | None = None,
                progress: bool = False) -> dict[str, Any]:
    """The stage: every (model, dropout, seed) run, then ``dropout.json`` and ``dropout.md``
    (a row's ``arch`` is its model's name)."""
    budget = DROPOUT_BUDGETS[budget_name]
    corpus = write_corpus(budget, out / "corpus")
    cells = list(product(MODELS, DROPOUTS, range(budget.seeds)))
    names = {cell: f"runs/{cell[0]}/dropout{cell[1]:g}/seed{cell[2]}" for cell in cells}
    results = run_jobs([Job(names[c], dropout_job, (budget_name, *c, str(corpus),
                                                    str(out / names[c]))) for c in cells],
                       out, jobs, threads, progress)
    with torch_threads(threads):
        times = timed_steps({f"{name}/{p:g}": (model(budget, name, p), budget.batch_size)
                             for name, p in product(MODELS, DROPOUTS)}, out / "step_s.json")
    table = {}
    for arch, dropout in product(MODELS, DROPOUTS):
        runs = [results[names[arch, dropout, s]] for s in range(budget.seeds)]
        table[f"{arch}/{dropout:g}"] = {
            "arch": arch, "dropout": dropout,
            **{k: spread([r[k] for r in runs])
               for k in ("best_valid_bits", "gap_at_best", "final_gap", "best_epoch")},
            "step_s": times[f"{arch}/{dropout:g}"],
            "train_step_s": statistics.median(r["step_s"] for r in runs),
            "by_epoch": by_epoch(runs)}
    summary = {"budget": budget_name, "size": budget.size, "epochs": budget.epochs,
               "steps_per_epoch": steps_per_epoch(budget), "train_bytes":
               (corpus / FILES["train"]).stat().st_size, "seeds": budget.seeds,
               "costs": {name: costs(model(budget, name)) for name in MODELS},
               "table": table, "findings": findings(table)}
    write_json(out / "dropout.json", summary)
    write_bytes_atomic(out / "dropout.md", dropout_markdown(summary).encode())
    return summary


def step_seconds(run: Path, budget: DropoutBudget) -> float:
    """A run's seconds per training step, from the median throughput its log records."""
    from ecp_lm.experiments.long_context.measure import train_tokens_per_s

    return budget.batch_size * budget.size["seq_len"] / train_tokens_per_s(run)


def by_epoch(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation bits/byte and the train-validation gap at the end of each epoch, over the
    seeds (mean, range)."""
    return [{"epoch": points[0]["epoch"],
             "valid_bits": spread([p["valid_bits"] for p in points]),
             "gap_bits": spread([p["gap_bits"] for p in points])}
            for points in zip(*(r["curve"] for r in runs), strict=True)]


def has_epochs(table: dict[str, Any]) -> bool:
    """Whether every row of ``table`` has its epochs (``by_epoch``; reports written before it
    have none)."""
    return all("by_epoch" in row for row in table.values())


def turning(row: dict[str, Any]) -> str:
    """Whether validation has turned in a cell: the epochs of its seeds' best scores and, where
    every seed's best came before the last epoch, how far validation rose after it."""
    final = row["by_epoch"][-1]
    epochs = final["epoch"]
    first, last = row["best_epoch"]["min"], row["best_epoch"]["max"]
    where = f"epoch {first:g}" if first == last else f"epochs {first:g}-{last:g}"
    head = (f"{row['arch']} at dropout {row['dropout']:g}: best validation at {where} of "
            f"{epochs:g}")
    if last < epochs:
        rise = final["valid_bits"]["mean"] - row["best_valid_bits"]["mean"]
        return head + f", then {rise:+.4f} bits/byte by the last (every seed overfits)"
    if first == epochs:
        return head + " (still improving in every seed)"
    return head + " (some seeds still improving)"


def findings(table: dict[str, Any]) -> list[str]:
    """The claim's two predictions, checked where the seeds' ranges separate, and, where the
    table has its epochs (``by_epoch``), whether each cell's validation has turned."""
    out = []
    names = list(dict.fromkeys(row["arch"] for row in table.values()))
    others = [name for name in names if name != "ecp"]
    ecp0 = table["ecp/0"]
    for arch in others:
        other = table[f"{arch}/0"]
        out.append(f"dropout 0, final train-validation gap: ecp "
                   f"{ecp0['final_gap']['mean']:.4f} against {arch} "
                   f"{other['final_gap']['mean']:.4f} bits/byte: "
                   + seeds_verdict(ecp0["final_gap"], other["final_gap"],
                                   "ecp's is smaller (ranges separate)",
                                   "ecp's is larger (ranges separate)"))
    best = {arch: min((table[f"{arch}/{d:g}"] for d in DROPOUTS),
                      key=lambda r: r["best_valid_bits"]["mean"]) for arch in names}
    for arch in names:
        out.append(f"{arch}: best validation {best[arch]['best_valid_bits']['mean']:.4f} "
                   f"bits/byte at dropout {best[arch]['dropout']:g}")
    # The second prediction: ECP's validation advantage at dropout 0, and once every model has
    # its own best dropout (the claim: it shrinks).
    for arch in others:
        at_zero = advantage(ecp0, table[f"{arch}/0"])
        at_best = advantage(best["ecp"], best[arch])
        out.append(f"ecp's best-validation advantage over {arch}: {at_zero} at dropout 0; "
                   f"{at_best} with each at its best dropout (ecp "
                   f"{best['ecp']['dropout']:g}, {arch} {best[arch]['dropout']:g})")
    if has_epochs(table):
        out += [turning(row) for row in table.values()]
    return out


def advantage(ecp: dict[str, Any], other: dict[str, Any]) -> str:
    """How far ``ecp``'s best validation score is below ``other``'s (bits/byte; positive: ecp
    better), and whether the seeds' ranges separate them."""
    a, b = ecp["best_valid_bits"], other["best_valid_bits"]
    verdict = seeds_verdict(a, b, "ecp ahead, ranges separate", "ecp behind, ranges separate")
    return f"{b['mean'] - a['mean']:+.4f} bits/byte ({verdict})"


def seeds_verdict(a: dict[str, float], b: dict[str, float], below: str, above: str) -> str:
    """``below`` if ``a``'s range over the seeds lies below ``b``'s, ``above`` if above, else
    that the seeds do not separate them."""
    side = separated(a, b)
    return below if side < 0 else above if side > 0 else "not separated by the seeds"


def dropout_markdown(summary: dict[str, Any]) -> str:
    size = summary["size"]
    lines = [f"# Evidence III: implicit dropout (budget `{summary['budget']}`)", "",
             f"{summary['train_bytes']:,} bytes of enwiki-mini training text, "
             f"{summary['epochs']} epochs of {summary['steps_per_epoch']} steps; N = "
             f"{size['seq_len']}, d_model {size['d_model']}, {size['n_layers']} layers; "
             f"{summary['seeds']} seeds per cell, mean ± half the range. Gap: validation minus "
             "training bits/byte, both scored in eval mode by the same protocol.", "",
             "Attention cost over full attention's: exact entries, the research's tiles, the "
             "tiles a block-sparse kernel visits at block 128. Step s: " + (
                 "one training step of each cell's model, timed one model after another in the "
                 "invocation that wrote this report (each run's own median training step, two "
                 "running side by side, is in `train_step_s`: runs trained in other sessions "
                 "ran at another pace)." if all("train_step_s" in row for row in
                                                summary["table"].values())
                 else "the median training step of the cell's runs, two running side by side "
                 "on one thread each."), "",
             "| model | entries | research tiles | kernel tiles |", "|---|---|---|---|"]
    for arch, c in summary["costs"].items():
        kernel = "-" if c["kernel_tiles"] is None else f"{c['kernel_tiles']:.3f}"
        lines.append(f"| {arch} | {c['entries']:.3f} | {c['research_tiles']:.3f} | {kernel} |")
    lines += ["", "| model | dropout | step s | best valid bits/byte | its epoch | gap at best | "
              "final gap |", "|---|---|---|---|---|---|---|"]
    for row in summary["table"].values():
        cells = [f"{row[k]['mean']:.4f} ± {row[k]['half_range']:.4f}"
                 for k in ("best_valid_bits", "best_epoch", "gap_at_best", "final_gap")]
        lines.append(f"| {row['arch']} | {row['dropout']:g} | {row['step_s']:.3f} | "
                     + " | ".join(cells) + " |")
    if has_epochs(summary["table"]):
        epochs = [f"{e['epoch']:g}" for e in next(iter(summary["table"].values()))["by_epoch"]]
        lines += ["", "Over training, at the end of each epoch, the mean over the seeds (their "
                  "ranges are in the JSON): the train-validation gap and validation bits/byte.",
                  "", "| model | dropout | measure | " + " | ".join(epochs) + " |",
                  "|---|---|---|" + "---|" * len(epochs)]
        for row in summary["table"].values():
            for key, label in (("gap_bits", "gap"), ("valid_bits", "valid")):
                means = [f"{e[key]['mean']:.3f}" for e in row["by_epoch"]]
                lines.append(f"| {row['arch']} | {row['dropout']:g} | {label} | "
                             + " | ".join(means) + " |")
    lines += ["", "Findings:", ""] + [f"- {f}" for f in summary["findings"]]
    return "\n".join(lines) + "\n"
