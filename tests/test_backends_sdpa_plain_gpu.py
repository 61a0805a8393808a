"""Tests of the plain-call lane's CUDA calls (``backends.sdpa_plain``, ``backends.plain_padding.device_padding``).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size.

On one CUDA device two masked calls take the lane as the full path runs them there: a
decoding step's padding (``lengths`` or ``starts``; hidden keys zeroed in copies of ``k``
and ``v`` before the kernel, branch-free, no scan of the output) and ``causal=True`` with
``i < j`` (PyTorch's ``causal_lower_right``). Without a GPU the tests make the lane take CPU
tensors for one GPU's (``_on_one_gpu`` answers True), so its choices and its numbers run
here, on PyTorch's CPU kernel; that CUDA calls take the lane is checked on a GPU by
``benchmarks/gpu_check.py``.
"""

import pytest
import torch

import qkv
from qkv.backends import plain_padding, sdpa_plain
from qkv.backends.tiling import flash_cpu

PADDING = {
    "lengths": lambda: qkv.masks.lengths(torch.tensor([6, 9])),
    "starts": lambda: qkv.masks.starts(torch.tensor([3, 0])),
    "lengths, a row with no key": lambda: qkv.masks.lengths(torch.tensor([0, 9])),
    "starts, a row with no key": lambda: qkv.masks.starts(torch.tensor([9, 2])),
    "no padding": lambda: qkv.masks.lengths(torch.tensor([9, 9])),
    "a static cache filled to 5": lambda: qkv.masks.lengths(torch.tensor([3, 5])),
    "a static cache, rows of one length": lambda: qkv.masks.lengths(torch.tensor([4, 4])),
    "starts, both past the first keys": lambda: qkv.masks.starts(torch.tensor([3, 5])),
}
#: The keys some row sees (what the lane reads) and whether any of them is hidden from a row (zeroed in copies).
READ = {"lengths": (0, 9, True), "starts": (0, 9, True), "lengths, a row with no key": (0, 9, True),
        "starts, a row with no key": (2, 9, True), "no padding": (0, 9, False),
        "a static cache filled to 5": (0, 5, True), "a static cache, rows of one length": (0, 4, False),
        "starts, both past the first keys": (3, 9, True)}  # fmt: skip


@pytest.fixture
def as_gpu(monkeypatch):
    """CPU tensors stand for one GPU's: the lane plans and runs them as a CUDA call."""
    monkeypatch.setattr(sdpa_plain, "_on_one_gpu", lambda q, k, v: True)


def _inputs(b=2, h=4, g=2, i=1, j=9, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype) for s in ((b, h, i, d), (b, g, j, d), (b, g, j, d))]


def _spoil_padding(k, v, mask):
    """k and v with nan and inf at every key the mask hides from its row (a cache's unfilled slots)."""
    hidden = mask.tile(qkv.masks.Tile.whole(1, k.shape[-2])).logical_not().transpose(-1, -2)  # (b, 1, j, 1)
    return torch.where(hidden, float("nan"), k), torch.where(hidden, float("inf"), v)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("what", sorted(PADDING))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_gpu_decoding_steps_padding_takes_the_lane_and_hidden_keys_never_reach_the_output(as_gpu, what, causal,
                                                                                            grad, dtype):  # fmt: skip
    """The lane's output and gradients on padding holding nan and inf equal the reference's on finite padding."""
    q, k, v = _inputs(dtype=dtype)
    mask = PADDING[what]()
    bad_k, bad_v = _spoil_padding(k, v, mask)
    exact = [x.double().requires_grad_(grad) for x in (q, k, v)]
    expected = qkv.attention(*exact, mask=mask, causal=causal, backend="reference")  # the finite inputs, float64
    leaves = [x.clone().requires_grad_(grad) for x in (q, bad_k, bad_v)]
    decided = sdpa_plain.plan(*leaves, "scaled_dot", causal, None, mask)
    assert decided is not None and decided.gpu
    j0, j1, hidden, _ = decided.keys
    assert (j0, j1, hidden is not None) == READ[what]
    assert (decided.attn_mask is None) == (hidden is None)  # every key read is seen by every row: no mask at all
    dead = ~mask.tile(qkv.masks.Tile.whole(1, 9)).any(-1)[:, 0, 0]  # (b,) rows that see no key
    if bool(dead.any()):  # given every key read (a GPU's kernel would give them nan) and zeroed after the kernel
        assert decided.attn_mask[dead].all() and torch.equal(decided.live_rows[:, 0, 0, 0], (~dead).to(dtype))
    else:
        assert decided.live_rows is None
    out = sdpa_plain.plain(*leaves, "scaled_dot", causal, None, mask)
    assert out is not None and out.dtype == dtype and torch.isfinite(out).all()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), expected.detach(), **tol)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    if grad:
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        got = torch.autograd.grad(out, leaves, cot.to(dtype))
        for a, b in zip(got, torch.autograd.grad(expected, exact, cot)):  # hidden keys' gradients 0 in both
            torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("what", ["lengths", "starts"])
