"""Tests of the modules ``qkv.Attention`` and ``qkv.MultiHeadAttention``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` per-head query/key size, ``e`` per-head value size; modules take ``(b, i, dim)``.
"""

import math

import pytest
import torch
from einops import rearrange
from torch.func import functional_call

import qkv
from qkv import projection, scores

# Each score by name, built for per-head size ``d`` (query and key sizes may differ: ``dk``).
SCORES = ["dot", "scaled_dot", "bilinear", "additive", "location"]


def _score(name, d, dk=None):
    dk = d if dk is None else dk
    return {
        "dot": lambda: scores.Dot(),
        "scaled_dot": lambda: scores.ScaledDot(),
        "bilinear": lambda: scores.Bilinear(d, dk),
        "additive": lambda: scores.Additive(d, dk, hidden=6, bias=True),
        "location": lambda: scores.Location(d, max_len=8),
    }[name]()


def _gradcheck_inputs(module, inputs, **kwargs):
    """gradcheck over the inputs with the parameters fixed, then finite, non-zero parameter gradients."""
    assert torch.autograd.gradcheck(lambda *x: module(*x, **kwargs), inputs)
    module.zero_grad()
    module(*inputs, **kwargs).square().sum().backward()
    for name, p in module.named_parameters():
        if isinstance(getattr(module, "attention", None), qkv.Attention) and name.startswith("k_proj"):
            if isinstance(module.attention.score, scores.Location):
                # The location score reads key positions, never key contents: W^K gets no gradient.
                assert p.grad is None or not p.grad.any(), name
                continue
        assert p.grad is not None and bool(p.grad.isfinite().all()) and p.grad.abs().sum() > 0, name


def _gradcheck_params(module, inputs, **kwargs):
    """gradcheck over the parameters (inputs fixed), binding them with ``torch.func.functional_call``."""
    names, params = zip(*module.named_parameters(), strict=True)
    fixed = tuple(x.detach() for x in inputs)
    leaves = tuple(p.detach().requires_grad_() for p in params)
    call = lambda *p: functional_call(module, dict(zip(names, p, strict=True)), fixed, kwargs)  # noqa: E731
    assert torch.autograd.gradcheck(call, leaves)


def _attention_case(name):
    dq, dk = 5, 5 if name in ("dot", "scaled_dot") else 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, dq, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, dk, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False, True]])  # (i=1 broadcast, j)
    return _score(name, dq, dk).double(), (q, k, v), mask


def _mha_case(name, **kwargs):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    return qkv.MultiHeadAttention(6, 2, kv_heads=1, score=_score(name, 3), **kwargs).double(), (x, memory)


