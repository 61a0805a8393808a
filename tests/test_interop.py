"""Tests of ``qkv.interop`` / ``MultiHeadAttention.from_torch`` against ``torch.nn.MultiheadAttention``.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``dim`` model
size; PyTorch's bool masks are True = blocked, qkv's True = may attend.
"""

import pytest
import torch
from torch import nn

import qkv

B, I, J, DIM, HEADS = 2, 5, 7, 12, 3


def _pair(*, kdim=None, vdim=None, bias=True, batch_first=True):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(DIM, HEADS, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).double()
    if bias:  # PyTorch zero-initialises the biases; make them count
        with torch.no_grad():
            theirs.in_proj_bias.normal_()
            theirs.out_proj.bias.normal_()
    return theirs, qkv.MultiHeadAttention.from_torch(theirs)


def _inputs(kdim=DIM, vdim=DIM, self_attention=False):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, I, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    if self_attention:
        return x, x, x
    key = torch.randn(B, J, kdim, generator=gen, dtype=torch.float64, requires_grad=True)
    value = torch.randn(B, J, vdim, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, key, value


def _their_grads(theirs):
    """Gradients of PyTorch's weights, under qkv's names."""
    if theirs._qkv_same_embed_dim:
        wq, wk, wv = theirs.in_proj_weight.grad.chunk(3)
    else:
        wq, wk, wv = theirs.q_proj_weight.grad, theirs.k_proj_weight.grad, theirs.v_proj_weight.grad
    grads = {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv, "out_proj.weight": theirs.out_proj.weight.grad}
    if theirs.in_proj_bias is not None:
        bq, bk, bv = theirs.in_proj_bias.grad.chunk(3)
        grads.update({"q_proj.bias": bq, "k_proj.bias": bk, "v_proj.bias": bv, "out_proj.bias": theirs.out_proj.bias.grad})
    return grads


def _compare(theirs, ours, inputs, *, torch_kwargs, qkv_kwargs, batch_first=True):
    """Outputs, head-averaged weights and all gradients of the two modules on the same inputs."""
    their_inputs = inputs if batch_first else tuple(x.transpose(0, 1) for x in inputs)
    y_t, w_t = theirs(*their_inputs, need_weights=True, average_attn_weights=True, **torch_kwargs)
    if not batch_first:
        y_t = y_t.transpose(0, 1)
    y_q, w_q = ours(*inputs, return_weights=True, **qkv_kwargs)
    torch.testing.assert_close(y_q, y_t)
    torch.testing.assert_close(w_q.mean(1), w_t)
    torch.testing.assert_close(ours(*inputs, **qkv_kwargs), y_t)  # without weights a fused backend may run
    dy = torch.randn(y_q.shape, generator=torch.Generator().manual_seed(2), dtype=y_q.dtype)
    leaves = tuple({id(x): x for x in inputs}.values())  # self-attention passes one tensor three times
    g_t = torch.autograd.grad(y_t, leaves, dy, retain_graph=True)
    g_q = torch.autograd.grad(y_q, leaves, dy, retain_graph=True)
    for a, b in zip(g_q, g_t, strict=True):
        torch.testing.assert_close(a, b)
    (y_t * dy).sum().backward()
    (y_q * dy).sum().backward()
    their_grads = _their_grads(theirs)
    assert set(their_grads) == {name for name, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, their_grads[name], msg=name)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("layout", ["packed", "separate"])
def test_cross_attention_matches(layout, bias):
    kdim, vdim = (DIM, DIM) if layout == "packed" else (8, 10)  # kdim/vdim != dim forces separate weights
    theirs, ours = _pair(kdim=kdim, vdim=vdim, bias=bias)
    assert theirs._qkv_same_embed_dim == (layout == "packed")
    _compare(theirs, ours, _inputs(kdim, vdim), torch_kwargs={}, qkv_kwargs={})


def test_masks_translate_to_the_opposite_convention():
    theirs, ours = _pair()
    gen = torch.Generator().manual_seed(3)
    blocked = torch.rand(I, J, generator=gen) > 0.7
    blocked[:, 0] = False  # every query keeps a key (PyTorch gives NaN otherwise)
    padding = torch.tensor([[False] * J, [False] * 4 + [True] * 3])  # True = padding key
    _compare(
        theirs, ours, _inputs(),
        torch_kwargs=dict(attn_mask=blocked, key_padding_mask=padding),
        qkv_kwargs=dict(mask=~blocked & ~padding[:, None, None, :]),
    )  # fmt: skip


def test_causal_self_attention_matches():
    theirs, ours = _pair()
    future = torch.ones(I, I, dtype=torch.bool).triu(1)  # True = blocked
    _compare(theirs, ours, _inputs(self_attention=True), torch_kwargs=dict(attn_mask=future, is_causal=True),
             qkv_kwargs=dict(causal=True))  # fmt: skip


def test_fully_padded_query_is_nan_in_pytorch_and_zero_in_qkv():
    theirs, ours = _pair()
    x, key, value = (t.detach() for t in _inputs())
    blocked = torch.zeros(I, J, dtype=torch.bool)
    blocked[2] = True  # query 2 may see no key
    y_t, _ = theirs(x, key, value, attn_mask=blocked)
    y_q, w_q = ours(x, key, value, mask=~blocked, return_weights=True)
    assert bool(y_t[:, 2].isnan().all())  # the documented difference
    assert torch.equal(w_q[:, :, 2], torch.zeros(B, HEADS, J))
    # qkv's row is the output projection of a zero context: just the output bias.
    torch.testing.assert_close(y_q[:, 2], ours.out_proj.bias.expand(B, DIM))
    torch.testing.assert_close(y_q[:, [0, 1, 3, 4]], y_t[:, [0, 1, 3, 4]])


def test_sequence_first_module_keeps_its_layout():
    """A batch_first=False module (PyTorch's default) becomes a qkv module taking (i, b, dim), not a batch-first one."""
    theirs, ours = _pair(batch_first=False)
    assert not ours.batch_first and "batch_first=False" in repr(ours)
    x = torch.randn(I, B, DIM, dtype=torch.float64, requires_grad=True)  # (i, b, dim)
    y_t, w_t = theirs(x, x, x, need_weights=True, average_attn_weights=True)
    y_q, w_q = ours(x, return_weights=True)
    assert y_q.shape == (I, B, DIM)
    torch.testing.assert_close(y_q, y_t)
    torch.testing.assert_close(w_q.mean(1), w_t)  # weights stay (b, h, i, j)
    dy = torch.randn(y_t.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(y_q, x, dy)[0], torch.autograd.grad(y_t, x, dy)[0])
    kv = torch.randn(J, B, DIM, dtype=torch.float64)  # cross-attention, keys longer than queries
    torch.testing.assert_close(ours(x, kv, kv), theirs(x, kv, kv, need_weights=False)[0])
    with pytest.raises(ValueError, match=r"query: expected shape \(length, b, dim\) \(batch_first=False\)"):
        ours(x[0])


def test_conversion_keeps_sizes_mode_and_dropout():
    theirs = nn.MultiheadAttention(DIM, HEADS, dropout=0.25, kdim=8, vdim=10, batch_first=True)
    theirs.eval()
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    assert not ours.training and ours.attention.dropout == 0.25
    assert (ours.heads, ours.dim_head, ours.k_proj.in_features, ours.v_proj.in_features) == (HEADS, 4, 8, 10)
    assert ours.q_proj.weight.dtype == torch.float32


@pytest.mark.parametrize(
    ("module", "error", "message"),
    [
        (nn.Linear(3, 3), TypeError, r"module: expected torch.nn.MultiheadAttention, got Linear"),
        (nn.MultiheadAttention(DIM, HEADS, add_bias_kv=True), ValueError, r"module: add_bias_kv and add_zero_attn"),
        (nn.MultiheadAttention(DIM, HEADS, add_zero_attn=True), ValueError, r"module: add_bias_kv and add_zero_attn"),
    ],
)
def test_from_torch_errors(module, error, message):
    with pytest.raises(error, match=message):
        qkv.MultiHeadAttention.from_torch(module)
