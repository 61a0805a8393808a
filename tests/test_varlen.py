"""``qkv.varlen_attention`` (flash-attn's varlen dialect), ``unpad_input`` and ``pad_input``.

Shape legend: ``t`` packed tokens, ``h`` query heads, ``g`` KV heads, ``d`` query/key size,
``e`` value size, ``b`` sequences; ``sq``/``sk`` one sequence's lengths. h=6, g=3, d=11,
e=13, so a swapped axis fails.

The oracle is written here, literally: a loop over the sequences, each the formula of
``flash_attn_varlen_func``'s docstring (bottom-right causal and windows, ALiBi
``-slope·|r + sk - sq - c|``, the soft cap before ALiBi, zeros for a query with no key),
materialised in float64. Outputs, log-sum-exps and every gradient are compared to 1e-10.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv

from flash_ref import allowed

H, G, D, E = 6, 3, 11, 13


def packed(lengths_q, lengths_k, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, H, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(tk, G, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(tk, G, E, generator=gen, dtype=dtype).requires_grad_()
    cu = lambda ls: torch.tensor([0, *torch.cumsum(torch.tensor(ls), 0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_k)


def oracle(q, k, v, cu_q, cu_k, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None, score_mod=None,
           sinks=None):  # fmt: skip
    """Per sequence, the formula written out: ``(out (t, h, e), lse (h, t))``."""
    scale = D**-0.5 if scale is None else scale
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        a, b, c0, c1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        sq, sk = b - a, c1 - c0
        qs = q[a:b].transpose(0, 1)  # (h, sq, d)
        ks = k[c0:c1].transpose(0, 1).repeat_interleave(H // G, 0)
        vs = v[c0:c1].transpose(0, 1).repeat_interleave(H // G, 0)
        logits = scale * qs @ ks.transpose(-1, -2)  # (h, sq, sk)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        r = torch.arange(sq)[:, None]
        col = torch.arange(sk)[None, :]
        diag = r + sk - sq  # the key each query is aligned with
        if alibi is not None:
            slopes = alibi if alibi.dim() == 1 else alibi[s]
            logits = logits - slopes.double()[:, None, None] * (diag - col).abs()
        if score_mod is not None:
            logits = torch.stack([
                torch.stack([score_mod(logits[hh, rr, cc], torch.tensor(s), torch.tensor(hh), torch.tensor(rr), torch.tensor(cc))
                             for rr in range(sq) for cc in range(sk)]).reshape(sq, sk) if sq * sk else logits[hh]
                for hh in range(H)
            ])  # fmt: skip
        logits = logits.masked_fill(~allowed(sq, sk, causal, window), -math.inf)
        if sinks is not None:
            logits = torch.cat((logits, sinks.reshape(H, 1, 1).expand(H, sq, 1)), -1)
        lse = torch.logsumexp(logits, -1)  # (h, sq)
        live = torch.isfinite(lse)[..., None]
        w = torch.where(live, torch.exp(logits - torch.where(live, lse[..., None], 0.0)), 0.0)
        if sinks is not None:
            w = w[..., :-1]
        outs.append((w @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, -1)


def relative(score, b, h, q_idx, kv_idx):
    """A score_mod reading every index: the sequence, the head and local positions."""
    return score + 0.1 * b + 0.05 * h - 0.02 * (q_idx - kv_idx).abs()


CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(2, 1)),
    "causal_window": dict(causal=True, window_size=(3, -1)),
    "alibi": dict(causal=True, alibi_slopes="h"),
    "alibi_per_sequence": dict(alibi_slopes="bh"),
    "softcap": dict(causal=True, softcap=2.0),
    "softcap_alibi": dict(softcap=2.0, alibi_slopes="h"),
    "score_mod": dict(causal=True, score_mod=relative),
    "sinks": dict(causal=True, sinks=True),
    "scale": dict(softmax_scale=0.7),
}
LENGTHS = [([3, 0, 1, 5, 2], [4, 2, 1, 5, 0]), ([1, 4], [1, 4]), ([5, 3, 4], [5, 3, 4])]


def _args(case: dict, b: int):
    kw = dict(case)
    gen = torch.Generator().manual_seed(4)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = torch.rand(H, generator=gen, dtype=torch.float64)
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = torch.rand(b, H, generator=gen, dtype=torch.float64)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_()
    theirs = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                  alibi=kw.get("alibi_slopes"), scale=kw.get("softmax_scale"), score_mod=kw.get("score_mod"),
                  sinks=kw.get("sinks"))  # fmt: skip
    return kw, theirs


@pytest.mark.parametrize("lengths", LENGTHS, ids=["ragged", "short", "self"])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_the_per_sequence_formula(name, lengths):
    q, k, v, cu_q, cu_k = packed(*lengths)
    kw, theirs = _args(CASES[name], len(lengths[0]))
    out, lse = qkv.varlen_attention(q, k, v, cu_q, cu_k, max(lengths[0]), max(lengths[1]), return_lse=True, **kw)
    want, want_lse = oracle(q, k, v, cu_q, cu_k, **theirs)
    assert out.shape == (q.shape[0], H, E) and lse.shape == (H, q.shape[0])
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    gen = torch.Generator().manual_seed(2)
    d_out, d_lse = torch.randn(out.shape, generator=gen, dtype=out.dtype), torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    finite = torch.isfinite(want_lse)
    got = torch.autograd.grad((out * d_out).sum() + (torch.where(finite, lse, 0.0) * d_lse).sum(), leaves)
    expected = torch.autograd.grad((want * d_out).sum() + (torch.where(finite, want_lse, 0.0) * d_lse).sum(), leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_rows_with_no_key_are_zero_and_their_lse_is_minus_inf():
    q, k, v, cu_q, cu_k = packed([2, 3], [0, 2])
    out, lse = qkv.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and bool(torch.isneginf(lse[:, :2]).all())
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq[:2], torch.zeros_like(dq[:2])) and bool(torch.isfinite(dq).all())


def test_float32_follows_the_flash_rule():
    q, k, v, cu_q, cu_k = packed([40, 7, 25], [40, 7, 25])
    low = [x.detach().float().requires_grad_() for x in (q, k, v)]
    got = qkv.varlen_attention(*low, cu_q, cu_k, causal=True)
    plain, _ = oracle(*low, cu_q, cu_k, causal=True)
    exact, _ = oracle(q, k, v, cu_q, cu_k, causal=True)
    assert (got.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max() + 1e-6


def test_a_sequence_is_bitwise_the_same_alone_and_among_neighbours():
    """Batch invariance: output and gradients of a document do not depend on what is packed beside it."""
    gen = torch.Generator().manual_seed(0)
    doc = [torch.randn(37, H, D, generator=gen), torch.randn(37, G, D, generator=gen), torch.randn(37, G, E, generator=gen)]
    d_out = torch.randn(37, H, E, generator=gen)

    def run(before: int, after: int):
        pad = lambda n, heads, size: torch.randn(n, heads, size, generator=gen)  # noqa: E731
        parts = [torch.cat([pad(before, x.shape[1], x.shape[2]), x, pad(after, x.shape[1], x.shape[2])]) for x in doc]
        leaves = [p.requires_grad_() for p in parts]
        cu = torch.tensor([0, before, before + 37, before + 37 + after], dtype=torch.int32)
        out = qkv.varlen_attention(*leaves, cu, cu, causal=True)
        grads = torch.autograd.grad(out[before : before + 37], leaves, d_out)
        return [out[before : before + 37], *(g[before : before + 37] for g in grads)]

    alone = run(0, 0)
    for before, after in ((5, 0), (0, 91), (64, 13)):
        for a, b in zip(alone, run(before, after)):
            assert torch.equal(a, b)


def test_padded_and_packed_agree():
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 2, 7])
    b, s = 3, 7
    x = torch.randn(b, s, H, D, generator=gen, dtype=torch.float64)
    mask = torch.arange(s)[None, :] < lengths[:, None]
    packed_x, indices, cu, longest, seqlens = qkv.unpad_input(x, mask)
    assert longest == 7 and cu.dtype == torch.int32 and cu.tolist() == [0, 5, 7, 14] and seqlens.tolist() == [5, 2, 7]
    assert torch.equal(qkv.pad_input(packed_x, indices, b, s), x * mask[..., None, None])
    out = qkv.varlen_attention(packed_x, packed_x[:, :G], packed_x[:, :G], cu, cu, causal=True)
    xt = x.transpose(1, 2)  # (b, h, s, d)
    padded = qkv.attention(xt, xt[:, :G], xt[:, :G], causal=True, mask=qkv.masks.lengths(lengths))
    torch.testing.assert_close(qkv.pad_input(out, indices, b, s), padded.transpose(1, 2) * mask[..., None, None])


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 2, 8])), ValueError, r"cu_seqlens_q: expected offsets from 0, non-decreasing"),
        (dict(cu_seqlens_q=torch.tensor([0.0, 8.0])), TypeError, r"cu_seqlens_q: expected an integer tensor"),
        (dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError, r"cu_seqlens_k: expected 3 offsets"),
        (dict(max_seqlen_q=4), ValueError, r"max_seqlen_q: expected an int at least the longest sequence, 5, got 4"),
        (dict(max_seqlen_q=torch.tensor(4)), ValueError, r"max_seqlen_q: expected an int at least the longest sequence, 5, got 4"),
        (dict(max_seqlen_k=5.0), TypeError, r"max_seqlen_k: expected an int \(or a 0-d integer tensor\), got float"),
        (dict(max_seqlen_k=True), TypeError, r"max_seqlen_k: expected an int \(or a 0-d integer tensor\), got bool"),
        (dict(max_seqlen_q=torch.tensor([5])), TypeError, r"max_seqlen_q: expected an int \(or a 0-d integer tensor\), got"),
        (dict(window_size=(-2, 0)), ValueError, r"window_size: expected \(left, right\), ints >= -1"),
        (dict(alibi_slopes=torch.ones(4)), ValueError, r"alibi_slopes: expected shape \(6,\) or \(2, 6\), got \(4,\)"),
        (dict(softcap=-1.0), ValueError, r"softcap: expected a finite number >= 0"),
        (dict(softcap=float("nan")), ValueError, r"softcap: expected a finite number >= 0"),
        (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale: expected a finite number or None"),
        (dict(dropout_p=1.5), ValueError, r"dropout_p: expected a probability in \[0, 1\)"),
        (dict(alibi_slopes=torch.ones(6, dtype=torch.long)), TypeError, r"alibi_slopes: expected a float tensor .*got torch.int64"),
    ],
)
def test_errors_name_the_argument(kw, error, match):
    q, k, v, cu_q, cu_k = packed([3, 5], [3, 5])
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update(kw)
    with pytest.raises(error, match=match):
        qkv.varlen_attention(q, k, v, **args)


@pytest.mark.parametrize("make", [int, np.int64, np.int32, torch.tensor], ids=["int", "np.int64", "np.int32", "tensor"])
def test_max_seqlen_takes_what_flash_attn_takes(make):
    """flash-attn reads ``max_seqlen_*`` as a C++ int, so any integer converts: transformers passes
    ``position_ids.max() + 1``, a 0-d tensor, and numpy ints come from data loaders. They once were a
    ValueError, "expected an int at least the longest sequence, 5, got tensor(5)"."""
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 5])
    want = qkv.varlen_attention(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    out = qkv.varlen_attention(q, k, v, cu_q, cu_k, make(5), make(6), causal=True)
    assert torch.equal(out, want)


def test_return_attn_probs_gives_flash_attns_triple():
    """flash_attn_varlen_func(..., return_attn_probs=True) -> (out, softmax_lse (h, total_q), S_dmask); qkv's S_dmask is None."""
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    out, lse, s_dmask = qkv.varlen_attention(q, k, v, cu, cu, 5, 5, 0.0, None, True, (-1, -1), 0.0, None, False, True)
    want, want_lse = qkv.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    assert s_dmask is None and lse.shape == (2, 8)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(TypeError, match="return_attn_probs"):
        qkv.varlen_attention(q, k, v, cu, cu, return_attn_probs=1)