@pytest.mark.parametrize("name", SCORES)
def test_attention_module_gradcheck(name):
    score, inputs, mask = _attention_case(name)
    _gradcheck_inputs(qkv.Attention(score), inputs, mask=mask)
    # Parameter gradients of the chosen backend equal the reference backend's.
    auto = [p.grad.clone() for p in score.parameters()]
    score.zero_grad()
    qkv.Attention(score, backend="reference")(*inputs, mask=mask).square().sum().backward()
    for a, b in zip(auto, [p.grad for p in score.parameters()], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", SCORES)
def test_multi_head_attention_gradcheck(name):
    mha, inputs = _mha_case(name)
    _gradcheck_inputs(mha, inputs, causal=True)


def _backends_for(score_names):
    """(score, backend) pairs for the parameter gradchecks; backends come from the registry."""
    cases = []
    for name in score_names:
        for backend in sorted(qkv.backends.REGISTRY):
            cases.append(pytest.param(name, backend, id=f"{name}-{backend}"))
    return cases


@pytest.mark.parametrize(("name", "backend"), _backends_for(["bilinear", "additive", "location"]))
def test_score_parameters_gradcheck_on_every_backend(name, backend):
    score, inputs, mask = _attention_case(name)
    impl = qkv.backends.REGISTRY[backend]
    req = qkv.checks.request(*inputs, score=score, mask=mask, bias=None, causal=False, scale=None,
                             dropout=0.0, return_weights=False)  # fmt: skip
    if impl.supports(req) is not None:
        pytest.skip(impl.supports(req))
    _gradcheck_params(qkv.Attention(score, backend=backend), inputs, mask=mask)


@pytest.mark.parametrize("name", SCORES)
def test_multi_head_attention_parameters_gradcheck(name):
    mha, inputs = _mha_case(name)
    mha.attention.backend = "reference"  # every backend is covered per score above
    _gradcheck_params(mha, inputs, causal=True)


def test_attention_single_step_query_is_the_weighted_sum_of_annotations():
    # Bahdanau: c = Σ_j α_j h_j with α = softmax_j(score(s, h_j)); values default to keys.
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(3, 4, generator=gen, dtype=torch.float64)  # decoder states (b, dq)
    h = torch.randn(3, 6, 4, generator=gen, dtype=torch.float64)  # annotations (b, j, dk)
    c, alpha = qkv.Attention("dot")(s, h, return_weights=True)
    assert c.shape == (3, 4) and alpha.shape == (3, 6)
    expected_alpha = torch.softmax(torch.einsum("bd,bjd->bj", s, h), dim=-1)
    torch.testing.assert_close(alpha, expected_alpha)
    manual = torch.stack([sum(alpha[n, t] * h[n, t] for t in range(6)) for n in range(3)])
    torch.testing.assert_close(c, manual)
    # The same query as a length-1 sequence (b, i, dq) gives the same context.
    torch.testing.assert_close(qkv.Attention("dot")(s[:, None], h)[:, 0], c)
    # A padding mask shaped like the single-step weights (b, j).
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] * 2 + [False] * 4])
    c_masked, alpha_masked = qkv.Attention("dot")(s, h, mask=keep, return_weights=True)
    expected = torch.softmax(torch.einsum("bd,bjd->bj", s, h).masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(alpha_masked, expected)
    torch.testing.assert_close(c_masked, torch.einsum("bj,bjd->bd", expected, h))


def test_attention_sequence_query_with_separate_values():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 7, 6, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 7, 3, generator=gen, dtype=torch.float64)
    att = qkv.Attention("general", query_dim=4, key_dim=6).double()
    out, w = att(q, k, v, return_weights=True)
    expected = torch.softmax(q @ att.score.weight @ k.mT, dim=-1)
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(out, expected @ v)


@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize(("b", "i", "j"), [(0, 3, 4), (2, 0, 4), (2, 3, 0)], ids=["no-batch", "no-steps", "no-source"])
def test_attention_seq2seq_form_with_a_size_0_dim_gives_empty_or_zero_contexts(name, b, i, j):
    # (b, i, dq) reaches qkv.attention as (h, i, d): a batch of 0 was refused as "h=0 heads of g=0",
    # and the concat score's tiles divided by it.
    dq, dk = 5, 5 if name in ("dot", "scaled_dot") else 4
    attend = qkv.Attention(_score(name, dq, dk))
    q, k = torch.randn(b, i, dq, requires_grad=True), torch.randn(b, j, dk, requires_grad=True)
    keep = torch.ones(b, 1, j, dtype=torch.bool)  # a padding mask, as Bahdanau's decoder passes one
    out, w = attend(q, k, mask=keep, return_weights=True)
    assert out.shape == (b, i, dk) and w.shape == (b, i, j)
    assert not out.any() and not w.any()  # no rows, or rows that see no key: zeros
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    step, step_w = attend(torch.randn(b, dq), k, return_weights=True)  # one decoder state per row, (b, dq)
    assert step.shape == (b, dk) and step_w.shape == (b, j)


def test_mha_shapes_self_and_cross():
    mha = qkv.MultiHeadAttention(12, 3)
    x, memory = torch.randn(2, 5, 12), torch.randn(2, 7, 12)
    y, w = mha(x, return_weights=True)
    assert y.shape == (2, 5, 12) and w.shape == (2, 3, 5, 5)
    y, w = mha(x, memory, return_weights=True)
    assert y.shape == (2, 5, 12) and w.shape == (2, 3, 5, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5))
    torch.testing.assert_close(mha(x, memory), mha(x, memory, memory))  # value defaults to key
    torch.testing.assert_close(mha(x), mha(x, x, x))  # key defaults to query


def test_mha_equals_the_per_head_formula_with_free_head_sizes():
    # dim_head and dim_value_head need not divide dim: d=7, e=5 with dim=10, h=3.
    mha = qkv.MultiHeadAttention(10, 3, dim_head=7, dim_value_head=5, kdim=4, vdim=9).double()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 10, generator=gen, dtype=torch.float64)
    key = torch.randn(2, 6, 4, generator=gen, dtype=torch.float64)
    value = torch.randn(2, 6, 9, generator=gen, dtype=torch.float64)
    heads = []
    for n in range(3):
        rows_d, rows_e = slice(7 * n, 7 * n + 7), slice(5 * n, 5 * n + 5)
        qn = x @ mha.q_proj.weight[rows_d].T + mha.q_proj.bias[rows_d]
        kn = key @ mha.k_proj.weight[rows_d].T + mha.k_proj.bias[rows_d]
        vn = value @ mha.v_proj.weight[rows_e].T + mha.v_proj.bias[rows_e]
        heads.append(torch.softmax(qn @ kn.mT / math.sqrt(7), dim=-1) @ vn)
    expected = mha.out_proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(mha(x, key, value), expected)



