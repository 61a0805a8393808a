"""``qkv.flex_attention`` and ``qkv.masks.from_mask_mod`` against FlexAttention's own CPU forward and a materialised oracle.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``L`` query length, ``S`` key
length, ``E`` query/key size, ``Ev`` value size; B=2, Hq=4, Hkv=2, L=300, S=260, E=16, Ev=8:
three of flex's 128-blocks along each side, the last one ragged.

The forward is compared with ``torch.nn.attention.flex_attention`` itself (eager, float64);
flex has no backward on the CPU, so gradients are compared with autograd through the
definition, materialised: the logits, ``score_mod`` and ``mask_mod`` evaluated per element
with ``torch.vmap`` (flex's semantics), a softmax, ``@ v``.
"""

import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, HQ, HKV, L, S, E, EV = 2, 4, 2, 300, 260, 16, 8
GEN = torch.Generator().manual_seed(0)
IDS_Q = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 100, 100]))
IDS_K = torch.repeat_interleave(torch.arange(3), torch.tensor([60, 100, 100]))
TABLE = torch.randn(B, HQ, L, S, generator=GEN, dtype=torch.float64)
REL = torch.randn(L + S, generator=GEN, dtype=torch.float64)


def inputs(dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, L, E, generator=gen, dtype=dtype)
    k = torch.randn(B, HKV, S, E, generator=gen, dtype=dtype)
    v = torch.randn(B, HKV, S, EV, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


MASK_MODS = {
    "causal": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
    "document_causal": lambda b, h, q_idx, kv_idx: (IDS_Q[q_idx] == IDS_K[kv_idx]) & (q_idx >= kv_idx),
    "sliding_window": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 40,
    "prefix_lm": lambda b, h, q_idx, kv_idx: (kv_idx < 50) | (q_idx >= kv_idx),
    "per_batch_and_head": lambda b, h, q_idx, kv_idx: (kv_idx % (b + h + 2)) != 0,
}
SCORE_MODS = {
    "none": None,
    "chained_index": lambda score, b, h, q_idx, kv_idx: score + TABLE[b][h][q_idx][kv_idx],
    "relative_table": lambda score, b, h, q_idx, kv_idx: score + REL[q_idx - kv_idx + S],
    "alibi_like": lambda score, b, h, q_idx, kv_idx: score - (h + 1) * 0.05 * (q_idx - kv_idx).abs(),
    "soft_cap": lambda score, b, h, q_idx, kv_idx: 20 * torch.tanh(score / 20),
}


def block_mask(name):
    mm = MASK_MODS[name]
    per = name == "per_batch_and_head"
    return flex.create_block_mask(mm, B if per else None, HQ if per else None, L, S, device="cpu")


def oracle(q, k, v, score_mod, mask_mod, scale=E**-0.5):
    """The definition, materialised, with flex's per-element semantics: ``(out, lse)``."""
    kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    s = scale * q @ kr.transpose(-1, -2)
    idx = (torch.arange(B), torch.arange(HQ), torch.arange(L), torch.arange(S))
    if score_mod is not None:
        s = flex._vmap_for_bhqkv(score_mod, prefix=(0,))(s, *idx)
    if mask_mod is not None:
        allowed = flex._vmap_for_bhqkv(mask_mod, prefix=())(*idx)
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return w @ vr, lse


@pytest.mark.parametrize("mask", list(MASK_MODS))
@pytest.mark.parametrize("mod", list(SCORE_MODS))
def test_forward_equals_flex_itself(mask, mod):
    q, k, v = (x.detach() for x in inputs())
    bm = block_mask(mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, want_lse = flex.flex_attention(q, k, v, score_mod=SCORE_MODS[mod], block_mask=bm, enable_gqa=True, return_lse=True)
    got, got_lse = qkv.flex_attention(q, k, v, score_mod=SCORE_MODS[mod], block_mask=bm, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_lse, want_lse.to(got_lse.dtype), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", ["document_causal", "per_batch_and_head"])
@pytest.mark.parametrize("mod", ["chained_index", "alibi_like", "soft_cap"])
def test_backward_on_the_cpu_equals_the_definition(mask, mod):
    q, k, v = inputs()
    got = qkv.flex_attention(q, k, v, score_mod=SCORE_MODS[mod], block_mask=block_mask(mask), enable_gqa=True,
                             return_aux=flex.AuxRequest(lse=True))  # fmt: skip
    assert isinstance(got[1], flex.AuxOutput)
    want = oracle(q, k, v, SCORE_MODS[mod], MASK_MODS[mask])
    gen = torch.Generator().manual_seed(3)
    cots = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in want]

    def loss(out, lse):
        return (out * cots[0]).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * cots[1]).sum()

    mine = torch.autograd.grad(loss(got[0], got[1].lse), (q, k, v))
    theirs = torch.autograd.grad(loss(*want), (q, k, v))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_blocks_the_lists_leave_out_are_not_computed_and_full_ones_skip_the_mask_mod():
    """A hand-made BlockMask whose lists disagree with its mask_mod: flex's kernel follows the lists, so does qkv.

    (flex's eager path, which materialises the scores, applies the mask_mod on full blocks
    too; its compiled kernel, what users run, does not: checked once by hand, and here
    against the lists' meaning, so the test needs no compile.)"""
    q, k, v = (x.detach()[:1, :1, :256, :] for x in inputs())
    k, v = k[..., :256, :], v[..., :256, :]
    never = lambda b, h, q_idx, kv_idx: q_idx < 0  # noqa: E731  (False everywhere)
    kv_num = torch.tensor([[[1, 0]]], dtype=torch.int32)  # q block 0: one partial block; q block 1: none
    kv_idx = torch.tensor([[[[1, 0], [0, 0]]]], dtype=torch.int32)
    full_num = torch.tensor([[[0, 1]]], dtype=torch.int32)  # q block 1: key block 0 full
    full_idx = torch.tensor([[[[0, 0], [0, 0]]]], dtype=torch.int32)
    bm = flex.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, mask_mod=never, seq_lengths=(256, 256))
    got, got_lse = qkv.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.equal(got[..., :128, :], torch.zeros_like(got[..., :128, :]))  # a partial block whose mask_mod is False
    assert bool(torch.isneginf(got_lse[..., :128]).all())
    want, want_lse = qkv.attention(q[..., 128:, :], k[..., :128, :], v[..., :128, :], return_lse=True, backend="reference")
    torch.testing.assert_close(got[..., 128:, :], want, rtol=1e-10, atol=1e-10)  # a full block: no mask_mod
    torch.testing.assert_close(got_lse[..., 128:], want_lse, rtol=1e-10, atol=1e-10)