@st.composite
def varlen_calls(draw):
    """A random flash-attn varlen call: 1-4 sequences of 0-6 queries and keys each, and any options together."""
    b = draw(st.integers(1, 4))
    lengths_q = [draw(st.integers(0, 6)) for _ in range(b)]
    lengths_k = [draw(st.integers(0, 6)) for _ in range(b)]
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["window_size"] = (draw(st.integers(-1, 3)), draw(st.integers(-1, 3)))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([1.5, 4.0]))
    kw["alibi_slopes"] = draw(st.sampled_from([None, "h", "bh"]))
    if draw(st.booleans()):
        kw["sinks"] = True
    if draw(st.booleans()):
        kw["softmax_scale"] = draw(st.sampled_from([0.2, 1.3]))
    return lengths_q, lengths_k, {name: x for name, x in kw.items() if x is not None}, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=varlen_calls())
def test_random_calls_equal_the_per_sequence_formula(call):
    """Empty sequences, no keys, queries beyond the keys and every option at once, forward and gradients."""
    lengths_q, lengths_k, case, seed = call
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, seed=seed)
    kw, theirs = _args(case, len(lengths_q))
    out, lse = qkv.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, **kw)
    want, want_lse = oracle(q, k, v, cu_q, cu_k, **theirs)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    if not q.shape[0]:
        return
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    gen = torch.Generator().manual_seed(seed + 1)
    d_out, d_lse = torch.randn(out.shape, generator=gen, dtype=out.dtype), torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    finite = torch.isfinite(want_lse)
    got = torch.autograd.grad((out * d_out).sum() + (torch.where(finite, lse, 0.0) * d_lse).sum(), leaves, allow_unused=True)
    expected = torch.autograd.grad((want * d_out).sum() + (torch.where(finite, want_lse, 0.0) * d_lse).sum(), leaves,
                                   allow_unused=True)  # fmt: skip
    for x, a, e in zip(leaves, got, expected):
        a = torch.zeros_like(x) if a is None else a
        e = torch.zeros_like(x) if e is None else e
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("grad", [True, False])
def test_no_query_at_all_gives_an_empty_output(grad):
    """Every sequence empty (``total_q = 0``): flash-attn answers an empty ``(0, h, e)`` and lse ``(h, 0)``."""
    q, k, v, cu_q, cu_k = packed([0, 0], [0, 3])
    with torch.set_grad_enabled(grad):
        out, lse = qkv.varlen_attention(q, k, v, cu_q, cu_k, 0, 3, return_lse=True)
    assert out.shape == (0, H, E) and lse.shape == (H, 0)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.randn(5, 4), torch.arange(5), 2, 2), ValueError,
         r"seqlen: batch \* seqlen = 2 \* 2 = 4 positions, but indices reach flat position 4"),
        ((torch.randn(5, 4), torch.arange(4), 2, 3), ValueError, r"indices: expected one flat position per packed row \(5,\), got \(4,\)"),
        ((torch.randn(5, 4), torch.arange(5.0), 2, 3), TypeError, r"indices: expected an integer tensor, got torch.float32"),
        ((torch.randn(2, 4), torch.tensor([-1, 0]), 2, 3), ValueError, r"indices: expected flat positions >= 0, got -1"),
        ((torch.randn(5, 4), torch.arange(5), 2.0, 3), TypeError, r"batch: expected an int, got float"),
        ((torch.randn(5, 4), torch.arange(5), 2, -3), ValueError, r"seqlen: expected an int >= 0, got -3"),
        (([1.0], torch.arange(1), 1, 1), TypeError, r"hidden_states: expected a tensor \(t, \.\.\.\), got list"),
    ],
)  # fmt: skip
def test_pad_input_checks_its_arguments(args, error, match):
    # a seqlen too small for the indices gave "IndexError: index_copy_(): index 4 is out of bounds"
    with pytest.raises(error, match=match):
        qkv.pad_input(*args)
