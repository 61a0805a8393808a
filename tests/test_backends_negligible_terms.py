"""Dropping a fixed bias's negligible terms from the offset profile (``DiagonalMask.without_negligible``).

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` head
size, ``L = i + j - 1`` offsets.

ALiBi's far keys give PyTorch's fused kernel weights in float32's subnormal range, which
makes its products take microcode assists on x86. The fused engine sends every term that
lies ``40`` logits below its row's largest possible one to ``-inf``. Checked here: each
row's largest profile value against brute force; that terms are dropped only below the
bound (never a row's best term, never a learned bias's, never float64's); and that the
engine's result still equals the float64 reference.
"""

import pytest
import reference as ref
import torch

import qkv
from qkv.backends.engines import fused_blocks, fused_masks
from qkv.backends.tiling.offset_profile import NEGLIGIBLE, DiagonalMask
from qkv.masks import causal, offsets, window


DROP_MIN_LOGITS = fused_masks.DROP_MIN_LOGITS


@pytest.fixture(autouse=True)
def small_calls_drop_too(monkeypatch):
    """These calls are small; the size gate is tested on its own below."""
    monkeypatch.setattr(fused_masks, "DROP_MIN_LOGITS", 0)


def brute_row_maxima(d: DiagonalMask, i: int, j: int, mask) -> torch.Tensor:
    want = torch.full((d.profile.shape[0], i), float("-inf"), dtype=d.profile.dtype)
    for r in range(i):
        for c in range(j):
            o = c - r - (j - i)
            if mask is not None and ((mask.lo is not None and o < mask.lo) or (mask.hi is not None and o > mask.hi)):
                continue
            want[:, r] = torch.maximum(want[:, r], d.profile[:, o - d.offset0])
    return want


@pytest.mark.parametrize("i, j", [(7, 7), (5, 9), (9, 5), (1, 6), (13, 13)])
@pytest.mark.parametrize("mask", [causal(), window(3, 0), window(2, 1), offsets(-100, -8), offsets(2, None), None])
@pytest.mark.parametrize("bias", ["alibi", "t5"])
def test_each_rows_largest_profile_value_matches_brute_force(i, j, mask, bias):
    b = qkv.ALiBi(3) if bias == "alibi" else qkv.RelativePositionBias(3, buckets=8, max_distance=6).requires_grad_(False)
    d = DiagonalMask(mask, b, i, j, torch.float32, "cpu")
    assert torch.equal(d.row_maxima(), brute_row_maxima(d, i, j, mask))


def test_only_terms_below_every_rows_best_minus_the_margin_are_dropped():
    i = j = 256  # head 0's slope 1/4: its terms reach -64 < -2·3 - 40
    d = DiagonalMask(causal(), qkv.ALiBi(4), i, j, torch.float32, "cpu")
    bound = 3.0
    kept = d.without_negligible(bound)
    cut = d.row_maxima().amin(-1, keepdim=True) - 2 * bound - NEGLIGIBLE  # ALiBi: every causal row sees offset 0
    assert torch.equal(cut, torch.full_like(cut, -2 * bound - NEGLIGIBLE))
    dropped = torch.isfinite(d.profile) & ~torch.isfinite(kept.profile)
    assert bool(dropped.any())  # the steep heads lose their far keys
    assert torch.equal(dropped, torch.isfinite(d.profile) & (d.profile < cut))
    assert torch.equal(kept.profile[~dropped], d.profile[~dropped])
    assert d.without_negligible(bound).profile.data_ptr() != d.profile.data_ptr()  # a copy: d is untouched
    double = DiagonalMask(causal(), qkv.ALiBi(4), i, j, torch.float64, "cpu")
    assert double.without_negligible(bound) is double  # float64 has no subnormal weights at these sizes


def test_a_bias_far_below_zero_everywhere_keeps_every_row():
    """The cut follows each row's best term, not 0: a uniformly very negative bias drops nothing."""
    t5 = qkv.RelativePositionBias(2, buckets=8, max_distance=16).requires_grad_(False)
    with torch.no_grad():
        t5.embedding.weight.fill_(-1000.0)
    d = DiagonalMask(causal(), t5, 40, 40, torch.float32, "cpu")
    assert torch.equal(d.without_negligible(1.0).profile, d.profile)


@pytest.mark.parametrize("spread", [0.5, 1.0, 1.5])
def test_a_profile_narrower_than_the_margin_is_kept_whole_and_the_cut_is_the_same(spread):
    """A bias whose terms all lie within ``2·bound + 40`` of each other (T5's buckets) has none below the cut: the
    profile comes back as it is, without the rows' maxima being sought; a wider one is cut as the rows' maxima say."""
    bound = 3.0
    t5 = qkv.RelativePositionBias(2, buckets=8, max_distance=16).requires_grad_(False)
    with torch.no_grad():  # terms spread over `spread` times the margin
        t5.embedding.weight.copy_(torch.linspace(0.0, -spread * (2 * bound + NEGLIGIBLE), 16).reshape(8, 2))
    d = DiagonalMask(None, t5, 40, 40, torch.float32, "cpu")
    cut = d.row_maxima().amin(-1, keepdim=True) - 2 * bound - NEGLIGIBLE
    want = d.profile.masked_fill(d.profile < cut, float("-inf"))
    kept = d.without_negligible(bound)
    assert torch.equal(kept.profile, want)
    assert (kept is d) == (spread <= 1.0)


