"""Property test: random calls of ``qkv.scaled_dot_product_attention`` against ``F.scaled_dot_product_attention``.

Shape legend: ``N…`` batch dims (none to two), ``Hq`` query heads, ``H`` KV heads, ``L``
query length, ``S`` key length, ``E`` query/key size, ``Ev`` value size.

hypothesis draws whole SDPA calls, as PyTorch's own tests of the op vary them: inputs of
rank 2 to 5; grouped heads (``enable_gqa``); batch dims of 1, or missing, in any of query,
key and value where another holds them (broadcast); ``L`` above, below and equal to ``S``;
no mask, a bool mask or a float mask (with ``-inf`` entries, some rows wholly ``-inf``) of
any shape that broadcasts to ``(N…, Hq, L, S)``, leading dims dropped; ``is_causal``
(top-left); a scale, negative and 0 too (there ``is_causal`` is compared with PyTorch's
mask: its kernel's flag gives nan rows); float64 and float32. The output and the gradients
of query, key, value and a float mask must equal PyTorch's (float64 to 1e-12).
``derandomize=True``: every run makes the same calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv

TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}


@st.composite
def calls(draw):
    rank = draw(st.integers(2, 5))
    lead = tuple(draw(st.integers(1, 2)) for _ in range(max(0, rank - 3)))
    kv_heads, per = (draw(st.integers(1, 3)), draw(st.integers(1, 3))) if rank >= 3 else (1, 1)
    heads = kv_heads * per
    L, S, E, Ev = (draw(st.integers(1, 7)) for _ in range(4))
    # each batch dim held at full size by at least one of q, k, v, the others 1 (broadcast); a tensor may
    # also lack leading dims (a lower rank broadcasts too)
    holders = [draw(st.sampled_from(["q", "k", "v", "qk", "qv", "kv", "qkv"])) for _ in lead]
    own = {x: tuple(n if x in held else 1 for n, held in zip(lead, holders)) for x in "qkv"}
    for x in "qkv":
        drop = draw(st.integers(0, len(lead)))
        if all(size == 1 for size in own[x][:drop]):
            own[x] = own[x][drop:]
    is_causal = draw(st.booleans()) and draw(st.booleans())
    mask = None
    if not is_causal:
        kind = draw(st.sampled_from([None, "bool", "float"]))
        if kind is not None:
            scores = tuple(torch.broadcast_shapes(own["q"], own["k"]))  # PyTorch adds the mask to q·kᵀ, then reads v
            full = (*scores, heads, L, S) if rank >= 3 else (L, S)
            kept = full[draw(st.integers(0, len(full) - 2)) :]  # leading dims may be dropped
            shape = tuple(draw(st.sampled_from([1, n])) for n in kept)
            mask = (kind, shape, draw(st.sampled_from([0.2, 0.5, 0.9])), draw(st.booleans()))
    return dict(
        lead=lead, own=own, heads=heads, kv_heads=kv_heads, L=L, S=S, E=E, Ev=Ev,
        gqa=per > 1 or (rank >= 3 and draw(st.booleans())), is_causal=is_causal, mask=mask,
        scale=draw(st.sampled_from([None, 0.3, 1.7, -0.5, 0.0])), dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        rank=rank, seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def build(c: dict, grad: bool) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(c["seed"])

    def randn(*shape):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(c["dtype"])
        return x.requires_grad_(grad)

    heads, kv_heads = ((c["heads"],), (c["kv_heads"],)) if c["rank"] >= 3 else ((), ())
    own = c["own"] if c["rank"] >= 3 else {x: () for x in "qkv"}
    q = randn(*own["q"], *heads, c["L"], c["E"])
    k = randn(*own["k"], *kv_heads, c["S"], c["E"])
    v = randn(*own["v"], *kv_heads, c["S"], c["Ev"])
    kw = dict(is_causal=c["is_causal"], scale=c["scale"])
    if c["gqa"]:
        kw["enable_gqa"] = True
    if c["mask"] is not None:
        kind, shape, p, dead_row = c["mask"]
        keep = torch.rand(shape, generator=gen) < p
        if dead_row and len(shape) >= 2 and shape[-2] > 1:
            keep[..., 0, :] = False  # a query that sees no key
        if kind == "bool":
            kw["attn_mask"] = keep
        else:
            bias = torch.randn(shape, generator=gen, dtype=torch.float64).masked_fill(~keep, float("-inf"))
            kw["attn_mask"] = bias.to(c["dtype"]).requires_grad_(grad)
    return (q, k, v), kw


SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@SETTINGS
@given(c=calls())
def test_random_calls_equal_torch(c):
    (q, k, v), kw = build(c, grad=True)
    theirs = kw
    if kw["is_causal"] and kw["scale"] is not None and kw["scale"] <= 0:
        # PyTorch's kernel gives nan rows for is_causal with a scale <= 0 (torch 2.13); its mask path is the softmax
        theirs = {**kw, "is_causal": False, "attn_mask": torch.ones(c["L"], c["S"], dtype=torch.bool).tril()}
    want = F.scaled_dot_product_attention(q, k, v, **theirs)
    got = qkv.scaled_dot_product_attention(q, k, v, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOLERANCE[c["dtype"]], equal_nan=True)
    leaves = [x for x in (q, k, v, kw.get("attn_mask")) if x is not None and x.requires_grad]
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(c["dtype"])
    want_grads = torch.autograd.grad(want, leaves, cot, allow_unused=True)
    got_grads = torch.autograd.grad(got, leaves, cot, allow_unused=True)
    for name, a, b in zip("qkvm", got_grads, want_grads):
        a = torch.zeros_like(leaves["qkvm".index(name)]) if a is None else a
        b = torch.zeros_like(leaves["qkvm".index(name)]) if b is None else b
        torch.testing.assert_close(a, b, **TOLERANCE[c["dtype"]], equal_nan=True, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_wholly_masked_row_gives_what_torch_gives(dtype):
    """A query whose every logit is masked: PyTorch's CPU kernels answer zeros (bool or -inf float mask)."""
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=dtype) for _ in range(3))
    keep = torch.ones(3, 3, dtype=torch.bool)
    keep[1] = False
    for mask in (keep, torch.zeros(3, 3, dtype=dtype).masked_fill(~keep, float("-inf"))):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask), want, **TOLERANCE[dtype])
