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


@pytest.fixture(scope="session")
def native_kernel():
    """The native ECP kernel, built. It must build wherever the tests run (a C++ compiler is part
    of the test environment); ECP_LM_NATIVE=0 is the only way to skip the tests that need it."""
    from ecp_lm.model.kernels import native

    if os.environ.get("ECP_LM_NATIVE") == "0":
        pytest.skip("ECP_LM_NATIVE=0: native kernel turned off")
    assert native.load(), "the native ECP kernel did not build (see the warning above)"
    return native
