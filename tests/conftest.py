"""Test set-up: one torch thread (the tensors are tiny; pytest-xdist runs a worker per core,
and more threads only spin-wait on a shared 2-core machine), fixed seeds."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
