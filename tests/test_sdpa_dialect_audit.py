"""An audit of ``qkv.scaled_dot_product_attention`` against ``F.scaled_dot_product_attention`` (torch 2.13, CPU).

Shape legend: ``N`` batch, ``Hq`` query heads, ``H`` KV heads, ``L`` query length, ``S`` key
length, ``E`` query/key size, ``Ev`` value size; N=2, Hq=6, H=3, L=5, S=7, E=11, Ev=13.

What PyTorch refuses, qkv refuses with the same exception type, naming the argument: the
checks of ATen's ``validate_sdpa_input`` (dtypes, devices, ranks), a mask that does not
broadcast to the scores ``q·kᵀ`` (PyTorch adds it in place), and the argument parser's
rules for ``scale`` and ``dropout_p`` (keyword-only ``scale``/``enable_gqa``; a number, a
numpy scalar or a 0-d tensor without grad). The deliberate differences of the module
docstring (a negative or non-finite argument, nested tensors) are pinned here too. The
oracle is the real op, called beside qkv's in every test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv

N, HQ, H, L, S, E, EV = 2, 6, 3, 5, 7, 11, 13


def inputs(q_lead=(N, HQ), kv_lead=(N, HQ), dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(*q_lead, L, E, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(*kv_lead, S, E, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(*kv_lead, S, EV, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def raises_as_torch(*args, names=(), **kw):
    """Both refuse the call with one exception type; qkv's message names each of ``names``."""
    with pytest.raises(Exception) as theirs:
        F.scaled_dot_product_attention(*args, **kw)
    with pytest.raises(theirs.type) as mine:
        qkv.scaled_dot_product_attention(*args, **kw)
    for name in names:
        assert name in str(mine.value), (name, str(mine.value))
    return str(mine.value)