@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the oneDNN projection route needs oneDNN")
@pytest.mark.parametrize("kv_heads", [6, 3], ids=["mha", "gqa"])
@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch's mkldnn.flags() resets every flag
def test_mha_with_onednn_projections_matches_the_float64_formula(kv_heads):
    # 2 · 528 = 1056 tokens (16 · 66): the q/k/v/out projections run as 1×1 convolutions
    # (qkv.projection); outputs and parameter gradients must stay within the flash-attention
    # rule of a float64 run, which takes F.linear.
    mha = qkv.MultiHeadAttention(24, 6, kv_heads=kv_heads, dim_value_head=5)
    mha64 = qkv.MultiHeadAttention(24, 6, kv_heads=kv_heads, dim_value_head=5).double()
    mha64.load_state_dict(mha.state_dict())
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 528, 24, generator=gen)
    dy = torch.randn(2, 528, 24, generator=gen)
    assert projection.uses_convolution(x, mha.q_proj.weight)

    def run(module, inputs):
        module.zero_grad()
        y = module(inputs, causal=True)
        y.backward(dy.to(y.dtype))
        return [y.detach()] + [p.grad.clone() for p in module.parameters()]

    exact, ours = run(mha64, x.double()), run(mha, x)
    with torch.backends.mkldnn.flags(enabled=False):  # F.linear projections: PyTorch's own float32 error
        assert not projection.uses_convolution(x, mha.q_proj.weight)
        plain = run(mha, x)
    for e, a, p in zip(exact, ours, plain):
        err_ours, err_plain = (a.double() - e).abs().max().item(), (p.double() - e).abs().max().item()
        assert err_ours <= 2 * err_plain + 1e-5 * e.abs().max().item(), (err_ours, err_plain)


@pytest.mark.parametrize("kv_heads", [3, 1], ids=["gqa", "mqa"])
def test_grouped_kv_heads_equal_repeated_kv_weights(kv_heads):
    heads, d = 6, 4
    grouped = qkv.MultiHeadAttention(24, heads, kv_heads=kv_heads).double()
    full = qkv.MultiHeadAttention(24, heads).double()
    with torch.no_grad():
        for proj in ("q_proj", "out_proj"):
            getattr(full, proj).load_state_dict(getattr(grouped, proj).state_dict())
        for proj in ("k_proj", "v_proj"):
            src, dst = getattr(grouped, proj), getattr(full, proj)
            # query head n reads KV head n // (h / g): repeat each KV head's rows h/g times
            w = rearrange(src.weight, "(g d) c -> g d c", g=kv_heads).repeat_interleave(heads // kv_heads, dim=0)
            dst.weight.copy_(rearrange(w, "h d c -> (h d) c"))
            b = rearrange(src.bias, "(g d) -> g d", g=kv_heads).repeat_interleave(heads // kv_heads, dim=0)
            dst.bias.copy_(b.flatten())
    assert grouped.k_proj.out_features == kv_heads * d
    x, memory = torch.randn(2, 5, 24, dtype=torch.float64), torch.randn(2, 7, 24, dtype=torch.float64)
    for causal in (False, True):
        torch.testing.assert_close(grouped(x, memory, causal=causal), full(x, memory, causal=causal))


def test_mha_masks_and_padding():
    mha = qkv.MultiHeadAttention(8, 2).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])
    y, w = mha(x, mask=keep[:, None, None, :], causal=True, return_weights=True)
    torch.testing.assert_close(y, mha(x, mask=qkv.masks.lengths(torch.tensor([5, 3])), causal=True))
    assert torch.equal(w[1, :, :, 3:], torch.zeros(2, 5, 2))
    assert torch.equal(w[0].triu(1), torch.zeros(2, 5, 5))  # causal, i == j: nothing above the diagonal
    # Padding keys do not influence the real positions: change them and nothing moves.
    x2 = x.clone()
    x2[1, 3:] = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(mha(x2, mask=keep[:, None, None, :], causal=True)[1, :3], y[1, :3])


