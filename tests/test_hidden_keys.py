"""Keys that no query sees never reach an output: NaN, inf or garbage in padding, on every engine.

Also: a padded causal batch (the commonest language-model mask) never builds its ``(i, j)``
mask on a fused path.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import backends, checks
from qkv.backends import hidden_keys
from qkv.masks import base as mask_base
from qkv.masks import padding

B, H, G, N, D = 2, 4, 2, 24, 8
LENGTHS = torch.tensor([15, N])
STARTS = torch.tensor([0, 9])

# A call's masks, each hiding keys from every row of a batch row; (mask, bias) and where padding is.
CASES = {
    "lengths": (lambda: qkv.masks.lengths(LENGTHS), None, "right"),
    "lengths & causal": (lambda: qkv.masks.lengths(LENGTHS) & qkv.masks.causal(), None, "right"),
    "starts & causal": (lambda: qkv.masks.starts(STARTS) & qkv.masks.causal(), None, "left"),
    "dense (b, 1, 1, j)": (lambda: _keep("right")[:, None, None, :], None, "right"),
    "dense & causal": (lambda: qkv.masks.as_mask(_keep("left")[:, None, None, :]) & qkv.masks.causal(), None, "left"),
    "float bias, -inf columns": (lambda: None, lambda: _neg_inf_bias("right"), "right"),
}


def _keep(side: str) -> torch.Tensor:
    cols = torch.arange(N)
    return cols[None] < LENGTHS[:, None] if side == "right" else cols[None] >= STARTS[:, None]


def _neg_inf_bias(side: str) -> torch.Tensor:
    bias = torch.zeros(B, 1, N, N)
    return bias.masked_fill(~_keep(side)[:, None, None, :], float("-inf"))


def _inputs(poison: float, side: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, N, D, generator=g, dtype=torch.float64)
    hidden = ~_keep(side)[:, None, :, None]  # (b, 1, j, 1)
    clean_k, clean_v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
    bad_k, bad_v = k.masked_fill(hidden, poison), v.masked_fill(hidden, -poison if poison == poison else poison)
    return q, (bad_k, bad_v), (clean_k, clean_v)


def _engines(mask, bias) -> list[str]:
    """The backends that take this call (auto first)."""
    names = ["auto"]
    q = torch.zeros(B, H, N, D)
    req = checks.request(q, q[:, :G], q[:, :G], score="scaled_dot", mask=mask, bias=bias, causal=False,
                         scale=None, dropout=0.0, return_weights=False)  # fmt: skip
    for name, impl in backends.REGISTRY.items():
        if impl.supports(req) is None:
            names.append(name)
    return names


def _never_reached(q, bad, expected, names, label: str, kwargs) -> None:
    """On each backend of ``names``, with ``bad = (k, v)`` holding nan or inf where no row looks: an inference and a
    differentiated call equal ``expected``, and every gradient is finite. ``kwargs()`` gives each call its options."""
    for name in names:
        with torch.no_grad():  # inference: the output is checked after the engine ran
            out = qkv.attention(q, *bad, backend=name, **kwargs())
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10, msg=f"{label}, backend {name}, no_grad")
        q1, k1, v1 = (x.clone().requires_grad_() for x in (q, *bad))  # recording gradients: the keys are read before
        out = qkv.attention(q1, k1, v1, backend=name, **kwargs())
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10, msg=f"{label}, backend {name}")
        out.square().sum().backward()
        for which, grad in (("q", q1.grad), ("k", k1.grad), ("v", v1.grad)):
            assert torch.isfinite(grad).all(), f"{label}, backend {name}: non-finite gradient of {which}"


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 3e38], ids=["nan", "inf", "huge"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_padding_holding_nan_or_inf_never_reaches_an_output_or_a_gradient(case, poison):
    make_mask, make_bias, side = CASES[case]
    mask, bias = make_mask(), None if make_bias is None else make_bias()
    q, bad, clean = _inputs(poison, side)
    expected = qkv.attention(q, *clean, mask=mask, bias=bias, backend="reference")
    assert torch.isfinite(expected).all()
    _never_reached(q, bad, expected, _engines(mask, bias), case, lambda: dict(mask=make_mask(), bias=bias))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_large_outputs_scan_for_nan_by_its_sum_still_keeps_padding_out(case, monkeypatch):
    """Outputs above ``EQUAL_ELEMENTS`` are scanned by a sum instead of ``torch.equal``: nan padding still never shows."""
    monkeypatch.setattr(hidden_keys, "EQUAL_ELEMENTS", 0)
    make_mask, make_bias, side = CASES[case]
    mask, bias = make_mask(), None if make_bias is None else make_bias()
    q, bad, clean = _inputs(float("nan"), side)
    expected = qkv.attention(q, *clean, mask=mask, bias=bias, backend="reference")
    _never_reached(q, bad, expected, ["auto"], case, lambda: dict(mask=make_mask(), bias=bias))


@pytest.mark.parametrize("numel", [hidden_keys.EQUAL_ELEMENTS, hidden_keys.EQUAL_ELEMENTS + 1, 2**20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_no_nan_finds_one_nan_anywhere_in_either_scan(numel, dtype):
    out = torch.randn(numel, dtype=torch.float64).to(dtype)
    assert hidden_keys.no_nan(out)
    for at in (0, numel // 2, numel - 1):
        poisoned = out.clone()
        poisoned[at] = float("nan")
        assert not hidden_keys.no_nan(poisoned), at
    huge = torch.full((numel,), torch.finfo(dtype).max, dtype=dtype)  # a sum that overflows to inf is no nan
    assert hidden_keys.no_nan(huge)


def test_padding_through_the_sdpa_dialect_and_return_lse_and_weights():
    q, (k, v), clean = _inputs(float("nan"), "right")
    keep = _keep("right")[:, None, None, :]
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    assert torch.isfinite(out).all()
    out, weights, lse = qkv.attention(q, k, v, mask=keep, return_weights=True, return_lse=True)
    ref = qkv.attention(q, *clean, mask=keep, return_weights=True, return_lse=True)
    for got, want in zip((out, weights, lse), ref):
        torch.testing.assert_close(got, want)


def test_an_inference_call_reads_no_padding_and_runs_once_when_its_output_is_finite(monkeypatch):
    """A decoding step over a padded cache pays one sum over its output, not a read of the padding."""
    q, (k, v), _ = _inputs(0.5, "right")
    monkeypatch.setattr(hidden_keys, "guard", lambda req: pytest.fail("the padding was read"))
    with torch.no_grad():
        out = qkv.attention(q[:, :, -1:], k, v, mask=qkv.masks.lengths(LENGTHS))
    assert torch.isfinite(out).all()


def test_finite_padding_costs_no_copy():
    """The usual case: padding that holds finite values leaves k and v as they were (no copy)."""
    q, (k, v), _ = _inputs(0.5, "right")
    req = checks.request(q, k, v, score="scaled_dot", mask=qkv.masks.lengths(LENGTHS), bias=None, causal=True,
                         scale=None, dropout=0.0, return_weights=False)  # fmt: skip
    assert req.k is k and req.v is v
    unpadded = qkv.masks.lengths(torch.tensor([N, N]))
    assert unpadded.hidden_keys(N, N) is None  # no padding: no tensor built at all


def test_hidden_keys_per_kv_head_needs_every_query_head_of_its_group():
    """A key hidden from one query head of a group but seen by another is not hidden."""
    keep = torch.ones(1, H, 1, N, dtype=torch.bool)
    keep[0, 0, 0, 3] = False  # head 0 (group 0) hides key 3; head 1, same group, sees it
    keep[0, 2:4, 0, 5] = False  # both heads of group 1 hide key 5
    q = torch.zeros(1, H, N, D)
    req = checks.request(q, q[:, :G], q[:, :G], score="scaled_dot", mask=keep, bias=None, causal=False,
                         scale=None, dropout=0.0, return_weights=False)  # fmt: skip
    found = hidden_keys.hidden_keys(req)[0, :, :, 0]  # (g, j)
    assert found[0].nonzero().flatten().tolist() == []
    assert found[1].nonzero().flatten().tolist() == [5]


def test_on_meta_tensors_the_zeroing_is_branch_free():
    q = torch.empty(B, H, N, D, device="meta")
    out = qkv.attention(q, q[:, :G], q[:, :G], mask=qkv.masks.lengths(LENGTHS.to("meta")), causal=True)
    assert out.shape == (B, H, N, D) and out.device.type == "meta"


def test_a_padded_causal_batch_never_builds_its_i_by_j_mask(monkeypatch):
    """``causal=True, mask=lengths(L)``: the fused paths see tiles, never the whole ``(i, j)`` mask."""
    n = 1024  # (b, i, j) = 2 · 1024² elements: beyond what SDPA may be given as a materialised mask
    built = []
    for cls in (padding.Lengths, mask_base.And, qkv.masks.Window):
        original = cls.tile

        def spy(self, t, original=original):
            out = original(self, t)
            built.append(out.shape[-2] * out.shape[-1])
            return out

        monkeypatch.setattr(cls, "tile", spy)
    q = torch.randn(2, 2, n, 16)
    lengths = torch.tensor([700, n])
    for name in ("auto", "chunked"):
        built.clear()
        out = qkv.attention(q, q, q, mask=qkv.masks.lengths(lengths), causal=True, backend=name)
        assert max(built, default=0) < n * n, f"backend {name} built a {max(built)}-element mask tile"
        assert torch.isfinite(out).all()
    # one call per batch row over its own keys: no mask at all
    assert qkv.explain(q, q, q, mask=qkv.masks.lengths(lengths), causal=True).splitlines()[0] == "backend: segments"


# Masks of positions with fewer queries than keys hide keys from every row too.
OFFSET_CASES = {
    "top-left causal, i < j (is_causal)": (6, 20, lambda i, j: qkv.masks.offsets(None, i - j)),
    "window of 3, one query": (1, 20, lambda i, j: qkv.masks.window(3)),
    "strictly the past, two back": (5, 12, lambda i, j: qkv.masks.offsets(None, -2)),
    "the next two only": (5, 12, lambda i, j: qkv.masks.offsets(1, 2)),
}


@pytest.mark.parametrize("i, j", [(1, 9), (4, 9), (9, 4), (6, 6)])
@pytest.mark.parametrize("lo, hi", [(None, 0), (None, -2), (-3, 0), (1, 2), (-2, None), (None, None), (-1, 4)])
def test_offsets_name_the_keys_no_row_sees(i, j, lo, hi):
    mask = qkv.masks.offsets(lo, hi)
    seen = mask.tile(mask_base.Tile.whole(i, j)).any(dim=0)  # (j,): some row sees the key
    hidden = mask.hidden_keys(i, j)
    if hidden is None:
        assert seen.all()
    else:
        assert hidden.shape == (1, 1, 1, j)
        assert torch.equal(hidden.flatten(), ~seen)


@pytest.mark.parametrize("case", sorted(OFFSET_CASES))
def test_keys_outside_every_rows_offsets_never_reach_an_output(case):
    i, j, make = OFFSET_CASES[case]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, i, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, j, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, j, D, generator=g, dtype=torch.float64)
    mask = make(i, j)
    hidden = mask.hidden_keys(i, j).view(1, 1, j, 1)
    assert hidden.any()
    bad_k, bad_v = k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("inf"))
    expected = qkv.attention(q, k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0), mask=mask, backend="reference")
    req = checks.request(q, k, v, score="scaled_dot", mask=mask, bias=None, causal=False, scale=None, dropout=0.0,
                         return_weights=False)  # fmt: skip
    names = ["auto", *(name for name, impl in backends.REGISTRY.items() if impl.supports(req) is None)]
    _never_reached(q, (bad_k, bad_v), expected, names, case, lambda: dict(mask=mask))


def _cross_documents():
    ids_q = torch.tensor([[1, 1, 1, 0, 0, 0]])
    ids_k = torch.tensor([[0, 0, 0, 0, 1, 1]])  # keys 4, 5: document 1's rows all come before them
    return qkv.masks.documents(ids_q, ids_k) & qkv.masks.causal()


def _row_dense(i: int):
    keep = torch.ones(1, 1, i, 1, dtype=torch.bool)
    keep[..., -1, :] = False  # the last row, the only one causal lets reach the last key, sees nothing
    return qkv.masks.as_mask(keep) & qkv.masks.causal()


# Keys no row sees, though each part of the mask alone lets some row see them: (i, j, mask, hidden keys)
JOINT_CASES = {
    "diagonal & strictly the past": (6, 6, lambda: qkv.masks.window(0, 0) & qkv.masks.offsets(None, -1), range(6)),
    "per-row dense & causal": (5, 5, lambda: _row_dense(5), [4]),
    "documents & causal, crossed": (6, 6, _cross_documents, [4, 5]),
}


@pytest.mark.parametrize("mod", [None, "relative"])
@pytest.mark.parametrize("case", sorted(JOINT_CASES))
def test_keys_hidden_only_by_the_parts_together_never_reach_an_output(case, mod):
    """Found by evaluating the whole mask (``exact_hidden_keys``), on every engine, with a score_mod too
    (its engine adds the mask to the modified logits, where a nan key's logit must not empty its row)."""
    i, j, make, where = JOINT_CASES[case]
    score_mod = None if mod is None else (lambda s, b, h, q_idx, kv_idx: s - 0.125 * (q_idx - kv_idx))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, H, i, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, G, j, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, G, j, D, generator=g, dtype=torch.float64)
    hidden = torch.zeros(1, 1, j, 1, dtype=torch.bool)
    hidden[..., list(where), :] = True
    req = checks.request(q, k, v, score="scaled_dot", mask=make(), bias=None, causal=False, scale=None, dropout=0.0,
                         return_weights=False)  # fmt: skip
    assert torch.equal(hidden_keys.exact_hidden_keys(req)[0, 0, :, 0], hidden[0, 0, :, 0])
    bad_k, bad_v = k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("inf"))
    expected = qkv.attention(q, k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0), mask=make(),
                             score_mod=score_mod, backend="reference")  # fmt: skip
    req = checks.request(q, k, v, score="scaled_dot", mask=make(), bias=None, causal=False, scale=None, dropout=0.0,
                         return_weights=False, score_mod=score_mod)  # fmt: skip
    names = ["auto", *(name for name, impl in backends.REGISTRY.items() if impl.supports(req) is None)]
    _never_reached(q, (bad_k, bad_v), expected, names, case, lambda: dict(mask=make(), score_mod=score_mod))


