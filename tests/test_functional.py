"""Tests of the functional API (``qkv.attention``, ``qkv.attention_weights``, ``qkv.explain``).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size. Odd distinct sizes (b=2, h=6, g=3, i=5, j=7,
d=11, e=13) so that a swapped axis cannot pass.
"""

import math

import pytest
import reference as ref
import torch
import torch.nn.functional as F

import qkv
from qkv import backends, checks

B, H, I, J, D, E = 2, 6, 5, 7, 11, 13
_PLAIN = dict(score="scaled_dot", mask=None, bias=None, causal=False, scale=None, dropout=0.0, return_weights=False)


def _inputs(dtype, g, i, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, i, D), (B, g, J, D), (B, g, J, E))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def _sdpa(q, k, v, allowed, scale):
    """PyTorch's kernel with qkv's mask made explicit (bool, bottom-right causal already in it)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _grads(out, inputs, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("mask", ref.MASK_CASES)
@pytest.mark.parametrize("i", [J, I], ids=["i=j", "i<j"])
@pytest.mark.parametrize("g", [H, 3], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_attention_equals_pytorch_sdpa(dtype, causal, g, i, mask):
    q, k, v = _inputs(dtype, g, i)
    lazy, allowed = ref.mask_case(mask, B, i, J, causal=causal)
    scale = 1 / math.sqrt(D)
    out = qkv.attention(q, k, v, mask=lazy, causal=causal)
    grads = _grads(out, (q, k, v))
    if dtype == torch.bfloat16:
        # Flash-attention rule: no more than twice the error of plain bf16 PyTorch vs float64.
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        oracle = _sdpa(q64, k64, v64, allowed, scale)
        plain = ref.plain_attention(q, k, v, scale=scale, mask=allowed.expand(B, H, i, J))
        ref.assert_flash_rule(out, plain, oracle)
        for ours, base, exact in zip(grads, _grads(plain, (q, k, v)), _grads(oracle, (q64, k64, v64)), strict=True):
            ref.assert_flash_rule(ours, base, exact)
        return
    expected = _sdpa(q, k, v, allowed, scale)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5}[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    for ours, theirs in zip(grads, _grads(expected, (q, k, v)), strict=True):
        torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)


@pytest.mark.parametrize("mask", ["none", "dense&lengths", "window|dense"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
def test_every_backend_agrees_with_the_literal_oracle_and_the_reference(name, causal, mask):
    q, k, v = _inputs(torch.float64, 3, I)
    lazy, allowed = ref.mask_case(mask, B, I, J, causal=causal)
    impl = backends.REGISTRY[name]
    reason = impl.supports(checks.request(q, k, v, **{**_PLAIN, "mask": lazy, "causal": causal}))
    if reason is not None:
        pytest.skip(reason)
    expected, _ = ref.literal_attention(q.detach(), k.detach(), v.detach(), scale=1 / math.sqrt(D), mask=allowed)
    out = qkv.attention(q, k, v, mask=lazy, causal=causal, backend=name)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    g_ref = _grads(qkv.attention(q, k, v, mask=lazy, causal=causal, backend="reference"), (q, k, v))
    for a, b in zip(_grads(out, (q, k, v)), g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)



@pytest.mark.parametrize("scale", [-0.5, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
def test_a_scale_that_is_not_positive_gives_the_softmax_on_every_backend(name, causal, scale):
    """PyTorch's fused CPU kernel with its causal flag gives nan rows for a scale <= 0 (torch 2.13): qkv must not."""
    q, k, v = _inputs(torch.float64, 3, J)  # i == j: the kernel's own causal square
    lazy, allowed = ref.mask_case("none", B, J, J, causal=causal)
    reason = backends.REGISTRY[name].supports(checks.request(q, k, v, **{**_PLAIN, "causal": causal, "scale": scale}))
    if reason is not None:
        pytest.skip(reason)
    expected, _ = ref.literal_attention(q.detach(), k.detach(), v.detach(), scale=scale, mask=allowed)
    out = qkv.attention(q, k, v, causal=causal, scale=scale, backend=name)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    g_ref = _grads(qkv.attention(q, k, v, causal=causal, scale=scale, backend="reference"), (q, k, v))
    for a, b in zip(_grads(out, (q, k, v)), g_ref, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)