def test_from_mask_mod_composes_with_qkv_masks_and_never_builds_the_whole_mask(monkeypatch):
    q, k, v = inputs()
    doc = qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: IDS_Q[q_idx] == IDS_K[kv_idx])
    mask = doc & qkv.masks.causal()
    got = qkv.attention(q, k, v, mask=mask)
    allowed = (IDS_Q[:, None] == IDS_K[None, :]) & (torch.arange(S)[None, :] <= torch.arange(L)[:, None] + S - L)
    want = qkv.attention(q, k, v, mask=allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    from qkv import _mods
    from qkv.backends.engines import fused_runs

    monkeypatch.setattr(fused_runs, "RUN_ROWS", 32)  # blocks of 32 rows, so that a block is not the whole call
    sizes = []
    real = _mods.evaluate
    monkeypatch.setattr(_mods, "evaluate", lambda fn, score, b, h, qi, kv: sizes.append(len(qi) * len(kv)) or real(fn, score, b, h, qi, kv))
    qkv.attention(q.detach().float(), k.detach().float(), v.detach().float(), mask=mask, backend="chunked")
    assert sizes and max(sizes) < L * S  # tile by tile
    big = torch.empty(1, 8, 4096, 64, device="meta")
    huge = qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    assert "not sdpa: the lazy mask would be materialised as a (1, 4096, 4096) tensor" in qkv.explain(big, big, big, mask=huge)


def test_errors_follow_flex():
    q, k, v = (x.detach() for x in inputs())
    with pytest.raises(ValueError, match=r"key: expected query and key/value to have the same number of heads but got Hq=4 and Hkv=2"):
        qkv.flex_attention(q, k, v)
    with pytest.raises(ValueError, match=r"block_mask: created for \(q_len, kv_len\) = \(300, 260\), got \(299, 260\)"):
        qkv.flex_attention(q[..., :299, :], k, v, block_mask=block_mask("causal"), enable_gqa=True)
    with pytest.raises(ValueError, match="return_lse: give return_lse or return_aux"):
        qkv.flex_attention(q, k, v, enable_gqa=True, return_lse=True, return_aux=flex.AuxRequest(lse=True))
    with pytest.raises(TypeError, match="mask_mod: expected a bool tensor"):
        qkv.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                      mask=qkv.masks.from_mask_mod(lambda b, h, qi, kv: (qi - kv).float()))  # fmt: skip


