"""Evidence IV: the research's comparisons of small models on one CPU.

Language (bytes of ``sympy-code``) and multi-query associative recall. Every model shares the
skeleton's sizes (vocabulary, d_model, layers, heads, N, m); what differs:

- ``ecp``: segments of m; ``sliding_window``: ECP's unmasked score entries (its default w);
  ``sliding_window_tiles``: w = m, ECP's cost in the research's tiles; ``s2``: groups of m
  (about half ECP's entries); ``transformer``: full causal attention;
- ``perceiver_ar``: l = N/2 latents, the research's headline comparison, at equal training
  tokens (language only: it predicts only its latents, recall queries anywhere); it and the
  transformer also train for the time ECP's last point took (secondary comparisons);
- ``mamba2``, ``gated_deltanet``: the mixer width whose parameter count is the nearest to
  ECP's; ``rwkv7``: attention's widths, its low-rank maps on top (the report states its
  parameter difference).

Primary family (nine): ECP against each rival at the last language point, and on recall how
much more ECP gains from L = 2 to L = 4 than the sliding window of its entries does (ECP's reach
grows with depth, the window's by w − 1 per layer).
"""

from __future__ import annotations

from ecp_lm.studies.spec import Contrast, Grid, Language, Recall, Stage, Study

ATTENTION = {
    "ecp": {"arch": "ecp"},
    "sliding_window": {"arch": "sliding_window"},
    "sliding_window_tiles": {"arch": "sliding_window", "window": "m"},
    "s2": {"arch": "s2"},
    "transformer": {"arch": "transformer"},
}
RECURRENT = {
    "mamba2": {"arch": "mamba2", "mixer_width": "matched"},
    "gated_deltanet": {"arch": "gated_deltanet", "mixer_width": "matched"},
    "rwkv7": {"arch": "rwkv7"},
}
LANGUAGE_MODELS = {**ATTENTION, "perceiver_ar": {"arch": "perceiver_ar"}, **RECURRENT}
RECALL_MODELS = {**ATTENTION, **RECURRENT}
RIVALS = tuple(m for m in LANGUAGE_MODELS if m != "ecp")

SMALL_TASK = dict(seq_len=64, num_pairs=4, num_queries=4, d_min=17, d_max=32, num_keys=16,
                  num_values=16, num_filler=16)
"""N = 64, S = 8, m = 8: a query is 2 to 4 segments after its key, so one ECP layer never
sees the pair, four always do."""


def language(size, train, points, select_steps, grid, seeds, select_tokens=None,
             report_tokens=None, select_seeds=(0, 1)) -> Stage:
    return Stage("language", Language("sympy-code", size, train, points, select_steps,
                                      select_tokens=select_tokens, report_tokens=report_tokens,
                                      context_models=("transformer", "ecp"),
                                      equal_time=("transformer", "perceiver_ar")),
                 LANGUAGE_MODELS, seeds, grid, select_seeds)


def recall(task, model, train, depths, steps, select_steps, grid, seeds) -> Stage:
    return Stage("recall", Recall(task, 8, model, train, depths, steps, select_steps, 4),
                 RECALL_MODELS, seeds, grid)


STUDY = Study(
    name="evidence4",
    question="Is ECP better than each rival the research names, at equal cost, on language "
             "and on recall?",
    budgets={
        "tiny": (
            language(dict(d_model=32, n_layers=2, n_heads=2, seq_len=128, num_segments=4),
                     dict(batch_size=2, warmup_steps=1, eval_every=4, checkpoint_every=2,
                          log_every=1, eval_max_tokens=1024, min_lr_ratio=0.0,
                          logger="none"),
                     (4, 8), 4, Grid((1e-3, 4e-3), 4.0, extensions=1), (0, 1),
                     select_tokens=1024, report_tokens=2048),
            recall(dict(SMALL_TASK, num_keys=8, num_values=8), dict(d_model=16, n_heads=2),
                   dict(batch_size=8, warmup_steps=5, eval_every=20, eval_size=64),
                   (2, 4), 30, 15, Grid((1e-3, 3e-3), 3.0, extensions=1), (0, 1)),
        ),
        # about 3 hours of a 2-core CPU at --jobs 2 (docs/results.md gives what it took)
        "small": (
            language(dict(d_model=64, n_layers=4, n_heads=4, seq_len=1024, num_segments=4),
                     dict(batch_size=4, warmup_steps=20, eval_every=100, checkpoint_every=25,
                          log_every=25, eval_max_tokens=65536, min_lr_ratio=0.0,
                          logger="none"),
                     (200, 400), 200, Grid((2e-3, 4e-3, 8e-3), 2.0), (0, 1, 2, 3, 4),
                     select_tokens=131072),
            recall(SMALL_TASK, dict(d_model=64, n_heads=4), {}, (2, 4), 800, 400,
                   Grid((1e-4, 3e-4, 1e-3, 3e-3, 1e-2), 3.0), (0, 1, 2, 3, 4)),
        ),
        "full": (
            language(dict(d_model=128, n_layers=4, n_heads=4, seq_len=1024, num_segments=4),
                     dict(batch_size=8, warmup_steps=60, eval_every=300, checkpoint_every=60,
                          log_every=25, eval_max_tokens=262144, min_lr_ratio=0.0,
                          logger="none"),
                     (300, 600, 1200), 300, Grid((1e-3, 2e-3, 4e-3, 8e-3), 2.0),
                     (0, 1, 2, 3, 4)),
            recall(SMALL_TASK, dict(d_model=64, n_heads=4), {}, (2, 4, 6), 9600, 2400,
                   Grid((3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), 3.0), (0, 1, 2, 3, 4)),
        ),
    },
    primary=(*(Contrast.pair("language", "ecp", rival) for rival in RIVALS),
             Contrast.interaction("recall", "ecp", "sliding_window", "L2", "L4")),
)