def same_as_torch(*args, **kw):
    want = F.scaled_dot_product_attention(*args, **kw)
    got = qkv.scaled_dot_product_attention(*args, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- the signature


def test_scale_and_enable_gqa_are_keyword_only():
    """torch: "The optional scale argument can only be specified as a keyword argument" (TypeError, 3 to 6
    positional). qkv took ``scale`` and ``enable_gqa`` positionally."""
    q, k, v = inputs()
    raises_as_torch(q, k, v, None, 0.0, False, 0.5)
    raises_as_torch(q, k, v, None, 0.0, False, None, True)


@pytest.mark.parametrize("value", [True, np.float32(0.5), np.int64(2), torch.tensor(0.5), torch.tensor(2)],
                         ids=["bool", "np.float32", "np.int64", "0-d float tensor", "0-d int tensor"])  # fmt: skip
def test_scale_is_any_number_torchs_parser_takes(value):
    same_as_torch(*inputs(), scale=value)


@pytest.mark.parametrize("value", [torch.tensor([0.5]), torch.tensor(0.5, requires_grad=True)], ids=["1-d", "grad"])
def test_a_tensor_scale_with_a_dim_or_a_grad_is_torchs_type_error(value):
    """torch's parser takes a tensor for a float only if it is 0-d and records no gradient; qkv read ``[0.5]``
    and a ``requires_grad`` scale (whose gradient it then dropped)."""
    raises_as_torch(*inputs(), scale=value, names=["scale"])


@pytest.mark.parametrize("value", [False, np.float32(0.0), torch.tensor(0.0), torch.tensor(0)],
                         ids=["bool", "np.float32", "0-d float tensor", "0-d int tensor"])  # fmt: skip
def test_dropout_p_is_any_number_torchs_parser_takes(value):
    """qkv refused these (TypeError: expected a float in [0, 1))."""
    same_as_torch(*inputs(), dropout_p=value)


@pytest.mark.parametrize("value", [torch.tensor([0.0]), torch.tensor(0.0, requires_grad=True)], ids=["1-d", "grad"])
def test_a_tensor_dropout_p_with_a_dim_or_a_grad_is_torchs_type_error(value):
    raises_as_torch(*inputs(), dropout_p=value, names=["dropout_p"])


def test_dropout_p_above_one_is_torchs_runtime_error():
    """torch: RuntimeError 'dropout probability has to be between 0 and 1, but got 1.5'; qkv: ValueError."""
    raises_as_torch(*inputs(), dropout_p=1.5, names=["dropout_p", "between 0 and 1"])


@pytest.mark.parametrize("value", [-0.1, float("nan")])
def test_a_negative_or_nan_dropout_p_is_refused_as_the_reference_does(value):
    """Deliberate: torch's CPU kernels skip dropout for ``p <= 0`` (and nan), its documented reference
    (``torch.dropout``) raises RuntimeError; qkv raises it too, as for ``p > 1``."""
    with pytest.raises(RuntimeError, match="dropout_p: .*dropout probability has to be between 0 and 1"):
        qkv.scaled_dot_product_attention(*inputs(), dropout_p=value)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_scale_that_is_not_finite_is_refused(value):
    """Deliberate: torch multiplies through (nan and inf logits, nan rows); qkv refuses the scale."""
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        qkv.scaled_dot_product_attention(*inputs(), scale=value)


# --------------------------------------------------------------------------- validate_sdpa_input's checks


@pytest.mark.parametrize("ranks", [(1, 1, 1), (1, 2, 2), (2, 1, 2), (4, 4, 1)], ids=str)
def test_a_tensor_of_rank_below_two_is_torchs_runtime_error(ranks):
    """torch: RuntimeError 'Expected query, key, and value to all be  at least 2 dimensional'; qkv: ValueError."""
    q, k, v = (x[(0,) * (x.dim() - 2)][(0,) * (2 - r)] for x, r in zip(inputs(), ranks))
    first = ["query", "key", "value"][ranks.index(1)]
    raises_as_torch(q, k, v, names=[first, "at least 2 dimensional"])


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_mixed_dtypes_are_torchs_runtime_error(which):
    """torch: RuntimeError 'Expected query, key, and value to have the same dtype'; qkv: TypeError."""
    q, k, v = inputs()
    args = {"query": q, "key": k, "value": v}
    args[which] = args[which].float()
    raises_as_torch(*args.values(), names=[which, "same dtype"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex128], ids=str)
def test_inputs_that_are_not_real_floats_are_refused_as_torch(dtype):
    """torch's kernels: RuntimeError for integer and bool tensors, NotImplementedError for complex; qkv: TypeError."""
    raises_as_torch(*(x.to(dtype) for x in inputs()), names=["query", str(dtype)])


def test_tensors_on_different_devices_are_torchs_runtime_error():
    """torch: RuntimeError ('same device type'; a mask elsewhere: 'not on the expected device'); qkv: ValueError."""
    q, k, v = inputs()
    raises_as_torch(q, k.to("meta"), v, names=["key", "device"])
    raises_as_torch(q, k, v, attn_mask=torch.ones(L, S, dtype=torch.bool, device="meta"), names=["attn_mask", "device"])


# --------------------------------------------------------------------------- the mask broadcasts to the scores


MASK_CASES = {  # name: (q lead, k/v lead, mask shape, enable_gqa); the scores are (broadcast(q, k lead), Hq, L, S)
    "(L, S-2)": ((N, HQ), (N, HQ), (L, S - 2), False),
    "rank above the scores'": ((N, HQ), (N, HQ), (2, N, HQ, L, S), False),
    "rank above, leading 1s": ((N, HQ), (N, HQ), (1, 1, 1, L, S), False),
    "batch 3 against 2": ((N, HQ), (N, HQ), (3, 1, L, S), False),
    "batch grows the scores'": ((1, HQ), (1, HQ), (N, HQ, L, S), False),
    "heads grow the scores'": ((N, 1), (N, 1), (N, HQ, L, S), False),
    "KV heads under enable_gqa": ((N, HQ), (N, H), (N, H, L, S), True),
    "batch only value holds": ((1, HQ), (1, HQ), (N, HQ, L, S), False),
}


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64], ids=["bool", "float"])
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_a_mask_that_does_not_broadcast_to_the_scores_is_torchs_runtime_error(case, dtype):
    """torch adds the mask to ``q·kᵀ`` in place: a mask that does not broadcast to it, or would grow it, is a
    RuntimeError. qkv: ValueError; and it ran a mask whose batch only ``value`` holds (it broadcast the mask to
    the output's batch, ``value``'s included)."""
    q_lead, kv_lead, shape, gqa = MASK_CASES[case]
    q, k, v = inputs(q_lead, kv_lead)
    if case == "batch only value holds":
        v = v.expand(N, *v.shape[1:])
    mask = torch.ones(shape, dtype=dtype)
    raises_as_torch(q, k, v, attn_mask=mask, enable_gqa=gqa, names=["attn_mask", str(tuple(shape))])


