"""Tests of the plain lane's plans kept for any number of keys (``sdpa_plain._shapes``, ``ANY_LENGTH``).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size.

An unmasked one-query call without grouped heads decides nothing from its key length, so a
decoding loop, one key longer at every step, plans once; every other call keeps its plan
under its exact shapes, and a call whose keys and values differ in length still gets the
full path's message.
"""

import pytest
import torch

import qkv
from qkv.backends import sdpa_plain


@pytest.fixture
def made(monkeypatch) -> list:
    """Every :func:`sdpa_plain.plan` call (a kept plan's call makes none), with the lane's plans emptied first."""
    calls, planned = [], sdpa_plain.plan
    monkeypatch.setattr(sdpa_plain, "_PLANS", {})

    def spy(*args, **kwargs):
        calls.append(args)
        return planned(*args, **kwargs)

    monkeypatch.setattr(sdpa_plain, "plan", spy)
    return calls


def _cache(b=2, g=4, j=40, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(b, g, j, d, generator=gen, dtype=dtype), torch.randn(b, g, j, d, generator=gen, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_decoding_loop_plans_once_and_equals_the_full_path_at_every_length(made, causal, dtype):
    K, V = _cache(dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for j in range(5, 25):
            q = torch.randn(2, 4, 1, 8, generator=gen, dtype=dtype)
            k, v = K[:, :, :j], V[:, :, :j]  # (a preallocated cache's views, as a model's step gives them)
            got = sdpa_plain.plain(q, k, v, "scaled_dot", causal, None)
            want = qkv.attention(q, k, v, causal=causal, backend="sdpa")
            assert got is not None and torch.equal(got, want)
    assert len(made) == 1, f"planned {len(made)} times for one loop"
    assert next(iter(sdpa_plain._PLANS.values())).shapes[1][2] == sdpa_plain.ANY_LENGTH


CALLS_OF_THEIR_LENGTH = {
    "grouped heads": dict(h=8, g=2, i=1),  # (grouped rows are timed per size class of the key length)
    "several queries": dict(h=4, g=4, i=3),
}


@pytest.mark.parametrize("name", list(CALLS_OF_THEIR_LENGTH))
def test_other_calls_keep_their_plans_under_their_own_length(made, name):
    shape = CALLS_OF_THEIR_LENGTH[name]
    K, V = _cache(g=shape["g"])
    q = torch.randn(2, shape["h"], shape["i"], 8)
    with torch.inference_mode():
        for j in (10, 11, 12, 11):
            got = sdpa_plain.plain(q, K[:, :, :j], V[:, :, :j], "scaled_dot", False, None)
            assert torch.equal(got, qkv.attention(q, K[:, :, :j], V[:, :, :j], backend="sdpa"))
    assert len(made) == 3  # one per length, the repeated one kept
    assert all(p.shapes[1][2] != sdpa_plain.ANY_LENGTH for p in sdpa_plain._PLANS.values())


def test_a_masked_decoding_step_keeps_its_plan_under_its_own_length(made):
    K, V = _cache()
    q = torch.randn(2, 4, 1, 8)
    with torch.inference_mode():
        for j in (10, 11):
            mask = qkv.masks.lengths(torch.tensor([j - 2, j]))
            got = sdpa_plain.plain(q, K[:, :, :j], V[:, :, :j], "scaled_dot", False, None, mask)
            assert torch.equal(got, qkv.attention(q, K[:, :, :j], V[:, :, :j], mask=mask, backend="sdpa"))
    assert len(made) == 2


def test_a_kept_plan_for_any_length_declines_keys_and_values_of_different_lengths(made):
    K, V = _cache()
    q = torch.randn(2, 4, 1, 8)
    with torch.inference_mode():
        sdpa_plain.plain(q, K[:, :, :10], V[:, :, :10], "scaled_dot", False, None)
        assert sdpa_plain.plain(q, K[:, :, :10], V[:, :, :11], "scaled_dot", False, None) is None
        (kept,) = sdpa_plain._PLANS.values()
        assert not sdpa_plain.fits(kept, q, K[:, :, :10], V[:, :, :11])
        assert not sdpa_plain.fits(kept, q, K[:, :, :0], V[:, :, :0])  # no key: the full path's answer
        assert sdpa_plain.fits(kept, q, K[:, :, :30], V[:, :, :30])
        with pytest.raises(ValueError, match="v"):
            qkv.attention(q, K[:, :, :10], V[:, :, :11])