def test_padding_and_offset_ranges_name_their_hidden_keys_exactly():
    """A differentiated call reads the named hidden keys alone where the names are exact, else sums k and v."""
    q = torch.zeros(B, H, N, D)

    def named(mask):
        req = checks.request(q, q[:, :G], q[:, :G], score="scaled_dot", mask=mask, bias=None, causal=False,
                             scale=None, dropout=0.0, return_weights=False)  # fmt: skip
        return hidden_keys.named_exactly(req)

    assert named(qkv.masks.lengths(LENGTHS) & qkv.masks.causal())
    assert named(qkv.masks.starts(STARTS) & qkv.masks.window(3) & qkv.masks.offsets(None, -1))
    assert named(qkv.masks.as_mask(_keep("right")[:, None, None, :]) & qkv.masks.causal())
    assert not named(qkv.masks.as_mask(torch.ones(1, 1, N, 1, dtype=torch.bool)) & qkv.masks.causal())
    ids = torch.zeros(1, N, dtype=torch.long)
    assert not named(qkv.masks.documents(ids, ids) & qkv.masks.causal())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
def test_every_kind_of_non_finite_padding_shows_as_nan_or_does_no_harm(bad, where, backend):
    """The inference check scans the output for nan alone (``hidden_keys.no_nan``): a hidden nan, +inf or -inf, in a key
    or a value, either turns into nan there (and the call runs again without it) or never mattered."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, n, N, D, generator=g) for n in (H, G, G))
    poisoned = (k if where == "key" else v).clone()
    poisoned[0, :, 20] = bad  # row 0 is padded from 15 on
    k2, v2 = (poisoned, v) if where == "key" else (k, poisoned)
    mask = qkv.masks.lengths(LENGTHS)
    with torch.no_grad():
        got = qkv.attention(q[:, :, -1:], k2, v2, mask=mask, backend=backend)
        want = qkv.attention(q[:, :, -1:], k, v, mask=mask, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_whose_seen_logits_all_overflow_to_minus_inf_gives_its_hidden_keys_no_weight():
    """The reference engine masked with the lowest float where a call had no bias: a row whose seen logits were all
    -inf (q·k overflowing) then weighed its hidden keys, and a hidden inf value made the output inf, no nan to see."""
    q = torch.full((1, 1, 1, 4), 1e20)
    k = torch.full((1, 1, 8, 4), -1e20)  # finite keys whose products overflow float32 to -inf
    v = torch.randn(1, 1, 8, 4)
    v[..., 4:, :] = float("inf")  # the padding's values
    mask = qkv.masks.lengths(torch.tensor([4]))
    with torch.no_grad():
        out, w = qkv.attention(q, k, v, mask=mask, return_weights=True, backend="reference")
    assert torch.equal(w, torch.zeros_like(w)) and torch.equal(out, torch.zeros_like(out))
