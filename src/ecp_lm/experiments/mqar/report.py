"""The experiment's reports: ``results.md`` and the PNG plots, from the runs' records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ecp_lm.experiments.mqar.budgets import Budget


def _local_size(record: dict[str, Any]) -> str:
    """sliding_window's window w or block_local's block b (records of an earlier release hold
    b as ``window`` too), else ``-``."""
    size = record.get("block_len") if record.get("block_len") is not None else record["window"]
    return "-" if size is None else str(size)


def markdown(budget: Budget, budget_name: str, results: list[dict[str, Any]]) -> str:
    spec, m = budget.spec, budget.segment_len
    lines = [f"# MQAR results (budget `{budget_name}`)", "",
             f"N = {spec.seq_len}, S = {budget.num_segments}, m = {m}; {spec.num_pairs} pairs, "
             f"{spec.num_queries} queries per sequence; key-to-query distance d in "
             f"[{spec.d_min}, {spec.d_max}] (2m = {2 * m}, {budget.reach_depth}m = "
             f"{budget.reach_depth * m}); {spec.num_keys} keys, "
             f"{spec.num_values} values (chance {spec.chance:.3f}), {spec.num_filler} filler "
             f"tokens. Training: {budget.train.steps} steps of {budget.train.batch_size} "
             f"sequences, AdamW lr {budget.train.lr} ({budget.train.schedule}), held-out set "
             f"of {budget.train.eval_size} sequences.", "",
             "## Final held-out accuracy", "",
             "| arch | L | reach L·m (ecp) | window w / block b | params | accuracy | "
             "by value-to-query "
             "segment offset | train s | s/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        by = ", ".join(f"{o}: {a:.3f}" for o, a in sorted(
            (int(k), v) for k, v in r["accuracy_by_offset"].items()))
        lines.append(f"| {r['arch']} | {r['n_layers']} | {r['n_layers'] * r['segment_len']} | "
                     f"{_local_size(r)} | {r['params']:,} | "
                     f"{r['accuracy']:.3f} | {by} | {r['train_wall_s']:.1f} | "
                     f"{r['s_per_step']:.3f} |")
    if results:
        steps = [p["step"] for p in results[0]["curve"]]
        lines += ["", "## Held-out accuracy against training steps", "",
                  "| arch | L | " + " | ".join(str(s) for s in steps) + " |",
                  "|---|---|" + "---|" * len(steps)]
        for r in results:
            lines.append(f"| {r['arch']} | {r['n_layers']} | "
                         + " | ".join(f"{p['accuracy']:.3f}" for p in r["curve"]) + " |")
    probes = (("segment_probe", "\n## Segment probe: linear read-out of a single pair's value",
               "segments after the value's segment, read at each segment's last position"),
              ("query_probe", "## Query probe: linear read-out of the answer at the query "
               "position", "segment offset from the value to the query"))
    for key, title, columns in probes:
        lines += [title, "", f"Rows: layer (0 = embedding). Columns: {columns}. Held-out "
                  f"accuracy; chance {spec.chance:.3f}.", ""]
        for r in results:
            lines += _grid_table(f"{r['arch']}, L = {r['n_layers']}", r[key]["offsets"],
                                 r[key]["accuracy"])
    return "\n".join(lines) + "\n"


def _grid_table(title: str, columns: list[int], grid: list[list[float]]) -> list[str]:
    lines = [f"**{title}**", "", "| layer | " + " | ".join(f"+{c}" for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    lines += [f"| {layer} | " + " | ".join(f"{a:.2f}" for a in row) + " |"
              for layer, row in enumerate(grid)]
    return [*lines, ""]



def write_plots(results: list[dict[str, Any]], out: Path, budget_name: str) -> None:
    """accuracy_vs_steps.png, accuracy_vs_depth.png, segment_probe.png and query_probe.png."""
    from matplotlib.figure import Figure

    from ecp_lm.plot import save_png

    if not results:
        return
    archs = list(dict.fromkeys(r["arch"] for r in results))
    depths = sorted({r["n_layers"] for r in results})
    chance = results[0]["chance"]
    by_key = {(r["arch"], r["n_layers"]): r for r in results}

    fig = Figure(figsize=(4 * len(archs), 3.4), layout="constrained")
    axes = fig.subplots(1, len(archs), sharey=True, squeeze=False)[0]
    for ax, arch in zip(axes, archs, strict=True):
        for i, depth in enumerate(depths):
            if (arch, depth) in by_key:
                curve = by_key[(arch, depth)]["curve"]
                ax.plot([p["step"] for p in curve], [p["accuracy"] for p in curve],
                        marker="o", ms=3, color=f"C{i}", label=f"L={depth}")
        ax.axhline(chance, color="grey", ls=":", lw=1)
        ax.set_title(arch)
        ax.set_xlabel("training step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("held-out accuracy")
    fig.suptitle(f"MQAR accuracy against training steps (budget {budget_name})")
    save_png(fig, out / "accuracy_vs_steps.png", dpi=110)

    fig = Figure(figsize=(5, 3.6), layout="constrained")
    ax = fig.subplots()
    for i, arch in enumerate(archs):
        points = [(d, by_key[(arch, d)]["accuracy"]) for d in depths if (arch, d) in by_key]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}",
                label=arch)
    ax.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    ax.set_xticks(depths)
    ax.set_xlabel("layers L")
    ax.set_ylabel("final held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"MQAR accuracy against depth (budget {budget_name})")
    save_png(fig, out / "accuracy_vs_depth.png", dpi=110)

    for name, xlabel in (("segment_probe", "segments after the value's segment"),
                         ("query_probe", "value-to-query segment offset")):
        fig = Figure(figsize=(max(5.0, 2.6 * len(depths) + 1), 2.3 * len(archs) + 0.8),
                     layout="constrained")
        axes = fig.subplots(len(archs), len(depths), squeeze=False)
        image = None
        for i, arch in enumerate(archs):
            for j, depth in enumerate(depths):
                ax = axes[i, j]
                if (arch, depth) not in by_key:
                    ax.set_axis_off()
                    continue
                probe = by_key[(arch, depth)][name]
                image = ax.imshow(probe["accuracy"], origin="lower", vmin=0, vmax=1,
                                  cmap="viridis", aspect="auto")
                ax.set_xticks(range(len(probe["offsets"])), [str(o) for o in probe["offsets"]])
                ax.set_yticks(probe["layers"])
                ax.set_title(f"{arch} L={depth}", fontsize="small")
                if j == 0:
                    ax.set_ylabel("layer")
                if i == len(archs) - 1:
                    ax.set_xlabel(xlabel, fontsize="small")
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="held-out probe accuracy")
        fig.suptitle(f"{name.replace('_', ' ')}: linear read-out of the value\n"
                     f"(budget {budget_name}, chance {chance:.3f})", fontsize="medium")
        save_png(fig, out / f"{name}.png", dpi=110)
