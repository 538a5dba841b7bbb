"""``ecp bench --loss-memory``: the peak memory of one training step with the plain loss and with
the chunked one (``models.loss``), and the loss's share of that peak.

Each case runs in a fresh process (on CPU the peak is the growth of the process's maximum
resident set, ``core.peak_bytes``): an ECP body of the benchmark's size on ``batch_size``
windows of ``seq_len`` tokens with the head at ``vocab_size`` (default the paper's 50,257), and
one forward and backward of

- ``hidden``: a trivial loss on the final hidden states (what the step costs without the head),
- ``plain``: ``F.cross_entropy(head(hidden).float(), targets)``, the logits of every row at once
  (``next_token_loss``),
- ``chunked``: ``LanguageModel.forward(tokens, targets=...)``, the head a chunk of rows at a time.

The loss's share of a case is its peak minus ``hidden``'s: the logits, their float32 copy and
gradient, and the head's own gradient.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ecp_lm.bench.core import BenchSpec, memory_mark, model_config, peak_bytes, synchronize
from ecp_lm.model import build_model
from ecp_lm.model.loss import chunk_rows, next_token_loss

LOSSES = ("hidden", "plain", "chunked")


@dataclass
class LossMemorySpec:
    vocab_size: int = 50257
    batch_size: int = 16
    seq_len: int = 1024
    """Rows of the loss: batch_size × seq_len (16,384 by default)."""
    body: BenchSpec = field(default_factory=BenchSpec)
    """The ECP body's size (m = ``segment_len``), device, precision and threads (``ecp bench``'s
    options)."""

    def __post_init__(self):
        if isinstance(self.body, dict):  # from JSON
            self.body = BenchSpec(**self.body)


def _loss(kind: str, model, tokens: torch.Tensor) -> torch.Tensor:
    if kind == "hidden":
        return model.hidden_states(tokens[:, :-1]).float().square().mean()
    if kind == "plain":
        return next_token_loss(model(tokens[:, :-1]), tokens)
    return model(tokens[:, :-1], targets=tokens[:, 1:])


def run_case(kind: str, spec: LossMemorySpec) -> dict[str, Any]:
    """One training step's forward and backward with loss ``kind``, in this process."""
    from ecp_lm.runtime import autocast, resolve_precision

    body = spec.body
    if body.threads:
        torch.set_num_threads(body.threads)
    torch.manual_seed(0)
    cfg = replace(model_config("ecp", spec.seq_len, body), vocab_size=spec.vocab_size)
    device = torch.device(body.device)
    model = build_model(cfg).to(device).train()
    tokens = torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_len + 1),
                           device=device)
    precision = resolve_precision(body.precision, device)
    mark = memory_mark(device)
    start = time.perf_counter()
    with autocast(precision, device):
        loss = _loss(kind, model, tokens)
    loss.backward()
    synchronize(device)
    step = time.perf_counter() - start
    return {"loss": kind, "step_s": step, "peak_mib": peak_bytes(device, mark) / 2**20,
            "precision": precision, "params": model.num_params()}


def run(spec: LossMemorySpec, progress: bool = True) -> dict[str, Any]:
    """Every loss in its own subprocess; the report's ``cases`` carry ``share_mib`` (the peak
    above ``hidden``'s) and ``share_ratio_to_plain``."""
    cases = []
    for kind in LOSSES:
        if progress:
            print(f"  bench loss memory: {kind} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "ecp_lm.bench.loss", kind, json.dumps(asdict(spec))]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
            raise RuntimeError(f"loss memory case {kind} failed: {tail}")
        cases.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = cases[0]["peak_mib"]
    for case in cases:
        case["share_mib"] = max(case["peak_mib"] - base, 0.0)
    plain = cases[1]["share_mib"]
    for case in cases:
        case["share_ratio_to_plain"] = case["share_mib"] / plain if plain else None
    return {"rows": spec.batch_size * spec.seq_len, "vocab_size": spec.vocab_size,
            "chunk_rows": chunk_rows(spec.vocab_size), "cases": cases}


def format_table(report: dict[str, Any], spec: LossMemorySpec) -> str:
    body, cases = spec.body, report["cases"]
    lines = [f"loss memory: one training step (forward + backward), ecp body d_model "
             f"{body.d_model} × {body.n_layers} layers, {spec.batch_size} × {spec.seq_len} = "
             f"{report['rows']:,} rows, vocab {report['vocab_size']:,}, chunks of "
             f"{report['chunk_rows']} rows, {cases[0]['precision']} on {body.device}",
             f"{'loss':>8} {'step s':>7} {'peak MiB':>9} {'loss share MiB':>15} "
             f"{'share ÷ plain':>13}"]
    for c in cases:
        ratio = "-" if c["share_ratio_to_plain"] is None else f"{c['share_ratio_to_plain']:.3f}"
        lines.append(f"{c['loss']:>8} {c['step_s']:>7.2f} {c['peak_mib']:>9,.0f} "
                     f"{c['share_mib']:>15,.0f} {ratio:>13}")
    return "\n".join(lines)


if __name__ == "__main__":  # one case, called by run(): prints its JSON line
    print(json.dumps(run_case(sys.argv[1], LossMemorySpec(**json.loads(sys.argv[2])))))
