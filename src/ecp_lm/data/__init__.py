"""Data: real corpora, tokenizers, token caches, batching and pixel sequences.

This package never imports ``ecp_lm.model``."""