@pytest.mark.parametrize("sizes", [[128, 256, 128], [100, 284, 128], [512]])
def test_a_packed_document_block_mask_runs_one_call_per_group_of_blocks(sizes):
    """Documents that no listed block joins are independent calls; the result is flex's, forward and backward."""
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    n = ids.numel()

    def doc_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    bm = flex.create_block_mask(doc_causal, None, None, n, n, device="cpu")
    groups = qkv.masks.FlexBlocks(bm).diagonal_groups()
    # a block shared by two documents joins them: groups are runs of whole blocks
    want_groups = {(128, 256, 128): [0] * 128 + [1] * 256 + [2] * 128, (100, 284, 128): [0] * 384 + [1] * 128, (512,): None}
    expected = want_groups[tuple(sizes)]
    assert (groups is None) if expected is None else groups.tolist() == expected
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, HQ, n, E, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, HKV, n, E, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, HKV, n, EV, generator=gen, dtype=torch.float64, requires_grad=True)
    soft = SCORE_MODS["soft_cap"]
    got, lse = qkv.flex_attention(q, k, v, score_mod=soft, block_mask=bm, enable_gqa=True, return_lse=True)
    kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    s = 20 * torch.tanh(E**-0.5 * q @ kr.transpose(-1, -2) / 20)
    s = s.masked_fill(~((ids[:, None] == ids[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()), float("-inf"))
    want, want_lse = torch.softmax(s, -1) @ vr, torch.logsumexp(s, -1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    cot = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    mine = torch.autograd.grad((got * cot).sum() + lse.sum(), (q, k, v))
    theirs = torch.autograd.grad((want * cot).sum() + want_lse.sum(), (q, k, v))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_diagonal_groups_need_square_blocks_and_no_block_across():
    n = 384
    window = flex.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 40, None, None, n, n, device="cpu")
    assert qkv.masks.FlexBlocks(window).diagonal_groups() is None  # every block reaches its neighbours
    ids = torch.arange(n) // 128
    docs = lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]  # noqa: E731
    assert qkv.masks.FlexBlocks(flex.create_block_mask(docs, None, None, n, n, device="cpu")).diagonal_groups() is not None
    wide = flex.create_block_mask(docs, None, None, n, n, device="cpu", BLOCK_SIZE=(128, 64))
    assert qkv.masks.FlexBlocks(wide).diagonal_groups() is None  # query and key blocks differ: not read


def test_a_reused_block_mask_evaluates_its_mask_mod_once_while_what_it_reads_is_unchanged(monkeypatch):
    """As a model's layers reuse one block mask: tiles are kept; a captured tensor changed in place is read afresh."""
    from qkv import _mods

    n = 256
    ids = torch.arange(n) // 100  # documents straddle blocks: the mask_mod is needed

    def docs(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    calls = []
    evaluate = _mods.evaluate
    monkeypatch.setattr(_mods, "evaluate", lambda fn, *a: calls.append(fn) or evaluate(fn, *a))
    bm = flex.create_block_mask(docs, None, None, n, n, device="cpu")
    q, k, v = (x.detach()[:1, :2, :n] for x in inputs())
    k, v = k[:, :, :n], v[:, :, :n]
    first = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert calls
    calls.clear()
    again = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert calls == [] and torch.equal(first, again)
    ids[150:] = 0  # in place: documents 1 and 2 become one, inside the blocks the lists already name
    changed = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert calls  # evaluated afresh
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(changed, want, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(changed, first)


def test_a_mask_mod_reading_a_list_is_evaluated_at_every_call():
    n = 256
    cut = [100]
    bm = flex.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= cut[0], None, None, n, n, device="cpu")
    q, k, v = (x.detach()[:1, :2, :n] for x in inputs())
    k, v = k[:, :, :n], v[:, :, :n]
    qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    cut[0] = 120  # a list changes unseen: nothing is kept, so flex's answer follows it
    got = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)



def _flex(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex.flex_attention(*args, **kw)


def test_a_block_mask_made_for_one_batch_row_and_head_evaluates_each_rows_and_heads_own():
    """``B=None, H=None``: inside partial blocks flex's mask_mod sees the call's ``b`` and ``h``; so must qkv's."""
    q, k, v = (torch.randn(2, 3, 64, 8, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(3))

    def alternate(b, h, q_idx, kv_idx):
        return (kv_idx + h + b) % 2 == 0

    bm = flex.create_block_mask(alternate, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)  # every block partial
    torch.testing.assert_close(qkv.flex_attention(q, k, v, block_mask=bm), _flex(q, k, v, block_mask=bm),
                               rtol=1e-10, atol=1e-10)  # fmt: skip
    # the same block mask at another batch and head count: nothing kept from the first call is reused
    q2, k2, v2 = (x[:1, :2] for x in (q, k, v))
    torch.testing.assert_close(qkv.flex_attention(q2, k2, v2, block_mask=bm), _flex(q2, k2, v2, block_mask=bm),
                               rtol=1e-10, atol=1e-10)  # fmt: skip


def test_a_mask_mod_reading_a_module_attribute_or_a_keyword_default_is_read_afresh():
    import types

    n = 256
    q, k, v = (x.detach()[:1, :2, :n] for x in inputs())
    k, v = k[:, :, :n], v[:, :, :n]
    cfg = types.ModuleType("cfg")
    cfg.ids = torch.arange(n) // 100
    globals()["cfg"] = cfg  # the mask_mod names it as a global, as code reading a config module does
    try:
        by_module = flex.create_block_mask(lambda b, h, q_idx, kv_idx: cfg.ids[q_idx] == cfg.ids[kv_idx], None, None, n, n,
                                           device="cpu")  # fmt: skip
        ids = torch.arange(n) // 100

        def by_default(b, h, q_idx, kv_idx, *, ids=ids):
            return ids[q_idx] == ids[kv_idx]

        by_keyword = flex.create_block_mask(by_default, None, None, n, n, device="cpu")
        for bm in (by_module, by_keyword):
            qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        cfg.ids[150:] = 0
        ids[150:] = 0
        for bm in (by_module, by_keyword):
            torch.testing.assert_close(qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True),
                                       _flex(q, k, v, block_mask=bm, enable_gqa=True), rtol=1e-10, atol=1e-10)  # fmt: skip
        cfg.ids = torch.zeros(n, dtype=torch.long)  # rebound
        torch.testing.assert_close(qkv.flex_attention(q, k, v, block_mask=by_module, enable_gqa=True),
                                   _flex(q, k, v, block_mask=by_module, enable_gqa=True), rtol=1e-10, atol=1e-10)  # fmt: skip
    finally:
        del globals()["cfg"]


def test_any_aux_request_is_answered_with_an_aux_output():
    q, k, v = (x.detach() for x in inputs())
    out, aux = qkv.flex_attention(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest())
    want, want_aux = _flex(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest())
    assert isinstance(aux, flex.AuxOutput) and aux.lse is None and want_aux.lse is None
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_key_and_value_of_another_dtype_compute_in_the_querys():
    q, k, v = (x.detach() for x in inputs())
    got = qkv.flex_attention(q.float(), k.bfloat16(), v.bfloat16(), enable_gqa=True)
    want = _flex(q.float(), k.bfloat16(), v.bfloat16(), enable_gqa=True)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_score_mod_that_ignores_the_score_is_broadcast_to_it():
    q, k, v = (x.detach() for x in inputs())

    def distance(score, b, h, q_idx, kv_idx):
        return -0.5 * (q_idx - kv_idx).abs().double()

    torch.testing.assert_close(qkv.flex_attention(q, k, v, score_mod=distance, enable_gqa=True),
                               _flex(q, k, v, score_mod=distance, enable_gqa=True), rtol=1e-10, atol=1e-10)  # fmt: skip


@pytest.mark.parametrize("i, j", [(3, 0), (0, 5)])
def test_an_empty_call_with_a_mask_mod_gives_the_empty_result_and_learns_nothing_of_the_program(i, j):
    """vmap cannot run a program like ``(q + kv) % 2`` over a size-0 dim: the empty grid is not evaluated,
    and the probe that decides whether the program broadcasts waits for a grid with values."""
    from qkv import _mods

    def every_other(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 2 == 0

    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 2, i, 4, generator=gen), torch.randn(1, 2, j, 4, generator=gen), torch.randn(1, 2, j, 4, generator=gen)
    for backend in ("auto", "reference"):
        out = qkv.attention(q, k, v, mask=qkv.masks.from_mask_mod(every_other), backend=backend)
        assert out.shape == (1, 2, i, 4) and not out.any()
    learned = lambda: [exact for slot, (_, exact) in _mods._modes.items() if slot[0] == id(every_other)]  # noqa: E731
    assert learned() == []
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen) for _ in range(3))
    qkv.attention(q, k, v, mask=qkv.masks.from_mask_mod(every_other))
    assert learned() and all(learned())  # it broadcasts, as learned from a grid with values