def _dead_rows_case(case):
    """``(q, k, v, kwargs, dead)``: float64 b=2, h=6, g=3, j=7 inputs and a mask under which the
    query rows ``dead`` of batch 0 see no key (batch 1 keeps every row alive)."""
    if case == "long-window&lengths":
        # long enough (j=160) for block-local backends; batch 0 has 80 real keys, so rows
        # r >= 83 (which see keys r - 3 .. r) see none
        gen = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
                   for s in ((B, H, 160, D), (B, 3, 160, D), (B, 3, 160, E)))  # fmt: skip
        return q, k, v, dict(mask=qkv.masks.window(3) & qkv.masks.lengths(torch.tensor([80, 160]))), list(range(83, 160))
    i = 6 if case == "causal-i>j" else I
    q, k, v = _inputs(torch.float64, 3, i, seed=4)
    if case == "dense":
        mask = torch.ones(B, 1, I, J, dtype=torch.bool)
        mask[0, 0, [1, 3]] = False
        return q, k, v, dict(mask=mask), [1, 3]
    if case == "window&lengths":
        # rows r see keys r .. r + 2 (window 2, j - i = 2); batch 0 has only 3 real keys
        return q, k, v, dict(mask=qkv.masks.window(2) & qkv.masks.lengths(torch.tensor([3, 7]))), [3, 4]
    # bottom-right causal with i > j: nothing to see for the first i - j queries, in every batch row
    k, v = k[:, :, :4].detach().requires_grad_(), v[:, :, :4].detach().requires_grad_()
    return q, k, v, dict(causal=True), [0, 1]


@pytest.mark.parametrize("case", ["dense", "window&lengths", "causal-i>j", "long-window&lengths"])
@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
def test_fully_masked_rows_are_finite_zeros_on_every_backend(name, case):
    q, k, v, kwargs, dead = _dead_rows_case(case)
    impl = backends.REGISTRY[name]
    ran = False
    for return_weights in (False, True):
        req = checks.request(q, k, v, **{**_PLAIN, **kwargs, "return_weights": return_weights})
        if impl.supports(req) is not None:
            continue
        ran = True
        result = qkv.attention(q, k, v, return_weights=return_weights, backend=name, **kwargs)
        out = result[0] if return_weights else result
        assert torch.equal(out[0, :, dead], torch.zeros(H, len(dead), E))
        if return_weights:
            w = result[1]
            assert torch.equal(w[0, :, dead], torch.zeros(H, len(dead), k.shape[-2]))
            alive = [r for r in range(q.shape[-2]) if r not in dead]
            torch.testing.assert_close(w[0, :, alive].sum(-1), torch.ones(H, len(alive), dtype=w.dtype))
        grads = _grads(out, (q, k, v))
        assert all(bool(x.isfinite().all()) for x in grads)
        assert torch.equal(grads[0][0, :, dead], torch.zeros(H, len(dead), D))
        expected = _grads(qkv.attention(q, k, v, backend="reference", **kwargs), (q, k, v))
        for ours, exact in zip(grads, expected, strict=True):
            torch.testing.assert_close(ours, exact)
    if not ran:
        pytest.skip(impl.supports(req))


#: Every kind of mask, bias and score an empty call may carry (built per call: some are learned).
EMPTY_KINDS = ("none", "causal", "window", "lengths", "alibi", "alibi&causal", "t5", "dropout", "sinks",
               "softcap", "general", "concat")  # fmt: skip


def _empty_kwargs(kind: str, j: int) -> dict:
    from qkv.positional import ALiBi, RelativePositionBias

    return {
        "none": {},
        "causal": {"causal": True},
        "window": {"mask": qkv.masks.window(2)},
        "lengths": {"mask": qkv.masks.lengths(torch.tensor([min(3, j), j]))},
        "alibi": {"bias": ALiBi(H)},
        "alibi&causal": {"bias": ALiBi(H), "causal": True},
        "t5": {"bias": RelativePositionBias(H).double()},  # learned: its table gets a (zero) gradient
        "dropout": {"dropout": 0.5},
        "sinks": {"sinks": torch.zeros(H, dtype=torch.float64, requires_grad=True)},
        "softcap": {"score_mod": qkv.SoftCap(5.0)},
        "general": {"score": qkv.scores.Bilinear(D).double()},
        "concat": {"score": qkv.scores.Additive(D, hidden=4).double()},
    }[kind]


