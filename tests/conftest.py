"""Shared fixtures. Tests never reach a model or dataset hub."""

from __future__ import annotations

import os

import pytest

from ecp_lm.config import ARCHS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param