def test_a_kept_gpu_padding_plan_serves_the_next_layer_and_sees_an_in_place_change(as_gpu, what):
    q, k, v = _inputs()
    mask = PADDING[what]()
    with torch.no_grad():
        first = sdpa_plain.plain(q, k, v, "scaled_dot", True, None, mask)
        decided = sdpa_plain.plan(q, k, v, "scaled_dot", True, None, mask)
        assert mask._plain[2][1] is decided.keys  # the tile and hidden keys are kept on the mask, built once
        q2, k2, v2 = _inputs(seed=1)  # the model's next layer: new tensors, the same mask
        assert sdpa_plain.fits(decided, q2, k2, v2)
        torch.testing.assert_close(sdpa_plain.run(decided, q2, k2, v2),
                                   qkv.attention(q2, k2, v2, mask=mask, causal=True, backend="reference"))  # fmt: skip
        assert first is not None
        mask.tensors()[0][1].add_(0)  # written in place: the plan is stale
        assert not sdpa_plain.fits(decided, q2, k2, v2)


@pytest.mark.parametrize("made", ["lengths", "starts"])
def test_padding_changed_in_place_after_the_mask_read_it_leaves_the_lane(as_gpu, made):
    """Against the mask's docs, but nothing wrong may come of it: the keys read and the rows with no key come from
    the numbers read when the mask was made, so a changed tensor sends the call to the full path, which reads it."""
    q, k, v = _inputs()
    rows = torch.tensor([5, 5]) if made == "lengths" else torch.tensor([4, 4])
    mask = getattr(qkv.masks, made)(rows)
    with torch.no_grad():
        assert sdpa_plain.plain(q, k, v, "scaled_dot", True, None, mask) is not None
        rows[0] = 3 if made == "lengths" else 6  # row 0 now sees keys 0-2, or 6-8
        assert sdpa_plain.plain(q, k, v, "scaled_dot", True, None, mask) is None
        out = qkv.attention(q, k, v, mask=mask, causal=True)
        fresh = getattr(qkv.masks, made)(rows.clone())
        torch.testing.assert_close(out, qkv.attention(q, k, v, mask=fresh, causal=True, backend="reference"))


def test_a_gpu_padding_plan_made_under_inference_mode_does_not_serve_a_call_that_records_gradients(as_gpu):
    q, k, v = _inputs()
    mask = PADDING["lengths"]()
    with torch.inference_mode():
        sdpa_plain.plain(q, k, v, "scaled_dot", False, None, mask)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sdpa_plain.plain(*leaves, "scaled_dot", False, None, mask)  # (inference tensors cannot be saved)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_a_plan_for_one_gpu_does_not_serve_another(as_gpu):
    """Meta tensors and CPU tensors stand for two GPUs here: a padded step's plan holds its device's tensors."""
    q, k, v = _inputs(dtype=torch.float32)
    mask = PADDING["lengths"]()
    with torch.no_grad():
        on_meta = sdpa_plain.plan(*(x.to("meta") for x in (q, k, v)), "scaled_dot", True, None, mask)
        assert on_meta is not None and not sdpa_plain.fits(on_meta, q, k, v)


