"""Test set-up: one torch thread (the tensors are tiny; pytest-xdist runs a worker per core,
and more threads only spin-wait on a shared 2-core machine), fixed seeds."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _onednn_projections(monkeypatch):
    """Large float32 projections on oneDNN, as the tests were written for; which library is
    faster is timed per CPU at first use in real runs (``tests/test_projection.py`` tests that)."""
    from qkv import projection

    monkeypatch.setattr(projection, "onednn_faster", lambda: True)
