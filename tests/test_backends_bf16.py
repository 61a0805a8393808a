"""bfloat16 on every engine path: sdpa, chunked (fused blocks and online-softmax tiles), local.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13.

The flash-attention rule, with PyTorch's own bf16 attention as the yardstick: against a
float64 oracle, each path's output and gradients (q, k, v and a learned bias table) are
at most twice as far off as ``F.scaled_dot_product_attention`` on the same bf16 inputs with
the bias and mask materialised, plus one bf16 rounding of the result (``2^-8`` of its
largest value: a result that lies near a rounding boundary may round either way).
"""

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.backends.tiling import flash_cpu as kernels

B, H, G, D, E = 2, 6, 3, 11, 13


def needs_the_fused_kernel(dtype: torch.dtype) -> None:
    """Skip where torch's fused CPU kernel fails its check for ``dtype``: with ``ATEN_CPU_CAPABILITY`` below an AMX
    CPU's own, torch's packed bfloat16 path raises ("pack_vnni2 is only supported when avx512 is supported"), and
    qkv runs its online tiles instead (what the online cases test); PyTorch's own SDPA raises there too."""
    if not kernels.works(dtype):
        pytest.skip(f"torch's fused CPU kernel fails its {dtype} check on this CPU capability")


def make(kind, dtype, i, j):
    """``(kwargs for qkv.attention, learned parameters, additive mask (b|1, h|1, i, j) for SDPA)``."""
    torch.manual_seed(7)
    allowed = torch.ones(i, j, dtype=torch.bool)
    kw, params, bias = {}, [], None
    if "causal" in kind:
        kw["causal"] = True
        allowed = qkv.masks.causal().dense(i, j)
    if "window" in kind:
        kw["mask"] = qkv.masks.window(4, 2)
        allowed = kw["mask"].dense(i, j)
    if "lengths" in kind:  # short rows, but every query keeps a key (SDPA gives NaN otherwise)
        lengths = qkv.masks.lengths(torch.tensor([j, j - 3 if "window" in kind else j // 2]))
        kw["mask"] = lengths if "mask" not in kw else kw["mask"] & lengths
        allowed = allowed & lengths.dense(i, j)
    if kind.startswith("alibi"):
        kw["bias"] = qkv.ALiBi(H).to(dtype)
        bias = kw["bias"].dense(i, j)
    elif kind.startswith("t5"):
        kw["bias"] = qkv.RelativePositionBias(H, 8, 20).to(dtype)
        params = list(kw["bias"].parameters())
        bias = kw["bias"].dense(i, j)
    elif kind.startswith("dense"):
        kw["bias"] = torch.randn(H, i, j, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(dtype)
        bias = kw["bias"]
    add = torch.zeros((), dtype=dtype).masked_fill(~allowed, float("-inf"))
    return kw, params, add if bias is None else (bias + add).to(dtype)  # (ALiBi's slopes are float64)


def results(fn, inputs, params):
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out.dtype)
    return [out, *torch.autograd.grad(out, [*leaves, *params], cot)]


def check_bf16(backend, kind, i, j, monkeypatch=None, online=False):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((B, H, i, D), (B, G, j, D), (B, G, j, E))]
    low = [x.bfloat16() for x in inputs]
    kw64, params64, _ = make(kind, torch.float64, i, j)
    exact = results(lambda q, k, v: qkv.attention(q, k, v, backend="reference", **kw64), inputs, params64)
    kw, params, add = make(kind, torch.bfloat16, i, j)
    d = max(D, E)  # SDPA's kernel needs d == e: pad as the fused path does, and cut the output

    def sdpa(q, k, v):
        qp, kp, vp = (F.pad(x, (0, d - x.shape[-1])) for x in (q, k, v))
        return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=add, enable_gqa=True, scale=D**-0.5)[..., :E]

    try:
        yardstick = results(sdpa, low, params)
    except RuntimeError as error:  # ATEN_CPU_CAPABILITY below the CPU's own: torch's packed bf16 path raises
        if kernels.works(torch.bfloat16):
            raise
        pytest.skip(f"the yardstick, PyTorch's own bfloat16 SDPA, fails on this CPU capability: {error}")
    if online:  # this dtype fails the kernel's probe: the chunked backend runs its online tiles
        monkeypatch.setitem(kernels._probed, torch.bfloat16, False)
    elif not kernels.works(torch.bfloat16):  # the online cases test what runs instead
        pytest.skip("torch's fused CPU kernel fails its bfloat16 check on this CPU capability")
    text = qkv.explain(*low, backend=backend, **kw)
    if backend == "chunked":
        assert f"chunked ({'online_softmax' if online else 'fused_blocks'})" in text, text
    got = results(lambda q, k, v: qkv.attention(q, k, v, backend=backend, **kw), low, params)
    assert got[0].dtype == torch.bfloat16
    for name, a, s, x in zip(["out", "dq", "dk", "dv", "d table"], got, yardstick, exact):
        bound = 2 * (s.double() - x).abs().max() + 2**-8 * x.abs().max()
        assert (a.double() - x).abs().max() <= bound, f"{name}: {(a.double() - x).abs().max():.3g} > {bound:.3g}"


KINDS = ["none", "causal", "lengths&causal", "dense", "alibi", "alibi&causal", "t5", "t5&causal"]


@pytest.mark.parametrize("kind", ["none", "causal", "lengths", "lengths&causal", "dense", "window"])
def test_sdpa(kind):
    check_bf16("sdpa", kind, 37, 45)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_fused_blocks(kind):
    check_bf16("chunked", kind, 37, 45)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_online_tiles(kind, monkeypatch):
    check_bf16("chunked", kind, 37, 45, monkeypatch, online=True)


@pytest.mark.parametrize("kind", ["window", "window&alibi", "window&lengths"])
def test_local(kind):
    check_bf16("local", kind.replace("window&alibi", "alibi&window"), 150, 160)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_general_engine_multiplies_half_precision_logits_in_float32(dtype):
    """A learned T5 bias under a lengths mask runs ``online_softmax``: its q·kᵀ was a half-precision product, every
    logit rounded to 8 (or 11) bits before the softmax: 12x the rule's bound in bf16. Inputs of |x| up to 4 and
    a T5 table of std 1, where the rounding shows."""
    import copy

    gen = torch.Generator().manual_seed(0)
    b, h, i, d = 2, 1, 200, 8
    q, k, v = ((torch.randn(b, h, i, d, generator=gen, dtype=torch.float64) * 4).clamp(-4, 4).to(dtype) for _ in range(3))
    needs_the_fused_kernel(dtype)  # (its yardstick is PyTorch's SDPA in the same dtype)
    bias = qkv.RelativePositionBias(h, 16, 64)
    with torch.no_grad():
        bias.embedding.weight.copy_(torch.randn(16, h, generator=gen))
    bias = bias.to(dtype)
    bias64 = copy.deepcopy(bias).double()
    lens = torch.tensor([i, i // 2])
    mask = qkv.masks.lengths(lens)
    assert "online_softmax" in qkv.explain(q, k, v, bias=bias, mask=mask).splitlines()[0]
    allowed = (torch.arange(i)[None] < lens[:, None])[:, None, None]
    add = bias.dense(i, i).detach().to(dtype).masked_fill(~allowed, float("-inf"))
    cot = torch.randn(b, h, i, d, generator=gen, dtype=torch.float64)

    def run(fn, inputs):
        inputs = [x.detach().requires_grad_() for x in inputs]
        out = fn(*inputs)
        return [out, *torch.autograd.grad((out.double() * cot).sum(), inputs)]

    got = run(lambda *x: qkv.attention(*x, bias=bias, mask=mask), (q, k, v))
    base = run(lambda *x: F.scaled_dot_product_attention(*x, attn_mask=add), (q, k, v))
    want = run(lambda *x: qkv.attention(*x, bias=bias64, mask=mask, backend="reference"), (q.double(), k.double(), v.double()))
    for a, s, o in zip(got, base, want):
        err, base_err = (a.double() - o).abs().max().item(), (s.double() - o).abs().max().item()
        assert err <= 2 * base_err + 1e-5, (err, base_err)


@pytest.mark.parametrize("causal", [False, True])
def test_a_learned_bias_gets_no_gradient_from_a_row_with_one_key_in_bfloat16(causal):
    """One query, one key: its weight is 1 whatever the bias, so the table's exact gradient is 0 (the reference's
    too). The fused kernel's bias gradient recomputes ``dS = P ∘ (dO vᵀ - D)``; with ``dO vᵀ`` a bfloat16 product
    (its output rounded apart from ``D``) the table got 0.02."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = ((torch.randn(2, 2, 1, 16, generator=gen, dtype=torch.float64) * 4).clamp(-4, 4).bfloat16().requires_grad_()
               for _ in range(3))  # fmt: skip
    needs_the_fused_kernel(torch.bfloat16)
    bias = qkv.RelativePositionBias(2, 16, 64).bfloat16()
    assert "fused_blocks" in qkv.explain(q, k, v, bias=bias, causal=causal).splitlines()[0]
    out = qkv.attention(q, k, v, bias=bias, causal=causal)
    (d_table,) = torch.autograd.grad(out, list(bias.parameters()), torch.randn(out.shape, generator=gen).bfloat16())
    assert not bool(d_table.any()), d_table.abs().max()


@pytest.mark.parametrize("dtype,seed", [(torch.float16, 7), (torch.bfloat16, 11)], ids=["fp16", "bf16"])
def test_weights_of_a_non_dot_score_are_rebuilt_from_float32_logits(dtype, seed):
    """``return_weights`` with the additive score on the chunked backend rebuilds the weights from the lse: its
    ``tanh(W_q q + W_k k)·v`` ran on half-precision prepared q and k, every logit rounded before ``exp(s - lse)``
    (the lse came from float32 tiles): 2x the flash rule's bound in fp16 (yardstick: the reference backend)."""
    import copy

    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(1, 2, n, 8, generator=g) * 4).clamp(-4, 4).to(dtype) for n in (64, 300, 300))
    torch.manual_seed(seed)
    score = qkv.scores.Additive(8, 8, 32)
    with torch.no_grad():
        for p in score.parameters():
            p.copy_((p * 4).to(dtype).float())

    def weights(xs, dd, backend):
        return qkv.attention(*xs, score=copy.deepcopy(score).to(dd), return_weights=True, backend=backend)[1].double()

    with torch.no_grad():
        got, yard = weights((q, k, v), dtype, "chunked"), weights((q, k, v), dtype, "reference")
        oracle = weights([x.double() for x in (q, k, v)], torch.float64, "reference")
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert (got - oracle).abs().max() <= 2 * (yard - oracle).abs().max() + eps * oracle.abs().max()


def test_a_learned_table_gradient_on_the_general_engine_is_summed_in_float32():
    """A learned T5 table with a score_mod runs online_softmax, whose profile leaf (the table's ``(h, L)`` gradient)
    was kept in the table's dtype: each tile's share rounded to fp16 and summed there, 1.06x the flash rule's bound
    at 600 rows of 3 keys (yardstick: the reference backend)."""
    dtype, i, j, d = torch.float16, 600, 3, 64
    g = torch.Generator().manual_seed(i + d)
    q, k, v = ((torch.randn(2, 2, n, d, generator=g) * 4).clamp(-4, 4).to(dtype) for n in (i, j, j))
    table = torch.randn(32, 2, generator=g).to(dtype)
    mask = qkv.masks.lengths(torch.tensor([j, max(1, j // 2)]))
    cot = torch.randn(2, 2, i, d, generator=torch.Generator().manual_seed(123), dtype=torch.float64)

    def results(xs, dd, backend):
        t5 = qkv.RelativePositionBias(2, 32, 128)
        t5.embedding.weight = torch.nn.Parameter(table.to(dd).clone())
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = qkv.attention(*xs, bias=t5, mask=mask, score_mod=qkv.SoftCap(20.0), backend=backend)
        return [x.double() for x in torch.autograd.grad((out.double() * cot).sum(), [*xs, t5.embedding.weight])]

    got, yard = results((q, k, v), dtype, "auto"), results((q, k, v), dtype, "reference")
    oracle = results([x.double() for x in (q, k, v)], torch.float64, "reference")
    for a, y, o in zip(got, yard, oracle):
        assert (a - o).abs().max() <= 2 * (y - o).abs().max() + 2**-11 * o.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_runs_of_a_lazy_mask_are_merged_before_rounding(dtype):
    """A mask program on a large call runs each query block's keys as runs (full tiles unmasked, partial ones
    masked), one kernel call per run, merged by their log-sum-exp. In half precision each run's output (and
    backward share) was rounded first: where the runs' outputs cancel (keys alike, values +c on the first 128 keys
    and -c·128/n on the others) out was 3x the flash rule's bound and dq 1.9x (yardsticks: the reference backend
    and SDPA with the mask materialised)."""
    needs_the_fused_kernel(dtype)
    mask = qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: (kv_idx < 128) | (kv_idx % 2 == 0))
    i = j = 1100
    d = 16
    dense = ((torch.arange(j) < 128) | (torch.arange(j) % 2 == 0)).expand(i, j)
    g = torch.Generator().manual_seed(0)
    k0 = torch.randn(d, generator=g) * 2
    k = (k0 + 0.3 * torch.randn(1, 2, j, d, generator=g)).clamp(-4, 4).to(dtype)
    c = torch.rand(d, generator=g) + 2
    v = (torch.where((torch.arange(j) < 128)[:, None], c, -c * 128 / 486) + 0.3 * torch.randn(1, 2, j, d, generator=g))
    v = v.clamp(-4, 4).to(dtype)
    q = ((torch.randn(1, 2, i, d, generator=g) * 4).clamp(-4, 4) * 0.3).to(dtype)
    cot = torch.randn(1, 2, i, d, generator=torch.Generator().manual_seed(123), dtype=torch.float64)

    def results(fn, xs):
        xs = [x.detach().requires_grad_() for x in xs]
        out = fn(*xs)
        return [out.detach().double(), *[x.double() for x in torch.autograd.grad((out.double() * cot).sum(), xs)]]

    assert "fused_blocks" in qkv.explain(q, k, v, mask=mask).splitlines()[0]
    got = results(lambda a, b_, c_: qkv.attention(a, b_, c_, mask=mask), (q, k, v))
    oracle = results(lambda a, b_, c_: qkv.attention(a, b_, c_, mask=mask, backend="reference"), [x.double() for x in (q, k, v)])
    yards = [results(lambda a, b_, c_: qkv.attention(a, b_, c_, mask=mask, backend="reference"), (q, k, v)),
             results(lambda a, b_, c_: F.scaled_dot_product_attention(a, b_, c_, attn_mask=dense), (q, k, v))]  # fmt: skip
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    for name, a, o, *ys in zip(("out", "dq", "dk", "dv"), got, oracle, *yards):
        assert (a - o).abs().max() <= 2 * max((y - o).abs().max() for y in ys) + eps * o.abs().max(), name
