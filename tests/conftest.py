"""Test set-up: one torch thread per pytest-xdist worker (the machine has 2 cores), fixed seeds."""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
