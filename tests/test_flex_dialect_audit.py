"""``qkv.flex_attention`` against PyTorch's own ``flex_attention``: the calls flex refuses, the layouts it answers in,
the block masks it takes, and a compact grid of its eager CPU forward.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``L`` query length, ``S`` key length, ``E``
query/key size, ``Ev`` value size. Small shapes throughout: flex's eager forward compiles (dynamo, eager backend) once
per ``score_mod`` and ``mask_mod``.

Each test after the grid pins one place where qkv answered otherwise than flex (see ``qkv.flex``'s docstring).
flex has no backward on the CPU, so gradients are checked against autograd through the definition, materialised.
"""

import re
import types
import warnings

import pytest
import torch

import qkv

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, HQ, HKV, L, S, E, EV = 2, 4, 2, 37, 53, 8, 5  # lengths not multiples of any block size; L != S; Ev != E


def _flex(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex.flex_attention(*args, **kw)


def _inputs(dtype=torch.float64, seed=0, kv_batch=B):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, L, E, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(kv_batch, HKV, S, E, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(kv_batch, HKV, S, EV, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


# --------------------------------------------------------------------------- the grid: flex's eager forward

BIAS = torch.randn(HQ, L, S, generator=torch.Generator().manual_seed(7))  # float32: promotes no dtype below float64
SCORE_MODS = {
    None: None,
    "head_bias": lambda score, b, h, q_idx, kv_idx: score + BIAS[h, q_idx, kv_idx] - 0.1 * h * (q_idx - kv_idx).abs(),
    "soft_cap": lambda score, b, h, q_idx, kv_idx: 2 * torch.tanh(score / 2),
    "rows_out": lambda score, b, h, q_idx, kv_idx: torch.where(q_idx < 3, -float("inf"), score),  # rows with no key
}
MASK_MODS = {  # name: (mask_mod, B and H of the block mask)
    None: (None, None),
    "causal": (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, (None, None)),
    "per_row": (lambda b, h, q_idx, kv_idx: (kv_idx + b + h) % 3 != 0, (B, HQ)),
    "late_keys": (lambda b, h, q_idx, kv_idx: kv_idx >= q_idx + 30, (None, HQ)),  # the last rows see no key
}
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}
GRID = [  # (dtype, score_mod, mask_mod, BLOCK_SIZE, scale, K/V batch 1)
    (torch.float64, None, None, 128, None, False),
    (torch.float64, "head_bias", "causal", 16, None, False),
    (torch.float64, "soft_cap", "per_row", (8, 32), 0.3, False),
    (torch.float64, "rows_out", "late_keys", 16, None, False),
    (torch.float64, "head_bias", "per_row", 128, 1.5, True),
    (torch.float32, "soft_cap", "causal", (32, 8), None, False),
    (torch.float32, "rows_out", "per_row", 16, None, False),
    (torch.bfloat16, "head_bias", "causal", 16, None, False),
    (torch.bfloat16, None, "late_keys", 128, 0.5, False),
]


@pytest.mark.parametrize("dtype, mod, mask, block, scale, kv_one", GRID, ids=lambda x: str(x).replace("torch.", ""))
def test_grid_equals_flex_eager_forward_out_and_lse(dtype, mod, mask, block, scale, kv_one):
    """Out and lse (natural log, as flex returns it: its kernels' base-2 lse times ln 2) from both lse spellings."""
    q, k, v = _inputs(dtype, kv_batch=1 if kv_one else B)
    bm = None
    if mask is not None:
        mask_mod, (b, h) = MASK_MODS[mask]
        bm = flex.create_block_mask(mask_mod, B if kv_one else b, h, L, S, device="cpu", BLOCK_SIZE=block)
    kw = dict(score_mod=SCORE_MODS[mod], block_mask=bm, scale=scale, enable_gqa=True)
    want, want_aux = _flex(q, k, v, **kw, return_aux=flex.AuxRequest(lse=True))
    got, got_aux = qkv.flex_attention(q, k, v, **kw, return_aux=flex.AuxRequest(lse=True))
    got_out, got_lse = qkv.flex_attention(q, k, v, **kw, return_lse=True)
    assert got.dtype == want.dtype and got_aux.lse.dtype == want_aux.lse.dtype  # lse: float32 under bfloat16
    assert torch.equal(got, got_out) and torch.equal(got_aux.lse, got_lse)
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(torch.isneginf(got_aux.lse), torch.isneginf(want_aux.lse))  # rows with no key: -inf, out 0
    torch.testing.assert_close(got_aux.lse, want_aux.lse, rtol=tol, atol=tol)
    assert not got[torch.isneginf(got_aux.lse)].any()


def test_gradients_of_a_captured_tensor_and_of_rows_with_no_key_equal_the_definition():
    """A score_mod reading tensors that require grad, rows the mask and the score_mod leave empty: finite gradients."""
    q, k, v = (x.requires_grad_() for x in _inputs())
    slope = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64, requires_grad=True)
    table = torch.randn(L + S, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < 2, -float("inf"), score * (1 + slope[h]) + table[q_idx - kv_idx + S])

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 10 * h - 20

    bm = flex.create_block_mask(mask_mod, None, HQ, L, S, device="cpu", BLOCK_SIZE=16)
    got, lse = qkv.flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True, return_lse=True)
    idx = (torch.arange(B), torch.arange(HQ), torch.arange(L), torch.arange(S))
    s = E**-0.5 * q @ k.repeat_interleave(HQ // HKV, 1).transpose(-1, -2)
    s = flex._vmap_for_bhqkv(mod, prefix=(0,))(s, *idx).masked_fill(~flex._vmap_for_bhqkv(mask_mod, prefix=())(*idx), -torch.inf)
    want, want_lse = torch._safe_softmax(s, -1) @ v.repeat_interleave(HQ // HKV, 1), torch.logsumexp(s, -1)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=want.dtype)

    def loss(out, lse):
        return (out * cot).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    params = (q, k, v, slope, table)
    for a, b in zip(torch.autograd.grad(loss(got, lse), params), torch.autograd.grad(loss(want, want_lse), params)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- calls flex refuses: refused alike


def _refused_alike(call_flex, call_qkv, qkv_match):
    """flex refuses; qkv refuses with an exception of flex's class, naming the problem."""
    with pytest.raises(Exception) as theirs:
        call_flex()
    with pytest.raises(type(theirs.value), match=qkv_match):
        call_qkv()


@pytest.mark.parametrize("rank", [3, 5])
def test_a_rank_other_than_four_is_not_implemented_as_in_flex(rank):
    """flex: ``NotImplementedError("NYI: query, key, and value must be 4D tensors")``; qkv raised a ValueError."""
    q, k, v = _inputs()
    shape = (lambda x: x[0]) if rank == 3 else (lambda x: x[None])
    _refused_alike(lambda: _flex(shape(q), shape(k), shape(v), enable_gqa=True),
                   lambda: qkv.flex_attention(shape(q), shape(k), shape(v), enable_gqa=True),
                   r"query: expected a 4-d tensor")  # fmt: skip
    with pytest.raises(ValueError):  # qkv's own shape errors are ValueErrors: still caught as one
        qkv.flex_attention(shape(q), shape(k), shape(v), enable_gqa=True)


def test_nested_tensors_are_refused_naming_them():
    """flex: ``NotImplementedError`` "does not support NestedTensor inputs"; qkv failed inside SDPA, naming no input."""
    gen = torch.Generator().manual_seed(0)
    nt = torch.nested.nested_tensor([torch.randn(4, 5, 8, generator=gen), torch.randn(4, 7, 8, generator=gen)],
                                    layout=torch.jagged)  # fmt: skip
    _refused_alike(lambda: _flex(nt, nt, nt), lambda: qkv.flex_attention(nt, nt, nt), r"query: .*nested tensors")


def test_max_scores_are_not_implemented_as_in_flex_on_the_cpu():
    q, k, v = _inputs()
    request = flex.AuxRequest(lse=True, max_scores=True)
    _refused_alike(lambda: _flex(q, k, v, enable_gqa=True, return_aux=request),
                   lambda: qkv.flex_attention(q, k, v, enable_gqa=True, return_aux=request), r"return_aux: .*max_scores")  # fmt: skip


@pytest.mark.parametrize("options, match", [
    ({"BACKEND": "CUTLASS"}, r"kernel_options: BACKEND must be one of \('AUTO'.*got 'CUTLASS'"),
    ({"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": True}, r"kernel_options: BACKEND .* FORCE_USE_FLEX_ATTENTION"),
    ({"OUTPUT_LOGSUMEXP": True}, r"kernel_options: OUTPUT_LOGSUMEXP"),
    ({"OUTPUT_MAX": False}, r"kernel_options: OUTPUT_MAX"),
], ids=["unknown_backend", "backend_and_legacy_force", "output_logsumexp", "output_max"])  # fmt: skip
def test_kernel_options_flex_refuses_are_refused(options, match):
    """qkv ignores kernel_options, but not the ones flex refuses before any kernel runs (it took them all)."""
    q, k, v = _inputs()
    with pytest.raises(Exception):
        _flex(q, k, v, enable_gqa=True, kernel_options=options)
    with pytest.raises((ValueError, RuntimeError), match=match):
        qkv.flex_attention(q, k, v, enable_gqa=True, kernel_options=options)


@pytest.mark.parametrize("options", [types.MappingProxyType({"BLOCK_M": 16}), [("PRESCALE_QK", True)]], ids=["mapping", "pairs"])
def test_kernel_options_of_any_mapping_are_accepted_as_flex_accepts_them(options):
    """flex reads ``dict(kernel_options)``; qkv refused anything but a dict."""
    q, k, v = _inputs()
    torch.testing.assert_close(qkv.flex_attention(q, k, v, enable_gqa=True, kernel_options=options),
                               _flex(q, k, v, enable_gqa=True, kernel_options=options), rtol=1e-12, atol=1e-12)  # fmt: skip
    with pytest.raises(TypeError, match=r"kernel_options: expected a dict"):
        qkv.flex_attention(q, k, v, enable_gqa=True, kernel_options=3)


def test_return_aux_that_is_no_aux_request_is_refused():
    """flex fails reading ``return_aux.lse``; qkv answered ``return_aux=True`` with an empty AuxOutput."""
    q, k, v = _inputs()
    with pytest.raises(AttributeError):
        _flex(q, k, v, enable_gqa=True, return_aux=True)
    with pytest.raises(TypeError, match=r"return_aux: expected an AuxRequest"):
        qkv.flex_attention(q, k, v, enable_gqa=True, return_aux=True)


def test_a_block_mask_on_another_device_is_refused_naming_both_devices():
    """flex: ``RuntimeError("Expect q/k/v and block_mask to be on the same device ...")``; qkv failed copying out of
    the meta lists."""
    q, k, v = _inputs()
    bm = flex.create_block_mask(MASK_MODS["causal"][0], None, None, L, S, device="meta")
    _refused_alike(lambda: _flex(q, k, v, block_mask=bm, enable_gqa=True),
                   lambda: qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True), r"block_mask: .*cpu.*meta")  # fmt: skip


# --------------------------------------------------------------------------- what flex answers


def test_the_output_has_the_querys_memory_layout_as_flex_gives_it():
    """flex lays its output out in the query's stride order (``_permute_strides``): a query made from ``(B, L, H, E)``
    by ``transpose(1, 2)`` gives an output whose ``transpose(1, 2)`` is contiguous, which model code then ``view``s.
    qkv returned a contiguous ``(B, H, L, Ev)``."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, L, HQ, E, generator=gen, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, HKV, E, generator=gen, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, S, HKV, EV, generator=gen, dtype=torch.float64).transpose(1, 2)
    want = _flex(q.detach(), k, v, enable_gqa=True)
    got = qkv.flex_attention(q, k, v, enable_gqa=True)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.transpose(1, 2).view(B, L, HQ * EV)  # as model code reshapes flex's output
    (grad,) = torch.autograd.grad(got, q, torch.ones_like(got))  # still differentiable
    assert torch.isfinite(grad).all()
    # the query's last dim not innermost: flex still gives Ev the unit stride
    q2 = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
    assert qkv.flex_attention(q2, k, v, enable_gqa=True).stride() == _flex(q2, k, v, enable_gqa=True).stride()


@pytest.mark.parametrize("lead", [(), (HQ,)], ids=["no_batch_or_heads", "heads_only"])
def test_a_block_mask_with_fewer_leading_dims_is_taken_as_flex_takes_it(lead):
    """``BlockMask.from_kv_blocks`` takes lists of any leading dims (at least ``(nq,)`` and ``(nq, nk)``); flex's eager
    forward takes them. qkv read their first two dims as ``(B, H)`` and failed. They broadcast from the right."""
    q, k, v = _inputs()
    nq, nk = -(-L // 8), -(-S // 8)  # more query blocks than heads: no (B, H) reading of the lists fits by chance
    counts = torch.full((*lead, nq), nk, dtype=torch.int32)
    indices = torch.arange(nk, dtype=torch.int32).expand(*lead, nq, nk).contiguous()
    bm = flex.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=8, seq_lengths=(L, S), mask_mod=MASK_MODS["per_row"][0])
    want, want_lse = _flex(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    got, got_lse = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_block_mask_with_more_leading_dims_is_refused_naming_them():
    q, k, v = _inputs()
    counts = torch.ones(1, 1, 1, 1, dtype=torch.int32)
    bm = flex.BlockMask.from_kv_blocks(counts, torch.zeros(1, 1, 1, 1, 1, dtype=torch.int32), BLOCK_SIZE=64, seq_lengths=(L, S))
    with pytest.raises(ValueError, match=re.escape("block_mask: expected lists of (B, H, q blocks), got (1, 1, 1, 1)")):
        qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)


def test_a_sliced_block_mask_is_refused_even_where_its_mask_mod_would_never_run():
    """flex refuses ``bm[i]`` (its mask_mod a stub) up front; qkv ran the stub only inside partial blocks, so a sliced
    block mask of full blocks alone gave an answer."""
    q, k, v = (x[1:] for x in _inputs())
    bm = flex.create_block_mask(flex.noop_mask, B, HQ, L, S, device="cpu", BLOCK_SIZE=8)[1]  # every block full
    _refused_alike(lambda: _flex(q, k, v, block_mask=bm, enable_gqa=True),
                   lambda: qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True), r"block_mask: .*sliced BlockMask")  # fmt: skip


def test_a_value_of_batch_one_under_a_key_of_the_querys_batch_is_broadcast_as_flex_does():
    """flex checks only the key's batch against the query's, then ``expand``s value: qkv refused value batch 1."""
    q, k, v = _inputs()
    torch.testing.assert_close(qkv.flex_attention(q, k, v[:1], enable_gqa=True), _flex(q, k, v[:1], enable_gqa=True),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("mask_mod", [None, "per_row"])
def test_flex_no_op_block_mask_takes_any_lengths(mask_mod):
    """flex's no-op block mask (``BLOCK_SIZE`` 2^30, ``_create_empty_block_mask``) skips flex's length check, its
    mask_mod deciding every element; qkv refused it (made for lengths (1, 1))."""
    q, k, v = _inputs()
    empty = flex._create_empty_block_mask(q, k)
    bm = flex.BlockMask.from_kv_blocks(empty.kv_num_blocks, empty.kv_indices, BLOCK_SIZE=empty.BLOCK_SIZE,
                                       seq_lengths=(1, 1), mask_mod=MASK_MODS[mask_mod][0])  # fmt: skip
    want, want_lse = _flex(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    got, got_lse = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- in qkv's engines


def test_a_score_mod_undefined_where_the_mask_hides_gives_finite_query_key_value_gradients():
    """flex's backward masks dS after the score_mod (eager: ``where(mask_mod, grad_scores, 0)``), so q, k, v
    gradients stay finite when the score_mod is nan at hidden elements (a log of a negative here)."""
    q, k, v = (x[:, :, :L].contiguous().requires_grad_() for x in _inputs())  # L x L

    def mod(score, b, h, q_idx, kv_idx):
        return score - 0.3 * torch.log((q_idx - kv_idx + 1).double())  # nan where kv_idx > q_idx + 1

    bm = flex.create_block_mask(MASK_MODS["causal"][0], None, None, L, L, device="cpu", BLOCK_SIZE=16)
    out = qkv.flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True)
    assert not out.isnan().any()  # the forward is right
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))


@pytest.mark.xfail(strict=True, reason="the engines' online log-sum-exp gives nan (inf - inf) on a row with a +inf "
                   "logit, where flex's logsumexp gives +inf")  # fmt: skip
def test_a_row_with_a_plus_inf_logit_has_lse_plus_inf_as_flex():
    q, k, v = _inputs()

    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == 3, float("inf"), score)

    _, want_lse = _flex(q, k, v, score_mod=mod, enable_gqa=True, return_lse=True)
    _, got_lse = qkv.flex_attention(q, k, v, score_mod=mod, enable_gqa=True, return_lse=True)
    assert torch.isposinf(want_lse).all()
    assert torch.equal(got_lse, want_lse)


def test_a_zero_d_tensor_scale_is_read_as_its_number_as_flex_reads_it():
    """flex's eager forward multiplies by a 0-d tensor ``scale``; qkv refused any tensor."""
    q, k, v = _inputs()
    want = _flex(q, k, v, enable_gqa=True, scale=torch.tensor(0.5))
    torch.testing.assert_close(qkv.flex_attention(q, k, v, enable_gqa=True, scale=torch.tensor(0.5)), want,
                               rtol=1e-12, atol=1e-12)  # fmt: skip
    with pytest.raises(TypeError, match=r"scale"):
        qkv.flex_attention(q, k, v, enable_gqa=True, scale=torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("empty", ["queries", "batch"])  # (no heads: flex divides by the KV heads)
def test_an_lse_without_elements_is_none_as_flex_answers_it(empty):
    """flex's ``_finalize_outputs`` drops an lse with no element (``return_lse`` and ``AuxRequest(lse=True)``);
    qkv answered an empty tensor."""
    q, k, v = _inputs()
    q, k, v = {"queries": (q[:, :, :0], k, v), "batch": (q[:0], k[:0], v[:0])}[empty]
    gqa = True
    theirs, ours = _flex(q, k, v, enable_gqa=gqa, return_lse=True), qkv.flex_attention(q, k, v, enable_gqa=gqa, return_lse=True)
    assert theirs[1] is None and ours[1] is None and ours[0].shape == theirs[0].shape
    request = flex.AuxRequest(lse=True)
    assert qkv.flex_attention(q, k, v, enable_gqa=gqa, return_aux=request)[1].lse is None
    assert _flex(q, k, v, enable_gqa=gqa, return_aux=request)[1].lse is None


@pytest.mark.parametrize("case", ["kv_batch", "value_heads", "backend_and_force"])
def test_what_flex_refuses_as_a_runtime_error_is_one_here(case):
    """flex raises ``RuntimeError`` for K/V batches that do not broadcast (under a block mask), value heads other than
    key's and ``BACKEND`` with ``FORCE_USE_FLEX_ATTENTION``; qkv raised ``ValueError`` (it still is one)."""
    q, k, v = _inputs()
    kw = dict(enable_gqa=True)
    if case == "kv_batch":
        k, v = _inputs(kv_batch=3)[1:]
        kw["block_mask"] = flex.create_block_mask(MASK_MODS["causal"][0], B, None, L, S, device="cpu")
    elif case == "value_heads":
        v = torch.cat([v, v], 1)
    else:
        kw["kernel_options"] = {"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": True}
    match = {"kv_batch": r"key: Bq and Bkv must broadcast", "value_heads": r"value: expected 2 heads like key",
             "backend_and_force": r"kernel_options: BACKEND"}[case]  # fmt: skip
    _refused_alike(lambda: _flex(q, k, v, **kw), lambda: qkv.flex_attention(q, k, v, **kw), match)
    with pytest.raises(ValueError, match=match):
        qkv.flex_attention(q, k, v, **kw)


@pytest.mark.parametrize("query_dtype, kv_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                   (torch.float32, torch.float64), (torch.float64, torch.float32)])  # fmt: skip
def test_a_key_in_another_dtype_than_the_query_is_read_as_flex_reads_it(query_dtype, kv_dtype):
    """flex's scores are the query and the key as given in float32 (float64 for a float64 query), the value is taken in
    the query's dtype, the output given in it: a float32 key under a bfloat16 query is not rounded to bfloat16 first
    (qkv rounded it, and its lse moved by 3e-3 where flex's own bfloat16 rounding is 6e-5)."""
    q, _, _ = _inputs(query_dtype)
    _, k, v = _inputs(kv_dtype, seed=1)
    want, want_aux = _flex(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest(lse=True))
    got, got_lse = qkv.flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    assert got.dtype == want.dtype == query_dtype and got_lse.dtype == want_aux.lse.dtype
    lse_tol = 1e-12 if query_dtype == torch.float64 else 2e-6  # the scores in the same working precision
    torch.testing.assert_close(got_lse, want_aux.lse, rtol=lse_tol, atol=lse_tol)
    out_tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(query_dtype, lse_tol)  # flex rounds the weights first
    torch.testing.assert_close(got, want, rtol=out_tol, atol=out_tol)
