"""The local (block sliding-window) backend against the float64 reference.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Blocks are shrunk to 8 rows so that small
inputs span many blocks, with padded windows at both ends.
"""

import pytest
import torch

import qkv
from qkv.backends import local

B, H, G, D, E = 2, 6, 3, 11, 13


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(local, "block_size", lambda window: 8)


def make_inputs(i, j, dtype=torch.float64, e=E):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, i, D, generator=gen, dtype=dtype)
    k = torch.randn(B, G, j, D, generator=gen, dtype=dtype)
    v = torch.randn(B, G, j, e, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def both(q, k, v, **kw):
    results = []
    for backend in ("reference", "local"):
        out = qkv.attention(q, k, v, backend=backend, **kw)
        gen = torch.Generator().manual_seed(1)
        results.append((out, torch.autograd.grad(out, [q, k, v], torch.randn(out.shape, generator=gen, dtype=out.dtype))))
    return results


@pytest.mark.parametrize("i, j", [(40, 40), (30, 50), (50, 30)])
@pytest.mark.parametrize("left, right", [(3, 0), (5, 2), (0, 4)])
def test_matches_reference(i, j, left, right):
    q, k, v = make_inputs(i, j)
    (o_ref, g_ref), (o, g) = both(q, k, v, mask=qkv.masks.window(left, right))
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "extra",
    [
        {"mask": qkv.masks.window(4) & qkv.masks.lengths(torch.tensor([40, 13]))},
        {"mask": qkv.masks.window(4), "bias": qkv.ALiBi(H).double()},
        {"mask": qkv.masks.window(4) & qkv.masks.causal(), "score": "dot"},
        {"mask": qkv.masks.window(4) & qkv.masks.lengths(torch.tensor([40, 13])), "bias": qkv.ALiBi(H).double()},
    ],
)
def test_combined_masks_and_biases(extra):
    q, k, v = make_inputs(36, 40)
    (o_ref, g_ref), (o, g) = both(q, k, v, **extra)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_rows_without_keys_are_zero():
    q, k, v = make_inputs(50, 30)  # i > j: with right=0 the first 20 queries precede every key
    (o_ref, _), (o, (dq, _, _)) = both(q, k, v, mask=qkv.masks.window(3))
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(o[:, :, :20], torch.zeros_like(o[:, :, :20]))
    assert torch.equal(dq[:, :, :20], torch.zeros_like(dq[:, :, :20]))


def test_flash_rule_float32():
    q, k, v = make_inputs(40, 40)
    mask = qkv.masks.window(5)
    exact = qkv.attention(q, k, v, mask=mask, backend="reference")
    low = [x.detach().float() for x in (q, k, v)]
    plain = qkv.attention(*low, mask=mask, backend="reference")
    fast = qkv.attention(*low, mask=mask, backend="local")
    assert (fast.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max() + 1e-5


def test_work_per_block_does_not_grow_with_length(monkeypatch):
    """Each block of 8 queries sees 8 + left + right keys, whatever i: cost O(i·window)."""
    seen = []
    original = local._Kernel.apply

    def spy(q, k, v, add, scale):
        seen.append((q.shape[-2], k.shape[-2]))
        return original(q, k, v, add, scale)

    monkeypatch.setattr(local._Kernel, "apply", spy)
    for i in (40, 80, 160):
        q, k, v = (x.detach() for x in make_inputs(i, i))
        qkv.attention(q, k, v, mask=qkv.masks.window(5, 1), backend="local")
    assert {s for s in seen} == {(8, 8 + 5 + 1)}


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"score": qkv.scores.Additive(D, D, 4).double(), "mask": qkv.masks.window(3)}, "not a dot product"),
        ({"causal": True}, "no bounded sliding window"),
        ({"mask": qkv.masks.window(3), "return_weights": True}, "does not return weights"),
        ({"mask": qkv.masks.window(3), "dropout": 0.1}, "no dropout"),
        ({"mask": qkv.masks.window(3) & torch.ones(40, 40, dtype=torch.bool)}, "dense mask"),
        ({"mask": qkv.masks.window(30)}, "covers most"),
    ],
)
def test_refuses_with_a_reason(kw, reason):
    q, k, v = make_inputs(40, 40)
    with pytest.raises(ValueError, match=f"backend: 'local' cannot run this call: .*{reason}"):
        qkv.attention(q, k, v, backend="local", **kw)


@pytest.mark.parametrize("shape", [(1, 1), (1, 40), (36, 1), (B, 1, 1, 1), (H, 36, 40)])
def test_dense_bias_broadcast_along_i_or_j(shape):
    # found by tests/test_properties.py: a bias broadcast along i or j crashed in the block masks
    q, k, v = make_inputs(36, 40)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (o_ref, g_ref), (o, g) = both(q, k, v, mask=qkv.masks.window(4, 1), bias=bias)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_dense_bias_with_blocks_that_see_no_key():
    # i > j: the first blocks' windows lie left of key 0 (found by tests/test_properties.py)
    q, k, v = make_inputs(50, 30)
    bias = torch.randn(50, 30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (o_ref, _), (o, _) = both(q, k, v, mask=qkv.masks.window(2) & qkv.masks.causal(), bias=bias)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(o[:, :, :20], torch.zeros_like(o[:, :, :20]))


@pytest.mark.parametrize("i, j", [(40, 40), (30, 50), (50, 30)])
def test_masks_that_read_positions_are_asked_only_about_real_rows_and_keys(i, j):
    """Blocks overhang the rows and their windows the keys; a documents mask or a mask_mod indexing a table must
    not be asked about those positions (it would index past its ids)."""
    q, k, v = make_inputs(i, j)
    ids_q = torch.repeat_interleave(torch.arange(3), torch.tensor([i // 3, i // 3, i - 2 * (i // 3)]))[None]
    ids_k = torch.repeat_interleave(torch.arange(3), torch.tensor([j // 3, j // 3, j - 2 * (j // 3)]))[None]
    table_q, table_k = ids_q[0], ids_k[0]
    for mask in (qkv.masks.documents(ids_q, ids_k),
                 qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: table_q[q_idx] == table_k[kv_idx])):  # fmt: skip
        full = qkv.masks.window(3, 1) & qkv.masks.causal() & mask
        (want, want_grads), (got, got_grads) = both(q, k, v, mask=full)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