def test_masks_that_broadcast_to_the_scores_still_run():
    q, k, v = inputs((1, HQ), (1, HQ))
    same_as_torch(q, k, v.expand(N, *v.shape[1:]), attn_mask=torch.rand(1, HQ, L, S) > 0.3)  # value's batch: not the mask's
    q, k, v = inputs((N, HQ), (N, H))
    same_as_torch(q, k, v, attn_mask=torch.rand(N, 1, 1, S) > 0.3, enable_gqa=True)
    same_as_torch(q, k, v, attn_mask=torch.randn(L, 1, dtype=torch.float64), enable_gqa=True)



@pytest.mark.parametrize("mask", [torch.tensor(True), torch.tensor(0.7, dtype=torch.float64)], ids=["bool", "float"])
def test_a_zero_dimensional_mask_broadcasts_as_documented(mask):
    """Deliberate: "must be broadcastable" (torch's docs); torch 2.13's kernels raise IndexError for a 0-d mask, as
    for a 1-d one (``test_torch_sdpa``). qkv reads it as that value at every (query, key)."""
    q, k, v = inputs()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(L, S))
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask), want, rtol=1e-12, atol=1e-12)

# --------------------------------------------------------------------------- nested tensors and compile


def test_nested_tensors_are_refused_with_a_message():
    """Deliberate: torch takes jagged nested tensors; qkv's engines take dense ones (``qkv.varlen_attention`` takes
    packed sequences). qkv ran some calls through and failed others from inside ('ge: relation is indeterminate')."""
    gen = torch.Generator().manual_seed(0)
    nq = torch.nested.nested_tensor([torch.randn(n, HQ, E, generator=gen) for n in (4, 2)], layout=torch.jagged)
    nq = nq.transpose(1, 2)
    with pytest.raises(NotImplementedError, match="query: a nested tensor.*varlen_attention"):
        qkv.scaled_dot_product_attention(nq, nq, nq, is_causal=True)


@pytest.mark.parametrize("case", ["plain", "is_causal L<S", "bool mask", "enable_gqa"])
def test_compiles_with_fullgraph_as_torchs_does(case):
    """``torch.compile(fullgraph=True)`` traces qkv's call (dynamo, no C++ compiler needed), its checks included."""
    q, k, v = inputs((N, HQ), (N, H) if case == "enable_gqa" else (N, HQ), dtype=torch.float32)
    kw = {"plain": {}, "is_causal L<S": dict(is_causal=True), "bool mask": dict(attn_mask=torch.rand(L, S) > 0.3),
          "enable_gqa": dict(enable_gqa=True, scale=0.5)}[case]  # fmt: skip
    torch._dynamo.reset()
    got = torch.compile(qkv.scaled_dot_product_attention, fullgraph=True, backend="eager")(q, k, v, **kw)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, **kw), rtol=2e-5, atol=2e-5)