def test_mha_with_alibi_positional_equals_functional_bias():
    mha = qkv.MultiHeadAttention(8, 4, positional=qkv.ALiBi(4)).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    q = rearrange(mha.q_proj(x), "b i (h d) -> b h i d", h=4)
    k = rearrange(mha.k_proj(x), "b j (h d) -> b h j d", h=4)
    v = rearrange(mha.v_proj(x), "b j (h d) -> b h j d", h=4)
    out = qkv.attention(q, k, v, bias=qkv.ALiBi(4).dense(5, 5).double(), causal=True)
    torch.testing.assert_close(mha(x, causal=True), mha.out_proj(rearrange(out, "b h i e -> b i (h e)")))


def test_dropout_only_in_training_mode():
    mha = qkv.MultiHeadAttention(8, 2, dropout=0.5)
    plain = qkv.MultiHeadAttention(8, 2)
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 8)
    mha.eval()
    torch.testing.assert_close(mha(x), plain(x))
    mha.train()
    torch.manual_seed(7)
    first = mha(x)
    torch.manual_seed(7)
    assert torch.equal(first, mha(x))  # reproducible under a fixed seed
    assert not torch.allclose(first, plain(x))


@pytest.mark.parametrize("name", SCORES)
def test_every_score_trains_per_head(name):
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(8, 2, score=_score(name, 4))
    x = torch.randn(16, 6, 8)
    target = x.flip(1)  # a task attention can solve: copy the mirrored position
    opt = torch.optim.Adam(mha.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mha(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: qkv.MultiHeadAttention(10, 3), ValueError,
         r"dim: expected a multiple of heads=3 when dim_head is not given, got dim=10"),
        (lambda: qkv.MultiHeadAttention(12, 6, kv_heads=4), ValueError,
         r"kv_heads: heads=6 must be a multiple of kv_heads, got kv_heads=4"),
        (lambda: qkv.MultiHeadAttention(12, 0), ValueError, r"heads: expected a positive int, got 0"),
        (lambda: qkv.MultiHeadAttention(12, 2, dim_head=-1), ValueError, r"dim_head: expected a positive int, got -1"),
        (lambda: qkv.MultiHeadAttention(12, 2, dropout=1.5), ValueError, r"dropout: expected a probability in \[0, 1\), got 1.5"),
        (lambda: qkv.MultiHeadAttention(12, 2, positional=torch.nn.Identity()), TypeError,
         r"positional: expected a qkv.positional.Positional, got Identity"),
        (lambda: qkv.MultiHeadAttention(12, 2, score="dot", attention=qkv.Attention()), ValueError,
         r"score: give the score to the mechanism passed as attention=, not to both"),
        (lambda: qkv.MultiHeadAttention(12, 2)(torch.randn(2, 5, 10)), ValueError,
         r"query: expected shape \(b, length, 12\) \(batch first\), got \(2, 5, 10\)"),
        (lambda: qkv.MultiHeadAttention(12, 2)(torch.randn(12)), ValueError,
         r"query: expected shape \(b, length, 12\) \(batch first\), got \(12,\)"),
        (lambda: qkv.MultiHeadAttention(12, 2)(torch.randn(2, 5, 12), torch.randn(1, 7, 12)), ValueError,
         r"key: expected batch 2 like query, got 1 \(key \(1, 7, 12\)\)"),
        (lambda: qkv.MultiHeadAttention(12, 2)(torch.randn(2, 5, 12), torch.randn(2, 7, 12), torch.randn(2, 6, 12)),
         ValueError, r"value: expected batch and length matching key \(b, j = \(2, 7\)\)"),
        (lambda: qkv.MultiHeadAttention(12, 2)([1.0]), TypeError, r"query: expected a tensor \(b, length, 12\), got list"),
        (lambda: qkv.Attention()(torch.randn(2, 5, 4), torch.randn(1, 7, 4)), ValueError,
         r"key: expected batch 2 like query, got 1"),
        (lambda: qkv.Attention()(torch.randn(2, 4), torch.randn(1, 7, 4)), ValueError, r"key: expected batch 2 like query, got 1"),
        (lambda: qkv.Attention()(torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(1, 7, 3)), ValueError,
         r"value: expected batch 2 like query, got 1"),
        (lambda: qkv.Attention("general"), ValueError, r"score: 'general' has learned parameters"),
        (lambda: qkv.Attention(dropout=-1), ValueError, r"dropout: expected a probability in \[0, 1\), got -1"),
    ],
)  # fmt: skip
def test_module_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_positional_bias_with_an_approximate_mechanism_is_refused():
    from qkv.approx import LinearAttention

    with pytest.raises(ValueError, match=r"positional: ALiBi adds a bias to the logits, which the mechanism LinearAttention"):
        qkv.MultiHeadAttention(16, 4, positional=qkv.ALiBi(4), attention=LinearAttention())
    # a rotation needs no logits, so it works with any mechanism
    mha = qkv.MultiHeadAttention(16, 4, positional=qkv.Rotary(4), attention=LinearAttention())
    assert mha(torch.randn(2, 5, 16)).shape == (2, 5, 16)