# --------------------------------------------------------------------------- block masks of other batch and head counts
#
# flex_attention checks a block mask's batch against the query's only where K/V's batch differs from the query's
# (then it must be the query's); otherwise any (B, H) is taken. Its eager forward, flex's own on the CPU, evaluates
# the mask_mod at every element with each row's and head's own b and h and never reads the lists; its compiled
# kernels read them and disagree between themselves where (B, H) is not the call's or 1 (CPU: b // (Bq/B), a crash
# for more rows than the call's; CUDA: b % B). qkv: more rows or heads than the call's, the first ones (right for
# the call's rows where the lists came from the mask_mod); fewer but more than one, the mask_mod everywhere.

BM_B, BM_HQ, BM_HKV, BM_L = 3, 4, 2, 64  # three batch rows, so that 2 is fewer but not a divisor


def _bm_inputs(kv_batch=BM_B, grad=False):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(BM_B, BM_HQ, BM_L, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(kv_batch, BM_HKV, BM_L, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(kv_batch, BM_HKV, BM_L, 4, generator=gen, dtype=torch.float64)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _per_block(b, h, q_idx, kv_idx):
    """Whole 16-blocks hidden by batch row and head: the lists made for (b, h) are right for (b, h) alone."""
    return (((kv_idx // 16 + b + 2 * h) % 3 != 0) & (q_idx >= kv_idx)) | (q_idx == kv_idx)


def _per_element(b, h, q_idx, kv_idx):
    """Rows and heads differ inside each block only: one set of lists is right for every (b, h)."""
    return ((kv_idx + b + h) % 3 != 0) & (q_idx >= kv_idx)


BM_SHAPES = [  # (B, H) of the block mask; the call is (3, 4)
    (3, 4), (None, None), (1, 1), (None, 4), (3, None), (1, 4),  # the call's, or broadcast
    (5, 4), (3, 8), (5, 6), (4, 5),  # more rows or heads than the call's
    (2, 4), (3, 2), (3, 3), (2, 2), (1, 2), (2, 1),  # fewer, but more than one
    (5, 2), (2, 8),  # more of one, fewer of the other
]


@pytest.mark.parametrize("shape", BM_SHAPES, ids=lambda s: "B%s-H%s" % s)
def test_a_block_mask_of_any_batch_and_head_count_is_taken_as_flex_takes_it(shape):
    """Out and lse as flex's own CPU forward, float64. qkv refused every (B, H) but the call's and 1."""
    broadcast = all(n in (None, 1) or n == size for n, size in zip(shape, (BM_B, BM_HQ)))
    mask_mod = _per_element if broadcast else _per_block  # a broadcast block mask's lists are b = h = 0's
    q, k, v = _bm_inputs()
    bm = flex.create_block_mask(mask_mod, *shape, BM_L, BM_L, device="cpu", BLOCK_SIZE=16)
    want, want_lse = _flex(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    got, got_lse = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 8), (2, 3)], ids=lambda s: "B%s-H%s" % s)
def test_a_block_mask_of_other_counts_gives_the_definitions_gradients(shape):
    """flex has no backward on the CPU: ``.grad`` against the definition, the mask_mod at every element."""
    mine, theirs = _bm_inputs(grad=True), _bm_inputs(grad=True)
    bm = flex.create_block_mask(_per_block, *shape, BM_L, BM_L, device="cpu", BLOCK_SIZE=16)
    got = qkv.flex_attention(*mine, block_mask=bm, enable_gqa=True)
    q, k, v = theirs
    idx = (torch.arange(BM_B), torch.arange(BM_HQ), torch.arange(BM_L), torch.arange(BM_L))
    allowed = flex._vmap_for_bhqkv(_per_block, prefix=())(*idx)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=want.dtype)
    got.backward(cot)
    want.backward(cot)
    for name, a, b in zip(("query", "key", "value"), mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}.grad: {m}")


@pytest.mark.parametrize("shape", [(1, 4), (None, None), (5, 4), (2, 4)], ids=lambda s: "B%s-H%s" % s)
def test_key_and_value_of_batch_one_need_a_block_mask_of_the_querys_batch_as_flex(shape):
    """K/V batch 1 under query batch 3: flex's one check on the block mask's shape, its ValueError."""
    q, k, v = _bm_inputs(kv_batch=1)
    bm = flex.create_block_mask(_per_element, *shape, BM_L, BM_L, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError) as theirs:
        _flex(q, k, v, block_mask=bm, enable_gqa=True)
    with pytest.raises(ValueError, match=re.escape(str(theirs.value))):
        qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)


@pytest.mark.parametrize("heads", [2, 8, None], ids=lambda h: f"H{h}")
def test_key_and_value_of_batch_one_take_a_block_mask_of_the_querys_batch_and_any_heads(heads):
    q, k, v = _bm_inputs(kv_batch=1)
    bm = flex.create_block_mask(_per_element if heads is None else _per_block, BM_B, heads, BM_L, BM_L, device="cpu",
                                BLOCK_SIZE=16)  # fmt: skip
    want, want_lse = _flex(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    got, got_lse = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 8), (2, 3)], ids=lambda s: "B%s-H%s" % s)
