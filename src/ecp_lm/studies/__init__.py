"""Studies: declarative comparisons of architectures, run, analysed and reported alike.

- ``spec``: what a study declares before it runs (models, stages, seeds, grids, the primary
  family); ``specs``: the live studies, one file each;
- ``runner``: resumable jobs, workers, progress, invocation times, step times, the plan;
  ``rates``: the rate rules; ``anneal``: annealed points from one stable run;
- the tasks: ``language`` (a corpus, validation chooses, test reports) and ``recall`` (MQAR,
  ``mqar``: held-out sequences choose, others report);
- ``stats``: the additive model over a point's models and seeds, contrasts on the pooled
  degrees of freedom, Holm over the primary family, Bartlett, the bootstrap;
- ``report``: the verdict file and the report.

``python -m ecp_lm.studies STUDY --stage STAGE|report|all --budget B --out DIR``.
"""
