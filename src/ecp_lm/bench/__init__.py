"""Benchmarks (``ecp bench``) and the analytic attention cost (``ecp complexity``)."""
