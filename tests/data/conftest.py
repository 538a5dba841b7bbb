"""Fixtures: tiny corpora in the standard layouts, and a private user cache per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from corpora import TEXT, write_pg19, write_wikitext


@pytest.fixture
def wikitext(tmp_path) -> Path:
    return write_wikitext(tmp_path / "wikitext-103")


@pytest.fixture
def pg19(tmp_path) -> Path:
    return write_pg19(tmp_path / "pg19")


@pytest.fixture
def enwik8(tmp_path) -> Path:
    path = tmp_path / "enwik8"
    path.write_bytes(("<page>" + TEXT + "</page>\n").encode() * 50)
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test gets its own user cache folder."""
    monkeypatch.setenv("ECP_LM_CACHE", str(tmp_path / "cache"))