def _fused_plan_and_mask(q, k, bias, mask):
    req = qkv.checks.request(q, k, k, score="scaled_dot", mask=mask, bias=bias, causal=False, scale=None, dropout=0.0,
                             return_weights=False, score_mod=None)  # fmt: skip
    plan = fused_blocks.plan_of(req)
    return plan, fused_masks.diagonal_mask(plan, q.detach(), k.detach())


def test_the_fused_engine_drops_alibis_far_terms_and_still_matches_float64():
    q, k, v = ref.random_qkv(1, 8, 8, 300, 300, 16, 16, dtype=torch.float32, seed=0)
    plan, d = _fused_plan_and_mask(q, k, qkv.ALiBi(8), causal())
    full = DiagonalMask(causal(), qkv.ALiBi(8), 300, 300, torch.float32, "cpu")
    assert int((~torch.isfinite(d.profile)).sum()) > int((~torch.isfinite(full.profile)).sum())  # something was dropped
    kw = dict(causal=True, bias=qkv.ALiBi(8))
    out = qkv.attention(q, k, v, backend="chunked", **kw)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out64 = qkv.attention(q64, k64, v64, backend="reference", **kw)
    grads64 = torch.autograd.grad(out64.sum(), [q64, k64, v64])
    plain = qkv.attention(q.detach(), k.detach(), v.detach(), backend="reference", **kw)  # float32, nothing dropped
    ref.assert_flash_rule(out, plain, out64)
    for g, g64 in zip(grads, grads64):
        assert torch.allclose(g.double(), g64, rtol=0, atol=1e-5)


def test_a_learned_bias_and_unreadable_tensors_keep_every_term():
    q, k, _ = ref.random_qkv(1, 4, 4, 64, 64, 8, 8, dtype=torch.float32, seed=1)
    learned = qkv.RelativePositionBias(4, buckets=8, max_distance=16)
    plan, d = _fused_plan_and_mask(q, k, learned, causal())
    assert plan.learned and torch.equal(d.profile, DiagonalMask(causal(), learned, 64, 64, torch.float32, "cpu").profile)
    meta = [x.detach().to("meta") for x in (q, k)]
    plan, d = _fused_plan_and_mask(*meta, qkv.ALiBi(4), causal())
    assert d.profile.device.type == "meta"  # built, nothing read from it


def test_a_block_mask_drops_only_terms_far_below_its_rows_best_in_that_block():
    """The path without one offset profile (a padding mask with ALiBi): each block's own rows' best is a safe reference."""
    q, k, v = ref.random_qkv(2, 8, 8, 300, 300, 16, 16, dtype=torch.float32, seed=2)
    lengths = qkv.masks.lengths(torch.tensor([300, 170]))
    kw = dict(causal=True, bias=qkv.ALiBi(8), mask=lengths)
    req = qkv.checks.request(q, k, v, score="scaled_dot", bias=qkv.ALiBi(8), mask=qkv.masks.causal() & lengths,
                             causal=False, scale=None, dropout=0.0, return_weights=False, score_mod=None)  # fmt: skip
    plan = fused_blocks.plan_of(req)
    assert not plan.diagonal  # each block's mask is built, not read from a profile
    bound = fused_masks.logit_bound(plan, q.detach(), k.detach())
    t = qkv.masks.Tile(256, 300, 0, 300, 300, 300, "cpu")
    bias = fused_masks.BiasSource(plan.bias, 300, 300, "cpu")
    full, _ = fused_masks.block_mask(plan, t, bias, torch.float32, None)
    cut, _ = fused_masks.block_mask(plan, t, bias, torch.float32, bound)
    dropped = torch.isfinite(full) & ~torch.isfinite(cut)
    assert bool(dropped.any())
    best = full.amax(-1, keepdim=True)
    assert torch.equal(dropped, torch.isfinite(full) & (full < best - 2 * bound - NEGLIGIBLE))
    out = qkv.attention(q, k, v, backend="chunked", **kw)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out64 = qkv.attention(q64, k64, v64, backend="reference", **kw)
    grads64 = torch.autograd.grad(out64.sum(), [q64, k64, v64])
    plain_inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    plain = qkv.attention(*plain_inputs, backend="reference", **kw)
    ref.assert_flash_rule(out, plain, out64)
    # the gradients by the same rule: within twice a plain float32 softmax's own error (dv's is 1.8e-5 here, and
    # which backward runs, the fused kernel's or the tiles', is timed once per process)
    for g, g_plain, g64 in zip(grads, torch.autograd.grad(plain.sum(), plain_inputs), grads64):
        ref.assert_flash_rule(g, g_plain, g64)


def test_calls_under_the_size_gate_keep_every_term(monkeypatch):
    """Finding the negligible terms costs about 1 ms: a one-query step never pays it, a large call does."""
    monkeypatch.setattr(fused_masks, "DROP_MIN_LOGITS", DROP_MIN_LOGITS)
    q, k, _ = ref.random_qkv(1, 8, 8, 1, 1024, 16, 16, dtype=torch.float32, seed=4)
    _, d = _fused_plan_and_mask(q, k, qkv.ALiBi(8), causal())
    assert torch.equal(d.profile, DiagonalMask(causal(), qkv.ALiBi(8), 1, 1024, torch.float32, "cpu").profile)
    q, k, _ = ref.random_qkv(1, 8, 8, 512, 512, 16, 16, dtype=torch.float32, seed=4)
    assert 512 * 512 >= DROP_MIN_LOGITS
    _, d = _fused_plan_and_mask(q, k, qkv.ALiBi(8), causal())
    assert not torch.equal(d.profile, DiagonalMask(causal(), qkv.ALiBi(8), 512, 512, torch.float32, "cpu").profile)
