"""Linear probes of a trained model: the residual stream after each layer, and ridge-regression
classifiers that read a planted value back from it (the segment probe and the query probe)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ecp_lm.experiments.mqar.task import MQARSpec, mqar_batch, single_pair_batch
from ecp_lm.experiments.mqar.train import segment_offset
from ecp_lm.model import LanguageModel


@torch.no_grad()
def layer_states(model: LanguageModel, tokens: Tensor, positions: Tensor) -> Tensor:
    """(L + 1, B, P, d): the residual stream at ``positions`` (B, P) after the embedding
    (index 0) and after each block (1 .. L), read with forward hooks."""
    t = tokens.size(1)
    states: list[Tensor] = []
    index = positions[..., None].expand(-1, -1, model.cfg.d_model)

    def keep(_module, _inputs, output) -> None:
        x = output[0] if isinstance(output, tuple) else output
        if x.size(1) != t:
            raise ValueError(f"a layer returned {x.size(1)} rows for {t} positions; the probe "
                             "reads architectures that keep every position")
        states.append(x.gather(1, index).float())

    handles = [model.embed.register_forward_hook(keep)]
    handles += [block.register_forward_hook(keep) for block in model.blocks]
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(states)


def _collect(model: LanguageModel, tokens: Tensor, positions: Tensor, chunk: int = 128
             ) -> Tensor:
    was_training = model.training
    model.eval()
    try:
        return torch.cat([layer_states(model, tokens[i:i + chunk], positions[i:i + chunk])
                          for i in range(0, tokens.size(0), chunk)], dim=1)
    finally:
        model.train(was_training)


def fit_linear_probe(x_train: Tensor, y_train: Tensor, num_classes: int, ridge: float = 1e-3
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Closed-form ridge regression from standardised features (n, d) to one-hot labels
    0 .. num_classes - 1; returns (mean, scale, weights) for ``probe_predict``."""
    x = x_train.double()
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
    z = torch.cat([(x - mean) / scale, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    y = F.one_hot(y_train, num_classes).double()
    gram = z.T @ z + ridge * len(z) * torch.eye(z.size(1), dtype=x.dtype)
    weights = torch.linalg.solve(gram, z.T @ y)
    return mean, scale, weights


def probe_predict(probe: tuple[Tensor, Tensor, Tensor], x: Tensor) -> Tensor:
    mean, scale, weights = probe
    z = torch.cat([(x.double() - mean) / scale, torch.ones(len(x), 1, dtype=torch.float64)], 1)
    return (z @ weights).argmax(1)


def probe_accuracy(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor,
                   num_classes: int, ridge: float = 1e-3) -> float:
    """Held-out accuracy of a ridge linear probe fitted on (x_train, y_train)."""
    probe = fit_linear_probe(x_train, y_train, num_classes, ridge)
    return (probe_predict(probe, x_test) == y_test).double().mean().item()


def segment_probe(model: LanguageModel, spec: MQARSpec, segment_len: int, max_offset: int,
                  n_train: int, n_test: int, seed: int = 0, anchor: str = "segment_end",
                  ridge: float = 1e-3) -> dict[str, Any]:
    """Held-out accuracy of reading a single planted pair's value linearly from each layer
    (0 = embedding .. L) at each segment offset 0 .. ``max_offset`` after the value's segment.

    ``anchor``: ``segment_end`` reads the last position of that segment; ``value`` reads the
    position ``value_pos + offset·m`` (offset 0: the value token itself). Returns ``accuracy``,
    a list of L + 1 rows of ``max_offset + 1`` numbers, with ``layers``, ``offsets`` and
    ``chance``."""
    if anchor not in ("segment_end", "value"):
        raise ValueError(f"anchor={anchor!r} is not 'segment_end' or 'value'")
    m = segment_len
    offsets = torch.arange(max_offset + 1)

    def states(count: int, gen_seed: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(gen_seed)
        tokens, value_pos, values = single_pair_batch(spec, m, max_offset, count, gen)
        if anchor == "value":
            positions = value_pos[:, None] + offsets * m
        else:
            positions = (value_pos[:, None] // m + offsets + 1) * m - 1
        return _collect(model, tokens, positions), values - spec.values_start

    x_train, y_train = states(n_train, seed + 7_000_001)
    x_test, y_test = states(n_test, seed + 7_000_003)
    grid = [[probe_accuracy(x_train[layer, :, o], y_train, x_test[layer, :, o], y_test,
                            spec.num_values, ridge) for o in range(max_offset + 1)]
            for layer in range(x_train.size(0))]
    return {"accuracy": grid, "layers": list(range(x_train.size(0))),
            "offsets": offsets.tolist(), "anchor": anchor, "chance": spec.chance,
            "n_train": n_train, "n_test": n_test}


def query_probe(model: LanguageModel, spec: MQARSpec, segment_len: int, n_train: int,
                n_test: int, seed: int = 0, ridge: float = 1e-3) -> dict[str, Any]:
    """Held-out accuracy of reading each query's value linearly from each layer at the query
    position of MQAR sequences (one probe per layer over all queries), scored per segment offset
    from the planted value to the query. Returns ``accuracy`` (L + 1 rows, one column per offset in
    ``offsets``), ``overall`` (per layer), ``layers`` and ``chance``."""
    def states(count: int, gen_seed: int) -> tuple[Tensor, Tensor, Tensor]:
        batch = mqar_batch(spec, count, torch.Generator().manual_seed(gen_seed))
        x = _collect(model, batch.tokens, batch.query_pos).flatten(1, 2)  # (L+1, B·Q, d)
        offset = segment_offset(batch, segment_len)
        return x, (batch.values - spec.values_start).flatten(), offset.flatten()

    x_train, y_train, _ = states(n_train, seed + 9_000_001)
    x_test, y_test, offset = states(n_test, seed + 9_000_003)
    offsets = offset.unique().tolist()
    grid, overall = [], []
    for layer in range(x_train.size(0)):
        probe = fit_linear_probe(x_train[layer], y_train, spec.num_values, ridge)
        hit = probe_predict(probe, x_test[layer]) == y_test
        grid.append([hit[offset == o].double().mean().item() for o in offsets])
        overall.append(hit.double().mean().item())
    return {"accuracy": grid, "overall": overall, "layers": list(range(x_train.size(0))),
            "offsets": offsets, "chance": spec.chance, "n_train": n_train, "n_test": n_test}
