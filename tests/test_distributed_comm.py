"""The communication layer's pieces that need no other process: counting, attach, group checks."""

import pytest
import torch

from qkv.distributed import comm


def test_counting_is_a_fresh_tally_per_block():
    with comm.counting() as outer:
        comm.traffic.add("kv", 10)
        with comm.counting() as inner:
            comm.traffic.add("kv", 5)
            comm.traffic.add("grad", 7)
        comm.traffic.add("kv", 1)
    assert dict(outer.sent) == {"kv": 11} and outer.messages["kv"] == 2
    assert inner.total() == 12 and inner.total("grad") == 7


def test_attach_passes_values_and_sends_zero_gradients():
    out = torch.ones(2, requires_grad=True)
    other = torch.randn(3, requires_grad=True)
    y = comm.attach(out * 2, other)
    y.sum().backward()
    assert torch.equal(out.grad, torch.full((2,), 2.0)) and torch.equal(other.grad, torch.zeros(3))


def test_attach_is_a_no_op_without_gradients():
    x = torch.ones(2)
    assert comm.attach(x, torch.ones(3)) is x


def test_resolve_names_a_wrong_group_type(monkeypatch):
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    with pytest.raises(TypeError, match=r"ring_group: expected a torch.distributed.ProcessGroup or None, got str"):
        comm.resolve("world", "ring_group")