@pytest.mark.parametrize("kind", EMPTY_KINDS)
@pytest.mark.parametrize(
    ("b", "i", "j"), [(B, 0, J), (B, 0, 0), (B, I, 0), (0, I, J)], ids=["no-rows", "no-rows-no-keys", "no-keys", "no-batch"]
)
def test_an_empty_call_gives_an_empty_output_on_every_backend(b, i, j, kind):
    # ALiBi with no query rows used to reach the fused kernel's block loop (range step 0); the
    # concat score with no batch row divided its tile budget by b·h·n = 0.
    if b == 0 and kind == "lengths":
        pytest.skip("qkv.masks.lengths refuses an empty batch: it has no row's length to read")
    q = torch.randn(b, H, i, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 3, j, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 3, j, E, dtype=torch.float64, requires_grad=True)
    ran = []
    for name in ("auto", *sorted(backends.REGISTRY)):
        for return_weights in (False, True):
            kwargs = _empty_kwargs(kind, j)
            if name != "auto":
                req = checks.request(q, k, v, **{**_PLAIN, **kwargs, "return_weights": return_weights})
                if backends.REGISTRY[name].supports(req) is not None:
                    continue
            result = qkv.attention(q, k, v, return_weights=return_weights, backend=name, **kwargs)
            ran.append(name)
            out = result[0] if return_weights else result
            # no rows: nothing; no keys: every row sees no key, so zero output and weights
            assert out.shape == (b, H, i, E) and torch.equal(out, torch.zeros_like(out)), name
            if return_weights:
                assert result[1].shape == (b, H, i, j) and torch.equal(result[1], torch.zeros_like(result[1])), name
            learned = [p for x in kwargs.values() if isinstance(x, torch.nn.Module) for p in x.parameters()]
            learned += [x for x in kwargs.values() if isinstance(x, torch.Tensor) and x.requires_grad]
            grads = torch.autograd.grad(out, [q, k, v, *learned], torch.ones_like(out), allow_unused=True)
            for x, g in zip([q, k, v, *learned], grads, strict=True):
                assert g is None or (g.shape == x.shape and torch.equal(g, torch.zeros_like(g))), name
    assert {"auto", "chunked", "reference"} <= set(ran)


def test_dead_rows_do_not_touch_k_and_v_gradients():
    # The reference's k and v gradients with dead rows equal those with the rows removed.
    q, k, v, kwargs, dead = _dead_rows_case("dense")
    mask = kwargs["mask"]
    dout = torch.randn(B, H, I, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gk, gv = torch.autograd.grad(qkv.attention(q, k, v, mask=mask, backend="reference"), (k, v), dout)
    keep = [0, 2, 4]
    out_live = qkv.attention(q[:, :, keep], k, v, mask=mask[:, :, keep], backend="reference")
    gk_live, gv_live = torch.autograd.grad(out_live, (k, v), dout[:, :, keep])
    torch.testing.assert_close(gk[0], gk_live[0])  # batch 1 had no dead rows, so only batch 0 is comparable
    torch.testing.assert_close(gv[0], gv_live[0])


def test_fully_masked_rows_with_lazy_masks():
    # Bottom-right causal with i > j: the first i - j queries precede every key.
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (6, 4, 4))
    out, w = qkv.attention(q, k, v, causal=True, return_weights=True)
    assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 4)) and torch.equal(w[:, :, :2], torch.zeros(1, 2, 2, 4))
    out_sdpa = qkv.attention(q, k, v, causal=True, backend="sdpa")
    torch.testing.assert_close(out_sdpa, out)
    (gq,) = torch.autograd.grad(out_sdpa.sum(), (q,))
    assert torch.equal(gq[:, :, :2], torch.zeros(1, 2, 2, 4))


def test_attention_weights_rows_sum_to_one_and_match_attention():
    q, k, v = _inputs(torch.float64, 3, I)
    lazy, _ = ref.mask_case("dense&lengths", B, I, J, causal=True)
    w = qkv.attention_weights(q, k, mask=lazy, causal=True)
    assert w.shape == (B, H, I, J)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, I, dtype=torch.float64))
    out, w2 = qkv.attention(q, k, v, mask=lazy, causal=True, return_weights=True)
    torch.testing.assert_close(w, w2)
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, dim=1))


