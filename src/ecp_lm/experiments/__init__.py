"""Experiments that re-measure the research's claims (issue: evidence at small scale)."""
