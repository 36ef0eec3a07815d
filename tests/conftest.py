"""Fixtures: tiny random-weight checkpoints built from the real config classes (tests/matrix.py), saved as
real HF model directories once per session, and executors of them."""

from __future__ import annotations

import random

import pytest
import torch

import symbiosis
from matrix import make_checkpoint

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch name -> (path, auto class), built once per test session."""
    built = {}

    def get(arch: str):
        if arch not in built:
            path = tmp_path_factory.mktemp(arch)
            built[arch] = (path, make_checkpoint(arch, path))
        return built[arch]

    return get


@pytest.fixture(scope="module")
def executors(checkpoints):
    made = {}

    def get(arch):
        if arch not in made:
            path, _ = checkpoints(arch)
            made[arch] = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
            # A second attached client: every call then takes the executor path (autograd Function, batcher),
            # not the single-client direct path, which test_single_client_direct_path covers.
            made[arch].attach(made[arch].fingerprint, "bystander")
        return made[arch]

    return get


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