def test_causal_with_fewer_queries_than_keys_under_autocast_leaves_the_lane(as_gpu):
    """``causal_lower_right`` calls its kernels below autocast: the full path casts the inputs first."""
    q, k, v = _inputs(h=4, g=4, i=5, j=9, dtype=torch.float32)
    decided = sdpa_plain.plan(q, k, v, "scaled_dot", True, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sdpa_plain.plan(q, k, v, "scaled_dot", True, None) is None
        assert not sdpa_plain.fits(decided, q, k, v)


def test_gpu_padding_takes_every_grouping_of_heads(as_gpu):
    for h, g in ((4, 4), (4, 2), (4, 1)):
        q, k, v = _inputs(h=h, g=g)
        mask = PADDING["lengths"]()
        out = sdpa_plain.plain(q, k, v, "scaled_dot", True, None, mask)
        torch.testing.assert_close(out, qkv.attention(q, k, v, mask=mask, causal=True, backend="reference"))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_gpu_causal_call_with_fewer_queries_than_keys_runs_causal_lower_right(as_gpu, dtype, grad):
    if dtype == torch.float32 and not flash_cpu.works(dtype):
        pytest.skip("this torch's fused CPU kernel fails its check")
    q, k, v = (x.requires_grad_(grad) for x in _inputs(h=4, g=4, i=5, j=9, dtype=dtype))
    decided = sdpa_plain.plan(q, k, v, "scaled_dot", True, None)
    assert decided is not None and type(decided.attn_mask).__name__ == "CausalBias" and not decided.is_causal
    out = sdpa_plain.plain(q, k, v, "scaled_dot", True, None)
    exact = [x.detach().double().requires_grad_(grad) for x in (q, k, v)]
    expected = qkv.attention(*exact, causal=True, backend="reference")  # bottom-right: query r sees keys c <= r + 4
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), expected.detach(), **tol)
    if grad:
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        got = torch.autograd.grad(out, [q, k, v], cot.to(dtype))
        for a, b in zip(got, torch.autograd.grad(expected, exact, cot)):
            torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("case", [
    dict(h=4, g=2, i=5, j=9),  # grouped heads: that kernel dispatch passes no enable_gqa (the full path's mask)
    dict(h=4, g=4, i=9, j=5),  # more queries than keys: rows that see no key
    dict(h=4, g=4, i=4, j=9, mask="lengths"),  # padding on several queries: the full path (flex, its BlockMask)
    dict(h=4, g=4, i=1, j=9, mask="dense"),  # a dense mask on a GPU: the full path
], ids=["grouped", "i > j", "padding, i > 1", "dense"])
def test_other_gpu_masked_calls_decline_the_lane(as_gpu, case):
    q, k, v = _inputs(h=case["h"], g=case["g"], i=case["i"], j=case["j"])
    mask = {"lengths": qkv.masks.lengths(torch.tensor([3, 9])),
            "dense": qkv.masks.Dense(torch.ones(2, 1, 1, case["j"], dtype=torch.bool))}.get(case.get("mask"))  # fmt: skip
    assert sdpa_plain.plan(q, k, v, "scaled_dot", True, None, mask) is None


def test_a_gpu_plan_fits_only_gpu_calls_and_a_cpu_plan_only_cpu_calls(monkeypatch):
    """Meta tensors stand for one GPU's, CPU tensors are the CPU's: a kept plan serves the device it was made for."""
    monkeypatch.setattr(sdpa_plain, "_on_one_gpu", lambda q, k, v: q.is_meta and k.is_meta and v.is_meta)
    cpu = _inputs(dtype=torch.float32)
    meta = [x.to("meta") for x in cpu]
    mask = PADDING["lengths"]()
    with torch.no_grad():
        on_gpu = sdpa_plain.plan(*meta, "scaled_dot", True, None, mask)
        assert on_gpu is not None and on_gpu.gpu and on_gpu.keys[2].is_meta and on_gpu.keys[3] == torch.device("meta")
        assert sdpa_plain.run(on_gpu, *meta).shape == meta[0].shape
        assert not sdpa_plain.fits(on_gpu, *cpu)
        unmasked = sdpa_plain.plan(*cpu, "scaled_dot", False, None)
        if unmasked is not None:  # (the CPU kernel passed its check)
            assert not unmasked.gpu and not sdpa_plain.fits(unmasked, *meta)
        with pytest.raises(ValueError, match="lengths got a row of 12 keys"):
            sdpa_plain.plan(*meta, "scaled_dot", True, None, qkv.masks.lengths(torch.tensor([12, 9])))


def test_device_padding_declines_a_broadcast_batch_several_queries_and_rows_that_all_see_no_key():
    q, k, _ = _inputs()
    assert plain_padding.device_padding(qkv.masks.lengths(torch.tensor([6])), q, k) is None
    assert plain_padding.device_padding(qkv.masks.lengths(torch.tensor([0, 0])), q, k) is None  # the full path's zeros
    assert plain_padding.device_padding(qkv.masks.starts(torch.tensor([9, 9])), q, k) is None
    q4, k4, _ = _inputs(i=4)
    assert plain_padding.device_padding(qkv.masks.lengths(torch.tensor([6, 9])), q4, k4) is None


def test_a_static_caches_unfilled_keys_are_never_read(as_gpu):
    """Keys past every row's length are left out of the kernel's view: garbage there costs nothing and reaches
    nothing, and the output equals a call on the filled keys alone."""
    q, k, v = _inputs(j=9)
    k[:, :, 5:], v[:, :, 5:] = float("nan"), float("nan")
    mask = qkv.masks.lengths(torch.tensor([5, 5]))
    with torch.no_grad():
        out = sdpa_plain.plain(q, k, v, "scaled_dot", True, None, mask)
        torch.testing.assert_close(out, qkv.attention(q, k[:, :, :5], v[:, :, :5], backend="reference"))
