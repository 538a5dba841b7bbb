"""Study II's ``results.md``: the sensitivity check, the scaling points, the same-token and
same-time comparisons and the longer windows."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from ecp_lm.experiments.long_context.budgets import ARCHS, REFERENCE


def fmt(value: float | None, spec: str = ".4f") -> str:
    """``value`` formatted by ``spec``; ``-`` where it is missing or NaN."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that exist (perceiver_ar predicts no position below N - l)."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {(max(values) - min(values)) / 2:.4f}"


def markdown(summary: dict[str, Any], recall: dict[str, Any] | None = None) -> str:
    results, sens = summary["runs"], summary["sensitivity"]
    model = summary["model"]
    n, m = model["seq_len"], model["seq_len"] // model["num_segments"]
    lines = [f"# Study II: long context (budget `{summary['budget']}`)", "",
             f"sympy-code test split, bytes; N = {n}, m = {m} (2m = {2 * m}), "
             f"d_model {model['d_model']}, {model['n_layers']} layers. Wall time of the runs "
             f"(training and scoring), summed over runs that may have run side by side "
             f"(`--jobs`): {summary.get('wall_s', 0) / 60:.0f} min.", "",
             "## Sensitivity: does the full transformer use context beyond 2m?", "",
             "Transformer test bits/byte with windows of 2m minus with windows of N, on the same "
             f"targets, per seed: {', '.join(f'{g:+.4f}' for g in sens['context_gain_bits'])} "
             f"(must exceed {sens['threshold_bits']:+.2f} in every seed); beside it, its mean "
             "loss (nats/byte) over positions [2m, N) minus over [m, 2m): "
             f"{', '.join(fmt(g, '+.4f') for g in sens['far_minus_near'])}. "
             + ("**Sensitive**: the comparison below can show long-context use."
                if sens["sensitive"] else
                "**Not sensitive**: this run cannot show long-context use; the recall task "
                "carries the verdict."), ""]
    if summary.get("scaling"):
        lines += ["Against the training budget (`--scaling`: each architecture at a constant "
                  "learning rate, validation split):", "",
                  "| arch | steps | training tokens | valid loss | context gain (bits) | "
                  "loss [m,2m) | loss [2m,N) | far − near |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p['arch']} | {p['steps']} | {p['train_tokens']:,} | "
                  f"{p['loss']:.4f} | {fmt(p.get('context_gain_bits'), '+.4f')} | "
                  f"{fmt(p['near_loss'])} | {fmt(p['far_loss'])} | "
                  f"{fmt(p['far_minus_near'], '+.4f')} |" for p in summary["scaling"]]
        lines.append("")
    for compare, title in (("tokens", "Same training tokens"), ("time", "Same training time")):
        lines += [f"## {title}", "",
                  "| arch | seeds | steps | train tokens | test bits/byte | bits/byte at 2m | "
                  "context gain (bits) | loss [m,2m) | loss [2m,N) | far − near | train tok/s "
                  "(measured; in the runs) | attention / full |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arch in ARCHS:
            runs = [r for r in results if r["arch"] == arch and (
                r["compare"] == compare or (compare == "time" and arch == REFERENCE
                                            and r["compare"] == "tokens" and r["seed"] == 0))]
            if not runs:
                continue
            lines.append(
                f"| {arch} | {len(runs)} | {runs[0]['steps']} | {runs[0]['train_tokens']:,} | "
                f"{_mean_spread([r['bits_per_byte'] for r in runs])} | "
                f"{fmt(_mean(r['bits_at_2m'] for r in runs))} | "
                f"{fmt(_mean(r['context_gain_bits'] for r in runs), '+.4f')} | "
                f"{fmt(_mean(r['near_loss'] for r in runs))} | "
                f"{fmt(_mean(r['far_loss'] for r in runs))} | "
                f"{fmt(_mean(r['far_minus_near'] for r in runs), '+.4f')} | "
                f"{summary['throughput'][arch]:,.0f}; "
                f"{statistics.fmean(r['train_tokens_per_s'] for r in runs):,.0f} | "
                f"{runs[0]['attention_ratio_to_full']:.3f} |")
        lines.append("")
    lines += ["## Windows longer than training (same-token runs, seed 0)", "",
              "| arch | window | test loss (nats/byte) | loss [2m,N') − [m,2m) |",
              "|---|---|---|---|"]
    for r in results:
        if r["compare"] == "tokens" and r["seed"] == 0:
            lines.append(f"| {r['arch']} | N | {r['test_loss']:.4f} | "
                         f"{fmt(r['far_minus_near'], '+.4f')} |")
            for key, longer in r["longer"].items():
                lines.append(f"| {r['arch']} | {key} | {longer['loss']:.4f} | "
                             f"{fmt(longer['far_minus_near'], '+.4f')} |")
    if recall is not None:
        lines += ["", "## Multi-query associative recall", "",
                  "See [mqar/results.md](mqar/results.md)."]
    return "\n".join(lines) + "\n"
