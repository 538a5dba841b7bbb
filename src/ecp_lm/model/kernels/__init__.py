"""Attention: mask predicates, kernels and the multi-head module."""
