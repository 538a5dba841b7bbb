"""Evidence V: the research's mechanism, context carried across segments through depth,
measured where the models learn, and its headline orderings.

**Mechanism**: recall with each query's key d ∈ {m/2, m, 2m, 4m, 8m} behind it (N = 64, m = 4;
queries in the second half, which PerceiverAR's l = N/2 latents predict), at depths 2, 4, 8,
scored per distance (points ``d2`` … ``d32``). ``reach`` is what each definition lets a query
see. The tile-matched window (w = m) falls short of ECP at every depth; the window of ECP's
entries (w = 7) reaches past it, so no distance lies beyond it and within ECP: its contrast asks
whether ECP recalls as well where both reach. Both sit at L = 4, d = 16 = 4m.

``small`` runs the models the mechanism names on this CPU; the research's other named rivals
join at ``full``, sized for a GPU (on this CPU they alone exceed the study's 20 hours).

Primary family (ten, declared before any run): the two mechanism contrasts, and on both
language corpora ECP against PerceiverAR (equal parameters and tokens), Mamba, RWKV-4 and the
Llama-style transformer (equal parameters). The language stages join the spec before they run.
"""

from __future__ import annotations

from ecp_lm.studies.spec import Contrast, Grid, Recall, Stage, Study


def plain(*names: str) -> dict[str, dict[str, str]]:
    """Models at the architecture's own defaults."""
    return {n: {"arch": n} for n in names}


MECHANISM = {**plain("ecp", "sliding_window"),
             "sliding_window_tiles": {"arch": "sliding_window", "window": "m"},
             **plain("block_local", "s2", "transformer", "perceiver_ar"),
             "mamba2": {"arch": "mamba2", "mixer_width": "matched"},
             "gated_deltanet": {"arch": "gated_deltanet", "mixer_width": "matched"},
             **plain("rwkv7")}
NAMED = {"mamba": {"arch": "mamba", "mixer_width": "matched"},
         "rwkv4": {"arch": "rwkv4", "ff_hidden": "matched"},
         **plain("xlstm", "performer", "sparse_transformer", "longformer", "compressive",
                 "routing"),
         "llama": {"arch": "transformer", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
                   "ff_hidden": "matched"}}

SEGMENTS = 16
DISTANCE_TASK = dict(seq_len=64, num_pairs=4, num_queries=4, distances=(2, 4, 8, 16, 32),
                     query_start=32, num_keys=16, num_values=16, num_filler=16)
"""N = 64, m = 4: distances m/2 … 8m, queries in positions 32 … 62."""


def mechanism(task, model, train, depths, steps, select_steps, grid, seeds, models
              ) -> Stage:
    return Stage("mechanism", Recall(task, SEGMENTS, model, train, depths, steps,
                                     select_steps, 4), models, seeds, grid)


def reach(model: str, depth: int, m: int, window: int, n: int) -> int:
    """How far back (in positions) a query can see at ``depth`` layers, by the model's
    definition: the receptive field drawn on the mechanism plot."""
    if model == "ecp":
        return depth * m
    if model.startswith("sliding_window"):
        return depth * ((m if model.endswith("tiles") else window) - 1)
    if model == "s2":
        return depth * (m - 1)
    if model == "block_local":
        return 2 * m - 1
    return n - 1


STUDY = Study(
    name="evidence5",
    question="Does ECP carry context across segments through depth as its definition says, "
             "and does it lead the rivals the research names where the models learn?",
    budgets={
        "tiny": (
            mechanism(dict(DISTANCE_TASK, num_keys=8, num_values=8), dict(d_model=16, n_heads=2),
                      dict(batch_size=8, warmup_steps=5, eval_every=20, eval_size=64),
                      (2, 4), 30, 15, Grid((1e-3, 3e-3), 3.0, extensions=1), (0, 1),
                      {m: MECHANISM[m] for m in ("ecp", "sliding_window",
                                                 "sliding_window_tiles", "perceiver_ar",
                                                 "mamba2")}),
        ),
        "small": (
            mechanism(DISTANCE_TASK, dict(d_model=64, n_heads=4),
                      dict(warmup_steps=100, eval_every=250), (2, 4, 8), 3000, 1000,
                      Grid((3e-4, 1e-3, 3e-3), 3.0), (0, 1, 2, 3, 4), MECHANISM),
        ),
        "full": (
            mechanism(DISTANCE_TASK, dict(d_model=64, n_heads=4),
                      dict(warmup_steps=100, eval_every=250), (2, 4, 8), 6000, 1000,
                      Grid((3e-4, 1e-3, 3e-3), 3.0), (0, 1, 2, 3, 4),
                      {**MECHANISM, **NAMED}),
        ),
    },
    primary=(
        Contrast.pair("mechanism", "ecp@L4", "sliding_window_tiles@L4", "d16"),
        Contrast.pair("mechanism", "ecp@L4", "sliding_window@L4", "d16"),
        *(Contrast.pair(corpus, "ecp", rival) for corpus in ("language", "replication")
          for rival in ("perceiver_ar", "mamba", "rwkv4", "llama")),
    ),
)
