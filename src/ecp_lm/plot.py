"""Learning curves from training runs, and loss against position from ``ecp eval --per-position``,
as PNG, PDF, SVG or JPEG: the format the output's suffix names (``FORMATS``).

A run folder holds ``metrics.jsonl`` (one JSON object per line, appended during training, with
``kind`` "train" or "valid") and optionally ``config.yaml`` whose ``model.arch`` names the
architecture. Losses are in nats/token; the optional second panel shows validation bits per byte,
the tokenizer-independent measure that lets runs with different vocabularies be compared.

Resumed runs re-log some steps, so the last record of each (kind, step) wins; a crashed run may
leave a truncated final line, which is dropped. Figures use the Agg canvas, so no display is needed.

A per-position report (JSON, ``"kind": "per_position"``) holds the mean loss at each position of
a window (None where the architecture predicts nothing) and bucket means; ``plot_per_position``
draws it against position on a logarithmic axis, one curve per report, with marks at the
segment length m and 2m.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, NullLocator, ScalarFormatter

from ecp_lm.config import read_yaml_mapping
from ecp_lm.fsutil import write_bytes_atomic
from ecp_lm.outputs import PNG_METADATA, check_file, is_png_plot

KINDS = ("train", "valid")
X_LABELS = {"tokens": "training tokens", "step": "optimizer step"}


def read_text(path: Path) -> str:
    """``path``'s text, else a ValueError naming it (not UTF-8: where)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: "
                         f"{raw[err.start:err.start + 1]!r})") from None


def read_metrics(run_dir: str | Path) -> dict[str, list[dict]]:
    """Train and valid records of one run, each sorted by step, the last record per step kept."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise ValueError(f"run folder {run_dir} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    lines = [(n, s) for n, s in enumerate(read_text(path).splitlines(), 1) if s.strip()]
    by_step: dict[str, dict[int, dict]] = {kind: {} for kind in KINDS}
    for i, (lineno, text) in enumerate(lines):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:  # a write cut short by a crash or a live run
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or record.get("kind") not in KINDS:
            continue
        if not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{lineno}: {record['kind']} record has no integer 'step'")
        by_step[record["kind"]][record["step"]] = record
    return {kind: [steps[s] for s in sorted(steps)] for kind, steps in by_step.items()}


def run_label(run_dir: str | Path) -> str:
    """``<folder name> (<arch>)`` from config.yaml's ``model.arch``, or the folder name alone
    (also when it already is the architecture's name)."""
    run_dir = Path(run_dir)
    name = run_dir.resolve().name
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        return name
    config = read_yaml_mapping(config_path, None, "a run config")
    model = config.get("model")
    arch = model.get("arch") if isinstance(model, dict) else None
    return f"{name} ({arch})" if arch and arch != name else name


def _xy(records: list[dict], x: str, y: str) -> tuple[list, list]:
    points = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    x: str = "tokens",
    title: str | None = None,
) -> Path:
    """Write one PNG of train/valid loss (and valid bits per byte if logged) for each run."""
    if x not in X_LABELS:
        raise ValueError(f"x={x!r} is not one of {sorted(X_LABELS)}")
    if not run_dirs:
        raise ValueError("no run folders given")
    check_figure_path(out, "--out")
    runs = [(run_label(d), read_metrics(d)) for d in run_dirs]
    has_bpb = any(r.get("bits_per_byte") is not None for _, m in runs for r in m["valid"])

    num_panels = 2 if has_bpb else 1
    fig = Figure(figsize=(9, 3.8 * num_panels), layout="constrained")
    axes = fig.subplots(num_panels, 1, sharex=True, squeeze=False)[:, 0]
    loss_ax = axes[0]
    for i, (_, metrics) in enumerate(runs):
        colour = f"C{i % 10}"
        loss_ax.plot(*_xy(metrics["train"], x, "loss"), color=colour, lw=0.8, alpha=0.7)
        loss_ax.plot(*_xy(metrics["valid"], x, "loss"), color=colour, lw=1.5, marker="o", ms=4)
        if has_bpb:
            axes[1].plot(*_xy(metrics["valid"], x, "bits_per_byte"), color=colour, marker="o",
                         ms=4, lw=1.5)

    loss_ax.set_ylabel("loss (nats/token)")
    loss_ax.set_title(title or "learning curves")
    if has_bpb:
        axes[1].set_ylabel("validation bits per byte")
    axes[-1].set_xlabel(X_LABELS[x])
    if x == "tokens":
        axes[-1].xaxis.set_major_formatter(EngFormatter())
    for ax in axes:
        ax.grid(alpha=0.3)

    # Colour says which run, line style says train or valid; the legend sits outside the axes.
    handles = [Line2D([], [], color=f"C{i % 10}", lw=2) for i in range(len(runs))]
    handles += [Line2D([], [], color="grey", lw=0.8), Line2D([], [], color="grey", marker="o")]
    labels = [label for label, _ in runs] + ["train", "valid"]
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    return save_figure(fig, out)


