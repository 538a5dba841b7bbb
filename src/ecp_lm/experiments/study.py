"""The study: the research's six architectures under one protocol, ECP ablations and the recall
probe.

    python -m ecp_lm.experiments.study --budget tiny|small --out DIR

Every architecture gets the same data, the same N, the same number of training tokens, the same
optimiser and schedule and matched parameter counts; checkpoints are selected on the validation
split and scored once on the test split with the same stride (SPEC §6). Each entry writes
``DIR/<entry>/result.json`` when it completes, so an interrupted study resumes where it stopped;
``DIR/results.json``, ``DIR/results.md`` and ``DIR/learning_curves.png`` are rewritten at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.config import ModelConfig
from ecp_lm.evaluate.checkpoints import evaluate_checkpoint
from ecp_lm.experiments import one_line_errors
from ecp_lm.experiments.probe import RecallSpec, train_probe
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.outputs import output_folder
from ecp_lm.plot import plot_runs, read_metrics
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.run.config import RunConfig
from ecp_lm.run.folder import holds_runs
from ecp_lm.training.loop import train_or_resume


@dataclass(frozen=True)
class Budget:
    lm_model: dict[str, Any]
    lm_train: dict[str, Any]
    test_max_tokens: int | None
    mnist_model: dict[str, Any]
    mnist_train: dict[str, Any]
    probe: RecallSpec
    probe_model: dict[str, Any]
    probe_steps: int
    probe_depths: tuple[int, ...]
    seeds: dict[str, int] = field(default_factory=lambda: {"ecp": 2, "perceiver_ar": 2,
                                                           "transformer": 2})


BUDGETS = {
    "tiny": Budget(
        lm_model=dict(d_model=32, n_layers=2, n_heads=2, seq_len=64, num_segments=4),
        lm_train=dict(steps=3, batch_size=2, warmup_steps=1, eval_every=3,
                      checkpoint_every=3, log_every=1, eval_max_tokens=1024),
        test_max_tokens=2048,
        mnist_model=dict(d_model=16, n_layers=2, n_heads=2, num_segments=14),
        mnist_train=dict(steps=2, batch_size=2, warmup_steps=1, eval_every=2,
                         checkpoint_every=2, log_every=1),
        probe=RecallSpec(seq_len=32, min_gap=10, max_gap=14, num_keys=8, num_values=8,
                         num_filler=16),
        probe_model=dict(d_model=16, n_heads=2, num_segments=8),
        probe_steps=5, probe_depths=(2, 3)),
    "small": Budget(
        lm_model=dict(d_model=128, n_layers=4, n_heads=4, seq_len=256, num_segments=8),
        lm_train=dict(steps=500, batch_size=16, lr=2e-3, warmup_steps=50, eval_every=250,
                      checkpoint_every=250, log_every=20, eval_max_tokens=65536),
        test_max_tokens=None,
        mnist_model=dict(d_model=64, n_layers=2, n_heads=4, num_segments=14),
        mnist_train=dict(steps=300, batch_size=16, lr=2e-3, warmup_steps=30, eval_every=150,
                         checkpoint_every=150, log_every=20),
        probe=RecallSpec(seq_len=128, min_gap=40, max_gap=60),
        probe_model=dict(d_model=64, n_heads=4, num_segments=8),
        probe_steps=600, probe_depths=(2, 4)),
}


STUDY_ARCHS = ("transformer", "perceiver_ar", "double", "compressed_double", "ssplit", "ecp")
"""The research's six architectures (the same-cost baselines are studied at long context)."""