def test_a_block_mask_of_other_counts_reused_by_many_calls_evaluates_its_mask_mod_once(shape, monkeypatch):
    """As a model's layers reuse one block mask: what qkv makes of it for the call's counts is kept with it, and
    the tiles evaluated with that."""
    from qkv import _mods

    calls = []
    evaluate = _mods.evaluate
    monkeypatch.setattr(_mods, "evaluate", lambda fn, *a: calls.append(fn) or evaluate(fn, *a))
    q, k, v = _bm_inputs()
    bm = flex.create_block_mask(_per_block, *shape, BM_L, BM_L, device="cpu", BLOCK_SIZE=16)
    first = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert calls
    calls.clear()
    again = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert calls == [] and torch.equal(first, again)


# --------------------------------------------------------------------------- random calls


def _mask_mod(kind: str, n: int, ids: torch.Tensor):
    """A mask_mod of one family, with its parameter ``n`` (and document ids for ``documents``)."""
    return {
        "causal": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        "window": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= n,
        "prefix": lambda b, h, q_idx, kv_idx: (kv_idx < n) | (q_idx >= kv_idx),
        "documents": lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx],
        "per_row": lambda b, h, q_idx, kv_idx: (kv_idx + b + h) % (n + 2) != 0,
        "late_keys": lambda b, h, q_idx, kv_idx: kv_idx >= n,  # rows may see no key at all
    }[kind]