def test_dropout_is_reproducible_with_a_generator_and_keeps_the_expectation():
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (3, 6, 6))
    run = lambda seed: qkv.attention(q, k, v, dropout=0.5, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))
    # Inverted dropout is unbiased: the mean over many draws approaches the output without it.
    mean = torch.stack([run(s) for s in range(800)]).mean(0)
    torch.testing.assert_close(mean, qkv.attention(q, k, v), atol=0.05, rtol=0)


def test_explain_names_the_backend_and_why_others_were_passed_over():
    q, k, v = _inputs(torch.float32, 3, I)
    text = qkv.explain(q, k, v)
    assert text.splitlines()[0] == f"backend: {backends.choose(checks.request(q, k, v, **_PLAIN), 'auto')[0].name}"
    text = qkv.explain(q, k, v, score=qkv.scores.Additive(D, D, 4))
    assert text.startswith("backend: ") and not text.startswith("backend: sdpa")
    assert "  not sdpa: the concat score is not a dot product" in text.splitlines()
    assert qkv.explain(q, k, v, backend="reference") == "backend: reference"



@pytest.mark.parametrize("score_name", ["scaled_dot", "concat"])
def test_attention_weights_on_the_fast_path_equal_the_reference(score_name, monkeypatch):
    # Force the fast path (MATERIALISE_ELEMENTS = 0 makes every call "large") and compare with the oracle.
    torch.manual_seed(0)
    q, k, _ = _inputs(torch.float64, 3, I)
    score = "scaled_dot" if score_name == "scaled_dot" else qkv.scores.Additive(D, D, 5).double()
    lazy, _ = ref.mask_case("dense&lengths", B, I, J, causal=True)
    expected = qkv.attention_weights(q, k, score=score, mask=lazy, backend="reference")
    monkeypatch.setattr(qkv.backends, "MATERIALISE_ELEMENTS", 0)
    fast = qkv.attention_weights(q, k, score=score, mask=lazy)
    torch.testing.assert_close(fast, expected)
    picked = qkv.attention_weights(q, k, score=score, mask=lazy, weights_for={"heads": [0, 2], "rows": slice(1, 4)})
    torch.testing.assert_close(picked, expected[:, [0, 2]][:, :, 1:4])


def test_attention_weights_selects_heads_and_rows_on_the_small_path_too():
    q, k, _ = _inputs(torch.float64, 3, I)
    full = qkv.attention_weights(q, k, backend="reference")
    got = qkv.attention_weights(q, k, weights_for={"rows": [0, 4]}, backend="reference")
    torch.testing.assert_close(got, full[..., [0, 4], :])


def test_attention_weights_gradients_flow_on_the_fast_path(monkeypatch):
    q, k, _ = _inputs(torch.float64, 3, I)
    q.requires_grad_(True)
    (g_ref,) = torch.autograd.grad((qkv.attention_weights(q, k, causal=True) ** 2).sum(), (q,))
    monkeypatch.setattr(qkv.backends, "MATERIALISE_ELEMENTS", 0)
    (g_fast,) = torch.autograd.grad((qkv.attention_weights(q, k, causal=True) ** 2).sum(), (q,))
    torch.testing.assert_close(g_fast, g_ref)


@pytest.mark.parametrize("kind", ["t5", "dense"])
def test_attention_weights_on_the_fast_path_give_the_bias_its_gradient(kind, monkeypatch):
    q, k, _ = _inputs(torch.float64, 3, I)
    torch.manual_seed(1)
    bias = qkv.RelativePositionBias(H, 8, 4).double() if kind == "t5" else torch.randn(H, I, J, dtype=torch.float64)
    params = list(bias.parameters()) if kind == "t5" else [bias.requires_grad_()]
    cot = torch.randn(B, H, I, J, dtype=torch.float64)
    (expected,) = torch.autograd.grad(qkv.attention_weights(q, k, bias=bias, backend="reference"), params, cot)
    monkeypatch.setattr(qkv.backends, "MATERIALISE_ELEMENTS", 0)
    w = qkv.attention_weights(q, k, bias=bias)
    assert w.requires_grad
    (got,) = torch.autograd.grad(w, params, cot)
    torch.testing.assert_close(got, expected)
