"""Study II's architectures and budgets: the model and training of each budget, the entries a
study runs, and the run configuration of each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ecp_lm.run.config import RunConfig

ARCHS = ("transformer", "ecp", "sliding_window", "block_local", "s2", "perceiver_ar")
"""Study II's architectures, in the order they run: the full transformer first, since its loss
against position says whether the experiment can see long context at all."""
FULL_ATTENTION = "transformer"
"""The model whose loss against position says whether the experiment can see long context."""
REFERENCE = "ecp"
"""The architecture whose same-token training time sets the same-time comparison."""


@dataclass(frozen=True)
class Budget:
    model: dict[str, Any]
    train: dict[str, Any]
    test_max_tokens: int | None
    longer: tuple[int, ...]
    """Window multiples of N at which architectures without a length limit are also scored."""
    mqar: str | None
    """The budget of the recall stage (None: skipped)."""
    scaling: tuple[int, ...] = ()
    """Steps at which the budget-scaling run of the full transformer is scored (``--scaling``)."""
    scaling_warmup: int = 1
    """Warm-up steps of the scaling run (its learning rate is constant after them)."""
    scaling_eval_tokens: int | None = None
    """Validation bytes each scaling point is scored on (None: ``train["eval_max_tokens"]``)."""
    seeds: dict[str, int] = field(default_factory=lambda: {"ecp": 2, "sliding_window": 2,
                                                           "transformer": 2})


BUDGETS = {
    "tiny": Budget(
        model=dict(d_model=32, n_layers=2, n_heads=2, seq_len=128, num_segments=4),
        train=dict(steps=4, batch_size=2, warmup_steps=1, eval_every=2, checkpoint_every=2,
                   log_every=1, eval_max_tokens=2048),
        test_max_tokens=4096, longer=(2,), mqar="tiny", scaling=(2, 4)),
    "small": Budget(
        model=dict(d_model=128, n_layers=4, n_heads=4, seq_len=2048, num_segments=8),
        train=dict(steps=300, batch_size=4, lr=2e-3, warmup_steps=30, eval_every=100,
                   checkpoint_every=100, log_every=25, eval_max_tokens=131072),
        test_max_tokens=262144, longer=(2, 4), mqar="small", scaling=(300, 600, 1200, 2400),
        scaling_warmup=60, scaling_eval_tokens=262144),
}


def entries(budget: Budget) -> list[dict[str, Any]]:
    """Every language-model run, in order: the same-token runs, then the same-time runs."""
    out = [{"name": f"tokens/{arch}/seed{seed}", "compare": "tokens", "arch": arch,
            "seed": seed} for arch in ARCHS for seed in range(budget.seeds.get(arch, 1))]
    out += [{"name": f"time/{arch}", "compare": "time", "arch": arch, "seed": 0}
            for arch in ARCHS if arch != REFERENCE]
    return out


def run_config(budget: Budget, arch: str, seed: int, steps: int | None = None) -> RunConfig:
    train = {**budget.train, "seed": seed}
    if steps is not None:  # the same schedule, stretched to the step count
        scale = steps / budget.train["steps"]
        for key in ("warmup_steps", "eval_every", "checkpoint_every"):
            train[key] = max(1, round(budget.train[key] * scale))
        train["steps"] = steps
    return RunConfig.from_dict({
        "model": {"vocab_size": 256, **budget.model, "arch": arch},
        "data": {"source": "sympy-code", "tokenizer": "bytes"},
        "train": train})
