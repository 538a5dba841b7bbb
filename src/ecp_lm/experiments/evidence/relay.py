"""Evidence III, is the relay causal? Interventions on the trained recall models.

For each query of held-out MQAR sequences, the residual stream at the segments strictly between
the planted value's segment and the query's is replaced, after the embedding and after every
block, by another sequence's at the same positions (a resample ablation, ``patched_logits``):
a model that carries the value to the query through those segments (ECP's relay, a sliding
window's chain) loses it, one that attends to the value directly (the transformer) does not.
The control replaces as many segments before the value's (where there are that many), which
no path from the value to the query crosses: the generic cost of the surgery. Reported per
model, depth and value-to-query segment offset: accuracy clean, with the path replaced and
with the control replaced, over the recall stage's seeds.

Binding (``binding_probe``): the single-pair segment probe shows that a value is decodable
downstream, not that the state keeps which key it belongs to. Here several pairs are planted at
once, one per segment from the first, and at the end of each later segment a linear probe per
key reads the value planted with that key from each layer's state: the bindings, not a bag of
values.

Both are measured on each seed's model by ``measure`` as soon as the recall stage has trained it
(its ``result.json`` keeps them under ``relay``), so the stage needs only the recall runs'
results, not their weights: a stage folder that keeps just its results (see
``evidence/.gitignore``) gives the same tables. Results without them (a recall folder written
before) are measured here from the kept weights.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ecp_lm.experiments.evidence.stats import spread
from ecp_lm.experiments.mqar.task import MQARBatch
from ecp_lm.experiments.mqar.train import segment_offset
from ecp_lm.model import LanguageModel

BINDING_PAIRS = 3
"""Pairs the binding probe plants at once."""


@torch.no_grad()
def patched_logits(model: LanguageModel, tokens: Tensor, donor: Tensor, patch: Tensor
                   ) -> Tensor:
    """Logits of ``tokens`` (B, N) with the residual stream at the positions ``patch`` (B, N,
    bool) taken, after the embedding and after every block, from ``donor`` (B, N)'s forward
    at the same positions."""
    modules = [model.embed, *model.blocks]
    donor_states: list[Tensor] = []

    def record(_module, _inputs, output):
        donor_states.append(output[0] if isinstance(output, tuple) else output)

    def replace(index: int):
        def hook(_module, _inputs, output):
            x = output[0] if isinstance(output, tuple) else output
            x = torch.where(patch[..., None], donor_states[index], x)
            return (x, *output[1:]) if isinstance(output, tuple) else x
        return hook

    handles = [m.register_forward_hook(record) for m in modules]
    try:
        model(donor)
    finally:
        for handle in handles:
            handle.remove()
    handles = [m.register_forward_hook(replace(i)) for i, m in enumerate(modules)]
    try:
        return model(tokens)
    finally:
        for handle in handles:
            handle.remove()


def segment_masks(batch: MQARBatch, segment_len: int, query: int) -> tuple[Tensor, Tensor]:
    """(path, control), each (B, N) bool, for query ``query`` of each row: the segments strictly
    between its value's and its own; as many segments ending where the value's begins (all
    False in a row without that many)."""
    n = batch.tokens.size(1)
    m = segment_len
    seg = torch.arange(n) // m  # (N,)
    value_seg = ((batch.key_pos[:, query] + 1) // m)[:, None]  # (B, 1)
    query_seg = (batch.query_pos[:, query] // m)[:, None]
    path = (seg > value_seg) & (seg < query_seg)
    count = query_seg - value_seg - 1
    control = (seg >= value_seg - count) & (seg < value_seg) & (value_seg - count >= 0)
    return path, control


@torch.no_grad()
def intervene(model: LanguageModel, batch: MQARBatch, donor: MQARBatch, segment_len: int
              ) -> dict[str, Any]:
    """Per value-to-query offset: accuracy clean, with the path replaced, with the control
    replaced (over the queries that have a control), and how many queries each counts."""
    model.eval()
    rows = torch.arange(batch.tokens.size(0))
    clean = model(batch.tokens).argmax(-1)
    offsets = segment_offset(batch, segment_len)  # (B, Q)
    out: dict[int, dict[str, list[bool]]] = {}
    for q in range(batch.query_pos.size(1)):
        pos, answer = batch.query_pos[:, q], batch.values[:, q]
        offset = offsets[:, q]
        path, control = segment_masks(batch, segment_len, q)
        hit_clean = clean[rows, pos] == answer
        hit_path = patched_logits(model, batch.tokens, donor.tokens, path).argmax(-1)[
            rows, pos] == answer
        hit_control = patched_logits(model, batch.tokens, donor.tokens, control).argmax(-1)[
            rows, pos] == answer
        has_control = control.any(1)
        for o in offset.unique().tolist():
            row = offset == o
            cell = out.setdefault(int(o), {"clean": [], "path": [], "control": [],
                                           "control_clean": []})
            cell["clean"] += hit_clean[row].tolist()
            cell["path"] += hit_path[row].tolist()
            cell["control"] += hit_control[row & has_control].tolist()
            cell["control_clean"] += hit_clean[row & has_control].tolist()

    def mean(values: list[bool]) -> float | None:
        return sum(values) / len(values) if values else None

    return {str(o): {"queries": len(c["clean"]), "clean": mean(c["clean"]),
                     "path_replaced": mean(c["path"]), "control_queries": len(c["control"]),
                     "control_clean": mean(c["control_clean"]),
                     "control_replaced": mean(c["control"])}
            for o, c in sorted(out.items())}


def binding_batch(spec, segment_len: int, pairs: int, count: int, generator: torch.Generator
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Sequences of filler with ``pairs`` key-value pairs of distinct keys, pair j inside segment
    j, and no query: (tokens (B, N), keys (B, P), values (B, P))."""
    m, n = segment_len, spec.seq_len
    if pairs * m > n or m < 2:
        raise ValueError(f"{pairs} pairs, one per segment of {m}, do not fit in seq_len={n}")
    tokens = torch.randint(spec.filler_start, spec.vocab_size, (count, n), generator=generator)
    keys = torch.rand(count, spec.num_keys, generator=generator).argsort(1)[:, :pairs]
    values = torch.randint(spec.values_start, spec.filler_start, (count, pairs),
                           generator=generator)
    start = torch.randint(0, m - 1, (count, pairs), generator=generator)  # key at start, value +1
    rows = torch.arange(count)[:, None]
    key_pos = torch.arange(pairs) * m + start
    tokens[rows, key_pos], tokens[rows, key_pos + 1] = keys, values
    return tokens, keys, values