PER_POSITION = "per_position"


def read_per_position(path: str | Path) -> dict:
    """A per-position report written by ``ecp eval --per-position FILE`` (or its ``--json``),
    checked for the fields the plot reads."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not" if path.is_dir() else "does not exist: no"
        raise ValueError(f"{path} {what} a per-position report (ecp eval --per-position)")
    try:
        report = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
    if not isinstance(report, dict) or report.get("kind") != PER_POSITION:
        raise ValueError(f"{path} is not a per-position report (ecp eval --per-position): its "
                         f"'kind' is not {PER_POSITION!r}")
    curve = report.get("per_position")
    if (not isinstance(curve, list) or not curve
            or not isinstance(report.get("buckets"), dict)
            or not all(v is None or isinstance(v, (int, float)) for v in curve)):
        raise ValueError(f"{path}: 'per_position' must be a list of losses (or nulls) and "
                         f"'buckets' an object")
    return report


def per_position_label(report: dict, path: str | Path) -> str:
    """``<run> (<arch>)`` from the report (the run alone when it is the architecture's name),
    else the file's name."""
    run, arch = report.get("run") or Path(path).stem, report.get("arch")
    return f"{run} ({arch})" if arch and arch != run else run


def plot_per_position(files: Sequence[str | Path], out: str | Path,
                      title: str | None = None) -> Path:
    """Write one PNG of mean loss against position in the window, one curve per report: the
    loss at each position (thin), the power-of-two bucket means (points), and vertical marks at
    the segment length m and 2m of each report that has one."""
    if not files:
        raise ValueError("no per-position files given")
    check_figure_path(out, "--out")
    reports = [(path, read_per_position(path)) for path in files]
    labels = [per_position_label(report, path) for path, report in reports]
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = f"{label} [{Path(reports[i][0]).name}]"

    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.subplots()
    longest = max(len(report["per_position"]) for _, report in reports)
    handles = []
    for i, (_, report) in enumerate(reports):
        colour = f"C{i % 10}"
        points = [(p, v) for p, v in enumerate(report["per_position"]) if v is not None]
        ax.plot([p for p, _ in points], [v for _, v in points], color=colour, lw=0.7, alpha=0.35)
        buckets = report["buckets"].get("pow2", [])
        handles += ax.plot([(b["start"] + b["stop"] - 1) / 2 for b in buckets],
                           [b["loss"] for b in buckets], color=colour, lw=1.6, marker="o", ms=4)
    marks = _segment_marks(ax, [report for _, report in reports], labels)

    ax.set_xscale("symlog", linthresh=1.0, linscale=0.5)
    ax.set_xlim(0, longest)
    ax.set_xticks([0, *(2 ** k for k in range(longest.bit_length()) if 2 ** k <= longest)])
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("position in the window (0: the first token; bucket means of powers of two "
                  "as points)")
    ax.set_ylabel("mean loss (nats/token)")
    ax.set_title(title or "loss against position")
    ax.grid(alpha=0.3)
    fig.legend(handles + [h for h, _ in marks], labels + [text for _, text in marks],
               loc="outside right upper", fontsize="small")
    return save_figure(fig, out)


def _segment_marks(ax, reports: list[dict], labels: list[str]) -> list[tuple[Line2D, str]]:
    """Lines at m (dashed) and 2m (dotted) for each segment length m among the reports: grey
    when there is one, else in the colour of the first curve that has it. Returns legend
    entries."""
    lengths = [r.get("segment_len") for r in reports]
    known = sorted({m for m in lengths if isinstance(m, int) and m > 0})
    entries = []
    for m in known:
        colour = "grey" if len(known) == 1 else f"C{lengths.index(m) % 10}"
        for k, style in ((1, "--"), (2, ":")):
            ax.axvline(k * m, color=colour, ls=style, lw=1.0)
        owners = [label for label, n in zip(labels, lengths, strict=True) if n == m]
        text = f"m = {m}, 2m = {2 * m}" + ("" if len(known) == 1 else f" ({', '.join(owners)})")
        entries.append((Line2D([], [], color=colour, ls="--", lw=1.0), text))
    return entries


FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg", ".jpg": "jpeg", ".jpeg": "jpeg"}
"""The figure files ``ecp plot`` writes, by suffix, in the format the suffix names."""
MARK = PNG_METADATA["Software"]
"""What every figure ecp writes carries as its PNG Software text, PDF and SVG Creator, JPEG
comment, by which ``is_own_figure`` recognises it."""
OWN = {"pdf": (b"%PDF", rb"/Creator \(ecp-lm "), "jpeg": (b"\xff\xd8", rb"\xff\xfe..ecp-lm "),
       "svg": (b"<?xml", rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>ecp-lm ")}
"""Per format: how the file starts, and the pattern of ``MARK`` as that format stores it."""


def figure_format(out: str | Path, option: str = "--out") -> str:
    """The format ``out``'s suffix names, else ValueError naming ``option`` and the suffixes
    there are."""
    suffix = Path(out).suffix.lower()
    if suffix not in FORMATS:
        what = f"suffix {Path(out).suffix}" if suffix else "no suffix"
        raise ValueError(f"{option} {out} has {what}; the suffix names the figure's format: "
                         f"{', '.join(FORMATS)}")
    return FORMATS[suffix]


def is_own_figure(path: Path) -> bool:
    """A figure ecp wrote in the format of ``path``'s suffix (a PNG also when an earlier
    release or matplotlib wrote it, ``outputs.is_png_plot``)."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        return False
    if fmt == "png":
        return is_png_plot(path)
    try:
        if path.stat().st_size > 64 << 20:
            return False
        data = path.read_bytes()
    except OSError:
        return False
    start, mark = OWN[fmt]
    return data.startswith(start) and re.search(mark, data, re.DOTALL) is not None


def check_figure_path(out: str | Path, option: str = "--out") -> Path:
    """A figure output, checked before any work: not a folder, not over a file that is not an
    ecp figure, its folder can be made (``outputs.check_file``), a suffix ``FORMATS`` knows."""
    path = check_file(out, option, is_own_figure)
    figure_format(out, option)
    return path


def save_figure(fig: Figure, out: str | Path, dpi: int = 120) -> Path:
    """Render ``fig`` in memory in the format ``out``'s suffix names (``FORMATS``), tagged as
    ecp-lm's (``is_own_figure``), and write it atomically: readers never see half a file."""
    fmt = figure_format(out)
    tag = {"png": {"metadata": PNG_METADATA}, "jpeg": {"pil_kwargs": {"comment": MARK}}}
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=dpi, **tag.get(fmt, {"metadata": {"Creator": MARK}}))
    write_bytes_atomic(Path(out), buffer.getvalue())
    return Path(out)


def save_png(fig: Figure, out: str | Path, dpi: int = 120) -> Path:
    """``save_figure`` for the ``.png`` files a report names."""
    if figure_format(out, "out") != "png":
        raise ValueError(f"save_png: {out} is not a .png path")
    return save_figure(fig, out, dpi)
