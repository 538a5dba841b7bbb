"""Shared fixtures. Tests never reach a model or dataset hub."""

from __future__ import annotations

import os

import pytest
import torch

from ecp_lm.config import ARCHS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def keeps_torch_threads():
    """A test that leaves torch's CPU thread count changed fails (and the count is put back): the
    tests after it would run their matrix products on another number of threads, whose sums round
    otherwise, and a comparison with a child process (which starts on every core) would differ."""
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch's CPU thread count at {after} (it was {before})")


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