def _score_mod(kind: str):
    return {
        None: None,
        "alibi": lambda score, b, h, q_idx, kv_idx: score - (h + 1) * 0.25 * (q_idx - kv_idx).abs(),
        "soft_cap": lambda score, b, h, q_idx, kv_idx: 3 * torch.tanh(score / 3),
        "batch": lambda score, b, h, q_idx, kv_idx: score + 0.5 * b - 0.25 * h,
    }[kind]


@st.composite
def flex_calls(draw):
    """Flex calls of every size against every block size: lengths 1 to 40, blocks of 8 to 128, any mask and score."""
    hkv = draw(st.integers(1, 2))
    return dict(
        B=draw(st.integers(1, 2)), hkv=hkv, hq=hkv * draw(st.integers(1, 2)), L=draw(st.integers(1, 40)),
        S=draw(st.integers(1, 40)), block=draw(st.sampled_from([8, 16, (8, 16), 128])),
        mask=draw(st.sampled_from([None, "causal", "window", "prefix", "documents", "per_row", "late_keys"])),
        n=draw(st.integers(0, 12)), per_batch_head=draw(st.booleans()), score=draw(st.sampled_from([None, "alibi", "soft_cap", "batch"])),
        scale=draw(st.sampled_from([None, 0.3])), kv_batch_one=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        counts=draw(st.sampled_from(["call", "call", "more", "fewer"])),  # a per-row block mask's (B, H)
    )  # fmt: skip


