"""Tests for qkv.models.checks: the token, length and batch checks every model shares.

Shape legend: ``b`` batch, ``t`` sequence length. The models' own tests check the messages
through each model's API; these check the helpers directly.
"""

import pytest
import torch

from qkv.models.checks import check_batch, check_ids, check_lengths, check_rows, check_tokens


def test_check_helpers_pass_good_input_through():
    ids = torch.tensor([[1, 2], [3, 4]])
    assert check_ids("x", ids, 5) is ids
    assert check_lengths("n", torch.tensor([1, 2], dtype=torch.int32), 2, 2).dtype == torch.long
    with pytest.raises(ValueError, match=r"x: expected shape \(b,\), got \(2, 2\)"):
        check_ids("x", ids, 5, dims=1)
    assert check_tokens("x", ids, "why") is ids and check_tokens("x", ids[:0], "why").shape == (0, 2)  # no row: none empty
    with pytest.raises(ValueError, match=r"x: expected at least one token per row \(why\), got shape \(2, 0\)"):
        check_tokens("x", ids[:, :0], "why")
    assert check_rows("x", ids) is ids
    with pytest.raises(ValueError, match=r"x: expected at least one batch row \(a loss is a mean over them\), got shape \(0, 2\)"):
        check_rows("x", ids[:0])


def test_check_batch_names_every_size():
    check_batch(a=torch.zeros(2, 3), b=None, c=torch.zeros(2))
    with pytest.raises(ValueError, match=r"batch: expected the same batch size for every input, got a 2, c 3"):
        check_batch(a=torch.zeros(2, 3), c=torch.zeros(3))