def entries(budget: Budget) -> list[dict[str, Any]]:
    """Every run of the study, in order: (name, kind, model/train overrides)."""
    out = []
    for arch in STUDY_ARCHS:
        for seed in range(budget.seeds.get(arch, 1)):
            out.append({"name": f"lm/{arch}/seed{seed}", "kind": "lm", "arch": arch,
                        "seed": seed, "model": {"arch": arch}})
    n = budget.lm_model["seq_len"]
    s = budget.lm_model["num_segments"]
    ablations = {f"S{s // 2}": {"num_segments": max(1, s // 2)},
                 f"S{s * 2}": {"num_segments": s * 2},
                 "rope-first": {"rope": "first"}, "tied-kv": {"tied_kv": True},
                 # Receptive field L·m against the window N (the main run has L·m = N/2):
                 "depth-short": {"n_layers": 2},  # L·m = N/4
                 "depth-covers": {"n_layers": s}}  # L·m = N, twice the main run's depth
    for name, model in ablations.items():
        out.append({"name": f"ablation/ecp-{name}", "kind": "lm", "arch": "ecp", "seed": 0,
                    "model": {"arch": "ecp", **model}, "note": f"N={n}"})
    for arch in STUDY_ARCHS:
        out.append({"name": f"mnist/{arch}", "kind": "mnist", "arch": arch, "seed": 0,
                    "model": {"arch": arch}})
    for arch in STUDY_ARCHS:
        for depth in budget.probe_depths:
            out.append({"name": f"probe/{arch}/L{depth}", "kind": "probe", "arch": arch,
                        "seed": 0, "model": {"arch": arch, "n_layers": depth}})
    return out


def _lm_config(budget: Budget, entry: dict) -> RunConfig:
    model = {"vocab_size": 256, **budget.lm_model, **entry["model"]}
    if _compresses(model["arch"]):
        model["compressed_len"] = matched_compressed_len(ModelConfig(**model))
    data = {"model": model,
            "data": {"source": "enwiki-mini", "tokenizer": "bytes"},
            "train": {**budget.lm_train, "seed": entry["seed"]}}
    return RunConfig.from_dict(data)


def _mnist_config(budget: Budget, entry: dict) -> RunConfig:
    model = {"vocab_size": 256, "seq_len": 784, "num_classes": 10, **budget.mnist_model,
             **entry["model"]}
    if _compresses(model["arch"]):
        model["compressed_len"] = matched_compressed_len(ModelConfig(**model))
    data = {"model": model, "data": {"source": "mnist-5k"}, "train": dict(budget.mnist_train)}
    return RunConfig.from_dict(data)


def _compresses(arch: str) -> bool:
    """Whether ``arch`` adds a learned history compression (``compressed_len``), whose size the
    study matches to the other architectures' parameter count."""
    from ecp_lm.model.archs import architecture

    return "compressed_len" in architecture(arch).size_fields


def matched_compressed_len(cfg: ModelConfig, tolerance: float = 0.04) -> int:
    """The largest p (at most the default h/2) whose Linear(h -> p) adds no more than
    ``tolerance`` of the other architectures' parameter count."""
    from ecp_lm.model import build_model

    base = build_model(ModelConfig(**{**cfg.to_dict(), "arch": "double",
                                      "compressed_len": None})).num_params()
    h = cfg.history_len
    return max(1, min(h // 2, int(tolerance * base / (h + 1))))


def run_entry(budget: Budget, entry: dict, out: Path, progress: bool) -> dict[str, Any]:
    run = out / entry["name"]
    base = {k: entry[k] for k in ("name", "kind", "arch", "seed")}
    if entry["kind"] == "probe":
        cfg = ModelConfig(vocab_size=budget.probe.vocab_size, seq_len=budget.probe.seq_len,
                          **{**budget.probe_model, **entry["model"]})
        start = time.perf_counter()
        result = train_probe(cfg, budget.probe, budget.probe_steps)
        return {**base, "n_layers": cfg.n_layers, "segment_len": cfg.segment_len,
                "min_gap": budget.probe.min_gap, "max_gap": budget.probe.max_gap, **result,
                "wall_s": time.perf_counter() - start}
    cfg = (_lm_config if entry["kind"] == "lm" else _mnist_config)(budget, entry)
    seconds = train_or_resume(cfg, run, progress)
    report = evaluate_checkpoint(run / "best", "test", max_tokens=budget.test_max_tokens,
                                 progress=False)
    speeds = [r["tokens_per_s"] for r in read_metrics(run)["train"]]
    cost = attention_cost(cfg.model)
    keep = ("params", "tokens_scored", "loss", "bits_per_byte", "accuracy", "step")
    return {**base, "model": entry["model"], **{k: report[k] for k in keep if k in report},
            "train_tokens": read_checkpoint(run / "latest").meta["tokens_seen"],
            "train_tokens_per_s": statistics.median(speeds) if speeds else None,
            "attention_ratio_to_full": cost.ratio_to_full,
            "attention_tile_ratio_to_full": cost.tile_ratio_to_full,
            "train_wall_s": seconds}


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON, written atomically."""
    write_bytes_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def resume_entries(todo: list[dict], out: Path, run: Callable[[dict], dict],
                   progress: bool) -> list[dict]:
    """The result of each entry, in order: read back from ``out/<name>/result.json`` where an
    earlier invocation finished it, else ``run(entry)``, written there when it completes."""
    results = []
    for entry in todo:
        path = out / entry["name"] / "result.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
            continue
        if progress:
            print(f"== {entry['name']}", flush=True)
        result = run(entry)
        write_json(path, result)
        results.append(result)
    return results


def run_study(budget_name: str, out: str | Path, progress: bool = True) -> list[dict]:
    budget, out = BUDGETS[budget_name], output_folder(out, "study", legacy=holds_runs)
    results = resume_entries(entries(budget), out,
                             lambda entry: run_entry(budget, entry, out, progress), progress)
    write_json(out / "results.json", results)
    write_bytes_atomic(out / "results.md", markdown(results, budget_name).encode())
    plot_runs([out / r["name"] for r in results if r["name"].startswith("lm/")
               and r["seed"] == 0], out / "learning_curves.png",
              title=f"enwiki-mini (bytes), budget {budget_name}")
    return results


def _mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {(max(values) - min(values)) / 2:.4f}"


def markdown(results: list[dict], budget_name: str) -> str:
    lines = [f"# Study results (budget `{budget_name}`)", "",
             "## Language modelling: enwiki-mini test split, bytes", "",
             "| arch | seeds | test bits/byte (mean ± half-range) | params | attention / full "
             "(exact) | train tok/s | train wall s |", "|---|---|---|---|---|---|---|"]
    for arch in STUDY_ARCHS:
        runs = [r for r in results if r["kind"] == "lm" and r["arch"] == arch
                and r["name"].startswith("lm/")]
        if runs:
            lines.append(f"| {arch} | {len(runs)} | "
                         f"{_mean_spread([r['bits_per_byte'] for r in runs])} | "
                         f"{runs[0]['params']:,} | {runs[0]['attention_ratio_to_full']:.3f} | "
                         f"{statistics.mean(r['train_tokens_per_s'] for r in runs):,.0f} | "
                         f"{statistics.mean(r['train_wall_s'] for r in runs):.0f} |")
    lines += ["", "## ECP ablations (same data and budget)", "",
              "| run | change | test bits/byte | params |", "|---|---|---|---|"]
    for r in results:
        if r["name"].startswith("ablation/"):
            change = ", ".join(f"{k}={v}" for k, v in r["model"].items() if k != "arch")
            lines.append(f"| {r['name']} | {change} | {r['bits_per_byte']:.4f} | "
                         f"{r['params']:,} |")
    lines += ["", "## Sequential MNIST (mnist-5k, 784 pixel tokens): test accuracy", "",
              "| arch | accuracy | params |", "|---|---|---|"]
    for r in results:
        if r["kind"] == "mnist":
            lines.append(f"| {r['arch']} | {r['accuracy']:.3f} | {r['params']:,} |")
    lines += ["", "## Long-range recall probe: accuracy (chance = 1/values)", "",
              "| arch | layers | segment m | gap | accuracy | chance |",
              "|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] == "probe":
            lines.append(f"| {r['arch']} | {r['n_layers']} | {r['segment_len']} | "
                         f"{r['min_gap']}–{r['max_gap']} | {r['accuracy']:.3f} | "
                         f"{r['chance']:.3f} |")
    return "\n".join(lines) + "\n"


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="small",
                        help="tiny: minutes, exercises every code path; small: under 2 hours "
                             "on a 2-core CPU")
    parser.add_argument("--out", default="runs/study", help="study folder (resumable)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    results = run_study(args.budget, args.out, progress=not args.quiet)
    print(markdown(results, args.budget))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