def _written_out(q, k, keep):
    """``softmax(q kᵀ)`` (Attention's default "dot") over the kept keys, and the context ``α k``, for ``q (b, i, d)``,
    ``k (b, j, d)``, ``keep (b, j)``."""
    logits = torch.einsum("bid,bjd->bij", q, k)
    alpha = torch.softmax(logits.masked_fill(~keep[:, None, :], float("-inf")), dim=-1)
    return alpha @ k, alpha


def test_attention_seq2seq_form_takes_a_lengths_mask_and_a_padding_mask_per_batch_row():
    # (b, i, dq) queries reached qkv.attention as (h, i, d) with no batch dim: a lengths mask failed
    # with "the call has no batch dim for it", a (b, j) keep-mask with "broadcastable to (h, i, j)"
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(3, 7, 16, generator=gen, dtype=torch.float64)
    lens = torch.tensor([7, 3, 5])
    keep = torch.arange(7) < lens[:, None]  # (b, j), True = a real key
    expected, expected_alpha = _written_out(q, k, keep)
    attend = qkv.Attention()
    for mask in (qkv.masks.lengths(lens), keep, keep[:, None, :], keep[:, None, None, :]):
        out, alpha = attend(q, k, mask=mask, return_weights=True)
        assert out.shape == (3, 5, 16) and alpha.shape == (3, 5, 7)
        torch.testing.assert_close(alpha, expected_alpha, rtol=0, atol=1e-12)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(attend(q, k, mask=mask), expected, rtol=0, atol=1e-12)  # the path without weights
    # a single step (b, dq) with the same masks
    for mask in (qkv.masks.lengths(lens), keep):
        out, alpha = attend(q[:, 0], k, mask=mask, return_weights=True)
        torch.testing.assert_close(alpha, expected_alpha[:, 0], rtol=0, atol=1e-12)
        torch.testing.assert_close(out, expected[:, 0], rtol=0, atol=1e-12)
    # per-query masks still broadcast as before: (i, j) and (b, i, j)
    causal = torch.ones(5, 7, dtype=torch.bool).tril(2)
    logits = torch.einsum("bid,bjd->bij", q, k)
    want = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    torch.testing.assert_close(attend(q, k, mask=causal, return_weights=True)[1], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(attend(q, k, mask=causal.expand(3, 5, 7), return_weights=True)[1], want, rtol=0, atol=1e-12)


def test_attention_seq2seq_form_refuses_a_mask_that_reads_both_as_b_j_and_i_j():
    q, k = torch.randn(4, 4, 8), torch.randn(4, 6, 8)
    with pytest.raises(ValueError, match=r"mask: shape \(4, 6\) reads as a padding mask \(b, j\) and as a per-query mask "
                                         r"\(i, j\) when b = i = 4; pass mask\[:, None, :\] \(b, 1, j\) or mask\[None\] "
                                         r"\(1, i, j\)"):  # fmt: skip
        qkv.Attention()(q, k, mask=torch.ones(4, 6, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_an_input_of_another_dtype_than_the_parameters_says_to_convert_one(dtype):
    # was "mat1 and mat2 must have the same dtype" from inside the projection
    mha = qkv.MultiHeadAttention(16, 8)
    x = torch.randn(2, 3, 16, dtype=dtype)
    with pytest.raises(TypeError, match=rf"query: dtype {dtype} differs from the module's parameters \(torch.float32\); "
                                        rf"call .to\({dtype}\) on the module or .to\(torch.float32\) on the input"):  # fmt: skip
        mha(x)
    with pytest.raises(TypeError, match=rf"key: dtype {dtype} differs from the module's parameters"):
        mha(torch.randn(2, 3, 16), x)
    with pytest.raises(TypeError, match=r"query: expected a floating-point tensor, got torch.int64"):
        mha(torch.ones(2, 3, 16, dtype=torch.long))
    # autocast converts the inputs itself: not an error there
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mha(torch.randn(2, 3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