@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=flex_calls())
def test_random_calls_equal_flex_itself(c):
    """Ragged last blocks, rows with no key, broadcast block masks, block masks for more or fewer rows and heads, and
    K/V batches: out and lse as flex's own forward."""
    gen = torch.Generator().manual_seed(c["seed"])
    kv_b = 1 if c["kv_batch_one"] else c["B"]
    q = torch.randn(c["B"], c["hq"], c["L"], 8, generator=gen, dtype=torch.float64)
    k = torch.randn(kv_b, c["hkv"], c["S"], 8, generator=gen, dtype=torch.float64)
    v = torch.randn(kv_b, c["hkv"], c["S"], 4, generator=gen, dtype=torch.float64)
    ids = torch.sort(torch.randint(0, 3, (max(c["L"], c["S"]),), generator=gen)).values
    bm = None
    if c["mask"] is not None:
        # a mask_mod reading b or h needs a block mask made per batch row and head: one made for b = h = 0
        # and broadcast would list blocks by that row alone, which the compiled kernel (and qkv) honour and
        # flex's eager forward, which evaluates the mask_mod everywhere, does not
        per = c["per_batch_head"] or c["mask"] == "per_row"
        B, H = (c["B"], c["hq"]) if per else (None, None)
        if per and c["counts"] == "more":  # its first rows and heads are the call's
            B, H = B + 1, H + 2
        elif per and c["counts"] == "fewer" and H > 2:  # no lists for the last head: the mask_mod alone
            H -= 1
        bm = flex.create_block_mask(_mask_mod(c["mask"], c["n"], ids), B, H, c["L"], c["S"], device="cpu",
                                    BLOCK_SIZE=c["block"])  # fmt: skip
    kw = dict(score_mod=_score_mod(c["score"]), block_mask=bm, scale=c["scale"], enable_gqa=c["hq"] != c["hkv"], return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want, want_lse = flex.flex_attention(q, k, v, **kw)
        except ValueError as refused:  # a call flex refuses (K/V batch 1 without a block mask of the query's): refused alike
            with pytest.raises(ValueError, match=re.escape(str(refused))):
                qkv.flex_attention(q, k, v, **kw)
            return
    got, got_lse = qkv.flex_attention(q, k, v, **kw)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_lse, want_lse.to(got_lse.dtype), rtol=1e-10, atol=1e-10)


def test_a_block_masks_kept_tiles_name_the_tensors_its_mask_mod_reads_held_not_by_id():
    """The kept tiles were recognised by the id of the tensor the mask_mod reads: freed, its id passed to the next
    batch's tensor, and the old tiles came back (an error of 1.1). The fingerprint now holds the tensor."""
    import gc
    import weakref

    from qkv.masks.reads import fingerprint

    doc = torch.zeros(8, dtype=torch.long)
    gone = weakref.ref(doc)
    mask_mod = (lambda d: lambda b, h, q_idx, kv_idx: d[q_idx] == d[kv_idx])(doc)
    kept = fingerprint(mask_mod)
    del doc, mask_mod
    gc.collect()
    assert gone() is not None  # held by the fingerprint: no new tensor can take its id
    assert kept == kept and kept != fingerprint(lambda b, h, q_idx, kv_idx: torch.zeros(8)[q_idx] > 0)


def test_a_program_masks_dense_tensor_is_the_callers_own():
    """FlexBlocks.dense returned the tile kept for later calls: and-ing another mask into it changed them (0.92)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 50

    block_mask = create_block_mask(near, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    for mask in (qkv.masks.FlexBlocks(block_mask), qkv.masks.from_mask_mod(near) if hasattr(qkv.masks, "from_mask_mod") else None):
        if mask is None:
            continue
        first = qkv.attention(q, k, v, mask=mask)
        dense = mask.dense(64, 64)
        dense &= torch.zeros(64, 64, dtype=torch.bool)
        torch.testing.assert_close(qkv.attention(q, k, v, mask=mask), first, rtol=0, atol=0)