@torch.no_grad()
def binding_probe(model: LanguageModel, spec, segment_len: int, pairs: int, n_train: int,
                  n_test: int, ridge: float = 1e-3) -> dict[str, Any]:
    """Held-out accuracy of reading, for every key, the value planted with it, linearly from
    each layer at the end of each segment from the last pair's to the end (one probe per layer,
    segment and key, over the sequences that plant that key), averaged over the keys."""
    from ecp_lm.experiments.mqar.linear_probe import _collect, fit_linear_probe, probe_predict

    m = segment_len
    anchors = torch.arange(pairs, spec.seq_len // m + 1) * m - 1  # segment ends from pair P-1's

    def states(count: int, seed: int):
        tokens, keys, values = binding_batch(spec, m, pairs, count,
                                             torch.Generator().manual_seed(seed))
        x = _collect(model, tokens, anchors.expand(count, -1))  # (L+1, B, A, d)
        return x, keys, values - spec.values_start

    x_train, k_train, y_train = states(n_train, 13_000_001)
    x_test, k_test, y_test = states(n_test, 13_000_003)
    grid = []
    for layer in range(x_train.size(0)):
        row = []
        for a in range(len(anchors)):
            hits, total = 0, 0
            for key in range(spec.num_keys):
                train_rows, train_slot = (k_train == key).nonzero(as_tuple=True)
                test_rows, test_slot = (k_test == key).nonzero(as_tuple=True)
                if len(train_rows) < 2 or not len(test_rows):
                    continue
                probe = fit_linear_probe(x_train[layer, train_rows, a],
                                         y_train[train_rows, train_slot], spec.num_values,
                                         ridge)
                predicted = probe_predict(probe, x_test[layer, test_rows, a])
                hits += int((predicted == y_test[test_rows, test_slot]).sum())
                total += len(test_rows)
            row.append(hits / total)
        grid.append(row)
    return {"accuracy": grid, "layers": list(range(x_train.size(0))),
            "segments": (anchors // m).tolist(), "pairs": pairs, "chance": spec.chance,
            "n_train": n_train, "n_test": n_test}


def load_recall_model(folder: Path) -> LanguageModel:
    from safetensors.torch import load_file

    from ecp_lm.config import ModelConfig
    from ecp_lm.model import build_model

    result = json.loads((folder / "result.json").read_text())
    model = build_model(ModelConfig(**result["config"]))
    model.load_state_dict(load_file(folder / "model.safetensors"))
    return model.eval()


def binding_pairs(task) -> int:
    """Pairs the binding probe plants at once on an MQAR task: ``BINDING_PAIRS``, or fewer where
    the sequence has fewer segments after the first."""
    return min(BINDING_PAIRS, task.spec.seq_len // task.segment_len - 1)


def measure(model: LanguageModel, mqar: str, sequences: int) -> dict[str, Any]:
    """The relay stage's measurements of one trained recall model on the task of the
    ``experiments.mqar`` budget ``mqar``: ``interventions`` (``intervene``, by value-to-query
    offset) on ``sequences`` held-out sequences (donors: as many others) and ``binding`` (the
    ``binding_probe`` accuracy grid, layer by segment)."""
    from ecp_lm.experiments.mqar.budgets import BUDGETS
    from ecp_lm.experiments.mqar.task import mqar_batch

    task = BUDGETS[mqar]
    batch = mqar_batch(task.spec, sequences, torch.Generator().manual_seed(11_000_001))
    donor = mqar_batch(task.spec, sequences, torch.Generator().manual_seed(11_000_003))
    model.eval()
    binding = binding_probe(model, task.spec, task.segment_len, binding_pairs(task),
                            4 * sequences, sequences)
    return {"interventions": intervene(model, batch, donor, task.segment_len),
            "binding": binding["accuracy"]}


def run_measures(folder: Path, mqar: str, sequences: int) -> dict[str, Any]:
    """``measure`` of the recall run in ``folder``: what its result keeps, else measured on its
    kept weights."""
    result = json.loads((folder / "result.json").read_text())
    if "relay" in result:
        return result["relay"]
    return measure(load_recall_model(folder), mqar, sequences)


def run_relay(recall_out: Path, out: Path) -> dict[str, Any]:
    """The interventions on every model the recall stage in ``recall_out`` trained, on its
    budget's ``relay_sequences`` held-out sequences (donors: as many others), over its
    seeds (``measure``), as its summary ``recall.json`` lists them."""
    from ecp_lm.experiments.mqar.budgets import BUDGETS
    from ecp_lm.experiments.study import write_json
    from ecp_lm.fsutil import write_bytes_atomic

    stage = json.loads((recall_out / "recall.json").read_text())
    task = BUDGETS[stage["mqar"]]
    sequences = stage["relay_sequences"]
    table: dict[str, Any] = {}
    pairs = binding_pairs(task)
    for name in stage["models"]:
        for depth in stage["depths"]:
            measures = [run_measures(recall_out / "runs" / name / f"L{depth}" / f"seed{s}",
                                     stage["mqar"], sequences) for s in range(stage["seeds"])]
            seeds = [m["interventions"] for m in measures]
            binding = [m["binding"] for m in measures]
            cells = {}
            for offset in seeds[0]:
                cells[offset] = {"queries": seeds[0][offset]["queries"],
                                 "control_queries": seeds[0][offset]["control_queries"]}
                for key in ("clean", "path_replaced", "control_clean", "control_replaced"):
                    values = [s[offset][key] for s in seeds if s[offset][key] is not None]
                    cells[offset][key] = spread(values) if values else None
            table[f"{name}/L{depth}"] = {
                "model": name, "depth": depth, "offsets": cells,
                "binding": [[statistics.fmean(seed[layer][a] for seed in binding)
                             for a in range(len(binding[0][0]))]
                            for layer in range(len(binding[0]))]}
    summary = {"recall_budget": stage["budget"], "sequences": sequences,
               "binding_pairs": pairs, "binding_chance": task.spec.chance,
               "binding_segments": list(range(pairs - 1, task.spec.seq_len // task.segment_len)),
               "seeds": stage["seeds"], "segment_len": task.segment_len, "table": table}
    write_json(out / "relay.json", summary)
    write_bytes_atomic(out / "relay.md", relay_markdown(summary).encode())
    return summary


def relay_markdown(summary: dict[str, Any]) -> str:
    def cell(value: dict[str, float] | None) -> str:
        return "-" if value is None else f"{value['mean']:.3f} ± {value['half_range']:.3f}"

    lines = [f"# Evidence III: is the relay causal? (recall budget `{summary['recall_budget']}`)",
             "", f"{summary['sequences']} held-out sequences, segments of "
             f"{summary['segment_len']}, {summary['seeds']} seeds per model (mean ± half the "
             "range). Path: the residual stream at every segment between the value's and the "
             "query's replaced by another sequence's, at every layer; control: as many "
             "segments before the value's replaced (on the queries that have them).", "",
             "| model | L | offset | queries | clean | path replaced | control: clean | "
             "control replaced |", "|---|---|---|---|---|---|---|---|"]
    for row in summary["table"].values():
        for offset, c in row["offsets"].items():
            lines.append(f"| {row['model']} | {row['depth']} | {offset} | {c['queries']} | "
                         f"{cell(c['clean'])} | {cell(c['path_replaced'])} | "
                         f"{cell(c['control_clean'])} | {cell(c['control_replaced'])} |")
    lines += ["", f"Binding: {summary['binding_pairs']} pairs planted at once (one per segment "
              "from the first, no query); a linear probe per key reads the value planted with "
              "it from each layer at the end of each segment from the last pair's on (chance "
              f"{summary['binding_chance']:.3f}); mean over the seeds, the best layer and "
              "segment (the best of many cells: an optimistic summary; the whole grid is in "
              "relay.json), and the last layer at the last segment:", "",
              "| model | L | best (layer, segment) | last layer, last segment |",
              "|---|---|---|---|"]
    for row in summary["table"].values():
        grid = row["binding"]
        best = max((v, layer, a) for layer, r in enumerate(grid) for a, v in enumerate(r))
        segment = summary["binding_segments"][best[2]]
        lines.append(f"| {row['model']} | {row['depth']} | {best[0]:.3f} ({best[1]}, "
                     f"{segment}) | {grid[-1][-1]:.3f} |")
    return "\n".join(lines) + "\n"
