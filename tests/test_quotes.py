"""Numbers the documentation pages quote are the report files' numbers: each quote is rendered
here from its JSON (or from the analytic cost model) and must appear in its page as written. A
report rerun with other numbers fails this test until the page follows. The pages: the evidence
page (docs/evidence.md), the performance page, the architectures page and the archive of the
studies' full reports (docs/archive.md).

The evidence page and the archive describe earlier studies whose code has left the package: they
and their reports and JSON (under docs/archive/) are frozen at the commits docs/archive.md names.
What is checked of them reads only that JSON and those pages; the checks that rendered a report
or a plan with the studies' own code (each report's markdown from its JSON, the full budgets'
planned steps, the cost table's block_local row) went with it, and a checkout of those commits
still runs them. The two-line rules the pages use, "separated" ranges and the rate a curve
chooses, are restated here.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ARCHIVED = "docs/archive"
"""The earlier studies' reports and JSON (docs/archive.md names the commit of each folder)."""
EVIDENCE, PERFORMANCE = DOCS / "evidence.md", DOCS / "performance.md"
ARCHITECTURES, ARCHIVE = DOCS / "concepts" / "architectures.md", DOCS / "archive.md"


def report(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def train_rows(path: str) -> dict[tuple[str, int], dict]:
    return {(r["arch"], r["seq_len"]): r for r in report(path)["train"]}


def throughput_ratio() -> str:
    """ECP's training tokens/s over the transformer's at N = 16,384 (bench_cpu.json)."""
    rows = train_rows("benchmarks/results/bench_cpu.json")
    ratio = rows["ecp", 16384]["tokens_per_s"] / rows["transformer", 16384]["tokens_per_s"]
    return f"{ratio:.2f}"


def segment_probe(layers: int = 4) -> dict[str, str]:
    """The 9,600-step ECP's segment-end probe at L = ``layers``: the accuracy range over the
    offsets each layer reaches (0 … l), the same without layer 1's one segment back, and the
    range beyond the reach."""
    [run] = [r for r in report(f"{ARCHIVED}/study2/mqar_9600/ecp.json")["runs"]
             if r["n_layers"] == layers]
    acc = run["segment_probe"]["accuracy"]
    inside = [acc[k][o] for k in range(1, layers + 1) for o in range(k + 1)]
    rest = [acc[k][o] for k in range(1, layers + 1) for o in range(k + 1) if (k, o) != (1, 1)]
    beyond = [acc[k][o] for k in range(1, layers + 1) for o in range(k + 1, len(acc[k]))]
    return {"low": f"{min(inside):.2f}", "high": f"{max(inside):.2f}",
            "layer1": f"{acc[1][1]:.2f}", "rest": f"{min(rest):.2f}–{max(rest):.2f}",
            "beyond": f"{min(beyond):.2f}–{max(beyond):.2f}"}


def cost(arch: str) -> str:
    """The attention cost relative to full attention at the Study II size (N = 2048, m = 256)."""
    cfg = ModelConfig(arch=arch, vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                      seq_len=2048, num_segments=8)
    return f"{attention_cost(cfg).ratio_to_full:.3f}"


def tile_ratio_window_to_ecp() -> str:
    """The entry-matched sliding window's cost over ECP's, counted in tiles."""
    cfgs = [ModelConfig(arch=a, vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                        seq_len=2048, num_segments=8) for a in ("sliding_window", "ecp")]
    window, ecp = (attention_cost(c).tile_entries for c in cfgs)
    return f"{window / ecp:.2f}"


def evidence_costs(name: str, label: str) -> str:
    """A row of the evidence page's Evidence III cost table, at the Study II size: the costs the
    full curve's report gives its model (block_local, not on that curve, is not checked)."""
    summary = report(f"{FULL['curve']}/curve.json")
    assert summary["size"] == dict(d_model=128, n_layers=4, n_heads=4, seq_len=2048,
                                   num_segments=8)
    c = summary["models"][name]["costs"]
    return (f"| {label} | {c['entries']:.3f} | {c['research_tiles']:.3f} | "
            f"{c['kernel_tiles']:.3f} |")


EVIDENCE_ROWS = {"transformer": "transformer", "ecp": "ecp",
                 "sliding_window": "sliding_window (entries)",
                 "sliding_window_tiles": "sliding_window_tiles (w = m)", "s2": "s2"}

def window_tile_range() -> str:
    """The entry-matched window's research tiles over ECP's across the baselines' N."""
    rows = train_rows("benchmarks/results/bench_baselines_cpu.json")
    ratios = [rows["sliding_window", n]["tile_ratio_to_full"] / rows["ecp", n]["tile_ratio_to_full"]
              for n in (1024, 2048, 4096, 8192, 16384)]
    return f"{min(ratios):.2f}–{max(ratios):.2f}× ECP\n({ratios[1]:.2f}× at 2048)"


SMALL = f"{ARCHIVED}/evidence3-small/small"
"""Evidence III's small-budget reports, as the stages wrote them."""
FULL = {stage: f"{ARCHIVED}/evidence3-full/{where}" for stage, where in (
    ("recall", "recall/full"), ("relay", "relay/full"), ("curve", "curve/full"),
    ("dropout", "dropout/full"), ("hybrid-recall", "hybrid/full/recall"),
    ("hybrid-curve", "hybrid/full/curve"))}
"""The full budgets' reports, where the stages wrote them (the stage folder, once the
repository's ``evidence/``; the hybrid stage's two as ``recall.*`` and ``curve.*`` in its own
folders)."""
DROPOUT_MODELS = tuple(report(f"{SMALL}/dropout.json")["costs"])
"""The dropout stage's four models, in its reports' order."""


def separated(a: dict[str, float], b: dict[str, float]) -> int:
    """-1 if ``a``'s range of seeds lies below ``b``'s, 1 if above, 0 if they overlap: the
    pages' "separated"."""
    return -1 if a["max"] < b["min"] else 1 if a["min"] > b["max"] else 0


def mean_h(cell: dict) -> str:
    return f"{cell['mean']:.3f} ± {cell['half_range']:.3f}"


def stage_model(name: str, model: str, where: str = SMALL) -> dict:
    """One model's entry in the report ``name`` (``recall``, ``hybrid-curve`` …) in the folder
    ``where`` (the small reports unless told)."""
    return report(f"{where}/{name}.json")["models"][model]


def recall_cell(model: str, depth: int, name: str = "recall", where: str = SMALL) -> str:
    return mean_h(stage_model(name, model, where)["depths"][str(depth)]["accuracy"])


def recall_costs() -> str:
    """The recall windows' costs against ECP's: the entry-matched one in tiles, the
    tile-matched one in entries."""
    models = report(f"{SMALL}/recall.json")["models"]
    ecp, window, tiles = (models[m]["costs"] for m in ("ecp", "sliding_window",
                                                       "sliding_window_tiles"))
    return (f"matched in entries (w = {window['window']}, "
            f"{window['research_tiles'] / ecp['research_tiles']:.2f}× ECP's cost in tiles) the "
            f"window is at least as good as ECP and better at L = 6; matched in tiles (w = m = "
            f"{tiles['window']}, the same tiles as ECP, {tiles['entries'] / ecp['entries']:.2f}× "
            "its entries)")


def curve_model(model: str, name: str = "curve", where: str = SMALL) -> dict:
    return stage_model(name, model, where)


def curve_cell(model: str, steps: int, name: str = "curve", where: str = SMALL) -> str:
    cell = curve_model(model, name, where)["points"][str(steps)]["bits_per_byte"]
    return f"{cell['mean']:.4f} ± {cell['half_range']:.4f}"


def full_curve(model: str) -> dict:
    return curve_model(model, where=FULL["curve"])


def full_cell(model: str, steps: int) -> str:
    return curve_cell(model, steps, where=FULL["curve"])


def full_gain(model: str, steps: int = 1200) -> dict:
    """One model's context gain on the full curve (mean, half-range, min and max of seeds)."""
    return full_curve(model)["points"][str(steps)]["context_gain_bits"]


def signed(cell: dict) -> str:
    return f"{cell['mean']:+.4f} ± {cell['half_range']:.4f}"


def gain_span(model: str) -> str:
    """The lowest and highest seed's context gain of ``model`` at 1,200 steps on the full
    curve."""
    gain = full_gain(model)
    return f"{gain['min']:.4f} to {gain['max']:.4f}"


def full_curve_spread() -> str:
    """The full curve's seed half-ranges at 1,200 steps against the largest gap between the
    models' means there, with the two models that make it."""
    at = {m: full_curve(m)["points"]["1200"]["bits_per_byte"]
          for m in report(f"{FULL['curve']}/curve.json")["models"]}
    halves = sorted(c["half_range"] for c in at.values())
    low, high = (min(at, key=lambda m: at[m]["mean"]), max(at, key=lambda m: at[m]["mean"]))
    assert (low, high) == ("sliding_window_tiles", "sliding_window")
    return (f"half-ranges there ({halves[0]:.3f} to {halves[-1]:.3f} bits/byte) are as large as "
            f"the gaps between the means (at most {at[high]['mean'] - at[low]['mean']:.3f}, the "
            "tile-matched window against the entry-matched one)")


def hybrid_curve(model: str) -> dict:
    return curve_model(model, "hybrid-curve")


def hybrid_model(model: str) -> dict:
    return stage_model("hybrid-recall", model)


def hybrid_recall(model: str, depth: int) -> str:
    return recall_cell(model, depth, "hybrid-recall")


def hybrid_rate_trials() -> str:
    """The tile-matched window's hybrid chose its rate on a flat grid, the rate at which the
    other two windows' hybrids peaked."""
    tiles = hybrid_model("hybrid_sliding_window_tiles")["trials"].values()
    rates = {hybrid_model(m)["lr"] for m in ("hybrid_ecp", "hybrid_sliding_window",
                                             "hybrid_sliding_window_tiles")}
    if len(rates) != 1:
        return "other rates"
    [rate] = rates
    peaks = (hybrid_model(m)["trials"][f"{rate:g}"] for m in ("hybrid_ecp",
                                                              "hybrid_sliding_window"))
    return ("trials all near chance, {:.3f}–{:.3f} at 400 steps, so by the noise of a flat grid; "
            "it fell on {}, where ECP's and the entry-matched window's hybrids peaked, {:.3f} "
            "and {:.3f}.)".format(min(tiles), max(tiles), f"{rate:.0e}".replace("e-0", "e-"),
                                  *peaks))


def hybrid_called(*calls: str) -> bool:
    """Every one of ``calls`` ("a > b") is an ordering the hybrid recall stage called at both
    of its depths."""
    orderings = report(f"{SMALL}/hybrid-recall.json")["orderings"]
    return all(call in orderings[depth] for call in calls for depth in ("4", "8"))


def hybrid_windows() -> str:
    """The tile-matched window's hybrid against ECP's, said only while the stage separates
    them at both depths, matches their tiles and leaves the entry-matched window level."""
    tiles, ecp = (hybrid_model(m)["costs"] for m in ("hybrid_sliding_window_tiles", "hybrid_ecp"))
    orderings = report(f"{SMALL}/hybrid-recall.json")["orderings"]
    level = not any(call in orderings[d] for d in ("4", "8") for call in (
        "hybrid_sliding_window > hybrid_ecp", "hybrid_ecp > hybrid_sliding_window"))
    if not (hybrid_called("hybrid_sliding_window_tiles > hybrid_ecp") and level
            and tiles["research_tiles"] == ecp["research_tiles"]):
        return "the stage no longer says this"
    cells = [hybrid_recall(m, d) for d in (4, 8) for m in ("hybrid_sliding_window_tiles",
                                                           "hybrid_ecp")]
    return ("the tile-matched window is ahead of ECP at both depths ({} against {} at L = 4, "
            "{} against {} at L = 8), ranges separated, with fewer entries ".format(*cells) +
            f"({tiles['entries']:.3f} of full attention's against {ecp['entries']:.3f}) and the "
            "same tiles; the entry-matched window is level with ECP")


def hybrid_block_local_and_transformer() -> str:
    locals_ = ("hybrid_ecp", "hybrid_sliding_window", "hybrid_sliding_window_tiles")
    if not (hybrid_called(*(f"{m} > hybrid_block_local" for m in locals_)) and hybrid_called(
            *(f"transformer > {m}" for m in (*locals_, "hybrid_block_local")))):
        return "the stage no longer says this"
    return (f"block_local's hybrid ({hybrid_recall('hybrid_block_local', 4)} at L = 4; chance "
            "0.062) is behind every other hybrid at both depths. - The transformer is ahead of "
            f"every hybrid at both depths ({hybrid_recall('transformer', 4)} at L = 4, "
            f"{hybrid_recall('transformer', 8)} at L = 8)")


def full_hybrid(model: str, depth: int) -> str:
    return recall_cell(model, depth, "recall", FULL["hybrid-recall"])


def full_hybrid_model(model: str) -> dict:
    return stage_model("recall", model, FULL["hybrid-recall"])


def full_hybrid_windows() -> str:
    """The full hybrid recall stage at L = 4: ECP's hybrid ahead of the tile-matched window's
    and block_local's, level with the entry-matched window's, which is ahead of the same two;
    said only while the stage calls exactly that."""
    calls = report(f"{FULL['hybrid-recall']}/recall.json")["orderings"]["4"]
    ahead = [f"{a} > {b}" for a in ("hybrid_ecp", "hybrid_sliding_window")
             for b in ("hybrid_sliding_window_tiles", "hybrid_block_local")]
    level = not {"hybrid_ecp > hybrid_sliding_window", "hybrid_sliding_window > hybrid_ecp"} & set(
        calls)
    ecp, tiles = (full_hybrid_model(m)["costs"] for m in ("hybrid_ecp",
                                                          "hybrid_sliding_window_tiles"))
    if not (all(c in calls for c in ahead) and level
            and ecp["research_tiles"] == tiles["research_tiles"]):
        return "the stage no longer says this"
    gap = (full_hybrid_model("hybrid_ecp")["depths"]["4"]["accuracy"]["mean"]
           - full_hybrid_model("hybrid_sliding_window_tiles")["depths"]["4"]["accuracy"]["mean"])
    return ("At L = 4 ECP's hybrid is ahead of the tile-matched window's ({} against {}) and of "
            "block_local's ({}), ranges separated, and level with the entry-matched window's "
            "({}), which is ahead of the same two. The small budget's order between ECP and the "
            "tile-matched window is reversed: at 800 steps the tile-matched window's hybrid was "
            "ahead at both depths; at 9,600 ECP's is ahead at L = 4, by {:.3f}, with the same "
            "tiles and {:.2f}× the tile-matched hybrid's entries").format(
                full_hybrid("hybrid_ecp", 4), full_hybrid("hybrid_sliding_window_tiles", 4),
                full_hybrid("hybrid_block_local", 4), full_hybrid("hybrid_sliding_window", 4),
                gap, ecp["entries"] / tiles["entries"])


def full_hybrid_deep() -> str:
    """L = 8 of the full hybrid recall stage: nothing separated, the hybrids' means and
    block_local's seeds; the transformer ahead of every hybrid at L = 4 only."""
    summary = report(f"{FULL['hybrid-recall']}/recall.json")
    hybrids = [m for m in summary["models"] if m.startswith("hybrid_")]
    ahead = all(f"transformer > {h}" in summary["orderings"]["4"] for h in hybrids)
    if summary["orderings"]["8"] or not ahead:
        return "the stage no longer says this"
    means = [full_hybrid_model(h)["depths"]["8"]["accuracy"]["mean"] for h in hybrids]
    seeds = full_hybrid_model("hybrid_block_local")["depths"]["8"]["per_seed"]
    return ("At L = 8 no two models are separated. The four hybrids' means are {:.3f}–{:.3f}; "
            "block_local's seeds are {:.3f}, {:.3f} and {:.3f}. - The transformer is ahead of "
            "every hybrid at L = 4 ({}: one seed at 1.000, two at 0.86, above every hybrid's best "
            "seed) and level with them at L = 8 ({}: {})").format(
                min(means), max(means), *seeds, full_hybrid("transformer", 4),
                full_hybrid("transformer", 8), "{:.3f}, {:.3f} and {:.3f}".format(*sorted(
                    full_hybrid_model("transformer")["depths"]["8"]["per_seed"], reverse=True)))


def full_hybrid_cell(model: str, steps: int) -> str:
    """A model's bits/byte on the full hybrid curve (the pure models as the stage set them
    beside the hybrids)."""
    return curve_cell(model, steps, "curve", FULL["hybrid-curve"])


def full_hybrid_curve(model: str) -> dict:
    return curve_model(model, "curve", FULL["hybrid-curve"])


def full_hybrid_gain(model: str) -> str:
    return signed(full_hybrid_curve(model)["points"]["600"]["context_gain_bits"])


def hybrid_gain() -> dict:
    return hybrid_curve("hybrid_ecp")["points"]["200"]["context_gain_bits"]


def hybrid_against_pure() -> str:
    """The hybrids' curve against the curve stage's pure models, set beside them in the
    stage's report: said only where the stage calls every hybrid ahead of the transformer at
    every point, none separated from ECP or either window alone, and s2 ahead of every hybrid
    at the last point."""
    summary = report(f"{SMALL}/hybrid-curve.json")
    calls = summary["orderings"]
    hybrids = [m for m, r in summary["models"].items() if "from" not in r]
    last = str(summary["points"][-1])
    ahead = all(f"{h} < transformer" in calls[p] for h in hybrids for p in calls)
    level = not any(f"{a} < {b}" in calls[p] or f"{b} < {a}" in calls[p] for p in calls
                    for a in hybrids for b in ("ecp", "sliding_window", "sliding_window_tiles"))
    s2 = all(f"s2 < {h}" in calls[last] for h in hybrids)
    timed = all(any(call.startswith(f"{h} < transformer ") for call in summary["equal_time"])
                for h in hybrids)
    if not (ahead and level and s2 and timed):
        return "the stage no longer says this"
    return ("**Every hybrid is ahead of the transformer** at both points, ranges separated "
            f"(hybrid ECP {curve_cell('hybrid_ecp', 200, 'hybrid-curve')} against "
            f"{curve_cell('transformer', 200, 'hybrid-curve')} at 200 steps), and at equal "
            "time too (hybrid ECP's step takes {:.3f} s, the transformer's {:.3f} s); none is "
            "separated from ECP or either window alone (hybrid ECP against ECP's {}), and s2 is "
            "ahead of every hybrid at 200 steps ({})".format(
                hybrid_curve("hybrid_ecp")["step_s"], hybrid_curve("transformer")["step_s"],
                curve_cell("ecp", 200, "hybrid-curve"), curve_cell("s2", 200, "hybrid-curve")))


def dropout_cell(cell: str, key: str, where: str = SMALL) -> dict:
    return report(f"{where}/dropout.json")["table"][cell][key]


def dropout_costs(arch: str, where: str = SMALL) -> dict:
    return report(f"{where}/dropout.json")["costs"][arch]


def dropout_text(cell: str, key: str, where: str = SMALL) -> str:
    """One cell's measure on a dropout stage, mean ± h to four places."""
    c = dropout_cell(cell, key, where)
    return f"{c['mean']:.4f} ± {c['half_range']:.4f}"


def full_dropout(cell: str, key: str) -> str:
    return dropout_text(cell, key, FULL["dropout"])


def full_dropout_epoch(cell: str, epoch: int) -> dict:
    return report(f"{FULL['dropout']}/dropout.json")["table"][cell]["by_epoch"][epoch - 1]


def full_dropout_rise(cell: str) -> str:
    """How far a cell's validation mean rose from its best to its last epoch."""
    row = report(f"{FULL['dropout']}/dropout.json")["table"][cell]
    return f"{row['by_epoch'][-1]['valid_bits']['mean'] - row['best_valid_bits']['mean']:+.4f}"


def full_dropout_apart(model: str) -> str:
    """The distance between ECP's final gaps' range and another model's at dropout 0."""
    ecp, other = (dropout_cell(f"{m}/0", "final_gap", FULL["dropout"]) for m in ("ecp", model))
    return f"{max(other['min'] - ecp['max'], ecp['min'] - other['max']):.4f}"


def full_dropout_batch() -> int:
    """The full dropout stage's batch: its epoch is its training bytes in steps of batch × N."""
    summary = report(f"{FULL['dropout']}/dropout.json")
    return summary["train_bytes"] // (summary["steps_per_epoch"] * summary["size"]["seq_len"])


def full_dropout_gap_claim() -> str:
    return (f"({full_dropout('ecp/0', 'final_gap')} against "
            f"{full_dropout('transformer/0', 'final_gap')} bits/byte, separated)")


def dropout_gaps() -> str:
    """The dropout-0 gaps and best validation scores, with the seeds' verdicts, and whether the
    four models' mean gaps rank as their validation scores do."""
    def cell(arch, key):
        return dropout_text(f"{arch}/0", key)

    def verdict(arch, key):
        side = separated(dropout_cell("ecp/0", key), dropout_cell(f"{arch}/0", key))
        return "separated" if side else "not separated"

    by_gap = sorted(DROPOUT_MODELS, key=lambda a: -dropout_cell(f"{a}/0", "final_gap")["mean"])
    by_fit = sorted(DROPOUT_MODELS,
                    key=lambda a: dropout_cell(f"{a}/0", "best_valid_bits")["mean"])
    return (f"ECP's final gap is {cell('ecp', 'final_gap')} bits/byte, larger than the "
            f"transformer's ({cell('transformer', 'final_gap')}, ranges "
            f"{verdict('transformer', 'final_gap')}), level with the entry-matched window's "
            f"({cell('sliding_window', 'final_gap')}, {verdict('sliding_window', 'final_gap')})"
            f" and smaller than the tile-matched window's "
            f"({cell('sliding_window_tiles', 'final_gap')}, "
            f"{verdict('sliding_window_tiles', 'final_gap')}). The gap follows the fit: at "
            f"dropout 0 ECP reaches {cell('ecp', 'best_valid_bits')} validation bits/byte "
            f"against the transformer's {cell('transformer', 'best_valid_bits')} "
            f"({verdict('transformer', 'best_valid_bits')}), the entry-matched window's "
            f"{cell('sliding_window', 'best_valid_bits')} "
            f"({verdict('sliding_window', 'best_valid_bits')}) and the tile-matched window's "
            f"{cell('sliding_window_tiles', 'best_valid_bits')} "
            f"({verdict('sliding_window_tiles', 'best_valid_bits')})"
            + (", and the four models' mean gaps rank as their validation scores do, the "
               "best-fitting with the largest gap" if by_gap == by_fit else ", ranked apart"))


def dropout_regime() -> str:
    """Said only while it holds: every run's best epoch is its last, every best at dropout 0."""
    summary = report(f"{SMALL}/dropout.json")
    last = all(row["best_epoch"]["min"] == summary["epochs"] for row in summary["table"].values())
    zero = all(summary["table"][f"{a}/0"]["best_valid_bits"]["mean"] ==
               min(row["best_valid_bits"]["mean"] for row in summary["table"].values()
                   if row["arch"] == a) for a in DROPOUT_MODELS)
    ecp = dropout_cell("ecp/0.2", "best_valid_bits")
    return ("every run's best validation score is at its last epoch" if last else "not last") + (
        ", so no model has started to overfit, and dropout only slows them all (every model's "
        f"best is at dropout 0, e.g. ECP {ecp['mean']:.4f} ± {ecp['half_range']:.4f} at 0.2)"
        if zero else "not zero")


def span(values) -> str:
    values = list(values)
    return f"{min(values):.3f}–{max(values):.3f}"


def relay(model: str, key: str, depths=(4, 6), where: str = SMALL) -> str:
    """The range over depths and value-to-query offsets of one relay measure's seed means;
    ``drop`` and ``control_drop``: clean minus replaced."""
    table = report(f"{where}/relay.json")["table"]
    cells = [c for d in depths for c in table[f"{model}/L{d}"]["offsets"].values()]
    if key == "drop":
        return span(c["clean"]["mean"] - c["path_replaced"]["mean"] for c in cells)
    if key == "control_drop":
        return span(c["control_clean"]["mean"] - c["control_replaced"]["mean"] for c in cells)
    return span(c[key]["mean"] for c in cells)


def curve_trial(model: str, lr: float) -> float:
    """Validation bits per byte of the full curve's rate trial of ``model`` at ``lr``."""
    return report(f"{FULL['curve']}/select/{model}/lr{lr:g}/result.json")["bits_per_byte"]


def curve_rates() -> dict[str, float]:
    """The rate the full curve's trials choose for each model, as the stage picked it: the
    lowest validation bits/byte, the lower rate on a tie."""
    summary = report(f"{FULL['curve']}/curve.json")
    return {m: min(summary["lrs"], key=lambda lr: (curve_trial(m, lr), lr))
            for m in summary["models"]}


def relay_full(model: str, key: str, depths=(4, 6)) -> str:
    """``relay`` of the full budget's relay report."""
    return relay(model, key, depths, FULL["relay"])


def relay_offsets(model: str, depth: int, key: str = "clean", where: str = SMALL) -> list[str]:
    """One relay measure of ``model`` at ``depth``, mean ± h at each value-to-query offset."""
    offsets = report(f"{where}/relay.json")["table"][f"{model}/L{depth}"]["offsets"]
    return [mean_h(offsets[o][key]) for o in sorted(offsets, key=int)]


def binding_last(model: str, depth: int, where: str = SMALL) -> str:
    """The binding probe of ``model`` at ``depth`` read at the last layer and segment."""
    row = report(f"{where}/relay.json")["table"][f"{model}/L{depth}"]
    return f"{row['binding'][-1][-1]:.3f}"


def full_recall_trials(*models: str) -> list[float]:
    """The full recall stage's rate-trial accuracies of ``models`` (L = 4, 2,400 steps)."""
    return [a for m in models
            for a in stage_model("recall", m, FULL["recall"])["trials"].values()]


def binding(model: str, where: str = SMALL) -> str:
    """The best binding-probe cell of ``model`` over its depths, layers and segments."""
    table = report(f"{where}/relay.json")["table"]
    best = max(v for row in table.values() if row["model"] == model
               for layer in row["binding"] for v in layer)
    return f"{best:.3f}"


RERUN = f"{ARCHIVED}/evidence3-small/small-rerun"
"""The small budget's second sitting, all five stages one after another on a CPU with another
instruction set (``benchmarks/evidence_small.py`` at the time), its reports as the stages wrote
them and the script's timings (``evidence_small_cpu.json``)."""


def minutes(seconds: float) -> str:
    """``1,389 s`` as ``23 min``, ``8,723 s`` as ``2 h 25 min``, as the pages give a time."""
    m = round(seconds / 60)
    return f"{m // 60} h {m % 60} min" if m >= 60 else f"{m} min"


@functools.cache
def small_timing() -> dict:
    """The second sitting's stage times: the evidence page's table and their total."""
    seconds = report(f"{RERUN}/evidence_small_cpu.json")["seconds"]
    total = sum(seconds.values())
    lines = ["| stage | wall time |", "|---|---|"]
    lines += [f"| {stage} | {minutes(s)} ({s:,.0f} s) |" for stage, s in seconds.items()]
    lines.append(f"| all {len(seconds)} | {minutes(total)} ({total:,.0f} s) |")
    return {"table": "\n".join(lines), "total": minutes(total)}


def rerun_orderings(name: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The orderings (per depth or budget point) of the small report ``name`` called only in
    the first run, and those called only in the second."""
    first, second = (report(f"{w}/{name}.json")["orderings"] for w in (SMALL, RERUN))
    return ({k: [o for o in first[k] if o not in second[k]] for k in first},
            {k: [o for o in second[k] if o not in first[k]] for k in first})


def listed(orderings: dict[str, list[str]]) -> str:
    return "; ".join(f"L = {k}: {', '.join(sorted(v))}" for k, v in orderings.items() if v)


def rerun_recall_moves() -> str:
    """How far the second run moved one recall seed's accuracy (over models, depths, seeds)."""
    first, second = (report(f"{w}/recall.json")["models"] for w in (SMALL, RERUN))
    moves = (abs(a - b) for m in first for d in first[m]["depths"]
             for a, b in zip(first[m]["depths"][d]["per_seed"],
                             second[m]["depths"][d]["per_seed"], strict=True))
    return f"{max(moves):.3f}"


def rerun_rates(name: str, model: str) -> str:
    return ", then ".join(f"{stage_model(name, model, w)['lr']:.0e}".replace("e-0", "e-")
                          for w in (SMALL, RERUN))


def rerun_ecp_advantage() -> list[str]:
    """The dropout finding of ECP's best-validation advantage over the entry-matched window, in
    both runs: its first number."""
    import re

    lines = [next(f for f in report(f"{w}/dropout.json")["findings"]
                  if f.startswith("ecp's best-validation advantage over sliding_window:"))
             for w in (SMALL, RERUN)]
    return [re.search(r"[+-]\d\.\d{4}", line).group(0) for line in lines]


QUOTES = {
    "performance.md: the window in tiles across N": (PERFORMANCE, lambda: (
        f"key blocks, what a block-sparse kernel with blocks of the segment pays) it costs "
        f"{window_tile_range()}")),
    **{f"evidence.md: Evidence III cost of {name}": (EVIDENCE, lambda name=name, label=label:
                                                 evidence_costs(name, label))
       for name, label in EVIDENCE_ROWS.items()},
    "performance.md: throughput at 16k": (PERFORMANCE, lambda: (
        f"ECP's training tokens/s at N = 16384 is **{throughput_ratio()}×** the transformer's")),
    "archive.md: throughput at 16k": (ARCHIVE, lambda: (
        f"{throughput_ratio()}× the transformer's training throughput at N = 16,384")),
    "archive.md: segment probe": (ARCHIVE, lambda: (
        "holds the value at offsets 0 … l with {low}–{high} accuracy ({layer1} in layer 1 one "
        "segment back, the\nrest {rest}) and at chance beyond ({beyond})".format(
            **segment_probe()))),
    "architectures.md: costs of the cheaper baselines": (ARCHITECTURES, lambda: (
        f"which cost less ({cost('block_local')} and\n{cost('s2')} of full attention at "
        f"N = 2048, m = 256, against ECP's {cost('ecp')} and the transformer's "
        f"{cost('transformer')},")),
    "archive.md: the window in tiles": (ARCHIVE, lambda: (
        f"counted in tiles, {tile_ratio_window_to_ecp()}× ECP's")),
    "archive.md: recall, small": (ARCHIVE, lambda: (
        f"At L = 6 the entry-matched window ({recall_cell('sliding_window', 6)}) is ahead of "
        f"ECP ({recall_cell('ecp', 6)}), and ECP of the tile-matched window "
        f"({recall_cell('sliding_window_tiles', 6)}) and of block_local "
        f"({recall_cell('block_local', 6)}); at L = 2 and 4 ECP's seeds spread too widely "
        f"({recall_cell('ecp', 4)} at L = 4) to separate it from either window. The "
        f"transformer is ahead of every local model at every depth "
        f"({recall_cell('transformer', 4)} at L = 4).")),
    "archive.md: recall windows' costs": (ARCHIVE, lambda: recall_costs()),
    "archive.md: recall, ECP's rate trials": (ARCHIVE, lambda: (
        "ECP's trials spread from {:.3f} to {:.3f}".format(*sorted(
            report(f"{SMALL}/recall.json")["models"]["ecp"]["trials"].values())[::4]))),
    "evidence.md: recall, small": (EVIDENCE, lambda: (
        f"({recall_cell('transformer', 4)} at L = 4). At L = 6 the entry-matched window "
        f"({recall_cell('sliding_window', 6)}) is ahead of ECP ({recall_cell('ecp', 6)})")),
    "evidence.md: dropout, small": (EVIDENCE, lambda: (
        f"larger than the transformer's ({dropout_text('ecp/0', 'final_gap')} against "
        f"{dropout_text('transformer/0', 'final_gap')} bits/byte)")),
    "archive.md: curve, windows": (ARCHIVE, lambda: (
        f"({curve_cell('ecp', 200)} against {curve_cell('sliding_window', 200)} at 200 steps) "
        f"nor from the tile-matched one ({curve_cell('sliding_window_tiles', 200)})")),
    "archive.md: curve, transformer": (ARCHIVE, lambda: (
        f"({curve_cell('ecp', 200)} against {curve_cell('transformer', 200)} at 200 steps), "
        "and its step takes {:.2f} of the transformer's here".format(
            curve_model("ecp")["step_s"] / curve_model("transformer")["step_s"]))),
    "archive.md: curve, transformer's gain": (ARCHIVE, lambda: (
        "(−{:.4f} ± {:.4f} bits/byte at 200 steps)".format(
            -curve_model("transformer")["points"]["200"]["context_gain_bits"]["mean"],
            curve_model("transformer")["points"]["200"]["context_gain_bits"]["half_range"]))),
    "archive.md: curve, s2": (ARCHIVE, lambda: f"({curve_cell('s2', 200)}), at the lowest cost"),
    "archive.md: curve, orderings": (ARCHIVE, lambda: "\n".join(
        f"- {call}" for call in report(f"{SMALL}/curve.json")["equal_time"])),
    "evidence.md: hybrids, full": (EVIDENCE, lambda: (
        f"(ECP from {recall_cell('ecp', 4, where=FULL['recall'])} to "
        f"{full_hybrid('hybrid_ecp', 4)} at L = 4; block_local from chance to "
        f"{full_hybrid('hybrid_block_local', 4)})")),
    "evidence.md: hybrid curve, full": (EVIDENCE, lambda: (
        f"({full_hybrid_cell('hybrid_ecp', 600)} against "
        f"{full_hybrid_cell('hybrid_sliding_window', 600)} bits/byte at 600 steps) and level "
        f"with the other two. But no hybrid is ahead of its local layer alone (ECP "
        f"{full_hybrid_cell('ecp', 600)})")),
    "archive.md: hybrid verdict, full": (ARCHIVE, lambda: (
        f"(ECP from {recall_cell('ecp', 4, where=FULL['recall'])} to "
        f"{full_hybrid('hybrid_ecp', 4)} at L = 4, block_local from chance to "
        f"{full_hybrid('hybrid_block_local', 4)})")),
    "archive.md: hybrid curve, full, windows": (ARCHIVE, lambda: (
        f"({full_hybrid_cell('hybrid_ecp', 300)} against "
        f"{full_hybrid_cell('hybrid_sliding_window', 300)} at 300 steps, "
        f"{full_hybrid_cell('hybrid_ecp', 600)} against "
        f"{full_hybrid_cell('hybrid_sliding_window', 600)} at 600)")),
    "archive.md: hybrid curve, full, pure": (ARCHIVE, lambda: (
        f"ECP's hybrid {full_hybrid_cell('hybrid_ecp', 600)} at 600 steps against ECP's "
        f"{full_hybrid_cell('ecp', 600)}")),
    "archive.md: hybrid curve, full, tiles": (ARCHIVE, lambda: (
        f"({full_hybrid_cell('sliding_window_tiles', 600)} against the tile-matched hybrid's "
        f"{full_hybrid_cell('hybrid_sliding_window_tiles', 600)} at 600 steps)")),
    "archive.md: hybrid curve, full, transformer": (ARCHIVE, lambda: (
        f"({full_hybrid_cell('hybrid_ecp', 600)} against "
        f"{full_hybrid_cell('transformer', 600)})")),
    "archive.md: hybrid curve, full, gain": (ARCHIVE, lambda: (
        f"ECP's hybrid gains {full_hybrid_gain('hybrid_ecp')} bits/byte from windows of N at "
        f"600 steps, positive in every seed and above ECP alone ({full_hybrid_gain('ecp')}), "
        f"ranges separated; the transformer's own gain there is "
        f"{full_hybrid_gain('transformer')}, not positive in every seed. block_local's hybrid "
        f"loses with the longer windows in every seed ({full_hybrid_gain('hybrid_block_local')} "
        "at 600 steps)")),
    "archive.md: hybrid curve, full, step": (ARCHIVE, lambda: (
        "one global layer in four adds {:.0%} to ECP's step here ({:.3f} s against {:.3f} s), "
        "while the transformer's is {:.3f} s".format(
            full_hybrid_curve("hybrid_ecp")["step_s"] / full_hybrid_curve("ecp")["step_s"] - 1,
            full_hybrid_curve("hybrid_ecp")["step_s"], full_hybrid_curve("ecp")["step_s"],
            full_hybrid_curve("transformer")["step_s"]))),
    "archive.md: hybrid recall, full": (ARCHIVE, lambda: (
        f"hybrid ECP answers {full_hybrid('hybrid_ecp', 4)} at L = 4, pure ECP "
        f"{recall_cell('ecp', 4, where=FULL['recall'])} at the same budget (the recall stage "
        "above), and block_local, at chance alone "
        f"({recall_cell('block_local', 4, where=FULL['recall'])}), answers "
        f"{full_hybrid('hybrid_block_local', 4)} as a hybrid's local layer")),
    "archive.md: hybrid recall, full, windows": (ARCHIVE, full_hybrid_windows),
    "archive.md: hybrid recall, full, L = 8": (ARCHIVE, full_hybrid_deep),
    "archive.md: hybrid recall": (ARCHIVE, lambda: (
        f"hybrid ECP answers\n{hybrid_recall('hybrid_ecp', 4)} at L = 4, pure ECP "
        f"{recall_cell('ecp', 4)} at the same budget")),
    "archive.md: hybrid recall, windows": (ARCHIVE, lambda: hybrid_windows()),
    "archive.md: hybrid recall, block_local and transformer": (ARCHIVE, lambda: (
        hybrid_block_local_and_transformer())),
    "archive.md: hybrid curve": (ARCHIVE, lambda: hybrid_against_pure()),
    "archive.md: hybrid recall, rate trials": (ARCHIVE, lambda: hybrid_rate_trials()),
    "evidence.md: recall's step times at L = 4": (EVIDENCE, lambda: (
        "took a median of {:.3f}–{:.3f} s a step in the run its report keeps".format(
            *(f(r["depths"]["4"]["train_step_s"] for r in report(f"{SMALL}/recall.json")
                ["models"].values()) for f in (min, max))))),
    "archive.md: ECP's step in both curves": (ARCHIVE, lambda: (
        "ECP's step here {:.3f} s against {:.3f} s in the curve stage's".format(
            report(f"{SMALL}/hybrid-curve.json")["models"]["ecp"]["step_s"],
            report(f"{SMALL}/curve.json")["models"]["ecp"]["step_s"]))),
    "evidence.md: hybrids, small": (EVIDENCE, lambda: (
        f"lifts ECP on recall from {recall_cell('ecp', 4)} to {hybrid_recall('hybrid_ecp', 4)} "
        f"at L = 4, but the tile-matched window is the better local layer "
        f"({hybrid_recall('hybrid_sliding_window_tiles', 4)})"
        if hybrid_windows() != "the stage no longer says this" else "no longer")),
    "archive.md: hybrid context gain": (ARCHIVE, lambda: (
        "gains are at most +{:.4f} bits/byte (hybrid ECP {:+.4f} ± {:.4f} at 200 steps)".format(
            max(m["points"][p]["context_gain_bits"]["mean"] for m in report(
                f"{SMALL}/hybrid-curve.json")["models"].values() for p in ("100", "200")),
            hybrid_gain()["mean"], hybrid_gain()["half_range"]))),
    "archive.md: dropout gaps": (ARCHIVE, lambda: dropout_gaps()),
    "archive.md: dropout, not yet overfitting": (ARCHIVE, lambda: dropout_regime()),
    "archive.md: dropout, kernel tiles": (ARCHIVE, lambda: (
        "at N = 256 a block-sparse kernel with blocks of 128 visits {kernel_tiles:.3f} of the "
        "tiles for all four models".format(**dropout_costs("ecp")) if len({
            dropout_costs(a)["kernel_tiles"] for a in DROPOUT_MODELS}) == 1 else "differ")),
    "archive.md: relay, small": (ARCHIVE, lambda: (
        f"the answer drops to chance when the path is replaced ({relay('ecp', 'path_replaced')} "
        f"across value-to-query offsets of 2–4 segments; chance 0.062), from "
        f"{relay('ecp', 'clean')} clean, while the control leaves it at "
        f"{relay('ecp', 'control_replaced')}: the answer takes the segments between, and the "
        f"drop is the path's, not the damage's. The sliding window behaves the same "
        f"({relay('sliding_window', 'path_replaced')} against "
        f"{relay('sliding_window', 'control_replaced')} for the control).")),
    "archive.md: relay, transformer": (ARCHIVE, lambda: (
        f"replacing the path costs it {relay('transformer', 'drop', (2, 4, 6))}, less than the "
        f"control's {relay('transformer', 'control_drop', (2, 4, 6))}")),
    "archive.md: recall, full, the entry-matched window against ECP": (ARCHIVE, lambda: ", ".join(
        f"{recall_cell('sliding_window', d, where=FULL['recall'])} against "
        f"{recall_cell('ecp', d, where=FULL['recall'])} at L = {d}" for d in (2, 4, 6))),
    "archive.md: recall, full, transformer": (ARCHIVE, lambda: (
        f"**The transformer is ahead of every local model** "
        f"({recall_cell('transformer', 2, where=FULL['recall'])} at L = 2)")),
    "archive.md: recall, full, at chance": (ARCHIVE, lambda: (
        f"trials ({span(full_recall_trials('sliding_window_tiles', 'block_local'))} after 2,400 "
        f"steps, where ECP reached {span(sorted(full_recall_trials('ecp'))[-3:])} at 3e-5, "
        f"1e-4 and\n3e-4)")),
    "archive.md: recall, full, one value per seed": (ARCHIVE, lambda: (
        "({}, {}, {} for seeds 0, 1, 2), and its held-out loss is within 0.001 of".format(
            *(f"{a:.3f}" for a in stage_model("recall", "block_local", FULL["recall"])
              ["depths"]["2"]["per_seed"])))),
    "archive.md: recall, full, ECP's reach at L = 2": (ARCHIVE, lambda: (
        "{} at two segments and chance at three ({}) and four\n({})".format(
            *relay_offsets("ecp", 2, where=FULL["relay"])))),
    "archive.md: recall, full, the window's reach at L = 2": (ARCHIVE, lambda: " / ".join(
        relay_offsets("sliding_window", 2, where=FULL["relay"]))),
    "archive.md: relay, full, ECP": (ARCHIVE, lambda: (
        f"sends ECP to chance: {relay_full('ecp', 'path_replaced')}, from "
        f"{relay_full('ecp', 'clean')} clean. The control replaces as many\n"
        f"segments before the value. It leaves {relay_full('ecp', 'control_replaced')} "
        f"and costs {relay_full('ecp', 'control_drop')}, against the path's\n"
        f"{relay_full('ecp', 'drop')}.")),
    "archive.md: relay, full, window": (ARCHIVE, lambda: (
        f"{relay_full('sliding_window', 'path_replaced')} with the path "
        f"replaced, against\n{relay_full('sliding_window', 'control_replaced')} "
        "for the control")),
    "archive.md: relay, full, transformer": (ARCHIVE, lambda: (
        "Replacing the path costs it, at every depth, "
        f"{relay_full('transformer', 'drop', (2, 4, 6))}, "
        f"and\nthe control {relay_full('transformer', 'control_drop', (2, 4, 6))}.")),
    "archive.md: binding, full": (ARCHIVE, lambda: (
        f"reads the right value from ECP at {binding('ecp', FULL['relay'])} (chance 0.062), as "
        f"well as the\nentry-matched window ({binding('sliding_window', FULL['relay'])}) and "
        f"nearly as well as the transformer ({binding('transformer', FULL['relay'])}). The best "
        f"cell is\nthe best of many, an optimistic summary: the two models at chance reach "
        f"{binding('sliding_window_tiles', FULL['relay'])} and "
        f"{binding('block_local', FULL['relay'])} that\nway. ECP's last layer at the last "
        f"segment reads far less at L = 2 and 4 ({binding_last('ecp', 2, FULL['relay'])}, "
        f"{binding_last('ecp', 4, FULL['relay'])}) and\n{binding_last('ecp', 6, FULL['relay'])} "
        "at L = 6.")),
    "evidence.md: recall, full": (EVIDENCE, lambda: (
        f"({recall_cell('transformer', 2, where=FULL['recall'])} at L = 2). The window matched "
        f"in entries is ahead of ECP ({recall_cell('sliding_window', 4, where=FULL['recall'])}"
        f"\nagainst {recall_cell('ecp', 4, where=FULL['recall'])} at L = 4)")),
    "evidence.md: relay, full": (EVIDENCE, lambda: (
        f"sends ECP to chance ({relay_full('ecp', 'path_replaced')}\nat L = 4 "
        f"and 6) while the control leaves it at "
        f"{relay_full('ecp', 'control_replaced')}. The answer takes the relay. "
        f"The\nbest binding-probe cell reads ECP ({binding('ecp', FULL['relay'])}) about as well "
        f"as the window and nearly as well as\nthe transformer "
        f"({binding('transformer', FULL['relay'])})")),
    "evidence.md: the full curve's rate trials": (EVIDENCE, lambda: (
        "which chose 8e-3 by {:.3f} bits/byte over 4e-3 (its bits/byte at 2e-3, 4e-3, 8e-3 and "
        "1.6e-2: {}, {}, {}, {})".format(
            curve_trial("sliding_window", 4e-3) - curve_trial("sliding_window", 8e-3),
            *(f"{curve_trial('sliding_window', lr):.3f}" for lr in (2e-3, 4e-3, 8e-3, 1.6e-2))))),
    "archive.md: curve, full, context": (ARCHIVE, lambda: (
        f"({signed(full_gain('transformer'))} bits/byte, {gain_span('transformer')}), so at "
        "this budget the experiment can see long context. ECP's is positive in every seed too, "
        f"but less than a tenth of it ({signed(full_gain('ecp'))}, {gain_span('ecp')}), the "
        "ranges separated. The entry-matched window's "
        f"({signed(full_gain('sliding_window'))}) overlaps both")),
    "archive.md: curve, full, the context verdict": (ARCHIVE, lambda: (
        f"({signed(full_gain('transformer'))} bits/byte), ECP less than a tenth of that "
        f"({signed(full_gain('ecp'))})")),
    "archive.md: curve, full, what a GPU would settle": (ARCHIVE, lambda: (
        f"positive in every seed but small ({signed(full_gain('transformer'))} bits/byte)")),
    "evidence.md: curve, full, context": (EVIDENCE, lambda: (
        f"in every seed ({signed(full_gain('transformer'))} bits/byte) and ECP less than a "
        f"tenth of that ({signed(full_gain('ecp'))})")),
    "archive.md: curve, full, the entry-matched window": (ARCHIVE, lambda: (
        f"({full_cell('ecp', 600)} against {full_cell('sliding_window', 600)} at 600 steps, "
        f"{full_cell('ecp', 1200)} against {full_cell('sliding_window', 1200)} at 1,200)")),
    "archive.md: curve, full, the tile-matched window": (ARCHIVE, lambda: (
        f"({full_cell('sliding_window_tiles', 300)} against {full_cell('ecp', 300)} at 300 "
        f"steps, {full_cell('sliding_window_tiles', 600)} against {full_cell('ecp', 600)} at "
        "600). This window costs ECP's tiles, {:.2f} of its entries, and its step {:.2f} of "
        "ECP's here.".format(
            full_curve("sliding_window_tiles")["costs"]["entries"]
            / full_curve("ecp")["costs"]["entries"],
            full_curve("sliding_window_tiles")["step_s"] / full_curve("ecp")["step_s"]))),
    "archive.md: curve, full, transformer": (ARCHIVE, lambda: (
        f"({full_cell('ecp', 600)} against {full_cell('transformer', 600)} at 600 steps). The "
        "transformer's step takes {:.2f}× ECP's here ({:.3f} s against {:.3f} s), so ECP's 600 "
        "steps ({:.0f} s) are also ahead of the transformer's 600 ({:.0f} s).".format(
            full_curve("transformer")["step_s"] / full_curve("ecp")["step_s"],
            full_curve("transformer")["step_s"], full_curve("ecp")["step_s"],
            600 * full_curve("ecp")["step_s"], 600 * full_curve("transformer")["step_s"]))),
    "archive.md: curve, full, s2": (ARCHIVE, lambda: (
        f"at the lowest cost ({full_curve('s2')['costs']['entries']:.3f} of full attention's "
        f"entries); at 1,200 steps it is level with every model ({full_cell('s2', 1200)}, the "
        "narrowest range)")),
    "archive.md: curve, full, the spread at 1,200": (ARCHIVE, full_curve_spread),
    "archive.md: curve, full, orderings": (ARCHIVE, lambda: "\n".join(
        f"- {call}" for call in report(f"{FULL['curve']}/curve.json")["equal_time"])),
    "archive.md: dropout, full, the regime": (ARCHIVE, lambda: (
        "the first {:,} bytes of enwiki-mini's training text for {} epochs of {} steps (batch "
        "{})".format(*(report(f"{FULL['dropout']}/dropout.json")[k] for k in (
            "train_bytes", "epochs", "steps_per_epoch")), full_dropout_batch()) + (
        ", ecp, sliding_window (matched in entries, w = {}), sliding_window_tiles (matched in "
        "tiles, w = m = {})".format(*(dropout_costs(m, FULL["dropout"])["window"] for m in (
            "sliding_window", "sliding_window_tiles")))))),
    "archive.md: dropout, full, the turn": (ARCHIVE, lambda: (
        f"best at epochs 8-9 of 10, then {full_dropout_rise('ecp/0')}, "
        f"{full_dropout_rise('sliding_window/0')} and "
        f"{full_dropout_rise('sliding_window_tiles/0')} bits/byte by the last")),
    "archive.md: dropout, full, the gaps": (ARCHIVE, lambda: (
        f"ECP's final gap is {full_dropout('ecp/0', 'final_gap')} bits/byte, larger than the "
        f"transformer's ({full_dropout('transformer/0', 'final_gap')}, ranges separated)")),
    "archive.md: dropout, full, the windows' gaps": (ARCHIVE, lambda: (
        f"ECP's final gap is the smaller, by thin margins: "
        f"{full_dropout('sliding_window/0', 'final_gap')} for the entry-matched window (the "
        f"ranges {full_dropout_apart('sliding_window')} apart) and "
        f"{full_dropout('sliding_window_tiles/0', 'final_gap')} for the tile-matched one "
        f"({full_dropout_apart('sliding_window_tiles')} apart), against "
        f"{full_dropout_apart('transformer')} between ECP's range and the transformer's; at "
        f"their best epochs the four gaps are not separated (ECP "
        f"{full_dropout('ecp/0', 'gap_at_best')})")),
    "archive.md: dropout, full, the windows' gaps in the verdicts": (ARCHIVE, lambda: (
        f"smaller than both windows' by thin margins (their ranges "
        f"{full_dropout_apart('sliding_window')} and "
        f"{full_dropout_apart('sliding_window_tiles')} apart)")),
    "archive.md: dropout, full, best validation": (ARCHIVE, lambda: (
        f"The transformer reaches {full_dropout('transformer/0', 'best_valid_bits')} bits/byte, "
        f"ECP {full_dropout('ecp/0', 'best_valid_bits')}, the entry-matched window "
        f"{full_dropout('sliding_window/0', 'best_valid_bits')} and the tile-matched window "
        f"{full_dropout('sliding_window_tiles/0', 'best_valid_bits')}; ECP is separated from "
        "none of them, and the transformer is ahead of the entry-matched window, ranges "
        "separated, but not of the tile-matched one (their ranges overlap by {:.4f})".format(
            dropout_cell("transformer/0", "best_valid_bits", FULL["dropout"])["max"]
            - dropout_cell("sliding_window_tiles/0", "best_valid_bits", FULL["dropout"])["min"]))),
    "archive.md: dropout, full, dropout 0.1": (ARCHIVE, lambda: (
        "(ECP's final gap from {:.4f} to {:.4f} at 0.1) but costs more validation than it saves "
        "within 10 epochs (ECP {} at 0.1)".format(
            dropout_cell("ecp/0", "final_gap", FULL["dropout"])["mean"],
            dropout_cell("ecp/0.1", "final_gap", FULL["dropout"])["mean"],
            full_dropout("ecp/0.1", "best_valid_bits")))),
    "archive.md: dropout, full, verdict": (ARCHIVE, full_dropout_gap_claim),
    "evidence.md: dropout, full": (EVIDENCE, lambda: (
        f"ECP's train–validation gap is larger than the transformer's "
        f"{full_dropout_gap_claim()}")),
    "evidence.md: the small stages in one sitting": (EVIDENCE, lambda: small_timing()["table"]),
    "evidence.md: the small stages' total": (EVIDENCE, lambda: (
        f"the five `small` stages, one after\nanother in one sitting, take "
        f"{small_timing()['total']} on the two cores")),
    "archive.md: the small stages' total": (ARCHIVE, lambda: (
        f"(all five one after another in one sitting: {small_timing()['total']})")),
    "evidence.md: recall, small, again": (EVIDENCE, lambda: (
        f"the window's lead at L = 6 was not separated "
        f"({recall_cell('sliding_window', 6, where=RERUN)} against "
        f"{recall_cell('ecp', 6, where=RERUN)}) and ECP was also ahead of the "
        f"tile-matched window and block_local at L = 4: at 800 steps, near the threshold of "
        f"learning, rounding alone moves a seed by up to {rerun_recall_moves()}")),
    "archive.md: recall, small, again": (ARCHIVE, lambda: (
        f"a seed's accuracy moved by up to {rerun_recall_moves()}, block_local chose another "
        f"rate on its flat grid ({rerun_rates('recall', 'block_local')}), and two orderings "
        f"changed. Called only in the first run: {listed(rerun_orderings('recall')[0])}. Called "
        f"only in the second: {listed(rerun_orderings('recall')[1])}.")),
    "archive.md: hybrid recall, small, again": (ARCHIVE, lambda: (
        f"block_local's hybrid chose another rate "
        f"({rerun_rates('hybrid-recall', 'hybrid_block_local')}) "
        f"and moved ({hybrid_recall('hybrid_block_local', 4)}, then "
        f"{recall_cell('hybrid_block_local', 4, 'hybrid-recall', RERUN)} at L = 4)")),
    "archive.md: dropout, small, again": (ARCHIVE, lambda: (
        "window, {}, then {} bits/byte, not separated either time)".format(
            *rerun_ecp_advantage()))),
    "archive.md: curve step, small, again": (ARCHIVE, lambda: (
        "ECP's step on the curve took {:.3f} s in the first run, {:.3f} s in\nthe second".format(
            *(stage_model("curve", "ecp", w)["step_s"] for w in (SMALL, RERUN))))),
    "archive.md: relay, small, again": (ARCHIVE, lambda: (
        f"replacing the path sends ECP to chance again "
        f"({relay('ecp', 'path_replaced', where=RERUN)}, "
        f"from\n{relay('ecp', 'clean', where=RERUN)} clean, the control at "
        f"{relay('ecp', 'control_replaced', where=RERUN)})")),
    "archive.md: binding, small": (ARCHIVE, lambda: (
        f"ECP at best {binding('ecp')} (chance 0.062), about as well as the sliding window "
        f"({binding('sliding_window')}) and half as well as the transformer "
        f"({binding('transformer')})")),
}


@pytest.mark.parametrize("name", list(QUOTES))
def test_quote_matches_its_report(name):
    path, render = QUOTES[name]
    quote, text = (" ".join(t.split()) for t in (render(), path.read_text()))  # line breaks
    assert quote in text, f"{path.name} no longer quotes {quote!r}"


def check_table(report_path: str) -> None:
    """archive.md carries the table of the report ``report_path`` (.md) row for row, as the
    stage wrote it."""
    rows = [line for line in (ROOT / f"{report_path}.md").read_text().splitlines()
            if line.startswith("| ")]
    text = ARCHIVE.read_text().splitlines()
    missing = [row for row in rows if row not in text]
    assert rows and not missing, f"archive.md lacks {missing[:2]}"


@pytest.mark.parametrize("stage", ["recall", "dropout", "curve", "hybrid-recall", "hybrid-curve"])
def test_small_tables_are_the_stages_own(stage):
    """archive.md's tables of an Evidence III stage at the small budget are its report's, row for
    row."""
    check_table(f"{SMALL}/{stage}")


@pytest.mark.parametrize("stage", ["recall", "curve", "dropout", "hybrid-recall", "hybrid-curve"])
def test_full_tables_are_the_stages_own(stage):
    """archive.md's copy of a full report's table is that table, row for row (the relay's is
    linked and quoted, not copied)."""
    check_table(f"{FULL[stage]}/{stage.removeprefix('hybrid-')}")


def test_the_evidence_page_names_the_full_curves_chosen_rates():
    """The evidence page's account of the full curve's trials: 4e-3 for every model but the
    entry-matched window, and no choice at an edge of the grid."""
    rates = curve_rates()
    assert {m: r for m, r in rates.items() if r != 4e-3} == {"sliding_window": 8e-3}
    lrs = report(f"{FULL['curve']}/curve.json")["lrs"]
    assert min(lrs) < min(rates.values()) and max(rates.values()) < max(lrs)
    quote = ("every model's rate is now inside the grid: 4e-3 for all but the entry-matched "
             "window, which chose 8e-3")
    assert quote in " ".join(EVIDENCE.read_text().split())


def test_the_curves_first_point_is_its_trial_again():
    """Seed 0's 300-step point on the full curve is the same annealed run as the 4e-3 trial
    (seed 0, 300 steps, the same schedule), so its validation score is the trial's exactly, as
    the evidence page says."""
    point = report(f"{FULL['curve']}/curve/ecp/seed0/result.json")["points"][0]
    assert point["steps"] == 300
    assert point["bits_per_byte"] == curve_trial("ecp", 4e-3)


def test_the_full_curves_verdicts_are_its_orderings():
    """What archive.md and the evidence page say of the full curve is what its report called: ECP
    ahead of the entry-matched window and of the transformer at 600 steps only (the latter at
    equal time too), the tile-matched window ahead of ECP at 300 and 600, s2 ahead early, no
    ordering at 1,200, and the context gains: the transformer's positive in every seed, ECP's
    below its range and under a tenth of its mean."""
    summary = report(f"{FULL['curve']}/curve.json")
    calls = summary["orderings"]

    def ahead(a: str, b: str) -> list[str]:
        return [steps for steps, called in calls.items() if f"{a} < {b}" in called]

    assert ahead("ecp", "sliding_window") == ["600"] and not ahead("sliding_window", "ecp")
    assert ahead("sliding_window_tiles", "ecp") == ["300", "600"]
    assert not ahead("ecp", "sliding_window_tiles")
    assert ahead("ecp", "transformer") == ["600"] and not ahead("transformer", "ecp")
    others = [m for m in summary["models"] if m != "s2"]
    assert all(ahead("s2", m)[:1] == ["300"] for m in others)
    assert [m for m in others if "600" not in ahead("s2", m)] == ["sliding_window_tiles"]
    assert calls["1200"] == []
    assert any(call.startswith("ecp < transformer (ecp at 600 steps")
               for call in summary["equal_time"])
    ecp, transformer = full_gain("ecp"), full_gain("transformer")
    assert transformer["min"] > 0 and ecp["min"] > 0 and ecp["max"] < transformer["min"]
    assert ecp["mean"] < transformer["mean"] / 10


def test_the_full_hybrid_curves_verdicts_are_its_orderings():
    """What archive.md says of the full hybrid curve is what its report called: ECP's hybrid
    ahead of the entry-matched window's at both points and at equal time, level with the other
    two; no hybrid ahead of its local layer alone, the tile-matched window alone and s2 ahead
    of every hybrid; ECP's and the tile-matched hybrids ahead of the transformer at 300 steps,
    only ECP's at 600; the context gains' signs."""
    summary = report(f"{FULL['hybrid-curve']}/curve.json")
    calls, timed = summary["orderings"], summary["equal_time"]
    hybrids = [m for m, r in summary["models"].items() if "from" not in r]
    assert len(hybrids) == 4

    def ahead(a: str, b: str) -> list[str]:
        return [steps for steps, called in calls.items() if f"{a} < {b}" in called]

    def ahead_in_time(a: str, b: str) -> bool:
        return any(call.startswith(f"{a} < {b} ") for call in timed)

    both = ["300", "600"]
    assert ahead("hybrid_ecp", "hybrid_sliding_window") == both
    assert ahead_in_time("hybrid_ecp", "hybrid_sliding_window")
    for other in ("hybrid_sliding_window_tiles", "hybrid_block_local"):
        assert not ahead("hybrid_ecp", other) and not ahead(other, "hybrid_ecp")
    for hybrid, pure in (("hybrid_ecp", "ecp"), ("hybrid_sliding_window", "sliding_window"),
                         ("hybrid_sliding_window_tiles", "sliding_window_tiles")):
        assert not ahead(hybrid, pure)
    assert not ahead("sliding_window", "hybrid_sliding_window")
    assert not ahead("ecp", "hybrid_ecp")
    for hybrid in hybrids:
        assert ahead("sliding_window_tiles", hybrid) == both == ahead("s2", hybrid)
        assert ahead_in_time("sliding_window_tiles", hybrid)
    assert ahead("hybrid_ecp", "transformer") == both
    assert ahead("hybrid_sliding_window_tiles", "transformer") == ["300"]
    assert not ahead("hybrid_sliding_window", "transformer")
    assert not ahead("hybrid_block_local", "transformer")
    assert all(ahead_in_time(h, "transformer") for h in ("hybrid_ecp",
                                                         "hybrid_sliding_window_tiles"))
    assert "600" in ahead("ecp", "transformer")
    gain = {m: full_hybrid_curve(m)["points"]["600"]["context_gain_bits"]
            for m in summary["models"]}
    assert gain["hybrid_ecp"]["min"] > 0 and gain["hybrid_ecp"]["min"] > gain["ecp"]["max"]
    assert gain["transformer"]["min"] < 0 < gain["transformer"]["max"]
    assert gain["hybrid_block_local"]["max"] < 0


def test_the_full_curves_paired_seeds_are_as_the_archive_says():
    """At 1,200 steps, seed by seed: the tile-matched window below the entry-matched one and the
    transformer in every seed, every difference with ECP changing sign, ECP's seed 1 its worst
    and the best of both windows and the transformer."""
    at = {m: full_curve(m)["points"]["1200"]["per_seed"]
          for m in report(f"{FULL['curve']}/curve.json")["models"]}

    def signs(a: str, b: str) -> set[bool]:
        return {x < y for x, y in zip(at[a], at[b], strict=True)}

    assert signs("sliding_window_tiles", "sliding_window") == {True}
    assert signs("sliding_window_tiles", "transformer") == {True}
    assert all(signs("ecp", m) == {True, False} for m in at if m != "ecp")
    seeds = range(len(at["ecp"]))
    assert max(seeds, key=lambda s: at["ecp"][s]) == 1
    assert all(min(seeds, key=lambda s: at[m][s]) == 1
               for m in ("sliding_window", "sliding_window_tiles", "transformer"))
    assert "**The seeds are paired.**" in ARCHIVE.read_text()


def test_the_full_dropout_verdicts_are_its_findings():
    """What archive.md and the evidence page say of the full dropout stage is what its table holds:
    validation turned at dropout 0 in every seed of ECP and both windows and in two of the
    transformer's, ECP's final gap above the transformer's and below both windows' (ranges
    separated), the windows' above the transformer's, ECP's mean gap above the transformer's
    at every epoch (separated at 1 and 7-10, and at 7 with validation means within 0.002), the
    gaps at best unseparated, ECP's best score level with the three others' and the
    transformer's ahead of the entry-matched window's only, every model's best at dropout 0,
    and two dropout runs that have turned."""
    summary = report(f"{FULL['dropout']}/dropout.json")
    table, epochs = summary["table"], summary["epochs"]
    best_epoch = {cell: (row["best_epoch"]["min"], row["best_epoch"]["max"])
                  for cell, row in table.items()}
    assert best_epoch["ecp/0"] == best_epoch["sliding_window/0"] == (8.0, 9.0)
    assert best_epoch["sliding_window_tiles/0"] == (8.0, 8.0)
    assert best_epoch["transformer/0"] == (9.0, 10.0)
    seeds = [c["best_epoch"] for c in (report(
        f"{FULL['dropout']}/runs/transformer/dropout0/seed{s}/result.json") for s in range(3))]
    assert sorted(seeds) == [9.0, 9.0, 10.0]
    turned = [cell for cell, (_, last) in best_epoch.items()
              if last < epochs and not cell.endswith("/0")]
    assert turned == [] and [c for c, (first, _) in best_epoch.items()
                             if first < epochs and not c.endswith("/0")] == [
        "sliding_window_tiles/0.2", "transformer/0.1"]

    def cell(model, key):
        return table[f"{model}/0"][key]

    assert separated(cell("ecp", "final_gap"), cell("transformer", "final_gap")) == 1
    for window in ("sliding_window", "sliding_window_tiles"):
        assert separated(cell("ecp", "final_gap"), cell(window, "final_gap")) == -1
        assert separated(cell(window, "final_gap"), cell("transformer", "final_gap")) == 1
    assert separated(cell("ecp", "best_valid_bits"),
                     cell("sliding_window_tiles", "best_valid_bits")) == 0
    assert separated(cell("transformer", "best_valid_bits"),
                     cell("sliding_window_tiles", "best_valid_bits")) == 0
    for a, b in ((a, b) for i, a in enumerate(DROPOUT_MODELS) for b in DROPOUT_MODELS[i + 1:]):
        assert separated(cell(a, "gap_at_best"), cell(b, "gap_at_best")) == 0, (a, b)
    assert separated(cell("ecp", "best_valid_bits"), cell("transformer", "best_valid_bits")) == 0
    assert separated(cell("ecp", "best_valid_bits"),
                     cell("sliding_window", "best_valid_bits")) == 0
    assert separated(cell("transformer", "best_valid_bits"),
                     cell("sliding_window", "best_valid_bits")) == -1
    sides = [separated(full_dropout_epoch("ecp/0", e)["gap_bits"],
                       full_dropout_epoch("transformer/0", e)["gap_bits"])
             for e in range(1, epochs + 1)]
    assert [e + 1 for e, side in enumerate(sides) if side] == [1, 7, 8, 9, 10]
    assert not any(side < 0 for side in sides)
    assert all(full_dropout_epoch("ecp/0", e)["gap_bits"]["mean"]
               > full_dropout_epoch("transformer/0", e)["gap_bits"]["mean"]
               for e in range(1, epochs + 1))
    valid7 = [full_dropout_epoch(f"{m}/0", 7)["valid_bits"]["mean"]
              for m in ("ecp", "transformer")]
    assert abs(valid7[0] - valid7[1]) < 0.002
    models = {row["arch"] for row in table.values()}
    for model in models:
        best = min((row for row in table.values() if row["arch"] == model),
                   key=lambda row: row["best_valid_bits"]["mean"])
        assert best["dropout"] == 0, model


def test_the_second_small_sitting_repeats_language_and_dropout():
    """What archive.md says the second sitting repeated: every budget point of both curves and
    every dropout cell within 0.0001 bits/byte, the same rates and the same orderings at equal
    steps, one equal-time ordering of the hybrids' curve not called again, the dropout findings
    the same but for one digit, and the hybrids' recall orderings the same at both depths."""
    def numbers(tree, skip=("step_s", "train_step_s", "trials")):
        if isinstance(tree, dict):
            return {k: numbers(v) for k, v in tree.items() if k not in skip}
        if isinstance(tree, list):
            return [numbers(v) for v in tree]
        return tree

    def drift(a, b):
        if isinstance(a, dict):
            return max((drift(a[k], b[k]) for k in a), default=0.0)
        if isinstance(a, list):
            return max((drift(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return abs(a - b)
        assert a == b
        return 0.0

    for name in ("curve", "hybrid-curve"):
        first, second = (report(f"{w}/{name}.json") for w in (SMALL, RERUN))
        assert all(first["models"][m]["lr"] == second["models"][m]["lr"] for m in first["models"])
        assert drift(*(numbers({m: r["models"][m]["points"] for m in r["models"]})
                       for r in (first, second))) < 1e-4
        assert first["orderings"] == second["orderings"]
        timed = [{o.split(" (")[0] for o in r["equal_time"]} for r in (first, second)]
        assert (timed[0] - timed[1], timed[1] - timed[0]) == (
            ({"hybrid_sliding_window_tiles < hybrid_sliding_window"}, set())
            if name == "hybrid-curve" else (set(), set()))
    first, second = (report(f"{w}/dropout.json") for w in (SMALL, RERUN))
    assert drift(numbers(first["table"]), numbers(second["table"])) < 1e-4
    changed = [(a, b) for a, b in zip(first["findings"], second["findings"], strict=True)
               if a != b]
    assert len(changed) == 1 and changed[0][0].startswith("ecp's best-validation advantage")
    assert rerun_orderings("hybrid-recall") == ({"4": [], "8": []}, {"4": [], "8": []})
    first_only = rerun_orderings("recall")[0]
    both = {d: [o for o in called if o not in first_only[d]]
            for d, called in report(f"{SMALL}/recall.json")["orderings"].items()}
    local = ("ecp", "sliding_window", "sliding_window_tiles", "block_local")
    for d, called in both.items():  # what both runs call, as archive.md lists it
        assert {f"transformer > {m}" for m in local} <= set(called)
        assert {"sliding_window > sliding_window_tiles", "sliding_window > block_local"} <= set(
            called)
        assert ({"ecp > sliding_window_tiles", "ecp > block_local"} <= set(called)) == (d == "6")
