"""Evaluation: perplexity and bits per byte by the SPEC §6 protocol, per-position loss, streams."""
